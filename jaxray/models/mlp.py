"""The learning path's Fashion-MNIST MLP (lab 4): 784 -> D -> D/2 -> 10, GELU (D = ``width``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxray.models.axes import constrain

IN_FEATURES = 784
NUM_CLASSES = 10


def he_normal(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    """[fan_in, fan_out] float32 with std sqrt(2 / fan_in) (He et al. 2015, for ReLU-like activations)."""
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) * math.sqrt(2.0 / fan_in)


def cast_params(params, dtype):
    """Params are stored float32; the forward pass runs in ``dtype`` (mixed precision)."""
    return jax.tree.map(lambda a: a.astype(dtype), params)


def init(key: jax.Array, width: int) -> dict[str, jax.Array]:
    """Float32 params: He-normal weights and zero biases."""
    sizes = (IN_FEATURES, width, width // 2, NUM_CLASSES)
    keys = jax.random.split(key, len(sizes) - 1)
    params = {}
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, sizes[:-1], sizes[1:]), start=1):
        params[f"w{i}"] = he_normal(k, fan_in, fan_out)
        params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
    return params


def apply(params: dict[str, jax.Array], images: jax.Array, dtype=jnp.float32) -> jax.Array:
    """images [B, 784] float32 in [0, 1] -> logits [B, 10] float32, computed in ``dtype``."""
    p = cast_params(params, dtype)
    x = images.astype(dtype)
    x = constrain(jax.nn.gelu(x @ p["w1"] + p["b1"]), "batch", "mlp")
    x = constrain(jax.nn.gelu(x @ p["w2"] + p["b2"]), "batch", None)
    return (x @ p["w3"] + p["b3"]).astype(jnp.float32)
