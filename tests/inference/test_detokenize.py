"""Text from byte-token streams: UTF-8 pieces never split a character, bad bytes become U+FFFD, and
a choice ends before its first stop sequence, across chunks and characters."""

from __future__ import annotations

import asyncio

from jaxray.inference.detokenize import Choice, decoded


async def tokens(*chunks: bytes):
    """A token-chunk stream as the engine gives it (byte values)."""
    for chunk in chunks:
        yield list(chunk)


async def gathered(stream) -> list:
    return [item async for item in stream]


async def pieces(choice: Choice) -> list[str]:
    return [p async for p in choice.pieces()]


def test_text_never_splits_a_character_and_bad_bytes_become_replacement_chars():
    e_acute = "é".encode()
    pieces = asyncio.run(
        gathered(decoded(tokens(b"a" + e_acute[:1], e_acute[1:] + b"b", b"\xff", e_acute[:1])))
    )
    assert pieces == ["a", "éb", "\ufffd", "\ufffd"]  # the last: an unfinished character at the end


def test_a_stop_ends_the_choice_before_it_even_across_chunks_and_characters():
    e_acute = "é".encode()
    choice = Choice(
        0,
        lambda ended: tokens(b"Good m", b"orr" + e_acute[:1], e_acute[1:] + b"w\n\nRO", b"MEO"),
        ["\n\n", "rré"],
    )
    assert "".join(asyncio.run(pieces(choice))) == "Good mo"
    assert (choice.finish_reason, choice.stop_reason, choice.tokens) == ("stop", "rré", 7 + 4)
    choice = Choice(3, lambda ended: tokens(b"xab", b"cX"), ["abcX", "bc"])  # the stop that ends first
    assert "".join(asyncio.run(pieces(choice))) == "xa" and choice.stop_reason == "bc"
    choice = Choice(1, lambda ended: tokens(b"Good m", b"orrow"), ["\n\n"])
    assert asyncio.run(pieces(choice)) == ["Good ", "morro", "w"]  # one byte held back, flushed at the end
    assert (choice.finish_reason, choice.stop_reason, choice.tokens) == ("length", None, 11)
    choice = Choice(2, lambda ended: tokens(b"abc", b"def"), [])
    assert asyncio.run(pieces(choice)) == ["abc", "def"] and choice.tokens == 6  # no stop: nothing held
