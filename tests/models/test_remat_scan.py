"""``model.remat`` and ``model.scan_layers`` change how the step runs, not what it computes nor the
params: loss and gradients equal the plain model's, and the parameter tree (what a checkpoint holds) is
the same, so a checkpoint restores across these settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.config import ModelConfig
from jaxray.models import build

BASE = {"workload": "transformer", "width": 64, "num_heads": 2, "num_layers": 3, "max_seq_len": 64}
SETTINGS = [
    {"remat": "full"},
    {"remat": "dots"},
    {"scan_layers": True},
    {"scan_layers": True, "remat": "full"},
    {"scan_layers": True, "remat": "dots", "attention": "dense"},
]


def _loss_and_grads(model, params, tokens):
    def loss(p):
        logits = model.apply(p, tokens)
        return jnp.mean(
            jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        )

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_loss_and_gradients_equal_the_plain_models(setting):
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, 256)
    plain, other = build(ModelConfig(**BASE)), build(ModelConfig(**BASE, **setting))
    params = plain.init(jax.random.key(0))
    loss, grads = _loss_and_grads(plain, params, tokens)
    other_loss, other_grads = _loss_and_grads(other, params, tokens)
    assert float(other_loss) == pytest.approx(float(loss), abs=1e-5)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads)):
        np.testing.assert_allclose(h, g, atol=1e-5)


def test_the_parameter_tree_is_the_same_whatever_the_settings():
    def tree(**setting):
        shapes = jax.eval_shape(build(ModelConfig(**BASE, **setting)).init, jax.random.key(0))
        return jax.tree_util.tree_flatten_with_path(shapes)

    plain = tree()
    for setting in SETTINGS:
        assert tree(**setting) == plain
