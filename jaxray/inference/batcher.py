"""Continuous batching: requests join the running batch (one ``DecodeState``) between decode calls and
leave it when done, through the engine's compiled ``gather`` programs. Rows are independent: a request's
tokens do not depend on its batch-mates. With chunked prefill (``settings.prefill_chunk``, as vLLM's) a
longer prompt is prefilled one chunk per ``step`` and joins with its last chunk, so decoding rows wait
for one chunk, not the whole prompt."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from jaxray.inference.engine import Engine, Request


@dataclass
class Update:
    """New tokens of one request from one ``Batcher`` call; ``done`` once it has all of them."""

    ticket: Hashable
    tokens: list[int]
    done: bool


class Batcher:
    """The running batch of a compiled ``Engine``, at most ``max_batch_size`` live rows. ``admit``
    adds requests, ``step`` advances every live row by up to ``chunk`` tokens; both return
    ``Update``s. Not thread-safe."""

    def __init__(self, engine: Engine, max_batch_size: int | None = None):
        max_batch_size = max_batch_size or engine.max_batch_size
        if not 1 <= max_batch_size <= engine.max_batch_size:
            raise ValueError(
                f"max_batch_size must be in 1..{engine.max_batch_size} (the largest compiled "
                f"batch size), got {max_batch_size}"
            )
        self.engine, self.max_batch_size = engine, max_batch_size
        self.state = None
        self.rows: list[Hashable | None] = []  # the ticket of each row of ``state``; None: free
        self._left: dict[Hashable, int] = {}  # tokens each live request still expects
        # Requests prefilled a chunk per step, oldest first: [ticket, request, prompt tokens prefilled].
        self._prefilling: deque[list] = deque()
        self.decode_calls = self.rows_decoded = 0
        self.admit_s = self.decode_s = 0.0  # time spent in admit and step, seconds

    @property
    def live(self) -> int:
        """Requests in the running batch or being prefilled into it."""
        return len(self._left) + len(self._prefilling)

    @property
    def free(self) -> int:
        """Requests ``admit`` can take now."""
        return self.max_batch_size - self.live

    def admit(self, requests: list[Request], tickets: list[Hashable]) -> list[Update]:
        """Prefill ``requests`` (checked; 1..free of them), named by ``tickets`` (not live ones), and
        join them: each one's first token, but for a prompt longer than ``prefill_chunk`` (``step``
        prefills it and gives it). Raises ValueError when they do not fit."""
        if not 1 <= len(requests) <= self.free or len(tickets) != len(requests):
            raise ValueError(
                f"admit takes 1..{self.free} requests (free rows) with one ticket each, got "
                f"{len(requests)} requests and {len(tickets)} tickets"
            )
        chunk, now, counted = self.engine.settings.prefill_chunk, [], []
        for ticket, request in zip(tickets, requests):
            tokens = self.engine.prompt_tokens(request)
            # Its prefix-cache lookup counted here, once: not its chunks', nor its join's.
            cached = self.engine.count_prefix(request) if chunk and tokens > chunk else None
            if cached is not None and tokens - cached > chunk:  # more than a chunk left to compute
                self._prefilling.append([ticket, request, cached])
            else:
                now.append((ticket, request))
                counted.append(cached is None)
        return self._join([r for _, r in now], [t for t, _ in now], counted) if now else []

    def _join(self, requests: list[Request], tickets: list[Hashable], counted: list[bool]) -> list[Update]:
        """Prefill ``requests`` and join them; ``counted`` as ``Engine.start``'s."""
        begin = time.perf_counter()
        fresh, first = self.engine.start(requests, counted)
        live = self._live_rows()
        joined = live + [len(self.rows) + i for i in range(len(requests))]  # rows of (running, fresh) joined
        target = self.engine.batch_for(len(joined))
        # With nothing running the fresh batch already has the right size (batch_for of the same count).
        self.state = (
            fresh if self.state is None else self.engine.gather([self.state, fresh], *_index(joined, target))
        )
        self.rows = [self.rows[i] for i in live] + list(tickets) + [None] * (target - len(joined))
        updates = []
        for ticket, request, token in zip(tickets, requests, first):
            self._left[ticket] = request.max_new_tokens - 1
            updates.append(Update(ticket, [int(token)], request.max_new_tokens == 1))
        self._drop_finished()
        self.admit_s += time.perf_counter() - begin
        return updates

    def step(self) -> list[Update]:
        """The oldest prefilling request's next chunk (its first token after the last), then one
        ``Engine.decode_chunk`` call: an ``Update`` per live request. Finished requests leave."""
        joined = {u.ticket: u for u in self._prefill_chunk()} if self._prefilling else {}
        if not self._left:
            return list(joined.values())
        updates = self._decode()
        for update in updates:  # a request joined by its last chunk: its first token, then these
            if (first := joined.pop(update.ticket, None)) is not None:
                update.tokens[:0] = first.tokens
                update.done = update.done or first.done
        return list(joined.values()) + updates

    def _prefill_chunk(self) -> list[Update]:
        """The oldest prefilling request's next chunk into the prefix cache; its last one joins it."""
        entry = self._prefilling[0]
        ticket, request, done = entry
        chunk = self.engine.settings.prefill_chunk
        if done + chunk >= self.engine.prompt_tokens(request):
            self._prefilling.popleft()
            return self._join([request], [ticket], [False])
        begin = time.perf_counter()
        entry[2] = done + chunk
        self.engine.prefill_blocks(request, entry[2])
        self.admit_s += time.perf_counter() - begin
        return []

    def _decode(self) -> list[Update]:
        self.decode_calls, self.rows_decoded = self.decode_calls + 1, self.rows_decoded + len(self._left)
        begin = time.perf_counter()
        self.state, out, counts = self.engine.decode_chunk(self.state)
        updates = []
        for row, ticket in enumerate(self.rows):
            if ticket is not None:
                self._left[ticket] -= int(counts[row])
                updates.append(Update(ticket, out[row, : counts[row]].tolist(), self._left[ticket] <= 0))
        self._drop_finished()
        self.decode_s += time.perf_counter() - begin
        return updates

    def cancel(self, tickets: list[Hashable]) -> list[Update]:
        """End the live requests of ``tickets`` now, freeing their rows: an empty final ``Update`` each."""
        prefilling = [e[0] for e in self._prefilling if e[0] in tickets]
        self._prefilling = deque(e for e in self._prefilling if e[0] not in tickets)
        live = [t for t in tickets if t in self._left]
        for ticket in live:
            self._left[ticket] = 0
        self._drop_finished()
        return [Update(ticket, [], True) for ticket in prefilling + live]

    def reset(self) -> list[Hashable]:
        """Forget the running batch (after an engine failure); returns the tickets it held."""
        tickets = list(self._left) + [e[0] for e in self._prefilling]
        self.state, self.rows, self._left, self._prefilling = None, [], {}, deque()
        return tickets

    def _live_rows(self) -> list[int]:
        return [i for i, ticket in enumerate(self.rows) if ticket is not None]

    def _drop_finished(self) -> None:
        """Free finished rows, shrinking the batch to the smallest compiled size that holds the rest."""
        for row, ticket in enumerate(self.rows):
            if ticket is not None and self._left[ticket] <= 0:
                del self._left[ticket]
                self.rows[row] = None
        if not self._left:
            self.state, self.rows = None, []
            return
        target = self.engine.batch_for(len(self._left))
        if target < len(self.rows):
            live = self._live_rows()
            self.state = self.engine.gather([self.state], *_index(live, target))
            self.rows = [self.rows[i] for i in live] + [None] * (target - len(live))


def _index(rows: list[int], target: int) -> tuple[np.ndarray, np.ndarray]:
    """``gather`` arguments taking ``rows`` then finished padding up to ``target`` rows."""
    index = np.zeros(target, np.int32)
    index[: len(rows)] = rows
    return index, np.arange(target) < len(rows)
