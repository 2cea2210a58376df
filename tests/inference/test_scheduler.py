"""The serving engine loop without Ray: groups of requests (Serve's batches) driven through
``jaxray.inference.scheduler.Scheduler`` over a real engine of a tiny transformer (fresh weights).

Groups are admitted into the one running batch while it decodes once it has free rows; each
group's stream yields one list per step (a token list per request) and ends once all its requests
are done, with the tokens each request gets alone; an engine error reaches only the groups it hit.
"""

from __future__ import annotations

import asyncio
import itertools

import jax
import pytest

from jaxray.config import ModelConfig
from jaxray.inference.engine import Engine, Request
from jaxray.inference.scheduler import Scheduler
from jaxray.inference.settings import EngineSettings
from jaxray.models import build

LONG = Request(b"ROMEO:", 20, 0.0)  # 1 token at admission, then 5 chunks of 4
SHORT = Request(b"KING:", 6, 0.8, None, 3)


@pytest.fixture(scope="module")
def tiny_engine() -> Engine:
    model = build(ModelConfig(workload="transformer", width=32, num_layers=1, num_heads=2, max_seq_len=32))
    settings = EngineSettings(buckets=(8,), batch_sizes=(1, 2), chunk=4, max_new_tokens=64)
    return Engine.for_model(model, model.init(jax.random.key(0)), settings)


async def collect(scheduler: Scheduler, requests: list[Request], log: list, name: str) -> list[list[int]]:
    """Every request's tokens from ``scheduler.run``; each step appended to ``log`` as (name, step)."""
    tokens = [[] for _ in requests]
    async for step in scheduler.run(requests):
        assert len(step) == len(requests)
        log.append((name, step))
        for mine, new in zip(tokens, step):
            mine += new
    return tokens


def test_a_group_joins_the_running_batch_and_streams_its_tokens(tiny_engine):
    async def scenario():
        scheduler, log = Scheduler(tiny_engine, 2), []
        long = asyncio.create_task(collect(scheduler, [LONG], log, "long"))
        while not log:  # the long request is admitted and has its first token
            await asyncio.sleep(0.001)
        short = await collect(scheduler, [SHORT], log, "short")
        return scheduler, log, await long, short

    scheduler, log, [long], [short] = asyncio.run(scenario())
    [long_alone, short_alone] = tiny_engine.generate([LONG]), tiny_engine.generate([SHORT])
    assert long == long_alone[0].tokens and short == short_alone[0].tokens
    long_steps = [len(step[0]) for name, step in log if name == "long"]
    assert long_steps == [1, 4, 4, 4, 4, 3]  # the first token alone, then chunk-sized pieces
    assert [len(step[0]) for name, step in log if name == "short"] == [1, 4, 1]
    stats = scheduler.stats()
    assert stats["rows_decoded"] > stats["decode_calls"]  # the short request shared decode calls
    assert scheduler.batcher.live == 0 and scheduler.batcher.state is None


def test_a_group_that_does_not_fit_waits_for_free_rows(tiny_engine):
    async def scenario():
        scheduler, log = Scheduler(tiny_engine, 2), []
        pair = collect(scheduler, [LONG, SHORT], log, "pair")
        late = collect(scheduler, [SHORT], log, "late")
        return log, await asyncio.gather(pair, late)

    log, (pair, [late]) = asyncio.run(scenario())
    assert pair == [c.tokens for c in tiny_engine.generate([LONG, SHORT])]
    assert late == tiny_engine.generate([SHORT])[0].tokens
    # The pair fills both rows: the late group is admitted once the pair's short request is done,
    # and decodes beside the long one.
    pair_steps = [i for i, (name, _) in enumerate(log) if name == "pair"]
    short_tokens = itertools.accumulate(len(log[i][1][1]) for i in pair_steps)
    short_done = next(i for i, total in zip(pair_steps, short_tokens) if total == SHORT.max_new_tokens)
    late_first = next(i for i, (name, _) in enumerate(log) if name == "late")
    assert short_done < late_first < pair_steps[-1]


def test_an_engine_error_reaches_its_group_and_the_loop_goes_on(tiny_engine):
    async def scenario():
        scheduler = Scheduler(tiny_engine, 2)
        with pytest.raises(ValueError, match="a group holds 1..2 requests, got 3"):
            await collect(scheduler, [SHORT] * 3, [], "too many")
        with pytest.raises(ValueError, match="prompt is empty"):  # unchecked: the engine's start refuses it
            await collect(scheduler, [Request(b"", 4)], [], "empty")
        return await collect(scheduler, [SHORT], [], "after")

    assert asyncio.run(scenario()) == [tiny_engine.generate([SHORT])[0].tokens]


