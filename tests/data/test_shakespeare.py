"""Byte tokenizer and sequence split on the real TinyShakespeare file."""

from __future__ import annotations

import numpy as np
import pytest

from jaxray.data.shakespeare import (
    VOCAB_SIZE,
    ByteSequences,
    bytes_to_text,
    load_shakespeare,
    split_sequences,
)

N_BYTES = 1_115_394


def encode(text: str) -> np.ndarray:
    """UTF-8 encode ``text`` into a [len(text.encode())] int32 array in 0..255."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


@pytest.fixture(scope="module")
def text(real_dir) -> str:
    return (real_dir / "tinyshakespeare.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def seqs(real_dir) -> ByteSequences:
    return load_shakespeare(seq_len=256, seed=0, data_dir=real_dir)


def test_real_round_trip(text):
    tokens = encode(text)
    assert tokens.dtype == np.int32 and tokens.shape == (N_BYTES,)
    assert 0 <= tokens.min() and tokens.max() < VOCAB_SIZE
    assert bytes_to_text(tokens) == text


def test_non_ascii_round_trip():
    s = "Ophélie — ∑ 🎭"
    assert len(encode(s)) == len(s.encode("utf-8"))
    assert bytes_to_text(encode(s)) == s
    assert bytes_to_text(list(encode(s))) == s


def test_bytes_to_text_never_raises_on_invalid_utf8():
    cut = encode("é")[:1]  # half of a two-byte character
    assert bytes_to_text(cut) == "\ufffd"
    assert bytes_to_text(np.array([0xFF, 0x41], dtype=np.int32)) == "\ufffdA"
    assert bytes_to_text([]) == ""


@pytest.mark.parametrize("bad", [[256], [-1], [[65, 66]], [0.5]])
def test_bytes_to_text_rejects_non_byte_tokens(bad):
    with pytest.raises(ValueError):
        bytes_to_text(bad)


def test_real_split_sizes(seqs):
    assert seqs.seq_len == 256
    assert seqs.train.shape == (3921, 256) and seqs.validation.shape == (436, 256)
    assert seqs.train.dtype == np.int32 and seqs.validation.dtype == np.int32
    assert 3921 + 436 == N_BYTES // 256


def test_real_train_is_seeded_permutation_validation_unshuffled(text, seqs):
    unshuffled = encode(text)[: 4357 * 256].reshape(4357, 256)
    order = np.random.default_rng(0).permutation(3921)
    np.testing.assert_array_equal(seqs.train, unshuffled[:3921][order])
    np.testing.assert_array_equal(seqs.validation, unshuffled[3921:])
    assert not np.array_equal(seqs.train, unshuffled[:3921])

    # Independently of the exact RNG call: same multiset of rows.
    def sort_rows(a):
        return a[np.lexsort(a.T[::-1])]

    np.testing.assert_array_equal(sort_rows(seqs.train), sort_rows(unshuffled[:3921]))


def test_real_shuffle_is_deterministic(real_dir, seqs):
    again = load_shakespeare(seq_len=256, seed=0, data_dir=real_dir)
    np.testing.assert_array_equal(again.train, seqs.train)
    other = load_shakespeare(seq_len=256, seed=1, data_dir=real_dir)
    assert not np.array_equal(other.train, seqs.train)
    np.testing.assert_array_equal(other.validation, seqs.validation)


def test_seed_none_keeps_text_order(real_dir, text):
    seqs = load_shakespeare(seq_len=256, seed=None, data_dir=real_dir)
    np.testing.assert_array_equal(seqs.train, encode(text)[: 3921 * 256].reshape(3921, 256))


def test_split_drops_tail_and_other_lengths(text):
    tokens = encode(text[:1000])
    s = split_sequences(tokens, seq_len=64, seed=3)
    assert (len(s.train), len(s.validation)) == (13, 2)  # n = 1000 // 64 = 15, floor(13.5)
    # (1 - 0.3) * 90 is 62.99999999999999 in floating point; the split must say 63.
    s = split_sequences(tokens[:900], seq_len=10, seed=3, val_fraction=0.3)
    assert (len(s.train), len(s.validation)) == (63, 27)


@pytest.mark.parametrize("seq_len", [1, 0, -5])
def test_seq_len_too_small(text, seq_len):
    with pytest.raises(ValueError, match="seq_len"):
        split_sequences(encode(text[:1000]), seq_len=seq_len, seed=0)


def test_too_little_text_for_a_split(text):
    with pytest.raises(ValueError, match="need at least one train and one validation"):
        split_sequences(encode(text[:100]), seq_len=64, seed=0)
