"""Prefix caching (``jaxray.inference.prefix_cache``): the model's ``extend`` continues a prefill;
an engine with a prefix cache gives the same tokens as one without for the same seeds, whether the
sharing prompts arrive together, one after another or through the continuous batcher; hits and
reused tokens are counted; a pool too small for every prefix evicts the least recently used.
Chunked prefill through it: a long prompt joins after a chunk per step, the running rows getting
tokens at each, and its tokens unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.inference.batcher import Batcher, Update
from jaxray.inference.engine import Engine, Request
from jaxray.inference.kv_decode import _pad_cache
from jaxray.inference.load import load_engine
from jaxray.inference.prefix_cache import AUTO_CPU_MIB, PrefixCache, auto_mib, fit_hits
from jaxray.inference.settings import EngineSettings

SETTINGS = {"buckets": (8, 32), "batch_sizes": (1, 4), "chunk": 8, "max_new_tokens": 24}
SHARED = b"ROMEO: But soft, what light "  # 28 bytes: 3 blocks of 8 (the 4th ends past it)


def requests() -> list[Request]:
    """Four sampled requests sharing SHARED, each with its own seed and tail."""
    tails = [b"x", b"yo", b"", b"zz"]
    return [Request(SHARED + tail, 20, 0.9, None, seed) for seed, tail in enumerate(tails, 3)]


@pytest.fixture(scope="module")
def engines(tiny_transformer):
    """(an engine without a prefix cache, one with 1 MiB of 8-token blocks), compiled."""
    model, params, _ = tiny_transformer
    plain = Engine.for_model(model, params, EngineSettings(**SETTINGS))
    cached = Engine.for_model(model, params, EngineSettings(**SETTINGS, prefix_cache_mib=1, prefix_block=8))
    plain.compile(), cached.compile()
    return plain, cached


def test_extend_continues_a_prefill(tiny_transformer):
    model, params, _ = tiny_transformer
    tokens = jax.random.randint(jax.random.key(1), (2, 30), 0, 256)
    prefill, extend = jax.jit(model.prefill), jax.jit(model.extend)  # compiled: eager NNX is slow
    logits, _ = prefill(params, tokens)
    _, head = prefill(params, tokens[:, :12])
    rest, cache = extend(params, tokens[:, 12:], jnp.array([12, 12]), _pad_cache(head, 32))
    np.testing.assert_allclose(rest, logits[:, 12:], atol=2e-5)
    assert all(kv.shape == (2, 2, 32, 32) for kv in cache)  # [B, H, S, 2K]


def test_the_same_tokens_with_and_without_the_cache(engines):
    plain, cached = engines
    compiled = cached.info()["programs"]
    expected = [c.tokens for c in plain.generate(requests())]
    assert cached.prefix.queries == 0  # compile's warm-up is forgotten
    assert [c.tokens for c in cached.generate(requests())] == expected  # together: nothing cached yet
    assert cached.prefix.hits == 0 and cached.prefix.info()["blocks_used"] == 3  # SHARED's 3 blocks, once
    assert cached.prefix.queries == sum(len(r.prompt) for r in requests())
    for request, tokens in zip(requests(), expected):  # one after another: each reuses SHARED
        assert cached.generate([request])[0].tokens == tokens
    assert cached.prefix.hit_requests == 4 and cached.prefix.hits == 4 * 24
    # The continuous batcher, requests admitted while others decode: the same tokens again.
    batcher, got = Batcher(cached), {}
    for i, request in enumerate(requests()):
        for update in batcher.admit([request], [i]) + batcher.step():
            got.setdefault(update.ticket, []).extend(update.tokens)
    while batcher.live:
        for update in batcher.step():
            got[update.ticket].extend(update.tokens)
    assert [got[i] for i in range(4)] == expected
    assert cached.info()["prefix_cache"]["hit_requests"] == 8
    assert cached.info()["programs"] == compiled  # nothing compiled after compile


def test_a_prompt_of_whole_blocks_still_prefills_its_last_token(engines):
    plain, cached = engines
    request = Request(SHARED[:24], 10, 0.0, None, 0)  # 3 whole blocks, all cached above or now
    cached.generate([request])
    assert cached.generate([request])[0].tokens == plain.generate([request])[0].tokens


def test_a_small_pool_evicts_the_least_recently_used(tiny_transformer):
    model, params, _ = tiny_transformer
    block_bytes = 1 * 2 * 2 * 8 * 16 * 4  # layers, K and V, heads, block, head_dim, float32
    settings = EngineSettings(**SETTINGS, prefix_cache_mib=1, prefix_block=8)
    engine = Engine.for_model(model, params, settings)
    engine.prefix = PrefixCache(4, 8)  # 4 slots: one prompt's 3 blocks and one more
    assert engine.pool.shape == (2**20 // block_bytes, block_bytes // 4)  # a block's entries flat
    first, second = Request(b"A" * 8 + SHARED[8:], 4, 0.0, None, 0), Request(SHARED, 4, 0.0, None, 0)
    engine.generate([first]), engine.generate([second])  # second evicts first's oldest blocks
    engine.generate([first])
    assert engine.prefix.hit_requests == 0 and engine.prefix.info()["blocks_used"] == 4
    engine.generate([first])
    assert engine.prefix.hit_requests == 1


def test_fit_hits_leaves_a_token_and_fits_the_bucket():
    assert fit_hits([3], np.array([24]), (8, 32), 8, 32) == ([2], 8)  # 24 = 3 blocks: the last re-read
    assert fit_hits([3, 0], np.array([28, 30]), (8, 32), 8, 32) == ([0, 0], 32)  # 30 needs bucket 32
    assert fit_hits([1, 3], np.array([9, 31]), (8, 16, 32), 8, 32) == ([1, 3], 8)
    assert fit_hits([3], np.array([31]), (16, 32), 8, 32) == ([2], 16)  # 3 blocks + 16 > 32


def test_a_long_prompt_is_prefilled_a_chunk_per_step_and_samples_the_same(engines, tiny_transformer):
    plain, _ = engines
    model, params, _ = tiny_transformer
    chunked = Engine.for_model(
        model, params, EngineSettings(**SETTINGS, prefix_cache_mib=1, prefix_block=8, prefill_chunk=8)
    )
    running, long = Request(b"ab", 24, 0.9, None, 1), Request(SHARED + b"xy", 12, 0.9, None, 2)  # 30 bytes
    batcher, got = Batcher(chunked), {0: [], 1: []}
    for update in batcher.admit([running], [0]):
        got[0] += update.tokens
    assert batcher.admit([long], [1]) == [] and batcher.live == 2 and batcher.free == 2
    chunks = 0
    while not got[1]:  # chunks of 8: 0-8, 8-16, 16-24 into the cache; 24-30 with the join
        updates = batcher.step()
        assert len({u.ticket for u in updates}) == len(updates)  # one update per request and call
        # the running row decoded at each step until done (1 + 8 + 8 + 7 tokens)
        assert 0 in [u.ticket for u in updates if u.tokens] or len(got[0]) == 24
        for update in updates:
            got[update.ticket] += update.tokens
        chunks += 1
    assert chunks == 4 and len(got[1]) == 1 + 8  # the join's first token, then its first decode call
    while batcher.live:
        for update in batcher.step():
            got[update.ticket] += update.tokens
    assert [got[0], got[1]] == [c.tokens for c in plain.generate([running, long])]
    # Counted once each, at admission: a prompt's own chunks are not hits.
    assert (chunked.prefix.queries, chunked.prefix.hits) == (len(running.prompt) + len(long.prompt), 0)
    # Its prefix now cached, the same prompt joins at once: no chunk left but the last.
    assert [u.ticket for u in batcher.admit([long], [3])] == [3] and chunked.prefix.hit_requests == 1
    assert batcher.cancel([0, 1, 3]) == [Update(3, [], True)]
    other = Request(b"Q" * 30, 4, 0.0, None, 0)
    assert batcher.admit([other], [2]) == [] and batcher.cancel([2]) == [Update(2, [], True)]
    assert batcher.live == 0 and batcher.step() == []


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"prefix_block": 32}, "prefix_block must be below max_seq_len 32"),
        ({"prefix_block": 8, "prefill_chunk": 12}, "prefill_chunk must be a multiple of prefix_block 8"),
        ({"prefill_chunk": 8, "prefix_cache_mib": 0}, "prefill_chunk needs the prefix cache"),
        ({"prefix_block": 16, "prefix_cache_mib": 0}, None),
    ],
)
def test_bad_prefix_settings(tiny_transformer, settings, match):
    model, params, _ = tiny_transformer
    build = lambda: Engine.for_model(model, params, EngineSettings(**{"prefix_cache_mib": 1, **settings}))  # noqa: E731
    if match is None:
        assert build().prefix is None
    else:
        with pytest.raises(ValueError, match=match):  # pydantic's ValidationError is a ValueError
            build()


def test_an_export_artifact_has_no_prefix_cache(artifact):
    """Refused naming the setting given, not both."""
    with pytest.raises(ValueError, match="^prefix_cache_mib: an export artifact has no prefix-cache"):
        load_engine(
            artifact, EngineSettings(buckets=(8, 32), batch_sizes=(1, 2), chunk=8, prefix_cache_mib=1)
        )


def test_the_prefix_cache_is_on_by_default_where_it_can_be(tiny_transformer, artifact):
    """Default settings (``prefix_cache_mib`` None): a pool sized by ``auto_mib`` (at most 64 MiB on
    a CPU) where a block is shorter than the window; none for blocks as long as it or an export
    artifact, and then chunked prefill is refused by name."""
    model, params, _ = tiny_transformer
    assert 1 <= auto_mib(jax.devices()[0]) <= AUTO_CPU_MIB
    engine = Engine.for_model(model, params, EngineSettings(**SETTINGS, prefix_block=8))
    assert engine.prefix is not None and 0 < engine.info()["prefix_cache"]["mib"] <= AUTO_CPU_MIB
    assert engine.pool.nbytes <= auto_mib(jax.devices()[0]) << 20
    assert Engine.for_model(model, params, EngineSettings(**SETTINGS)).prefix is None  # block 32: the window
    exported = load_engine(artifact, EngineSettings(buckets=(8, 32), batch_sizes=(1, 2), chunk=8))
    assert exported.prefix is None
    with pytest.raises(ValueError, match="prefill_chunk needs the prefix cache, which this engine cannot"):
        Engine.for_model(model, params, EngineSettings(**SETTINGS, prefill_chunk=32))
