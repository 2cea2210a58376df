"""Sampling with a KV cache, pure functions over the model's ``prefill``/``decode_step``: ``start``
prefills one length bucket and samples each row's first token; ``decode_chunk`` runs up to ``chunk``
steps in a ``lax.while_loop``. Rows are independent; sampling matches ``sampling.sample`` key for key.
A row reaching position C = S - 1 (``sampling.context_len``; S = max_seq_len) restarts from its
newest ``keep`` tokens (re-prefilled at 0..keep-2); ``keep = C`` equals the full-recompute window."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxray.inference.sampling import context_len, next_tokens
from jaxray.models.kv_cache import KVCache


class DecodeState(NamedTuple):
    """Per-row sampling state; B rows, S = max_seq_len, V = vocab size.

    cache:       per layer kv [B, H, S, 2K] (``KVCache``: keys, then values), the cache's dtype
    context:     [B, S] int32, the token at each cache position
    positions:   [B] int32, cache entries written (the pending token's position)
    pending:     [B] int32, the newest sampled token, not yet in the cache
    remaining:   [B] int32, new tokens still to sample (<= 0: the row is finished)
    rng:         [B, 2] uint32, each row's PRNG key data (threefry)
    temperature: [B] float32, 0 is greedy
    top_k:       [B] int32, sample among the k most likely tokens (V: all)
    top_p:       [B] float32, sample among the most likely tokens holding this much probability (1: all)"""

    cache: KVCache
    context: jax.Array
    positions: jax.Array
    pending: jax.Array
    remaining: jax.Array
    rng: jax.Array
    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array


# (params, tokens [B, T]) -> (logits [B, T, V], cache [.., T, ..])
Prefill = Callable[[object, jax.Array], tuple]
# (params, tokens [B], positions [B], cache, length=) -> (logits [B, V], cache): one cached step per
# row, attention over the cache's first ``length`` entries
DecodeStep = Callable[[object, jax.Array, jax.Array, KVCache], tuple]
# (params, tokens [B, T], starts [B], cache) -> (logits [B, T, V], cache): T steps per row at once
Extend = Callable[[object, jax.Array, jax.Array, KVCache], tuple]


def cache_dtype(kv_cache_dtype: str, compute_dtype: str, platform: str) -> str:
    """The KV cache's dtype (``EngineSettings.kv_cache_dtype``): "auto" is bfloat16 on an accelerator
    (a decode step reads every cache entry: half the bytes of float32) and the compute dtype on a CPU."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "bfloat16" if platform != "cpu" else compute_dtype


def cast_prefill(prefill: Prefill, dtype: str) -> Prefill:
    """``prefill`` whose cache is in ``dtype``; ``decode_step`` and ``extend`` keep a cache's dtype."""

    def cast(params, tokens):
        logits, cache = prefill(params, tokens)
        return logits, jax.tree.map(lambda x: x.astype(dtype), cache)

    return cast


def _pad_cache(cache: KVCache, size: int) -> KVCache:
    """Each [B, H, T, 2K] layer zero-padded to [B, H, size, 2K]."""
    return tuple(jnp.pad(kv, ((0, 0), (0, 0), (0, size - kv.shape[2]), (0, 0))) for kv in cache)


def start(prefill: Prefill, params, tokens: jax.Array, lengths: jax.Array, *sampling, max_seq_len: int):
    """Prefill prompts and sample each row's first new token. tokens [B, P] int32 (row b's prompt in
    ``tokens[b, :lengths[b]]``); ``sampling``: seeds [B] uint32, temperature [B] float32, top_k [B]
    int32 (1..V), top_p [B] float32 (0..1], max_new_tokens [B] int32 (0 for padding). Returns
    (DecodeState, first [B] int32)."""
    logits, cache = prefill(params, tokens)  # [B, P, V]
    context = jnp.pad(tokens, ((0, 0), (0, max_seq_len - tokens.shape[1])))
    cache, positions = _pad_cache(cache, max_seq_len), lengths.astype(jnp.int32)
    return _first_tokens(logits, lengths, cache, context, positions, *sampling)


def _first_tokens(logits, lengths, cache, context, positions, seeds, temperature, top_k, top_p, max_new):
    """(DecodeState, first [B]): each row's first new token sampled from ``logits`` [B, T, V] at
    ``lengths - 1``; ``positions`` [B]: cache entries written."""
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]  # [B, V]
    rng = jax.vmap(lambda s: jax.random.key_data(jax.random.key(s)))(seeds)
    first, rng = next_tokens(last, rng, temperature, top_k, top_p)
    return DecodeState(cache, context, positions, first, max_new - 1, rng, temperature, top_k, top_p), first


