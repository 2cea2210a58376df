"""Model FLOPs and MFU, counted as PaLM does (Chowdhery et al. 2022, app. B): 6 FLOPs per matmul
weight per example or token, plus causal attention's 6 x L x T x D per token; embeddings, norms and
element-wise ops are not counted. MFU = model FLOP/s / (devices x peak FLOP/s for the dtype)."""

from __future__ import annotations

from jaxray.config import ModelConfig
from jaxray.models.mlp import IN_FEATURES, NUM_CLASSES

# Dense peak TFLOP/s per device. NVIDIA: data sheets; float32 is the TF32 peak (JAX's default matmul
# precision). TPU: Google Cloud's TPU pages (v4, v5e, v5p, v6e system architecture), bf16 per chip; at
# JAX's default precision a float32 matmul on TPU is one bf16 pass, so float32 counts the bf16 peak.
# Keys are matched against jax's device_kind ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), most specific first.
_TPU = {"TPU v5 lite": 197.0, "TPU v6 lite": 918.0, "TPU v6e": 918.0, "TPU v5p": 459.0, "TPU v5": 459.0}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    **{kind: dict.fromkeys(("bfloat16", "float16", "float32"), peak) for kind, peak in _TPU.items()},
    "TPU v4": dict.fromkeys(("bfloat16", "float16", "float32"), 275.0),
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},  # SXM; PCIe is lower
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0},
}


def matmul_weights(cfg: ModelConfig) -> int:
    """Matmul weights an example (MLPs) or a token (transformer) passes through."""
    w = cfg.width
    if cfg.workload == "mlp":
        return IN_FEATURES * w + w * (w // 2) + (w // 2) * NUM_CLASSES
    if cfg.workload == "shared_block_mlp":
        return IN_FEATURES * w + cfg.block_repeats * w * w + w * NUM_CLASSES
    return cfg.num_layers * (4 * w * w + 2 * w * cfg.ffn_dim) + w * cfg.vocab_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Transformer training FLOPs per processed token at sequence length ``seq_len`` (T)."""
    return 6.0 * matmul_weights(cfg) + 6.0 * cfg.num_layers * seq_len * cfg.width


def flops_per_example(cfg: ModelConfig, seq_len: int = 0) -> float:
    """Training FLOPs per image (MLPs) or per sequence of ``seq_len`` (transformer)."""
    if cfg.workload == "transformer":
        return seq_len * flops_per_token(cfg, seq_len)
    return 6.0 * matmul_weights(cfg)


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak FLOP/s of one ``device_kind`` device for ``dtype``; None when unknown (CPUs)."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_kind:
            return peaks[dtype] * 1e12
    return None


def mfu(rate: float, per_example: float, device_kind: str, dtype: str, devices: int) -> float | None:
    """Model FLOPs utilisation in [0, 1] at ``rate`` examples/s; None when the peak is unknown."""
    peak = peak_flops(device_kind, dtype)
    return None if peak is None else rate * per_example / (peak * devices)
