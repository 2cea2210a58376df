"""The KV cache of ``Transformer.prefill`` / ``decode_step`` / ``extend``: its layout, writes into it,
and attention of new queries over it (float32 softmax)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Per layer one [B, H, S, 2K] array, keys in [..., :K] and values in [..., K:]: the KV cache of
# ``Transformer.prefill`` / ``decode_step``. Side by side, a head dim of 64 fills a TPU's 128 lanes (two
# [.., 64] arrays are each padded to 128: twice the bytes a decode step reads), as vLLM's TPU kernels
# lay out K and V for head dim 64.
KVCache = tuple[jax.Array, ...]


def query_rows(platform: str) -> int:
    """Query rows ``cached_attention`` multiplies per (row, head): 8 on a TPU, else 1. XLA's TPU compiler
    runs a one-row product (M = 1) as a vector multiply-reduce whose time grew 8.8x from 16 to 64 rows
    (4 layers of [B, 4, 256, 64] fp32 caches: 89 -> 785 us per step, TPU v5e, 2026-12-06); one sublane
    tile of 8 rows (7 of zeros) keeps both products on the MXU (83 -> 414 us). CPUs run M = 1 best."""
    return 8 if platform == "tpu" else 1


def decode_rows(batch: int, platform: str) -> int:
    """Rows per batch row a decode step carries through its projections (row 0 the token's, the rest
    zeros): on a TPU enough for one sublane tile of 8 in all when ``batch`` is below 8 (an M = 1
    projection is a vector multiply-reduce there, as ``query_rows`` says of attention), else 1."""
    return -(-8 // batch) if platform == "tpu" and batch < 8 else 1


def cache_precision(dtype, platform: str) -> jax.lax.Precision:
    """The decode attention products' precision over a cache of ``dtype``: on a TPU HIGH (3 bfloat16
    passes, not HIGHEST's 6) for a 16-bit cache, exact in one pass, so the float32 query or softmax
    keeps ~16 bits; HIGHEST otherwise (HIGH would be TF32 on a GPU)."""
    narrow = jnp.dtype(dtype).itemsize < 4
    return jax.lax.Precision.HIGH if narrow and platform == "tpu" else jax.lax.Precision.HIGHEST


def _attend(query, kv, visible, precision=None):
    """softmax(q k^T / sqrt(K)) v over a joint cache: query [B, R, H, K]; kv [B, H, S, 2K] (``KVCache``'s
    layer); visible [B, R, S] bool. Returns [B, R, H, K] in query's dtype; float32 scores and softmax.
    On a TPU the query is zero-padded to 2K and both products read the whole kv (no lane slice at K);
    a CPU slices K and V apart (the lab model at batch 16: 5.3 ms of ops a step, 6.5 zero-padded)."""
    k_dim, dtype = query.shape[-1], query.dtype
    query = query.transpose(0, 2, 1, 3) * jnp.asarray(1.0 / math.sqrt(k_dim), dtype)  # [B, H, R, K]
    if jax.default_backend() == "tpu":
        query, keys, values = jnp.pad(query, ((0, 0),) * 3 + ((0, k_dim),)), kv, kv  # query [B, H, R, 2K]
    else:
        keys, values = kv[..., :k_dim], kv[..., k_dim:]
    f32 = jnp.float32
    scores = jnp.einsum("bhrk,bhsk->bhrs", query, keys, preferred_element_type=f32, precision=precision)
    scores = jnp.where(visible[:, None], scores, jnp.finfo(jnp.float32).min)  # [B, H, R, S]
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)  # a bfloat16 cache: float32 probs stay
    out = jnp.einsum("bhrs,bhsk->bhrk", probs, values, precision=precision)
    return out[..., -k_dim:].transpose(0, 2, 1, 3).astype(dtype)


def cached_attention(query, kv, positions):
    """This step's query per row against a KV cache: query [B, R, H, K] (row 0 the step's; R > 1:
    ``decode_rows``' zero rows); kv [B, H, S, 2K] (``KVCache``'s layer, this step's entry written);
    positions [B] int32; row b sees cache entries 0..positions[b] only. Returns [B, R, H, K]; float32
    softmax; both products at ``cache_precision`` over at least ``query_rows`` rows."""
    rows = query.shape[1]
    query = jnp.pad(query, ((0, 0), (0, max(0, query_rows(jax.default_backend()) - rows)), (0, 0), (0, 0)))
    visible = jnp.arange(kv.shape[2])[None, :] <= positions[:, None]  # [B, S]
    visible = jnp.broadcast_to(visible[:, None], (kv.shape[0], query.shape[1], kv.shape[2]))
    return _attend(query, kv, visible, cache_precision(kv.dtype, jax.default_backend()))[:, :rows]


def span_attention(query, kv, starts):
    """T new queries per row against a KV cache (a prompt's rest after a cached prefix): query
    [B, T, H, K] at positions ``starts`` [B] int32 + 0..T-1; kv [B, H, S, 2K] with the span's entries
    written; query t of row b sees cache entries 0..starts[b] + t. Returns [B, T, H, K]; float32 softmax."""
    seen = starts[:, None] + jnp.arange(query.shape[1])[None, :]  # [B, T]
    visible = jnp.arange(kv.shape[2])[None, None, :] <= seen[:, :, None]  # [B, T, S]
    return _attend(query, kv, visible)


def write_span(cache: jax.Array, starts: jax.Array, entries: jax.Array) -> jax.Array:
    """cache [B, H, S, C] with ``entries`` [B, T, H, C] written at ``starts[b]`` .. + T - 1 of each row
    (``starts[b] + T <= S``: ``dynamic_update_slice`` would move a span that does not fit)."""
    entries = entries.transpose(0, 2, 1, 3).astype(cache.dtype)  # [B, H, T, C]
    put = lambda row, entry, start: jax.lax.dynamic_update_slice(row, entry, (0, start, 0))  # noqa: E731
    return jax.vmap(put)(cache, entries, starts)


def write_cache(cache: jax.Array, positions: jax.Array, entry: jax.Array) -> jax.Array:
    """cache [B, H, S, C] with ``entry`` [B, H, C] written at ``positions`` [B] (row b, every head).
    One row is written with one index per head: a single-index scatter made XLA's CPU compiler copy
    the whole cache several times per decode step."""
    entry = entry.astype(cache.dtype)
    batch, heads = cache.shape[:2]
    if batch == 1:
        flat = cache.reshape(cache.shape[1:]).at[jnp.arange(heads), positions[0]].set(entry[0])
        return flat.reshape(cache.shape)
    return cache.at[jnp.arange(batch), :, positions].set(entry)
