"""Causal attention through the Pallas splash kernel shipped in JAX (TPU; Pallas interpret mode on CPU).

The kernel takes one example's q, k, v ``[H, T, K]`` without a scale: q is scaled by K**-0.5 here and
the kernel is vmapped over the batch. Under a training layout it runs in ``shard_map``, the batch split
over ``data``/``fsdp`` and the heads over ``tensor`` (each shard builds the kernel for its own heads), as
MaxText does. Source: ``jax.experimental.pallas.ops.tpu.splash_attention`` (JAX 0.10.2)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu import splash_attention as sa

from jaxray.models.attention import SPLASH_MULTIPLE
from jaxray.models.axes import layout_sharding

# 512 was fastest on a v5e at T 1024; the smallest is splash's kv-block multiple.
BLOCKS = (512, 256, SPLASH_MULTIPLE)


def block_size(seq_len: int) -> int:
    """The kernel's q and kv block for sequence ``seq_len``: the largest of ``BLOCKS`` dividing it.
    Raises ValueError when none does (T not a multiple of 128)."""
    for block in BLOCKS:
        if seq_len % block == 0:
            return block
    raise ValueError(
        f"splash attention needs a sequence length that is a multiple of {SPLASH_MULTIPLE}, got {seq_len}"
    )


@dataclass(frozen=True)
class Tiling:
    """The kernel's tiles: ``block`` for q and kv in every pass (None: ``block_size(T)``),
    ``kv_compute`` the kv sub-block computed at a time (None: the block), ``fused_bwd``: dq and dkv in
    one backward kernel. Defaults: the fastest measured on a v5e, fwd+bwd at T 1024 (blocks 512 with
    the fused backward 3.38 ms at 12 heads of 64, 1.37 ms at 6 of 128, against 4.04 and 1.68 unfused;
    blocks 256 6.52 ms; docs/benchmarks.md)."""

    block: int | None = None
    kv_compute: int | None = None
    fused_bwd: bool = True

    def block_sizes(self, seq_len: int) -> sa.BlockSizes:
        b = self.block or block_size(seq_len)
        c = self.kv_compute or b
        dq = {} if self.fused_bwd else {"block_q_dq": b, "block_kv_dq": b}
        return sa.BlockSizes(
            block_q=b, block_kv=b, block_kv_compute=c, block_q_dkv=b, block_kv_dkv=b,
            block_kv_dkv_compute=c, use_fused_bwd_kernel=self.fused_bwd, **dq,
        )  # fmt: skip


_TILING: ContextVar[Tiling] = ContextVar("jaxray_splash_tiling", default=Tiling())  # noqa: B039 - frozen


@contextlib.contextmanager
def tiling(tiles: Tiling) -> Iterator[None]:
    """Splash kernels traced inside use ``tiles`` (how ``bench check`` compares tilings)."""
    token = _TILING.set(tiles)
    try:
        yield
    finally:
        _TILING.reset(token)


@functools.cache
def make_kernel(heads: int, seq_len: int, interpret: bool, tiles: Tiling = Tiling()):
    """The causal splash kernel for ``heads`` heads of ``seq_len`` (forward and backward blocks set).
    Its mask tables are made concrete (``ensure_compile_time_eval``) so the cached kernel holds no
    tracer of the trace that first asked for it (a scan over layers, say)."""
    blocks = tiles.block_sizes(seq_len)
    mask = sa.MultiHeadMask([sa.CausalMask((seq_len, seq_len))] * heads)
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha(
            mask, block_sizes=blocks, head_shards=1, q_seq_shards=1, interpret=interpret
        )


def _local(query, key, value):
    """Splash over local arrays [b, T, h, K] -> [b, T, h, K]."""
    b, t, h, k = query.shape
    kernel = make_kernel(h, t, jax.default_backend() != "tpu", _TILING.get())
    heads_first = (0, 2, 1, 3)
    q, key, value = (x.transpose(heads_first) for x in (query, key, value))
    q = q * jnp.asarray(1.0 / math.sqrt(k), q.dtype)
    return jax.vmap(kernel)(q, key, value).transpose(heads_first)


def splash_attention(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
    """Causal attention: q, k, v ``[B, T, H, K]`` -> ``[B, T, H, K]`` in q's dtype; T a multiple of 128."""
    sharding = layout_sharding("batch", None, "heads", None)
    if sharding is None or sharding.mesh.size == 1:
        return _local(query, key, value)
    spec = sharding.spec
    return jax.shard_map(_local, mesh=sharding.mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)(
        query, key, value
    )
