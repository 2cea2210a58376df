"""On an NVIDIA GPU (skipped elsewhere): cuDNN flash attention in bfloat16 is as close to a float32
XLA reference as the bfloat16 XLA attention is, alone and inside the lab-7 transformer, and ``auto``
picks it there. Run on the device machine; CPU CI skips these."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxray.config import ModelConfig
from jaxray.models import build
from jaxray.models.transformer import causal_attention

pytestmark = pytest.mark.gpu  # cuDNN attention needs an NVIDIA GPU; tests/conftest.py skips it elsewhere


def _max_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))


def test_cudnn_attention_is_as_accurate_as_xla_in_bfloat16():
    # Lab 7's shapes: batch 8, T 256, 4 heads of 64.
    q, k, v = (
        jax.random.normal(key, (8, 256, 4, 64), jnp.float32) for key in jax.random.split(jax.random.key(0), 3)
    )
    reference = causal_attention(q, k, v)  # XLA, float32
    bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    cudnn_err = _max_err(causal_attention(*bf16, implementation="cudnn"), reference)
    xla_err = _max_err(causal_attention(*bf16), reference)
    assert cudnn_err <= 1.5 * xla_err + 1e-3, (cudnn_err, xla_err)


def test_transformer_logits_with_cudnn_match_xla():
    cfg = ModelConfig(workload="transformer", dtype="bfloat16")
    cudnn, xla = build(cfg, "cudnn"), build(cfg, "xla")
    assert (cudnn.attention.implementation, build(cfg).attention.implementation) == ("cudnn", "cudnn")
    params = xla.init(jax.random.key(1))
    tokens = jax.random.randint(jax.random.key(2), (4, 256), 0, 256)
    reference = jax.jit(build(cfg.model_copy(update={"dtype": "float32"}), "xla").apply)(params, tokens)
    cudnn_err = _max_err(jax.jit(cudnn.apply)(params, tokens), reference)
    xla_err = _max_err(jax.jit(xla.apply)(params, tokens), reference)
    assert cudnn_err <= 1.5 * xla_err + 1e-2, (cudnn_err, xla_err)
