"""KV-cache decoding on a checkpoint trained on the real TinyShakespeare bytes: prefill and cached
decode steps against the full forward, ``decode_chunk``'s step limits, and the context window
policy against the full-recompute sampler."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.checkpoint.trees import key_names
from jaxray.inference.engine import Engine, Request, kv_generate
from jaxray.inference.kv_decode import (
    _pad_cache,
    _slide,
    _slide_rows,
    attention_lengths,
    cast_prefill,
    decode_chunk,
    start,
)
from jaxray.inference.sampling import Sampling, generate
from jaxray.inference.settings import EngineSettings
from jaxray.models import kv_cache, transformer
from jaxray.models.kv_cache import cache_precision, cached_attention, decode_rows, query_rows, write_cache

TOL = 1e-5  # float32 logits; the two paths sum attention in a different order
BF16_TOL = 0.05  # logits, a bfloat16 KV cache against a float32 one (the suite's model: 0.0101)


def real_tokens(n: int) -> jnp.ndarray:
    text = b"ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun."
    return jnp.asarray(np.frombuffer(text[:n], np.uint8).astype(np.int32))[None]


def test_prefill_and_decode_steps_equal_the_full_forward(restored):
    model, params = restored
    size = model.config.max_seq_len
    tokens = real_tokens(size)
    full = jax.jit(model.apply)(params, tokens)  # [1, S, V]
    logits, cache = jax.jit(model.prefill)(params, tokens[:, :40])
    decode_step = jax.jit(model.decode_step)
    assert float(jnp.abs(logits - full[:, :40]).max()) < TOL
    cache = tuple(jnp.pad(kv, ((0, 0), (0, 0), (0, size - 40), (0, 0))) for kv in cache)
    for position in range(40, size):
        step, cache = decode_step(params, tokens[:, position], jnp.array([position]), cache)
        assert float(jnp.abs(step[0] - full[0, position]).max()) < TOL, position


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
@pytest.mark.parametrize("rows", [1, 8])
def test_cached_attention_equals_a_softmax_over_each_rows_visible_entries(monkeypatch, rows, platform):
    """The TPU's 8 query rows (7 of zeros, for the MXU) and its query zero-padded over the joint
    cache's values, and the CPU's one row over sliced keys and values, give the same attention."""
    monkeypatch.setattr(kv_cache, "query_rows", lambda platform: rows)
    monkeypatch.setattr(kv_cache.jax, "default_backend", lambda: platform)
    q, k, v = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate(
        [(3, 1, 2, 4), (3, 2, 6, 4), (3, 2, 6, 4)]))  # fmt: skip
    positions = jnp.array([0, 3, 5])
    got = np.asarray(cached_attention(q, jnp.concatenate([k, v], -1), positions))  # eager: per platform
    assert got.shape == (3, 1, 2, 4)
    for b, p in enumerate([0, 3, 5]):
        scores = np.einsum("hk,hsk->hs", np.asarray(q[b, 0]) / 2.0, np.asarray(k[b, :, : p + 1]))
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        expected = np.einsum("hs,hsk->hk", probs / probs.sum(-1, keepdims=True), np.asarray(v[b, :, : p + 1]))
        np.testing.assert_allclose(got[b, 0], expected, rtol=1e-5, atol=1e-6)
    assert (query_rows("tpu"), query_rows("cpu"), query_rows("gpu")) == (8, 1, 1)
    assert [decode_rows(b, "tpu") for b in (1, 3, 8, 64)] == [8, 3, 1, 1]
    assert decode_rows(1, "cpu") == decode_rows(1, "gpu") == 1
    high, highest = jax.lax.Precision.HIGH, jax.lax.Precision.HIGHEST
    assert [cache_precision(d, "tpu") for d in ("bfloat16", "float32")] == [high, highest]
    assert cache_precision("bfloat16", "gpu") == cache_precision("bfloat16", "cpu") == highest  # not TF32


def test_decode_steps_with_zero_rows_equal_one_row(restored, monkeypatch):
    """A TPU's decode_rows (the token's row and 7 of zeros through the projections) give the logits
    and cache of one row, run here on the CPU."""
    model, params = restored
    tokens = real_tokens(model.config.max_seq_len)
    _, cache = jax.jit(model.prefill)(params, tokens[:, :10])
    cache = tuple(jnp.pad(kv, ((0, 0), (0, 0), (0, model.config.max_seq_len - 10), (0, 0))) for kv in cache)
    args = (params, tokens[:, 10], jnp.array([10]), cache)
    one = model.decode_step(*args)
    monkeypatch.setattr(transformer, "decode_rows", lambda batch, platform: 8)
    eight = model.decode_step(*args)
    np.testing.assert_allclose(np.asarray(eight[0]), np.asarray(one[0]), atol=1e-5)
    for a, b in zip(eight[1], one[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("batch", [1, 3])
def test_write_cache_sets_one_position_per_row_in_every_head(batch):
    """Both ways of writing (one index per head for a single row, one per row otherwise)."""
    cache = jnp.arange(batch * 2 * 5 * 3, dtype=jnp.float32).reshape(batch, 2, 5, 3)
    entry = -jnp.arange(1, batch * 2 * 3 + 1, dtype=jnp.float32).reshape(batch, 2, 3)
    positions = jnp.array([4, 0, 2][:batch])
    expected = np.array(cache)
    for b, p in enumerate(np.asarray(positions)):
        expected[b, :, p] = entry[b]
    np.testing.assert_array_equal(np.asarray(jax.jit(write_cache)(cache, positions, entry)), expected)


def test_decode_chunk_stops_at_max_steps_and_at_each_rows_budget(restored, engine):
    """Rows with budgets of 3 and 10 tokens, chunks of 4 limited to 2 steps at first: the counts
    follow both limits, and the tokens are the engine's for the same requests."""
    model, params = restored
    prompts = [b"ROMEO:", b"KING:"]
    tokens = np.zeros((2, 8), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = np.frombuffer(prompt, np.uint8)
    lengths, budgets = np.array([6, 5], np.int32), np.array([3, 10], np.int32)
    greedy = (
        np.zeros(2, np.uint32),
        np.zeros(2, np.float32),
        np.full(2, 256, np.int32),
        np.ones(2, np.float32),
    )
    prefill = jax.jit(functools.partial(start, model.prefill, max_seq_len=64))
    state, first = prefill(params, tokens, lengths, *greedy, budgets)
    chunk = jax.jit(functools.partial(decode_chunk, model.prefill, model.decode_step, chunk=4, keep=32))
    got = [[int(t)] for t in first]
    for max_steps, counts_wanted in ((2, [2, 2]), (4, [0, 4]), (4, [0, 3]), (4, [0, 0])):
        state, out, counts = chunk(params, state, jnp.int32(max_steps))
        assert np.asarray(counts).tolist() == counts_wanted, max_steps
        for row in range(2):
            got[row] += np.asarray(out)[row, : int(counts[row])].tolist()
    alone = engine.generate([Request(p, int(n), 0.0) for p, n in zip(prompts, budgets)])
    assert got == [c.tokens for c in alone]


@pytest.mark.parametrize(
    "temperature,top_k,seed",
    [
        (0.0, None, 0),
        pytest.param(0.9, None, 7, marks=pytest.mark.slow),
        pytest.param(1.0, 5, 3, marks=pytest.mark.slow),
    ],
)
def test_kv_sampler_equals_the_full_recompute_sampler_past_the_window(restored, temperature, top_k, seed):
    """context_keep = C = max_seq_len - 1 re-prefills the last C - 1 bytes per token past the window:
    the full sampler's sliding window, so 150 new bytes after a 6-byte prompt (C = 63) match exactly."""
    model, params = restored
    ours = kv_generate(model, params, "ROMEO:", Sampling(150, temperature, seed, top_k), context_keep=63)
    assert ours == generate(model, params, "ROMEO:", Sampling(150, temperature, seed, top_k))


def test_default_window_policy_matches_inside_the_window(restored):
    model, params = restored
    context, prompt = model.config.max_seq_len - 1, "JULIET:\n"
    inside = context - len(prompt) + 1  # new tokens before the first slide
    ours = kv_generate(model, params, prompt, Sampling(150, 0.0))
    full = generate(model, params, prompt, Sampling(150, 0.0))
    assert ours[:inside] == full[:inside]
    assert len(ours.encode("utf-8", "surrogatepass")) >= 100  # the slide kept it going


def test_no_sampler_reads_the_position_training_never_predicts_from(restored, engine):
    """Training predicts from positions 0..S-2 (logits[:, :-1]), so pos_embed row S-1 never gets a
    gradient. With that row replaced by noise, both samplers give the same bytes for a prompt longer
    than the window (full at once, sliding at every new byte), and the prompt read is S - 1 bytes."""
    model, params = restored
    size = model.config.max_seq_len
    noise = 50.0 * jax.random.normal(jax.random.key(1), (model.config.width,))

    def poison(path, x):
        return x.at[size - 1].set(noise) if key_names(path) == ("pos_embed", "embedding") else x

    poisoned = jax.tree_util.tree_map_with_path(poison, params)
    prompt = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 2  # 122 bytes > S
    ours = generate(model, poisoned, prompt, Sampling(20, 0.0))
    assert ours == generate(model, params, prompt, Sampling(20, 0.0))
    request = Request(prompt.encode(), 40, 0.0)  # the KV window slides at once and again
    [done] = engine.generate([request])
    [poisoned_done] = dataclasses.replace(engine, params=poisoned).generate([request])  # no compile
    assert poisoned_done.tokens == done.tokens and done.prompt_tokens == size - 1


@pytest.mark.slow  # ~9 s of compiles: make test-all
def test_sliding_a_few_rows_alone_equals_sliding_the_batch(restored):
    """``_slide_rows`` (rows reaching the window's end at different steps, as under continuous
    batching) re-prefills only those rows, to the values ``_slide`` gives them; the other rows stay
    as they were."""
    model, params = restored
    size, keep, batch = model.config.max_seq_len, 32, 4
    tokens = jnp.tile(real_tokens(size), (batch, 1))
    tokens = tokens.at[1].set(jnp.roll(tokens[1], 5)).at[2].set(jnp.roll(tokens[2], 11))
    ones = jnp.ones(batch, jnp.int32)
    state, _ = start(
        model.prefill, params, tokens, ones * (size - 1), ones.astype(jnp.uint32), ones * 0.0,
        ones * 256, ones * 1.0, ones * 9, max_seq_len=size,
    )  # fmt: skip
    full = jnp.asarray([True, False, True, False])
    together = _slide(model.prefill, params, state, full, keep)
    alone = _slide_rows(model.prefill, params, state, full, keep)
    for got, want, before in zip(jax.tree.leaves(alone), jax.tree.leaves(together), jax.tree.leaves(state)):
        np.testing.assert_allclose(got[np.asarray(full)], want[np.asarray(full)], atol=TOL, rtol=TOL)
        np.testing.assert_array_equal(got[~np.asarray(full)], before[~np.asarray(full)])
    assert np.asarray(alone.positions).tolist() == [keep - 1, size - 1, keep - 1, size - 1]


def test_a_bfloat16_cache_keeps_the_float32_caches_logits_and_greedy_text(restored):
    """The accelerators' default cache (``kv_cache_dtype`` auto): each cached step's logits within
    ``BF16_TOL`` of the float32 cache's over the trained model's window, and the same greedy bytes."""
    model, params = restored
    size, tokens, step = (
        model.config.max_seq_len,
        real_tokens(model.config.max_seq_len),
        jax.jit(model.decode_step),
    )

    def steps(dtype: str) -> np.ndarray:
        _, cache = jax.jit(cast_prefill(model.prefill, dtype))(params, tokens[:, :8])
        cache, out = _pad_cache(cache, size), []
        assert all(kv.dtype == jnp.dtype(dtype) for kv in cache)
        for position in range(8, size):
            logits, cache = step(params, tokens[:, position], jnp.array([position]), cache)
            out.append(np.asarray(logits[0]))
        assert all(kv.dtype == jnp.dtype(dtype) for kv in cache)  # kept through the steps
        return np.stack(out)

    diff = float(np.abs(steps("bfloat16") - steps("float32")).max())
    assert 0 < diff < BF16_TOL, diff

    def greedy(dtype: str) -> list[int]:
        settings = EngineSettings(
            buckets=(8,), batch_sizes=(1,), chunk=100, max_new_tokens=100, prefix_cache_mib=16,
            kv_cache_dtype=dtype,
        )  # fmt: skip
        engine = Engine.for_model(model, params, settings)
        assert engine.pool.dtype == jnp.dtype(dtype)
        [done] = engine.generate([Request(b"JULIET:\n", 100, 0.0)])
        return done.tokens

    assert greedy("bfloat16") == greedy("float32")


def test_attention_over_the_filled_lengths_gives_the_whole_caches_tokens(restored):
    """decode_chunk attending over the shortest of 16, 32 and 64 entries above its live rows
    (re-chosen as a row passes one, and after each slide back to 31 entries) samples what attention
    over all 64 does: rows starting 6 and 20 bytes in, 120 new tokens each, the window sliding."""
    model, params = restored
    tokens = np.zeros((2, 32), np.int32)
    for row, prompt in enumerate([b"ROMEO:", b"JULIET:\nO Romeo, Romeo"]):
        tokens[row, : len(prompt)] = np.frombuffer(prompt, np.uint8)
    sampling = (
        np.array([6, 20], np.int32),
        np.array([1, 2], np.uint32),
        np.array([0.0, 0.8], np.float32),
        np.full(2, 256, np.int32),
        np.ones(2, np.float32),
        np.full(2, 120, np.int32),
    )
    state, _ = jax.jit(functools.partial(start, model.prefill, max_seq_len=64))(params, tokens, *sampling)
    outs = []
    for lengths in ((16, 32, 64), (64,)):
        chunk = functools.partial(
            decode_chunk, model.prefill, model.decode_step, chunk=119, keep=32, lengths=lengths
        )
        _, out, counts = jax.jit(chunk)(params, state, jnp.int32(119))
        assert np.asarray(counts).tolist() == [119, 119]
        outs.append(np.asarray(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert attention_lengths(1024, "cpu") == (128, 256, 512, 1024) and attention_lengths(64, "cpu") == (64,)
    assert attention_lengths(1024, "tpu") == (1024,)  # measured slower there
