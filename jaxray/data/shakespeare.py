"""TinyShakespeare as byte-level token sequences (raw UTF-8 bytes, vocabulary 256)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from jaxray.data.sources import read_verified

VOCAB_SIZE = 256


@dataclass(frozen=True)
class ByteSequences:
    """Non-overlapping byte sequences: ``train`` [N_train, seq_len] int32 in 0..255, shuffled (text
    order with ``seed=None``); ``validation`` [N_val, seq_len] int32, in text order."""

    train: np.ndarray
    validation: np.ndarray
    seq_len: int


def bytes_to_text(tokens) -> str:
    """Decode a 1-D sequence of byte tokens (list, NumPy or JAX array) to text; invalid UTF-8
    becomes U+FFFD. Raises ValueError if ``tokens`` is not 1-D, not integers, or outside 0..255."""
    arr = np.asarray(tokens)
    if arr.size == 0:
        return ""
    if arr.ndim > 1:
        raise ValueError(f"bytes_to_text expects a 1-D token sequence, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"bytes_to_text expects integer tokens, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= VOCAB_SIZE:
        raise ValueError(f"tokens must be bytes in 0..{VOCAB_SIZE - 1}, got range {arr.min()}..{arr.max()}")
    return arr.reshape(-1).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def split_sequences(
    tokens: np.ndarray, seq_len: int, seed: int | None, val_fraction: float = 0.1
) -> ByteSequences:
    """Cut ``tokens`` ([T] integers) into n = T // seq_len sequences (tail dropped): the first
    floor((1 - val_fraction) * n) are train (shuffled by ``default_rng(seed).permutation``; ``seed``
    None: text order), the rest validation. ValueError for ``seq_len`` < 2, ``val_fraction`` not in
    (0, 1), ``tokens`` not 1-D, or too few tokens for one train and one validation sequence."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 (input and shifted target), got {seq_len}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
    n = len(tokens) // seq_len
    # round() first so float noise (e.g. (1 - 0.3) * 90 = 62.99...) cannot drop a sequence.
    n_train = math.floor(round((1.0 - val_fraction) * n, 6))
    if n_train < 1 or n_train >= n:
        raise ValueError(
            f"{len(tokens)} tokens give {n} sequences of seq_len={seq_len}; "
            f"need at least one train and one validation sequence"
        )
    seqs = tokens[: n * seq_len].astype(np.int32).reshape(n, seq_len)
    train = seqs[:n_train]
    if seed is not None:
        train = train[np.random.default_rng(seed).permutation(n_train)]
    return ByteSequences(train=train, validation=seqs[n_train:], seq_len=seq_len)


def load_shakespeare(
    seq_len: int = 256, seed: int | None = 0, data_dir: str | os.PathLike | None = None
) -> ByteSequences:
    """Load verified TinyShakespeare (``data_dir`` searched first) and :func:`split_sequences` it;
    seq_len=256 gives 3921 train and 436 validation sequences. Raises DataFileError (missing file,
    wrong checksum) or ValueError as :func:`split_sequences`."""
    raw = read_verified("tinyshakespeare.txt", data_dir)
    tokens = np.frombuffer(raw, dtype=np.uint8)
    return split_sequences(tokens, seq_len, seed)
