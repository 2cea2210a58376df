"""Helpers shared by the PyTree models."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def he_normal(key: jax.Array, fan_in: int, fan_out: int) -> jax.Array:
    """[fan_in, fan_out] float32 with std sqrt(2 / fan_in) (He et al. 2015, for ReLU-like activations)."""
    return jax.random.normal(key, (fan_in, fan_out), jnp.float32) * math.sqrt(2.0 / fan_in)


def cast_params(params, dtype):
    """Params are stored float32; the forward pass runs in ``dtype`` (mixed precision)."""
    return jax.tree.map(lambda a: a.astype(dtype), params)
