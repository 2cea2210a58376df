"""The learning path's compute-heavy MLP (lab 6): one shared D x D block applied ``block_repeats``
times under ``lax.scan``, each repeat ``h = 0.9 h + 0.1 gelu(h W + b)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxray.models.mlp import IN_FEATURES, NUM_CLASSES, cast_params, he_normal

RESIDUAL_KEEP = 0.9


def init(key: jax.Array, width: int) -> dict[str, jax.Array]:
    """Float32 params: w_in [784, D], w_block [D, D], w_out [D, 10] (He-normal) and zero biases."""
    k_in, k_block, k_out = jax.random.split(key, 3)
    return {
        "w_in": he_normal(k_in, IN_FEATURES, width),
        "b_in": jnp.zeros((width,), jnp.float32),
        "w_block": he_normal(k_block, width, width),
        "b_block": jnp.zeros((width,), jnp.float32),
        "w_out": he_normal(k_out, width, NUM_CLASSES),
        "b_out": jnp.zeros((NUM_CLASSES,), jnp.float32),
    }


def apply(
    params: dict[str, jax.Array], images: jax.Array, block_repeats: int, dtype=jnp.float32
) -> jax.Array:
    """images [B, 784] float32 -> logits [B, 10] float32, computed in ``dtype``."""
    p = cast_params(params, dtype)
    h = jax.nn.gelu(images.astype(dtype) @ p["w_in"] + p["b_in"])

    def block(h, _):
        z = jax.nn.gelu(h @ p["w_block"] + p["b_block"])
        return (RESIDUAL_KEEP * h + (1 - RESIDUAL_KEEP) * z).astype(dtype), None

    h, _ = jax.lax.scan(block, h, xs=None, length=block_repeats)
    return (h @ p["w_out"] + p["b_out"]).astype(jnp.float32)
