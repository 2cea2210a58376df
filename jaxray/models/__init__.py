"""Model families behind one functional interface: ``build(cfg) -> Model(init, apply)``.

``init(key) -> params`` gives float32 params (a dict of arrays for the MLPs, the ``nnx.State`` of
``nnx.Param`` variables for the transformer); ``apply(params, inputs) -> logits`` float32 is pure, so
one jitted step, Orbax and sharding treat every family alike.

Axis letters: B batch, T time, D model width, H heads, K head dim, V vocab.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxray.config import ModelConfig
from jaxray.models import mlp, shared_block
from jaxray.models.transformer import Transformer

Params = Any


@dataclass(frozen=True)
class Model:
    """A model family's pure functions. ``apply`` takes images [B, 784] float32 or tokens [B, T] int32."""

    config: ModelConfig
    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]


def compute_dtype(cfg: ModelConfig):
    return jnp.dtype(cfg.dtype)


def build_transformer(cfg: ModelConfig, rngs: nnx.Rngs, attention: str | None = None) -> Transformer:
    """The NNX transformer for ``cfg`` (``attention``: None, "xla" or "cudnn")."""
    return Transformer(cfg.vocab_size, cfg.width, cfg.num_heads, cfg.num_layers, cfg.ffn_dim, cfg.max_seq_len,
                       dtype=compute_dtype(cfg), attention=attention, rngs=rngs)


def _transformer(cfg: ModelConfig, attention: str | None) -> Model:
    graphdef, _ = nnx.split(nnx.eval_shape(lambda: build_transformer(cfg, nnx.Rngs(0), attention)))

    def init(key):
        return nnx.state(build_transformer(cfg, nnx.Rngs(key), attention), nnx.Param)

    def apply(params, tokens):
        return nnx.merge(graphdef, params)(tokens)

    return Model(cfg, init, apply)


def build(cfg: ModelConfig, attention: str | None = None) -> Model:
    """The Model for ``cfg.workload``; ``attention`` only applies to the transformer."""
    dtype = compute_dtype(cfg)
    if cfg.workload == "transformer":
        return _transformer(cfg, attention)
    if cfg.workload == "mlp":
        return Model(cfg, functools.partial(mlp.init, width=cfg.width),
                     functools.partial(mlp.apply, dtype=dtype))
    return Model(cfg, functools.partial(shared_block.init, width=cfg.width),
                 functools.partial(shared_block.apply, block_repeats=cfg.block_repeats, dtype=dtype))


def param_count(params: Params) -> int:
    """Number of scalar parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(params))