def pool_cache(pool: jax.Array, table: jax.Array, hits: jax.Array, size: int, block_shape: tuple) -> KVCache:
    """The KV cache of rows whose first ``hits`` [B] int32 blocks come from ``pool`` [N, F] (slots
    ``table`` [B, nb] int32, nb = size // Bk); zeros past them. Per layer [B, H, size, 2K]. A block's
    F entries are ``block_shape`` (L, H, Bk, 2K) flattened: a TPU pads no minor dimension of it
    (a [N, L, H, Bk, 2K] pool of head dim 16 would take 4x its bytes, padded to 128 lanes)."""
    blocks = pool[table].reshape(*table.shape, *block_shape)  # [B, nb, L, H, Bk, 2K]
    used = jnp.arange(table.shape[1])[None, :] < hits[:, None]  # [B, nb]
    blocks = jnp.where(used.reshape(used.shape + (1,) * 4), blocks, jnp.zeros((), blocks.dtype))
    batch, nb, layers, heads, block, width = blocks.shape
    x = blocks.transpose(2, 0, 3, 1, 4, 5).reshape(layers, batch, heads, nb * block, width)
    x = jnp.pad(x, ((0, 0),) * 3 + ((0, size - nb * block), (0, 0)))
    return tuple(x[layer] for layer in range(layers))


def start_cached(
    extend: Extend,
    params,
    pool: jax.Array,
    table,
    hits,
    tokens,
    lengths,
    context,
    *sampling,
    block_shape: tuple,
):
    """``start`` after a cached prefix: row b's first ``hits[b]`` blocks of the pool (``pool_cache``;
    ``block_shape`` static), then its prompt's rest ``tokens[b, :lengths[b]]`` through ``extend`` at
    positions hits[b] * Bk + 0.. (table [B, nb], hits [B], tokens [B, T], lengths [B], context [B, S]:
    the whole prompt windows; int32). ``sampling`` and the result as ``start``'s."""
    starts = hits * block_shape[2]
    cache = pool_cache(pool, table, hits, context.shape[1], block_shape)
    logits, cache = extend(params, tokens, starts, cache)
    return _first_tokens(logits, lengths, cache, context, starts + lengths, *sampling)


def store_blocks(
    pool: jax.Array, cache: KVCache, rows: jax.Array, blocks: jax.Array, slots: jax.Array, block: int
):
    """``pool`` [N, F] (``pool_cache``'s) with block ``blocks[m]`` (of ``block`` tokens, static) of row
    ``rows[m]`` of ``cache`` written to slot ``slots[m]`` ([M] int32 each; a slot of N or more writes
    nothing: padding)."""
    stacked = jnp.stack(cache)  # [L, B, H, S, 2K]
    layers, batch, heads, size, width = stacked.shape
    nb = size // block
    split = stacked[:, :, :, : nb * block].reshape(layers, batch, heads, nb, block, width)
    picked = split[:, rows, :, blocks]  # [M, L, H, Bk, 2K]
    return pool.at[slots].set(picked.reshape(slots.shape[0], -1).astype(pool.dtype), mode="drop")


def gather_rows(states: tuple[DecodeState, ...], index: jax.Array, valid: jax.Array) -> DecodeState:
    """Rows of ``states`` joined along the batch axis: row i is joined row ``index[i]`` ([B'] int32),
    or a finished padding row where ``valid[i]`` ([B'] bool) is False (continuous batching)."""
    joined = jax.tree.map(lambda *rows: jnp.concatenate(rows), *states)
    picked = jax.tree.map(lambda x: jnp.take(x, index, axis=0), joined)
    return picked._replace(remaining=jnp.where(valid, picked.remaining, 0))


def _slide(prefill: Prefill, params, state: DecodeState, full: jax.Array, keep: int) -> DecodeState:
    """Rows where ``full`` [B] is set restart from their newest ``keep - 1`` context tokens."""
    size = state.context.shape[1]
    readable = context_len(size)
    tail = state.context[:, readable - keep + 1 : readable]  # [B, keep - 1]
    _, cache = prefill(params, tail)
    cache = _pad_cache(cache, size)
    choose = lambda new, old: jnp.where(full.reshape((-1,) + (1,) * (old.ndim - 1)), new, old)  # noqa: E731
    return state._replace(
        cache=jax.tree.map(choose, cache, state.cache),
        context=choose(jnp.pad(tail, ((0, 0), (0, size - keep + 1))), state.context),
        positions=jnp.where(full, keep - 1, state.positions),
    )


