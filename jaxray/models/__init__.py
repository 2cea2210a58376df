"""Model families behind one functional interface: ``build(cfg) -> Model(init, apply)``.

``init(key) -> params`` (float32); ``apply(params, inputs) -> logits`` float32, pure.

Axis letters used package-wide: B batch, T time, S max_seq_len (KV cache length), D model width,
H heads, K head dim, V vocab. "Global batch": one optimizer step over all devices of all workers;
"per-device batch": global batch // (data x fsdp), the mesh axes that split the batch
(``jaxray.config.check_devices``); ``tensor`` does not split it: a tensor group's devices hold the
same rows."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxray.config import ModelConfig
from jaxray.models import mlp, shared_block
from jaxray.models.attention import AttentionChoice, choose, target_for
from jaxray.models.transformer import Transformer

Params = Any


@dataclass(frozen=True)
class Model:
    """A model family's pure functions. ``apply`` takes images [B, 784] float32 or tokens [B, T] int32.
    The transformer adds ``prefill(params, tokens [B, T]) -> (logits [B, T, V], cache)`` and
    ``decode_step(params, tokens [B], positions [B], cache, length=None) -> (logits [B, V], cache)``
    (attention over the cache's first ``length`` entries) and
    ``extend(params, tokens [B, T], starts [B], cache) -> (logits [B, T, V], cache)``."""

    config: ModelConfig
    init: Callable[[jax.Array], Params]
    apply: Callable[[Params, jax.Array], jax.Array]
    attention: AttentionChoice | None = None
    prefill: Callable[..., tuple] | None = None
    decode_step: Callable[..., tuple] | None = None
    extend: Callable[..., tuple] | None = None


def resolve_attention(
    cfg: ModelConfig,
    requested: str | None = None,
    device: jax.Device | None = None,
    seq_len: int | None = None,
) -> AttentionChoice:
    """``requested`` (default ``cfg.attention``) decided for ``device`` (default: the first device) and
    the sequence trained on (default ``cfg.max_seq_len``). Raises AttentionError for "cudnn" or
    "splash" where it cannot run."""
    device = device or jax.devices()[0]
    target = target_for(device, cfg.dtype, cfg.head_dim, seq_len or cfg.max_seq_len)
    return choose(requested or cfg.attention, target)


def _transformer(cfg: ModelConfig, choice: AttentionChoice) -> Model:
    def make(rngs: nnx.Rngs) -> Transformer:
        return Transformer(cfg, choice.implementation, rngs=rngs)

    graphdef, _ = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))

    def method(name: str) -> Callable:
        """``params, *args -> Transformer.name(*args)`` on the module ``params`` make."""
        return lambda params, *args, **kwargs: getattr(nnx.merge(graphdef, params), name)(*args, **kwargs)

    def init(key):
        return nnx.state(make(nnx.Rngs(key)), nnx.Param)

    return Model(
        cfg, init, method("__call__"), choice, method("prefill"), method("decode_step"), method("extend")
    )


def build(cfg: ModelConfig, attention: str | None = None, seq_len: int | None = None) -> Model:
    """The Model for ``cfg.workload``; ``attention`` (``jaxray.models.attention.REQUESTS``) overrides
    ``cfg.attention``, decided for ``seq_len`` (the trained sequence; default ``cfg.max_seq_len``).
    Raises AttentionError for cuDNN or splash attention where it cannot run."""
    dtype = jnp.dtype(cfg.dtype)
    if cfg.workload == "transformer":
        return _transformer(cfg, resolve_attention(cfg, attention, seq_len=seq_len))
    if cfg.workload == "mlp":
        return Model(
            cfg, functools.partial(mlp.init, width=cfg.width), functools.partial(mlp.apply, dtype=dtype)
        )
    return Model(
        cfg,
        functools.partial(shared_block.init, width=cfg.width),
        functools.partial(shared_block.apply, block_repeats=cfg.block_repeats, dtype=dtype),
    )


def param_count(params: Params) -> int:
    """Number of scalar parameters."""
    return sum(int(x.size) for x in jax.tree.leaves(params))
