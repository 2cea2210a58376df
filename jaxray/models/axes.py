"""Logical axis names of every parameter, one table for all model families (``PARAM_AXES``).

Names: ``vocab`` (V), ``embed`` (D), ``positions`` (S), ``heads`` (H), ``head_dim`` (K), ``mlp`` (the
transformer's feed-forward width, the MLPs' first hidden layer), ``hidden`` (the MLPs' later hidden
width), ``pixels`` (784 inputs), ``classes`` (10 outputs), ``norm`` (LayerNorm scales and biases).
``jaxray.parallel.mesh.RULES`` maps them to mesh axes; optimizer moments take their param's names.
Activations are laid out by ``constrain`` under the layout training activates (``activation_layout``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import jax

Axes = tuple[str, ...]

# (module, param) or (param,) -> one name per dimension. Lookup: the last two dict keys of a leaf's
# path, then the last one (jaxray.models.transformer's NNX state; the MLPs' dicts).
PARAM_AXES: dict[tuple[str, ...], Axes] = {
    # Transformer (nnx.Embed, nnx.MultiHeadAttention, nnx.Linear, nnx.LayerNorm)
    ("token_embed", "embedding"): ("vocab", "embed"),
    ("pos_embed", "embedding"): ("positions", "embed"),
    **{(p, "kernel"): ("embed", "heads", "head_dim") for p in ("query", "key", "value")},
    **{(p, "bias"): ("heads", "head_dim") for p in ("query", "key", "value")},
    ("out", "kernel"): ("heads", "head_dim", "embed"),
    ("out", "bias"): ("embed",),
    ("fc_up", "kernel"): ("embed", "mlp"),
    ("fc_up", "bias"): ("mlp",),
    ("fc_down", "kernel"): ("mlp", "embed"),
    ("fc_down", "bias"): ("embed",),
    **{(n, p): ("norm",) for n in ("ln1", "ln2", "final_norm") for p in ("scale", "bias")},
    ("lm_head", "kernel"): ("embed", "vocab"),
    # MLP: 784 -> D -> D/2 -> 10 (column-split, then row-split: one all-reduce over tensor)
    ("w1",): ("pixels", "mlp"),
    ("b1",): ("mlp",),
    ("w2",): ("mlp", "hidden"),
    ("b2",): ("hidden",),
    ("w3",): ("hidden", "classes"),
    ("b3",): ("classes",),
    # Shared-block MLP: 784 -> D, a D x D block repeated, D -> 10
    ("w_in",): ("pixels", "mlp"),
    ("b_in",): ("mlp",),
    ("w_block",): ("hidden", "mlp"),
    ("b_block",): ("mlp",),
    ("w_out",): ("hidden", "classes"),
    ("b_out",): ("classes",),
}


def param_name(path: tuple) -> str:
    """A leaf's dotted name from its pytree key path: the dict keys and list indexes, e.g.
    ``blocks.0.attn.query.kernel`` (optimizer moments give the name of their param)."""
    parts = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
    return ".".join(str(p) for p in parts if p is not None and isinstance(p, str | int))


def axes_of(path: tuple, ndim: int) -> Axes | None:
    """The logical names of the leaf at ``path`` (a pytree key path) with ``ndim`` dimensions; ``()``
    for scalars (step counts); None for a leaf no table entry names."""
    keys = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey) and isinstance(k.key, str))
    for tail in (keys[-2:], keys[-1:]):
        axes = PARAM_AXES.get(tail)
        if axes is not None and len(axes) == ndim:
            return axes
    return () if ndim == 0 else None


# names -> jax.sharding.Sharding while a train or eval step is traced; None elsewhere (inference).
_LAYOUT: ContextVar[Callable[[tuple], Any] | None] = ContextVar("jaxray_activation_layout", default=None)


@contextmanager
def activation_layout(sharding_of: Callable[[tuple], Any]) -> Iterator[None]:
    """While tracing inside it, ``constrain(x, *names)`` lays ``x`` out as ``sharding_of(names)``."""
    token = _LAYOUT.set(sharding_of)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def layout_sharding(*names: str | None) -> Any:
    """The active layout's ``jax.sharding.NamedSharding`` for ``names`` (one logical name or None per
    dimension: "batch", "heads", "mlp"), or None outside a layout (inference, the shard_map step)."""
    sharding_of = _LAYOUT.get()
    return None if sharding_of is None else sharding_of(names)


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    """``x`` constrained to ``layout_sharding(*names)`` (``x`` itself outside a layout), so that XLA
    gathers a split param rather than splitting an activation on its contracted dimension."""
    sharding = layout_sharding(*names)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)