def test_a_cancelled_request_frees_its_row_and_its_group_still_ends(tiny_engine):
    """LONG (20 tokens) cancelled after its first chunk: no more decode calls are spent on it, its
    group's stream ends, and its batch-mate SHORT gets all its tokens."""

    async def scenario():
        scheduler, log = Scheduler(tiny_engine, 2), []
        long, short = Request(b"ROMEO:", 20, 0.0), Request(b"KING:", 6, 0.8, None, 3)
        tokens = [[], []]
        async for step in scheduler.run([long, short]):
            log.append(step)
            for mine, new in zip(tokens, step):
                mine += new
            if len(log) == 2:
                scheduler.cancel(long)
        return scheduler, log, tokens, short

    scheduler, log, (long_tokens, short_tokens), short = asyncio.run(scenario())
    assert short_tokens == tiny_engine.generate([short])[0].tokens
    assert len(long_tokens) < 20 and all(step[0] == [] for step in log[3:])
    # SHORT's 6 tokens take the admission and 2 decode calls; LONG alone would have taken 5 of them
    assert scheduler.batcher.live == 0 and scheduler.batcher.decode_calls == 2


def test_a_request_cancelled_while_its_group_waits_is_ended_once_admitted(tiny_engine):
    """One row: LONG decodes while a second 20-token request waits and is cancelled (its client
    left). Once admitted it gets its first token and at most one chunk, not its 20 tokens."""

    async def scenario():
        scheduler, log = Scheduler(tiny_engine, 1), []
        first = asyncio.create_task(collect(scheduler, [LONG], log, "first"))
        late = Request(b"KING:", 20, 0.0)
        second = asyncio.create_task(collect(scheduler, [late], log, "second"))
        while not any(late in group.requests for group in scheduler._waiting):
            await asyncio.sleep(0.001)
        scheduler.cancel(late)
        return scheduler, await first, await second

    scheduler, [first], [second] = asyncio.run(scenario())
    assert first == tiny_engine.generate([LONG])[0].tokens
    assert 1 <= len(second) <= 1 + 4  # admission's token and at most one chunk of 4
    # LONG's 20 tokens take 5 decode calls; the cancelled request at most one more
    assert scheduler.batcher.live == 0 and scheduler.batcher.decode_calls <= 6


def test_a_request_cancelled_before_it_reaches_the_scheduler_is_ended_once_admitted(tiny_engine):
    """A client that left while its request waited in Serve's queue: cancelled before ``run``."""

    async def scenario():
        scheduler, request = Scheduler(tiny_engine, 2), Request(b"KING:", 20, 0.0)
        assert scheduler.cancel(request) is False  # neither running nor waiting here yet
        return scheduler, await collect(scheduler, [request], [], "late")

    scheduler, [tokens] = asyncio.run(scenario())
    assert 1 <= len(tokens) <= 1 + 4 and scheduler.batcher.live == 0


def test_a_prompt_prefilled_in_chunks_streams_every_token(tiny_engine):
    """Chunked prefill through the scheduler: a 30-byte prompt joins with its last 8-token chunk
    while another request decodes; each gets the tokens it gets alone, its first one included."""
    settings = tiny_engine.settings.model_copy(
        update={"buckets": (8, 32), "prefix_cache_mib": 1, "prefix_block": 8}
    )
    model = build(tiny_engine.config)
    chunked = Engine.for_model(model, tiny_engine.params, settings.model_copy(update={"prefill_chunk": 8}))
    plain = Engine.for_model(model, tiny_engine.params, settings.model_copy(update={"prefix_cache_mib": 0}))
    long_prompt = Request(b"ROMEO: But soft, what light thr", 10, 0.8, None, 5)

    async def scenario():
        scheduler, log = Scheduler(chunked, 2), []
        running = asyncio.create_task(collect(scheduler, [LONG], log, "running"))
        while not log:
            await asyncio.sleep(0.001)
        return await collect(scheduler, [long_prompt], log, "long"), await running

    [long], [running] = asyncio.run(scenario())
    assert [long, running] == [c.tokens for c in plain.generate([long_prompt, LONG])]
