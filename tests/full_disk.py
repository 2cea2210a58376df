"""A small real filesystem to fill up: a tmpfs mounted for one test (root, or CAP_SYS_ADMIN; the
test is skipped with the reason where mounting is not permitted), and a filler file that takes its
free space until the kernel answers ENOSPC.

  with small_tmpfs(tmp_path / "disk", 16) as disk:
      fill(disk)                     # the next write there fails: [Errno 28] No space left on device
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

FILLER = "filler"


@contextmanager
def small_tmpfs(where: Path, size_mb: int) -> Iterator[Path]:
    """A tmpfs of ``size_mb`` MiB mounted at ``where`` (created) while the block runs; unmounted
    after it, whatever happened (lazily, so a process still holding a file there does not keep it)."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except FileNotFoundError as err:
        pytest.skip(f"no mount command to make a small tmpfs: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(disk: Path, leave: int = 0) -> Path:
    """Write ``disk/filler`` until the filesystem is full (ENOSPC), then give ``leave`` bytes back
    (truncate); the filler's path. Remove it to free the space again."""
    filler = disk / FILLER
    block = b"\0" * (1 << 20)
    with filler.open("ab", buffering=0) as f:  # unbuffered: nothing left to flush on close
        try:
            while True:
                f.write(block)
        except OSError as err:
            if err.errno != errno.ENOSPC:
                raise
    os.truncate(filler, max(0, filler.stat().st_size - leave))
    return filler
