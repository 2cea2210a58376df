"""Continuous batching on a checkpoint trained on the real TinyShakespeare bytes: requests that join
and leave a running batch get the tokens they get alone, and the batch follows its live rows."""

from __future__ import annotations

import pytest

from jaxray.inference.batcher import Batcher
from jaxray.inference.engine import Request

REQUESTS = {  # ticket -> request: greedy and sampled, top-k, both prompt buckets, 1 to 150 new tokens
    "romeo": Request(b"ROMEO:", 150, 0.0),  # outlives the others: the batch shrinks back to one row
    "citizen": Request(b"First Citizen:\nBefore we proceed any further, hear me", 33, 0.8, 10, 5),
    "one": Request(b"x", 1, 1.0, None, 9),
    "king": Request(b"KING:", 45, 0.7, None, 1),
    "juliet": Request(b"JULIET:\nO Romeo", 20, 0.0),
}


def collect(updates, tokens: dict, done: set) -> None:
    for update in updates:
        assert update.ticket not in done, f"{update.ticket} got tokens after it was done"
        tokens.setdefault(update.ticket, []).extend(update.tokens)
        if update.done:
            done.add(update.ticket)


def test_requests_joining_a_running_batch_get_their_tokens_alone(engine):
    batcher = Batcher(engine)
    tokens, done, sizes = {}, set(), []
    collect(batcher.admit([REQUESTS["romeo"]], ["romeo"]), tokens, done)
    sizes.append(len(batcher.rows))
    collect(batcher.step(), tokens, done)
    collect(batcher.admit([REQUESTS[t] for t in ("citizen", "one")], ["citizen", "one"]), tokens, done)
    sizes.append(len(batcher.rows))
    collect(batcher.step(), tokens, done)
    collect(batcher.admit([REQUESTS["king"]], ["king"]), tokens, done)
    waiting = ["juliet"]
    while batcher.live:
        collect(batcher.step(), tokens, done)
        sizes.append(len(batcher.rows))
        if waiting and batcher.free:
            collect(batcher.admit([REQUESTS[waiting[0]]], [waiting.pop()]), tokens, done)
    assert done == set(REQUESTS) and batcher.state is None and batcher.rows == []
    for ticket, request in REQUESTS.items():
        [alone] = engine.generate([request])
        assert tokens[ticket] == alone.tokens, ticket
    assert sizes[:2] == [1, 4] and sizes[-1] == 0 and 1 in sizes[2:]  # grew to 4 rows, then shrank to 1
    assert batcher.step() == [] and batcher.decode_calls > 0
    assert batcher.rows_decoded / batcher.decode_calls > 1  # rows shared decode calls


def test_admit_refuses_more_than_the_free_rows(engine):
    batcher = Batcher(engine, max_batch_size=2)
    batcher.admit([Request(b"a", 50, 0.0)], ["a"])
    with pytest.raises(ValueError, match="admit takes 1..1 requests"):
        batcher.admit([Request(b"b", 5, 0.0)] * 2, ["b", "c"])
    with pytest.raises(ValueError, match="one ticket each"):
        batcher.admit([Request(b"b", 5, 0.0)], [])
    assert batcher.live == 1 and batcher.reset() == ["a"] and batcher.live == 0


def test_max_batch_size_must_be_compiled(engine):
    with pytest.raises(ValueError, match="max_batch_size must be in 1..4"):
        Batcher(engine, max_batch_size=5)
