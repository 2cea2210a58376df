"""The Pallas splash kernel (``jaxray.models.splash``) against XLA's dense causal attention, run in Pallas
interpret mode on the CPU: outputs and the gradients of q, k and v, in float32 and bfloat16, alone and
under a (data, tensor) mesh through shard_map."""

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.models import splash
from jaxray.models.transformer import causal_attention

# bfloat16 keeps 8 bits of mantissa: outputs and gradients of size ~1-4 differ by a few units in the
# last place between two summation orders (measured: 0.016 outputs, 0.031 dk). float32: 1e-5, in
# interpret mode; on a TPU the kernel's float32 matmuls are single bf16 passes, held to bf16's tolerance.
TOLERANCE = {"float32": 1e-5, "bfloat16": 0.0625}


def _loss(impl, q, k, v):
    out = causal_attention(q, k, v, implementation=impl).astype(jnp.float32)
    return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1])))  # a loss that weighs each output apart


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
# The default tiling in make test; block 128 unfused (~5 s a dtype) in make test-all.
@pytest.mark.parametrize(
    "tiles",
    [splash.Tiling(), pytest.param(splash.Tiling(block=128, fused_bwd=False), marks=pytest.mark.slow)],
)
def test_splash_matches_dense_attention_and_its_gradients(dtype, tiles):
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (2, 256, 2, 64), dtype) for key in keys)
    # bfloat16 traced at the default precision: the suite's "highest" (for float32) on bfloat16
    # operands fails Mosaic's compile on a TPU ("Bad lhs type", JAX 0.10.2), the backward included
    precision = "default" if dtype == "bfloat16" else "highest"
    with splash.tiling(tiles), jax.default_matmul_precision(precision):
        out, grads = jax.jit(jax.value_and_grad(functools.partial(_loss, "splash"), argnums=(0, 1, 2)))(
            q, k, v
        )
    ref, ref_grads = jax.value_and_grad(functools.partial(_loss, "dense"), argnums=(0, 1, 2))(q, k, v)
    exact = dtype == "float32" and jax.default_backend() != "tpu"
    tol = TOLERANCE["float32" if exact else "bfloat16"]
    np.testing.assert_allclose(out, ref, rtol=1e-3 if exact else 0.02)
    for name, g, r in zip("qkv", grads, ref_grads):
        diff = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
        assert diff <= tol, f"d{name}: max difference {diff} over {tol}"


def test_block_size_takes_the_largest_that_divides_and_refuses_others():
    assert [splash.block_size(t) for t in (128, 384, 1024, 2048)] == [128, 128, 512, 512]
    with pytest.raises(ValueError, match="multiple of 128, got 200"):
        splash.block_size(200)


def test_a_sequence_splash_cannot_take_falls_back_to_dense():
    q = jax.random.normal(jax.random.key(1), (1, 100, 2, 16))
    np.testing.assert_allclose(
        causal_attention(q, q, q, implementation="splash"),
        causal_attention(q, q, q, implementation="dense"),
    )


def _bench(attention: str, data_dir) -> dict:
    cmd = [sys.executable, "-m", "jaxray.bench", "throughput", "--workload", "transformer", "--width", "64",
           "--seq-len", "128", "--batch", "4", "--devices", "4", "--cpu-devices", "4", "--mesh",
           "data=2,tensor=2", "--attention", attention, "--steps", "2", "--repeats", "1", "--json",
           "--out", "", "--data-dir", str(data_dir), "--compile-cache", ""]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # two 4-device subprocess runs (~35 s); CI runs it
def test_splash_trains_like_dense_under_a_data_and_tensor_mesh(real_dir):
    splash_row, dense_row = _bench("splash", real_dir), _bench("dense", real_dir)
    assert splash_row["attention"] == "splash" and splash_row["tensor"] == 2
    assert splash_row["final_loss"] == pytest.approx(dense_row["final_loss"], abs=1e-4)
