"""Model families: output shapes and dtypes, float32 params in every compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxray.config import ModelConfig
from jaxray.models import build, param_count


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "workload,inputs,out",
    [
        ("mlp", jnp.zeros((3, 784)), (3, 10)),
        ("shared_block_mlp", jnp.zeros((3, 784)), (3, 10)),
        ("transformer", jnp.zeros((3, 17), jnp.int32), (3, 17, 256)),
    ],
)
def test_output_shapes_and_dtypes(workload, inputs, out, dtype):
    model = build(ModelConfig(workload=workload, width=32, dtype=dtype, block_repeats=3, num_layers=2))
    params = model.init(jax.random.key(0))
    logits = model.apply(params, inputs)
    assert logits.shape == out and logits.dtype == jnp.float32
    assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {jnp.dtype("float32")}


def test_mlp_default_is_the_learning_path_shape():
    params = build(ModelConfig(workload="mlp")).init(jax.random.key(0))
    assert [params[f"w{i}"].shape for i in (1, 2, 3)] == [(784, 256), (256, 128), (128, 10)]
    assert param_count(params) == 784 * 256 + 256 + 256 * 128 + 128 + 128 * 10 + 10


def test_transformer_default_size():
    cfg = ModelConfig(workload="transformer")
    params = build(cfg).init(jax.random.key(0))
    assert cfg.width == 256 and cfg.ffn_dim == 1024 and cfg.num_layers == 4
    assert param_count(params) == 3_356_160  # the learning path's TinyTransformer


def test_transformer_is_causal():
    model = build(ModelConfig(workload="transformer", width=32, num_layers=1))
    params = model.init(jax.random.key(1))
    a = jnp.arange(10, dtype=jnp.int32)[None]
    b = a.at[0, 7:].set(99)
    la, lb = model.apply(params, a), model.apply(params, b)
    assert jnp.allclose(la[0, :7], lb[0, :7], atol=1e-6)
    assert not jnp.allclose(la[0, 7:], lb[0, 7:])
