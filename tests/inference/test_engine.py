"""The compiled engine on a checkpoint trained on the real TinyShakespeare bytes: greedy output
equal to the full-recompute sampler, prompts and rows padded to the compiled buckets and batch
sizes without changing any row's tokens, streaming, nothing compiled after ``compile``, and
``check``'s refusals."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxray.inference.batcher import Batcher
from jaxray.inference.engine import Engine, Request, gather_shapes
from jaxray.inference.sampling import Sampling, generate, prompt_window
from jaxray.inference.settings import EngineSettings


def test_greedy_generate_equals_the_full_recompute_sampler(engine, restored):
    model, params = restored
    prompts = ["ROMEO:", "First Citizen:\nBefore we proceed"]  # buckets 8 and 32
    done = engine.generate([Request(p.encode(), 20, 0.0) for p in prompts])
    for prompt, completion in zip(prompts, done):
        assert completion.text == generate(model, params, prompt, Sampling(20, 0.0))


def test_start_pads_prompts_to_the_bucket_and_rows_to_the_batch(engine):
    """Three requests run in the 4-row program of the 32-byte bucket: each row's context is its
    ``prompt_window``, the padding row has nothing to sample."""
    requests = [Request(b"ROMEO:", 5), Request(b"x" * 20, 3), Request(b"KING:", 1)]
    state, first = engine.start(requests)
    assert state.pending.shape == (4,) and first.shape == (3,)
    for row, request in enumerate(requests):
        window, length = prompt_window(request.prompt, engine.context_len, engine.config.max_seq_len)
        np.testing.assert_array_equal(np.asarray(state.context[row]), window)
        assert int(state.positions[row]) == length
    assert np.asarray(state.remaining).tolist() == [4, 2, 0, -1]  # the first token is already counted
    long = Request(bytes(range(100)), 2)  # longer than the context (63 bytes): its tail, in the 64 bucket
    state, _ = engine.start([long])
    window, _ = prompt_window(long.prompt, 63, 64)
    assert window.tolist() == [*range(37, 100), 0]
    np.testing.assert_array_equal(np.asarray(state.context[0]), window)


def test_each_row_of_a_batch_equals_the_row_alone(engine):
    requests = [
        Request(b"ROMEO:", 40, 0.0),
        Request(b"First Citizen:\nBefore we proceed", 25, 0.8, 10, 5),
        Request(b"x", 1, 1.0, None, 9),
    ]
    together = engine.generate(requests)
    assert [len(c.tokens) for c in together] == [40, 25, 1]
    for request, completion in zip(requests, together):
        [alone] = engine.generate([request])
        assert alone.tokens == completion.tokens
        assert alone.prompt_tokens == len(request.prompt)


def test_streamed_chunks_add_up_to_the_whole(engine):
    request = Request(b"KING:", 50, 0.7, None, 1)
    chunks = [c[0] for c in engine.stream([request])]
    assert len(chunks) == 1 + -(-49 // engine.settings.chunk)  # the first token, then chunk-sized pieces
    assert sum(chunks, []) == engine.generate([request])[0].tokens


def test_decode_chunk_updates_the_cache_in_place(engine):
    """The state is donated: a chunk writes into its cache rather than a copy of it."""
    state, _ = engine.start([Request(b"KING:", 10, 0.7, None, 1)])
    given = state.cache[0]
    state, _, counts = engine.decode_chunk(state)
    assert given.is_deleted() and not state.cache[0].is_deleted()
    assert int(counts[0]) == min(9, engine.settings.chunk)


def test_info_shows_the_model_fields_a_transformer_reads(engine):
    model = engine.info()["model"]  # /info's "model": a new ModelConfig field must be placed here or excluded
    read = {
        "workload",
        "width",
        "dtype",
        "num_layers",
        "num_heads",
        "max_seq_len",
        "vocab_size",
        "attention",
        "tie_embeddings",
    }
    assert set(model) == read
    assert model["workload"] == "transformer"


def test_nothing_compiles_after_compile(engine):
    """AOT: requests of every bucket and batch size run on programs compiled up front."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: compiles.append(event) if "backend_compile" in event else None
    )
    programs = len(engine.compiled)
    engine.generate([Request(b"a" * 30, 20, 0.5)] * 3)
    engine.generate([Request(b"b" * 200, 5, 0.0)])  # longer than max_seq_len: its tail is read
    batcher = Batcher(engine)
    batcher.admit([Request(b"c" * 10, 40, 0.5)], ["one"])
    batcher.step()
    batcher.admit([Request(b"d", 40, 0.5)] * 3, ["two", "three", "four"])  # joins: 4 rows
    while batcher.live:
        batcher.step()
    # start per (bucket, batch) and decode per batch; the default prefix cache's start_cached per
    # (bucket, batch) and block store per batch; the batcher's gathers.
    assert engine.prefix is not None
    assert compiles == [] and len(engine.compiled) == programs == 2 * (2 * 3 + 2) + len(gather_shapes((1, 4)))


@pytest.mark.parametrize(
    "request_,match",
    [
        (Request(b"", 5), "prompt is empty"),
        (Request(b"x" * 1001, 5), "prompt is 1001 bytes; the limit is 1000"),
        (Request(b"x", 0), "max_new_tokens must be in 1..200"),
        (Request(b"x", 201), "max_new_tokens must be in 1..200"),
        (Request(b"x", 5, -0.5), "temperature must be"),
        (Request(b"x", 5, float("nan")), "temperature must be"),
        (Request(b"x", 5, 1.0, 257), "top_k must be in 1..256"),
        (Request(b"x", 5, 1.0, 0), "top_k must be in 1..256"),
        (Request(b"x", 5, 1.0, None, 2**32), "seed must be in 0..4294967295"),
    ],
)
def test_bad_requests(engine, request_, match):
    with pytest.raises(ValueError, match=match):
        engine.check(request_)
    with pytest.raises(ValueError, match=match):
        engine.generate([request_])


def test_bad_settings(restored):
    model, params = restored
    with pytest.raises(ValueError, match="a batch holds 1..1 requests"):
        Engine.for_model(model, params, EngineSettings(batch_sizes=(1,))).generate([Request(b"x", 1)] * 2)
    with pytest.raises(ValueError, match="context_keep must be in 2..63"):
        Engine.for_model(model, params, EngineSettings(context_keep=64))
    for bad in ({"batch_sizes": ()}, {"buckets": (0, 8)}, {"chunk": 0}, {"context_keep": 1}, {"unknown": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineSettings(**bad)


def test_a_tiny_top_p_samples_greedily_and_top_p_one_changes_nothing(engine):
    """top_p 1e-6 keeps only the most likely byte: any temperature gives the greedy text; top_p 1
    gives what a request without top_p gives, draw for draw."""
    greedy, tiny, sampled, one = engine.generate(
        [
            Request(b"ROMEO:", 30, 0.0),
            Request(b"ROMEO:", 30, 1.5, seed=3, top_p=1e-6),
            Request(b"ROMEO:", 30, 1.0, seed=5),
            Request(b"ROMEO:", 30, 1.0, seed=5, top_p=1.0),
        ]
    )
    assert tiny.tokens == greedy.tokens and one.tokens == sampled.tokens
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0"):
        engine.check(Request(b"ROMEO:", 3, top_p=0.0))
