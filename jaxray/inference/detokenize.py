"""Text from a stream of byte tokens, as the serving routes return it: UTF-8 pieces that never split a
character, cut at the first stop sequence. No JAX, no Ray."""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing


async def decoded(chunks: AsyncIterator[list[int]]) -> AsyncIterator[str]:
    """Text pieces of a token stream; bytes that are not UTF-8 become U+FFFD."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    async for tokens in chunks:
        if text := decoder.decode(bytes(tokens)):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


class Choice:
    """One choice's text from its engine request, cut at the first stop sequence (matched on
    bytes, so it may span chunks and characters). After ``pieces`` ends: ``tokens`` (bytes
    generated up to and including the stop), ``finish_reason`` ("stop"/"length"), ``stop_reason``.
    ``chunks(ended)`` opens the token stream; ``ended()`` tells it why it was closed early."""

    def __init__(self, index: int, chunks: Callable[[Callable], AsyncIterator[list[int]]], stops: list[str]):
        self.index, self.chunks = index, chunks(lambda: self.finish_reason)
        self.stops = [s.encode("utf-8") for s in stops]
        self.tokens, self.finish_reason, self.stop_reason = 0, None, None

    async def pieces(self) -> AsyncIterator[str]:
        """The choice's text, a piece at a time (``decoded`` bytes up to the stop)."""
        async with aclosing(self._until_stop()) as until_stop:
            async for text in decoded(until_stop):
                yield text

    async def text(self) -> str:
        """The choice's whole text."""
        return "".join([piece async for piece in self.pieces()])

    async def _until_stop(self) -> AsyncIterator[bytes]:
        keep = max(map(len, self.stops), default=1) - 1  # bytes that may begin a stop
        held, emitted = b"", 0
        try:
            async for tokens in self.chunks:
                held += bytes(tokens)
                # The stop that ends first, as a check after every byte would find it.
                _, at, stop = min(
                    ((held.find(s) + len(s), held.find(s), s) for s in self.stops if s in held),
                    default=(0, -1, None),
                )
                if stop is not None:
                    self.tokens, self.finish_reason = emitted + at + len(stop), "stop"
                    self.stop_reason = stop.decode("utf-8")
                    yield held[:at]
                    return
                if (ready := len(held) - keep) > 0:
                    yield held[:ready]
                    held, emitted = held[ready:], emitted + ready
            self.tokens, self.finish_reason = emitted + len(held), "length"
            yield held
        finally:
            await self.chunks.aclose()  # a stop ends the request's stream early
