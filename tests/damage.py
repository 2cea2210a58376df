"""Damage to checkpoint files, for the tests of what reads them (imported by test modules)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def largest_params_file(directory: Path) -> Path:
    """The largest file under ``directory/params`` (an array's data)."""
    return max((f for f in (directory / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip_a_byte(file: Path) -> tuple[str, str]:
    """Damage ``file`` in place (one byte, same size); (its SHA-256 before, after)."""
    data = bytearray(file.read_bytes())
    before = hashlib.sha256(data).hexdigest()
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))
    return before, hashlib.sha256(data).hexdigest()


def damaged_copy(checkpoint: Path, into: Path) -> tuple[Path, str]:
    """A copy of ``checkpoint`` under ``into`` with one byte of its largest params file flipped;
    (the copy, that file's path relative to it)."""
    copy = Path(shutil.copytree(checkpoint, into / checkpoint.name))
    victim = largest_params_file(copy)
    flip_a_byte(victim)
    return copy, str(victim.relative_to(copy))
