"""Copies of a checkpoint for the tests of what reads it (imported by test modules and conftest):
damaged ones, and a run folder that was copied elsewhere, its original deleted."""

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


COPIED_TRIAL = "transformer_b16_float32_w64_lr0.003"


def copied_run_folder(checkpoint: Path, cluster: Path, laptop: Path) -> Path:
    """A run folder under ``cluster`` holding ``checkpoint`` as its one trial's (``COPIED_TRIAL``)
    checkpoint, summary.json by the sweep's writer from the absolute path Tune reports, copied into
    ``laptop``; the original is deleted. Returns the copy."""
    from jaxray.reporting.sweep import write_reports  # imports JAX: only the tests that call this

    root = cluster / "runs" / "demo"
    ck = shutil.copytree(checkpoint, root / "train" / COPIED_TRIAL / "checkpoint_step_00000060_attempt1")
    write_reports(
        root, [{"trial": COPIED_TRIAL, "workload": "transformer", "val_loss": 2.0, "checkpoint": str(ck)}], {}
    )
    copy = Path(shutil.copytree(root, laptop / "demo"))
    shutil.rmtree(root)
    return copy
