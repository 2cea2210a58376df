"""Which attention implementation the transformer uses: jaxray's block-skipping XLA attention
(``xla``), XLA's dense one (``dense``), the Pallas splash kernel on TPU (``splash``) or cuDNN flash
attention (``cudnn``). ``choose`` decides up front, so ``auto`` says why and a request that cannot run
raises ``AttentionError`` before compiling. ``auto``'s TPU rule is measured (docs/benchmarks.md).

cuDNN's conditions (``jax._src.cudnn.fused_attention_stablehlo``, JAX 0.10): NVIDIA GPU of compute
capability >= 8.0, bfloat16/float16, head dim a multiple of 8 and <= 128 (<= 256 from 9.0). Splash's:
a TPU (or Pallas interpret mode on CPU, for tests), a sequence that is a multiple of 128."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Requested = Literal["xla", "dense", "splash", "cudnn", "auto"]  # the order benchmarks show them in
REQUESTS: tuple[str, ...] = Requested.__args__
CUDNN_DTYPES = ("bfloat16", "float16")
MIN_COMPUTE_CAPABILITY = (8, 0)
SPLASH_MULTIPLE = 128  # splash's kv blocks are multiples of 128 that divide the sequence
# auto on TPU: splash from this sequence length, XLA below (v5e, bf16, fwd+bwd: splash 2.2x XLA at
# T 1024, XLA 2.1x splash at T 256; docs/benchmarks.md "Attention on the TPU"): dense in bfloat16, the
# blocked one in float32 (lab-7's step: 5.33 ms against dense 5.93; bf16 4.07 against 4.06).
SPLASH_MIN_SEQ = 512


class AttentionError(ValueError):
    """An attention implementation that cannot run here; the message says why and what to use."""


@dataclass(frozen=True)
class AttentionChoice:
    """``implementation`` ("xla", "dense", "splash" or "cudnn") for a ``requested`` one, and ``reason``:
    why ``auto`` chose it (empty otherwise)."""

    requested: str
    implementation: str
    reason: str = ""

    @property
    def note(self) -> str:
        if self.requested != "auto":
            return "requested in model.attention"
        return f"auto: {self.reason}"

    def describe(self) -> str:
        """One log line's part: "attention xla (auto: ...)"."""
        return f"attention {self.implementation} ({self.note})"


@dataclass(frozen=True)
class Target:
    """What decides the choice: the device platform ("gpu", "cpu", "tpu"), its compute capability
    (e.g. "9.0"; None off NVIDIA GPUs), the compute dtype name, the head dim K and the sequence T."""

    platform: str
    compute_capability: str | None
    dtype: str
    head_dim: int
    seq_len: int = 256


def _capability(text: str | None) -> tuple[int, int] | None:
    try:
        major, minor = str(text).split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def cudnn_blockers(target: Target) -> list[str]:
    """Why cuDNN attention cannot run on ``target`` (empty list: it can)."""
    if target.platform != "gpu":
        return [f"cuDNN attention needs an NVIDIA GPU, this device is {target.platform}"]
    blockers = []
    cc = _capability(target.compute_capability)
    if cc is None or cc < MIN_COMPUTE_CAPABILITY:
        blockers.append(f"compute capability {target.compute_capability} is below 8.0")
    if target.dtype not in CUDNN_DTYPES:
        blockers.append(f"dtype {target.dtype} is not bfloat16 or float16")
    max_head_dim = 256 if cc is not None and cc >= (9, 0) else 128
    if target.head_dim % 8 or target.head_dim > max_head_dim:
        blockers.append(f"head dim {target.head_dim} is not a multiple of 8 up to {max_head_dim}")
    return blockers


def splash_blockers(target: Target) -> list[str]:
    """Why the splash kernel cannot run on ``target`` (CPU runs it in Pallas interpret mode)."""
    tpu = target.platform in ("tpu", "cpu")
    blockers = [] if tpu else [f"splash needs a TPU, this device is {target.platform}"]
    if target.seq_len % SPLASH_MULTIPLE:
        blockers.append(f"sequence length {target.seq_len} is not a multiple of {SPLASH_MULTIPLE}")
    return blockers


def config_blockers(requested: str, dtype: str, head_dim: int, seq_len: int, accelerator: str) -> list[str]:
    """What rules out ``requested`` ("cudnn" or "splash") before any device is seen: the workers'
    ``accelerator``, the compute dtype, the head dim or the sequence length."""
    splash = requested == "splash"
    platform, check = ("tpu", splash_blockers) if splash else ("gpu", cudnn_blockers)
    ok = accelerator in (("tpu", "cpu") if splash else ("gpu",))
    blockers = [] if ok else [f"it needs {platform.upper()} workers (workers.accelerator: {platform})"]
    # cuDNN judged as on a compute capability 9.0 GPU: the most any GPU allows
    return blockers + check(Target(platform, "9.0", dtype, head_dim, seq_len))


def _auto(target: Target) -> AttentionChoice:
    if target.platform == "tpu":
        blockers, t = splash_blockers(target), target.seq_len
        if not blockers and t >= SPLASH_MIN_SEQ:
            return AttentionChoice("auto", "splash", f"TPU, sequence {t} >= {SPLASH_MIN_SEQ}")
        splash = "; ".join(blockers) if blockers else f"splash is slower below {SPLASH_MIN_SEQ}"
        if target.dtype == "float32":
            return AttentionChoice(
                "auto", "xla", f"TPU, float32, sequence {t}: blocked XLA beats dense; {splash}"
            )
        return AttentionChoice("auto", "dense", f"TPU, sequence {t}: dense XLA; {splash}")
    blockers = cudnn_blockers(target)
    if not blockers:
        return AttentionChoice("auto", "cudnn", "cuDNN can run here")
    return AttentionChoice("auto", "xla", "; ".join(blockers))


def choose(requested: str, target: Target) -> AttentionChoice:
    """The implementation for ``requested`` (``REQUESTS``) on ``target``. Raises AttentionError for an
    unknown request, or "cudnn" / "splash" where ``cudnn_blockers`` / ``splash_blockers`` find a reason."""
    if requested not in REQUESTS:
        raise AttentionError(f"attention must be one of {', '.join(REQUESTS)}, got {requested!r}")
    if requested == "auto":
        return _auto(target)
    check = {"cudnn": cudnn_blockers, "splash": splash_blockers}.get(requested)
    if check is not None and (blockers := check(target)):
        raise AttentionError(
            f"attention {requested!r} cannot run here: {'; '.join(blockers)}. Use 'auto' or 'xla'"
        )
    return AttentionChoice(requested, requested)


def target_for(device, dtype: str, head_dim: int, seq_len: int) -> Target:
    """The Target for a ``jax.Device`` (``compute_capability`` exists on CUDA devices only)."""
    return Target(device.platform, getattr(device, "compute_capability", None), dtype, head_dim, seq_len)
