"""The serving engine loop: continuous batching (``batcher``) driven from asyncio, fed by groups of
requests (a Serve replica's ``@serve.batch`` calls). Between two decode calls it admits every waiting
group, whole, that fits in the free rows. No Ray."""

from __future__ import annotations

import asyncio
import weakref
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from jaxray.inference.batcher import Batcher, Update
from jaxray.inference.engine import Engine, Request

_DONE = object()


class _Group:
    """One group (a Serve batch): its requests, its output queue and the requests not finished yet."""

    def __init__(self, requests: list[Request]):
        self.requests, self.out, self.unfinished = requests, asyncio.Queue(), len(requests)


class Scheduler:
    """Runs the ``Batcher`` on one worker thread so the event loop stays free (a replica keeps
    answering /healthz)."""

    def __init__(self, engine: Engine, max_batch_size: int):
        self.batcher = Batcher(engine, max_batch_size)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="jaxray-engine")
        self._waiting: deque[_Group] = deque()
        self._tickets: dict[int, tuple[_Group, int]] = {}  # id(request) -> its ticket, while live
        # Requests to end once admitted, by id; weak, so a finished one's id is never reused while here.
        self._cancelled: weakref.WeakValueDictionary[int, Request] = weakref.WeakValueDictionary()
        self._wake = asyncio.Event()
        self._driver: asyncio.Task | None = None

    async def run(self, requests: list[Request]) -> AsyncIterator[list[list[int]]]:
        """Yields, step by step, each request's new tokens ([] if finished or none) until all are
        done; at most ``max_batch_size`` requests. Raises what the engine raised."""
        if not 1 <= len(requests) <= self.batcher.max_batch_size:
            raise ValueError(f"a group holds 1..{self.batcher.max_batch_size} requests, got {len(requests)}")
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        group = _Group(requests)
        self._waiting.append(group)
        self._wake.set()
        while (item := await group.out.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self, request: Request) -> bool:
        """End ``request`` before its budget: before the next decode call if running, else once
        admitted. Its group's stream ends with its other requests. Returns whether it was running or
        waiting."""
        self._cancelled[id(request)] = request
        self._wake.set()
        return id(request) in self._tickets or any(r is request for g in self._waiting for r in g.requests)

    def stats(self) -> dict[str, float]:
        """Decode calls so far, the live requests they decoded in all, their mean, and the seconds spent
        admitting and decoding."""
        calls, rows = self.batcher.decode_calls, self.batcher.rows_decoded
        return {
            "decode_calls": calls,
            "rows_decoded": rows,
            "mean_rows": rows / calls if calls else 0.0,
            "admit_s": self.batcher.admit_s,
            "decode_s": self.batcher.decode_s,
        }

    def close(self) -> None:
        """End the engine thread once its call under way returns (the scheduler is done with)."""
        if self._driver is not None:
            self._driver.cancel()
        self._thread.shutdown(wait=False)

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting and not self.batcher.live:
                self._wake.clear()
                await self._wake.wait()
                continue
            if tickets := [self._tickets[key] for key in list(self._cancelled) if key in self._tickets]:
                for key in [id(group.requests[i]) for group, i in tickets]:
                    del self._cancelled[key]
                await self._run(loop, None, self.batcher.cancel, tickets)
            # The waiting groups, oldest first, that fit in the free rows (up to the first that does not).
            groups, free = [], self.batcher.free
            while self._waiting and len(self._waiting[0].requests) <= free:
                groups.append(self._waiting.popleft())
                free -= len(groups[-1].requests)
            if groups:
                tickets = [(group, i) for group in groups for i in range(len(group.requests))]
                requests = [r for group in groups for r in group.requests]
                self._tickets.update({id(r): t for r, t in zip(requests, tickets)})
                await self._run(loop, groups, self.batcher.admit, requests, tickets)
            if self.batcher.live:
                await self._run(loop, None, self.batcher.step)

    async def _run(self, loop, admitted: list[_Group] | None, call, *args) -> None:
        """``call`` on the engine thread, its updates sent to their groups (each request's new tokens);
        on an engine error the groups involved get it and the running batch is reset."""
        try:
            updates: list[Update] = await loop.run_in_executor(self._thread, call, *args)
        except Exception as err:  # noqa: BLE001 - the handlers get the error, the loop goes on
            failed = set(admitted or []) | {group for group, _ in self.batcher.reset()}
            for group in failed:
                group.out.put_nowait(err)
                group.out.put_nowait(_DONE)
            self._tickets = {key: t for key, t in self._tickets.items() if t[0] not in failed}
            return
        steps: dict[_Group, list[list[int]]] = {}
        for update in updates:
            group, i = update.ticket
            steps.setdefault(group, [[] for _ in group.requests])[i] += update.tokens
            group.unfinished -= update.done
            if update.done:
                self._tickets.pop(id(group.requests[i]), None)
        for group, step in steps.items():
            group.out.put_nowait(step)
            if group.unfinished == 0:
                group.out.put_nowait(_DONE)
