"""``model.dropout``: masks only in training's forward (given a key), none in evaluation and inference;
``model.tie_embeddings``: the LM head is the token embedding's transpose."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.config import ModelConfig
from jaxray.models import build
from jaxray.models.transformer import blocked_causal_attention, dropout
from jaxray.train.step import step_key

SHAPE = {"workload": "transformer", "width": 32, "num_heads": 2, "num_layers": 2, "max_seq_len": 16}


def tokens():
    return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)


@pytest.mark.parametrize("attention", [pytest.param("xla", marks=pytest.mark.slow), "dense"])  # xla: ~6 s
def test_dropout_acts_only_given_a_key(attention):
    cfg = ModelConfig(**SHAPE, dropout=0.3, attention=attention)
    model, plain = build(cfg), build(cfg.model_copy(update={"dropout": 0.0}))
    params = model.init(jax.random.key(0))
    x = tokens()
    evaluated = model.apply(params, x)
    np.testing.assert_array_equal(evaluated, plain.apply(params, x))  # no key: no dropout
    a = model.apply(params, x, step_key(0, "rbg", jnp.int32(1)))
    b = model.apply(params, x, step_key(0, "rbg", jnp.int32(1)))
    c = model.apply(params, x, step_key(0, "rbg", jnp.int32(2)))
    np.testing.assert_array_equal(a, b)  # a function of (seed, step)
    assert not np.allclose(a, evaluated) and not np.allclose(a, c)
    # Inference never drops: prefill's logits are evaluation's.
    logits, _ = model.prefill(params, x)
    np.testing.assert_allclose(logits, evaluated, atol=1e-5)


def test_dropout_rate_and_scale():
    x = jnp.ones((400, 1000))
    y = dropout(x, jax.random.key(3, impl="rbg"), 0.2)
    kept = np.asarray(y) != 0
    assert abs(kept.mean() - (1 - 51 / 256)) < 0.005  # round(0.2 * 256) = 51 of 256 byte values dropped
    np.testing.assert_allclose(np.asarray(y)[kept], 256 / 205)  # inverted: the mean is kept
    assert dropout(x, None, 0.2) is x and dropout(x, jax.random.key(0), 0.0) is x


def test_attention_weight_dropout_drops_weights_not_rows():
    q = k = v = jax.random.normal(jax.random.key(0), (1, 64, 2, 8))
    full = blocked_causal_attention(q, k, v, 16)
    dropped = blocked_causal_attention(q, k, v, 16, jax.random.key(1), 0.5)
    assert dropped.shape == full.shape and not np.allclose(dropped, full)
    np.testing.assert_array_equal(blocked_causal_attention(q, k, v, 16, None, 0.5), full)


def test_tied_embeddings_have_no_lm_head():
    model = build(ModelConfig(**SHAPE, tie_embeddings=True))
    params = model.init(jax.random.key(0))
    assert "lm_head" not in params and "lm_head" in build(ModelConfig(**SHAPE)).init(jax.random.key(0))
    x = tokens()
    merged = jax.tree.leaves(params["token_embed"])[0]
    logits = model.apply(params, x)
    assert logits.shape == (2, 16, 256)
    # The last position's logits are its final features times the embedding's transpose: zeroing the
    # embedding of byte 7 zeroes its logit column.
    zeroed = jax.tree.map(lambda e: e.at[7].set(0.0) if e is merged else e, params)
    assert np.all(np.asarray(model.apply(zeroed, x))[..., 7] == 0)


def test_gpt2_init_scales_weights_and_residual_outputs():
    """``model.init: gpt2``: weights and embeddings normal(0, 0.02), the residual branches' output
    projections 0.02 / sqrt(2 L), biases and norms as Flax's; ``flax`` keeps Flax's initializers."""
    cfg = ModelConfig(**{**SHAPE, "width": 64}, init="gpt2")
    params = build(cfg).init(jax.random.key(0))
    block = params["blocks"][0]
    for leaf in (
        params["token_embed"]["embedding"],
        block["attn"]["query"]["kernel"],
        block["fc_up"]["kernel"],
    ):
        assert abs(float(jnp.std(leaf[...])) - 0.02) < 0.002
    for leaf in (block["attn"]["out"]["kernel"], block["fc_down"]["kernel"]):
        assert abs(float(jnp.std(leaf[...])) - 0.01) < 0.001  # 0.02 / sqrt(2 x 2 layers)
    assert not jnp.any(block["fc_down"]["bias"][...]) and jnp.all(block["ln1"]["scale"][...] == 1)
    flax = build(cfg.model_copy(update={"init": "flax"})).init(jax.random.key(0))
    embed_std = float(jnp.std(flax["token_embed"]["embedding"][...]))
    assert abs(embed_std - 64**-0.5) < 0.01  # Flax's Embed: variance 1 / D


def test_init_is_a_transformer_setting():
    with pytest.raises(ValueError, match="init are transformer settings"):
        ModelConfig(workload="mlp", init="gpt2")
