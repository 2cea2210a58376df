"""Model FLOPs and model FLOPs utilisation (MFU).

Training FLOPs follow the PaLM paper's accounting (Chowdhery et al. 2022, appendix B): 6 FLOPs per
matmul weight per example or token (2 forward, 4 backward), plus, for the transformer, attention's
score and value matmuls, 12 x L x T x D per token for full attention, counted at half (6 x L x T x D)
because causal attention needs only the lower triangle. Embedding lookups, biases, norms and
element-wise ops are not counted (well under 1 % here). T is the sequence length processed (every
position goes through the model, though T - 1 of them are predicted), so

    transformer FLOPs per token   = 6 x (L x (4 D^2 + 2 D F) + D V) + 6 x L x T x D
    transformer FLOPs per example = T x FLOPs per token
    MLP FLOPs per example         = 6 x (784 W + W W/2 + W/2 x 10)
    shared-block FLOPs per example = 6 x (784 W + R W^2 + 10 W)  (the block runs R times)

MFU = achieved model FLOP/s / (devices x the device's peak FLOP/s for the compute dtype).
"""

from __future__ import annotations

from jaxray.config import ModelConfig
from jaxray.models.mlp import IN_FEATURES, NUM_CLASSES

# Dense (no sparsity) peak TFLOP/s per device from NVIDIA's data sheets. float32 matmuls run on
# TF32 tensor cores at JAX's default precision on these GPUs, so float32 uses the TF32 peak.
# Keys are matched against jax's device_kind (e.g. "NVIDIA H100 80GB HBM3"), most specific first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},
    "H100": {"bfloat16": 989.4, "float16": 989.4, "float32": 494.7},  # SXM; PCIe is lower
    "A100": {"bfloat16": 312.0, "float16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float16": 121.0, "float32": 60.0},
}


def matmul_weights(cfg: ModelConfig) -> int:
    """Matmul weights one example (MLPs) or one token (transformer) passes through, counting a
    shared block once per repeat."""
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
    """Training FLOPs per example: per image for the MLPs, per sequence of ``seq_len`` for the transformer."""
    if cfg.workload == "transformer":
        return seq_len * flops_per_token(cfg, seq_len)
    return 6.0 * matmul_weights(cfg)


def peak_flops(device_kind: str, dtype: str) -> float | None:
    """Peak FLOP/s of one device of ``device_kind`` for ``dtype``; None when unknown (CPUs, other GPUs)."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_kind:
            return peaks[dtype] * 1e12
    return None


def mfu(
    examples_per_sec: float, per_example: float, device_kind: str, dtype: str, devices: int
) -> float | None:
    """Model FLOPs utilisation in [0, 1] (examples/s x FLOPs per example over the devices' peak), or
    None when the peak is unknown."""
    peak = peak_flops(device_kind, dtype)
    return None if peak is None else examples_per_sec * per_example / (peak * devices)
