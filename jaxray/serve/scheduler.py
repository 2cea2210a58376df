"""One engine batch at a time, made of every Serve batch that waited for it.

Ray Serve's ``@serve.batch`` forms the next batch as soon as the previous one *starts* (the batch
queue is read again while the first batch still holds its concurrency permit), so under load it
hands over many batches of one or two requests that then wait in line: with 16 closed-loop clients
the replica saw a mean batch of 1.7 requests. The scheduler undoes that: Serve may run several
batch handlers at once (``max_concurrent_batches``), each hands its requests here, and whenever the
engine is free the next engine batch takes every waiting group that fits in ``max_batch_size``.
Requests of one Serve batch stay together, so each handler still streams its own rows.
"""
from __future__ import annotations

import asyncio
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Optional

from jaxray.engine import Engine, Request

_DONE = object()


class Scheduler:
    """Runs ``engine.stream`` for merged groups of requests on one worker thread (JAX calls leave
    the event loop, so the replica keeps answering /healthz while a batch decodes)."""

    def __init__(self, engine: Engine, max_batch_size: int):
        if not 1 <= max_batch_size <= engine.max_batch_size:
            raise ValueError(f"max_batch_size must be in 1..{engine.max_batch_size} (the largest compiled "
                             f"batch size), got {max_batch_size}")
        self.engine, self.max_batch_size = engine, max_batch_size
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="jaxray-engine")
        self._waiting: deque[tuple[list[Request], asyncio.Queue]] = deque()
        self._wake = asyncio.Event()
        self._driver: Optional[asyncio.Task] = None
        self.batches, self.largest_batch = 0, 0

    async def run(self, requests: list[Request]) -> AsyncIterator[list[list[int]]]:
        """Yields, chunk by chunk, the new tokens of each of ``requests`` (as ``Engine.stream``).
        Raises what the engine raised. At most ``max_batch_size`` requests."""
        if len(requests) > self.max_batch_size:
            raise ValueError(f"a group holds at most {self.max_batch_size} requests, got {len(requests)}")
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive())
        out: asyncio.Queue = asyncio.Queue()
        self._waiting.append((requests, out))
        self._wake.set()
        while (item := await out.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item

    def _next_groups(self) -> list[tuple[list[Request], asyncio.Queue]]:
        """The waiting groups, oldest first, that fit in one engine batch (always at least one)."""
        groups, size = [self._waiting.popleft()], 0
        size = len(groups[0][0])
        while self._waiting and size + len(self._waiting[0][0]) <= self.max_batch_size:
            groups.append(self._waiting.popleft())
            size += len(groups[-1][0])
        return groups

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            if not self._waiting:
                self._wake.clear()
                continue
            groups = self._next_groups()
            requests = [r for group, _ in groups for r in group]
            self.batches, self.largest_batch = self.batches + 1, max(self.largest_batch, len(requests))
            try:
                steps = self.engine.stream(requests)
                while (step := await loop.run_in_executor(self._thread, next, steps, None)) is not None:
                    start = 0
                    for group, out in groups:
                        out.put_nowait(step[start:start + len(group)])
                        start += len(group)
            except Exception as err:  # noqa: BLE001 - every waiting handler gets the error, the driver goes on
                for _, out in groups:
                    out.put_nowait(err)
            for _, out in groups:
                out.put_nowait(_DONE)