def _slide_rows(prefill: Prefill, params, state: DecodeState, full: jax.Array, keep: int) -> DecodeState:
    """``_slide``'s values, prefilling only the rows where ``full`` is set, one at a time (under
    continuous batching rows reach the window's end at different steps)."""
    size = state.context.shape[1]
    readable = context_len(size)

    def one(b, state: DecodeState) -> DecodeState:
        tail = jax.lax.dynamic_slice(state.context, (b, readable - keep + 1), (1, keep - 1))  # [1, keep - 1]
        _, cache = prefill(params, tail)
        put = lambda old, new: jax.lax.dynamic_update_slice_in_dim(old, new.astype(old.dtype), b, axis=0)  # noqa: E731
        return state._replace(
            cache=jax.tree.map(put, state.cache, _pad_cache(cache, size)),
            context=put(state.context, jnp.pad(tail, ((0, 0), (0, size - keep + 1)))),
            positions=state.positions.at[b].set(keep - 1),
        )

    return jax.lax.fori_loop(
        0, full.shape[0], lambda b, s: jax.lax.cond(full[b], one, lambda _, s: s, b, s), state
    )


def _slide_where(prefill: Prefill, params, state: DecodeState, full: jax.Array, keep: int) -> DecodeState:
    """Slide the rows where ``full`` is set: up to a quarter of the batch one at a time, more together."""
    branch = jnp.where(jnp.any(full), 1 + (4 * jnp.sum(full) > full.shape[0]), 0)
    slides = [lambda s, slide=slide: slide(prefill, params, s, full, keep) for slide in (_slide_rows, _slide)]
    return jax.lax.switch(branch, [lambda s: s, *slides], state)


def attention_lengths(size: int, platform: str, smallest: int = 128) -> tuple[int, ...]:
    """The cache lengths a decode step attends over (``decode_chunk``): on a CPU ``smallest`` doubled
    while below ``size``, then ``size``; elsewhere ``size`` alone. The lab model, 2026-12-06: on the
    TPU v5e the lengths cost 11 % at batch 1 and 8 % at batch 64 (a loop body per length); on the CPU
    they gained 8 % at batch 16 and 33 % with context_keep 255 (docs/benchmarks.md)."""
    if platform != "cpu":
        return (size,)
    lengths = [smallest]
    while lengths[-1] < size:
        lengths.append(lengths[-1] * 2)
    return (*lengths[:-1], size)


def decode_chunk(
    prefill: Prefill,
    decode_step: DecodeStep,
    params,
    state: DecodeState,
    max_steps,
    chunk: int,
    keep: int,
    lengths: tuple[int, ...] | None = None,
):
    """Up to ``min(max_steps, chunk)`` decode steps, fewer once no row has tokens to sample; ``keep``
    (2..C, static). Attention reads the filled part of the cache: the shortest of ``lengths``
    (static, ascending, the last S; default ``attention_lengths``) above every live row's position,
    re-chosen as rows pass it. Returns (state, tokens [B, chunk], counts [B]) int32: row b's new
    tokens ``tokens[b, :counts[b]]``."""
    size = state.context.shape[1]
    readable, lengths = context_len(size), lengths or attention_lengths(size, jax.default_backend())
    rows, limit = jnp.arange(state.pending.shape[0]), jnp.minimum(max_steps, chunk)

    def more(carry):
        i, state, _ = carry
        return (i < limit) & jnp.any(state.remaining > 0)

    def step(carry, length: int):
        i, state, out = carry
        active = state.remaining > 0
        at = jnp.minimum(state.positions, readable - 1)  # finished rows may sit at C; their writes are unused
        logits, cache = decode_step(params, state.pending, at, state.cache, length=length)
        token, rng = next_tokens(logits, state.rng, state.temperature, state.top_k, state.top_p)
        state = state._replace(
            cache=cache,
            context=state.context.at[rows, at].set(state.pending),
            positions=jnp.where(active, state.positions + 1, state.positions),
            pending=jnp.where(active, token, state.pending),
            remaining=state.remaining - active,
            rng=jnp.where(active[:, None], rng, state.rng),
        )
        return i + 1, state, out.at[:, i].set(token)

    def steps_within(length: int):
        def fits(carry):  # stop where a row must slide first, or outgrows ``length``
            _, state, _ = carry
            live = state.remaining > 0
            return more(carry) & ~jnp.any(live & (state.positions >= min(readable, length)))

        return lambda carry: jax.lax.while_loop(fits, lambda c: step(c, length), carry)

    def slide_then_steps(carry):
        # The slide's lax.cond sits outside the per-token loop (inside, the cache was copied per step).
        i, state, out = carry
        full = (state.remaining > 0) & (state.positions >= readable)
        state = _slide_where(prefill, params, state, full, keep)
        reach = jnp.max(jnp.where(state.remaining > 0, state.positions, 0))  # the furthest live row
        which = jnp.searchsorted(jnp.asarray(lengths), reach, side="right")  # the first length above it
        return jax.lax.switch(which, [steps_within(n) for n in lengths], (i, state, out))

    before, out = state.remaining, jnp.zeros((rows.shape[0], chunk), jnp.int32)
    _, state, out = jax.lax.while_loop(more, slide_then_steps, (jnp.int32(0), state, out))
    return state, out, jnp.maximum(before, 0) - jnp.maximum(state.remaining, 0)
