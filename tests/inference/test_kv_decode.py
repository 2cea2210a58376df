"""KV-cache decoding against the full forward and the full-recompute sampler, on a checkpoint
trained on the real TinyShakespeare bytes; the engine's batching, streaming, AOT and errors."""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.inference.batcher import Batcher
from jaxray.inference.engine import Engine, EngineSettings, Request, gather_shapes, kv_generate
from jaxray.inference.sampling import generate

TOL = 1e-5  # float32 logits; the two paths sum attention in a different order


def real_tokens(n: int) -> jnp.ndarray:
    text = b"ROMEO:\nWhat light through yonder window breaks? It is the east, and Juliet is the sun."
    return jnp.asarray(np.frombuffer(text[:n], np.uint8).astype(np.int32))[None]


def test_draw_follows_the_softmax_and_never_picks_an_excluded_token():
    from jaxray.inference.sampling import draw

    logits = jnp.array([2.0, 0.5, -jnp.inf, 1.0, 0.0])
    keys = jax.random.split(jax.random.key(0), 40_000)
    for temperature in (1.0, 0.5):
        tokens = np.asarray(jax.vmap(lambda k: draw(logits, k, jnp.float32(temperature)))(keys))
        frequencies = np.bincount(tokens, minlength=5) / len(tokens)
        expected = np.asarray(jax.nn.softmax(logits / temperature))
        assert frequencies[2] == 0 and np.abs(frequencies - expected).max() < 0.01, (frequencies, expected)
    assert int(draw(logits, keys[0], jnp.float32(0.0))) == 0  # greedy


def test_prefill_and_decode_steps_equal_the_full_forward(restored):
    model, params = restored
    size = model.config.max_seq_len
    tokens = real_tokens(size)
    full = jax.jit(model.apply)(params, tokens)  # [1, S, V]
    logits, cache = jax.jit(model.prefill)(params, tokens[:, :40])
    decode = jax.jit(model.decode)
    assert float(jnp.abs(logits - full[:, :40]).max()) < TOL
    cache = tuple(
        (
            jnp.pad(k, ((0, 0), (0, 0), (0, size - 40), (0, 0))),
            jnp.pad(v, ((0, 0), (0, 0), (0, size - 40), (0, 0))),
        )
        for k, v in cache
    )
    for position in range(40, size):
        step, cache = decode(params, tokens[:, position], jnp.array([position]), cache)
        assert float(jnp.abs(step[0] - full[0, position]).max()) < TOL, position


@pytest.mark.parametrize("batch", [1, 3])
def test_write_cache_sets_one_position_per_row_in_every_head(batch):
    """Both ways of writing (one index per head for a single row, one per row otherwise)."""
    from jaxray.models.transformer import write_cache

    cache = jnp.arange(batch * 2 * 5 * 3, dtype=jnp.float32).reshape(batch, 2, 5, 3)
    entry = -jnp.arange(1, batch * 2 * 3 + 1, dtype=jnp.float32).reshape(batch, 2, 3)
    positions = jnp.array([4, 0, 2][:batch])
    expected = np.array(cache)
    for b, p in enumerate(np.asarray(positions)):
        expected[b, :, p] = entry[b]
    np.testing.assert_array_equal(np.asarray(jax.jit(write_cache)(cache, positions, entry)), expected)


@pytest.mark.parametrize("temperature,top_k,seed", [(0.0, None, 0), (0.9, None, 7), (1.0, 5, 3)])
def test_kv_sampler_equals_the_full_recompute_sampler_past_the_window(restored, temperature, top_k, seed):
    """context_keep = max_seq_len re-prefills the last S - 1 bytes per token past the window: the
    full sampler's sliding window, so 150 new bytes after a 6-byte prompt (S = 64) match exactly."""
    model, params = restored
    ours = kv_generate(model, params, "ROMEO:", 150, temperature, seed, top_k, context_keep=64)
    assert ours == generate(model, params, "ROMEO:", 150, temperature, seed, top_k)


def test_default_window_policy_matches_inside_the_window(restored):
    model, params = restored
    size, prompt = model.config.max_seq_len, "JULIET:\n"
    inside = size - len(prompt) + 1  # new tokens before the first slide
    ours = kv_generate(model, params, prompt, 150, 0.0)
    full = generate(model, params, prompt, 150, 0.0)
    assert ours[:inside] == full[:inside]
    assert len(ours.encode("utf-8", "surrogatepass")) >= 100  # the slide kept it going


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
    batcher.decode()
    batcher.admit([Request(b"d", 40, 0.5)] * 3, ["two", "three", "four"])  # joins: 4 rows
    while batcher.live:
        batcher.decode()
    assert compiles == [] and len(engine.compiled) == programs == 2 * 3 + 2 + len(gather_shapes((1, 4)))


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
    with pytest.raises(ValueError, match="context_keep must be in 2..64"):
        Engine.for_model(model, params, EngineSettings(context_keep=65))
    for bad in ({"batch_sizes": ()}, {"buckets": (0, 8)}, {"chunk": 0}, {"context_keep": 1}, {"unknown": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            EngineSettings(**bad)


def test_cli_samplers_agree(trained_transformer):
    def run(*extra):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "jaxray.generate",
                "--checkpoint",
                str(trained_transformer),
                "--prompt",
                "ROMEO:",
                "--max-new-tokens",
                "40",
                "--temperature",
                "0",
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    assert run() == run("--sampler", "full")
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxray.generate",
            "--checkpoint",
            str(trained_transformer),
            "--sampler",
            "full",
            "--context-keep",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "--context-keep applies to --sampler kv only" in bad.stderr
