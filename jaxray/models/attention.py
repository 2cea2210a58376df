"""Which attention implementation the transformer uses: XLA everywhere, cuDNN flash attention where
it can run. ``choose`` decides up front, so ``auto`` falls back to XLA with a reason and ``cudnn``
raises ``AttentionError`` before compiling.

cuDNN's conditions (``jax._src.cudnn.fused_attention_stablehlo``, JAX 0.10): NVIDIA GPU of compute
capability >= 8.0, bfloat16/float16, head dim a multiple of 8 and <= 128 (<= 256 from 9.0)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Requested = Literal["xla", "cudnn", "auto"]  # the order benchmarks show them in
REQUESTS: tuple[str, ...] = Requested.__args__
CUDNN_DTYPES = ("bfloat16", "float16")
MIN_COMPUTE_CAPABILITY = (8, 0)


class AttentionError(ValueError):
    """An attention implementation that cannot run here; the message says why and what to use."""


@dataclass(frozen=True)
class AttentionChoice:
    """``implementation`` ("xla" or "cudnn") for a ``requested`` one, and ``reason`` when ``auto``
    fell back to XLA (empty otherwise)."""

    requested: str
    implementation: str
    reason: str = ""

    @property
    def note(self) -> str:
        """Why this implementation: "requested in model.attention", or what ``auto`` found
        ("auto: cuDNN can run here" or "auto: <reason>")."""
        if self.requested != "auto":
            return "requested in model.attention"
        return f"auto: {self.reason or 'cuDNN can run here'}"

    def describe(self) -> str:
        """One log line's part: "attention xla (auto: cuDNN attention needs an NVIDIA GPU, ...)"."""
        return f"attention {self.implementation} ({self.note})"


@dataclass(frozen=True)
class Target:
    """What decides cuDNN support: the device platform ("gpu", "cpu", "tpu"), its compute capability
    (e.g. "9.0"; None off NVIDIA GPUs), the compute dtype name and the head dim K."""

    platform: str
    compute_capability: str | None
    dtype: str
    head_dim: int


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


def config_blockers(dtype: str, head_dim: int, use_gpu: bool) -> list[str]:
    """What rules out cuDNN attention before any device is seen: no GPU workers, the compute dtype,
    or a head dim no GPU supports."""
    blockers = [] if use_gpu else ["it needs GPU workers (workers.use_gpu: true)"]
    if dtype not in CUDNN_DTYPES:
        blockers.append(f"dtype {dtype} is not bfloat16 or float16")
    if head_dim % 8 or head_dim > 256:
        blockers.append(f"head dim {head_dim} is not a multiple of 8 up to 256")
    return blockers


def choose(requested: str, target: Target) -> AttentionChoice:
    """The implementation for ``requested`` ("xla", "cudnn" or "auto") on ``target``. Raises
    AttentionError for an unknown request, or "cudnn" where ``cudnn_blockers`` finds a reason."""
    if requested not in REQUESTS:
        raise AttentionError(f"attention must be one of {', '.join(REQUESTS)}, got {requested!r}")
    if requested == "xla":
        return AttentionChoice(requested, "xla")
    blockers = cudnn_blockers(target)
    if not blockers:
        return AttentionChoice(requested, "cudnn")
    reason = "; ".join(blockers)
    if requested == "cudnn":
        raise AttentionError(
            f"attention 'cudnn' cannot run here: {reason}. Use 'auto' (falls back to XLA) or 'xla'"
        )
    return AttentionChoice(requested, "xla", reason)


def target_for(device, dtype: str, head_dim: int) -> Target:
    """The Target for a ``jax.Device`` (``compute_capability`` exists on CUDA devices only)."""
    return Target(device.platform, getattr(device, "compute_capability", None), dtype, head_dim)
