"""MFU arithmetic against values worked out by hand (see the numbers in each test)."""

import pytest

from jaxray.bench import mfu
from jaxray.config import ModelConfig


def test_mlp_flops_per_example_by_hand():
    # 784-256-128-10: 784*256 + 256*128 + 128*10 = 200704 + 32768 + 1280 = 234752 weights; x 6
    assert mfu.flops_per_example(ModelConfig(workload="mlp")) == 6 * 234752 == 1408512


def test_shared_block_counts_the_block_once_per_repeat():
    # w 256, 4 repeats: 784*256 + 4*256*256 + 256*10 = 200704 + 262144 + 2560 = 465408; x 6
    cfg = ModelConfig(workload="shared_block_mlp", width=256, block_repeats=4)
    assert mfu.flops_per_example(cfg) == 2792448


def test_transformer_flops_per_token_and_example_by_hand():
    # D 256, F 1024, L 4, V 256: 4 * (4*65536 + 2*256*1024) + 256*256 = 3211264 weights -> x 6 = 19267584;
    # causal attention at half: 6 * L * T * D = 6 * 4 * 256 * 256 = 1572864 -> 20840448 per token.
    cfg = ModelConfig(workload="transformer")
    assert mfu.flops_per_token(cfg, 256) == 20840448
    assert mfu.flops_per_example(cfg, 256) == 256 * 20840448


def test_mfu_uses_the_dtype_peak_and_device_count():
    # 1000 examples/s x 1e9 FLOPs = 1e12 FLOP/s over 2 H100s at 989.4 TFLOP/s bf16
    assert mfu.mfu(1000, 1e9, "NVIDIA H100 80GB HBM3", "bfloat16", 2) == pytest.approx(1e12 / (2 * 989.4e12))
    assert mfu.peak_flops("NVIDIA H200", "float32") == pytest.approx(494.7e12)
    assert mfu.peak_flops("NVIDIA L4", "bfloat16") == pytest.approx(121e12)
    assert mfu.peak_flops("NVIDIA A100-SXM4-80GB", "float16") == pytest.approx(312e12)


def test_no_peak_on_cpu_means_no_mfu():
    assert mfu.peak_flops("cpu", "float32") is None
    assert mfu.mfu(1000, 1e9, "cpu", "float32", 1) is None
