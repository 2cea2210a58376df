"""Output folders a command writes into: one writer at a time (``exclusive``), no empty folder left
by a failed command (``removed_if_failed``), no other command's results replaced (``check_overwrite``);
the names of a run folder's parts (``TRAIN_DIR``, ...)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

TRAIN_DIR, TUNE_DIR, TENSORBOARD_DIR = "train", "tune", "tensorboard"  # in a run folder
COMPILE_FILE = "compile.json"  # in train/<trial>/: what XLA knows about the trial's compiled step
LOCK_FILE = ".jaxray.lock"  # held by the one command writing into the folder (``exclusive``)


class RunFolderError(ValueError):
    """A run or output folder, or one of its files, that cannot be read or written, or is held by
    another command; the message names it."""


@contextmanager
def exclusive(run_dir: str | Path, command: str = "python -m jaxray.tune") -> Iterator[Path]:
    """Hold the folder ``run_dir`` (created if missing) for the one run of ``command`` writing into
    it: an OS lock on ``run_dir/.jaxray.lock`` (``filelock``), released however the process ends. A
    second run into it is refused at once, before it reads or moves anything. On exit the lock file
    goes, and so do the folders created here that are still empty (the run's checks failed).
    Raises RunFolderError naming the folder when another run holds it or it cannot be created."""
    run_dir = Path(run_dir).absolute()
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderError(f"--out {run_dir} is a file, not a folder")
    created = _first_missing(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(run_dir / LOCK_FILE, timeout=0)
        lock.acquire()
    except filelock.Timeout:
        raise RunFolderError(
            f"another {command} is writing into {run_dir} (it holds {run_dir / LOCK_FILE}); wait for "
            f"it to end, or choose another --out (nothing was changed)"
        ) from None
    except OSError as err:
        _remove_empty(run_dir, created)
        raise RunFolderError(f"--out {run_dir} cannot be written: {err}") from None
    try:
        yield run_dir
    finally:
        # Removed while still held, so the folder is left as the run left it.
        (run_dir / LOCK_FILE).unlink(missing_ok=True)
        lock.release()
        _remove_empty(run_dir, created)


@contextmanager
def removed_if_failed(out: str | Path) -> Iterator[Path]:
    """``out`` (absolute); when the block raises, the folders of ``out`` (``out`` included) that did
    not exist on entry and are empty then are removed, and the exception goes on."""
    out = Path(out).absolute()
    created = _first_missing(out)
    try:
        yield out
    except BaseException:
        _remove_empty(out, created)
        raise


def _first_missing(out: Path) -> Path | None:
    """The topmost folder of ``out`` (``out`` included) that does not exist yet; None if it exists."""
    return next((p for p in (*reversed(out.parents), out) if not p.exists()), None)


def _remove_empty(out: Path, created: Path | None) -> None:
    """Remove the empty folders from ``out`` up to ``created`` (the topmost one made for it)."""
    for folder in (out, *out.parents) if created is not None else ():
        if folder.is_dir():
            if any(folder.iterdir()):
                return
            folder.rmdir()
        if folder == created:
            return


def check_overwrite(out_dir: str | Path, writer: str, name: str = "summary.json") -> None:
    """Raise ValueError naming the file when ``out_dir/name`` exists and its ``written_by`` is not
    ``writer`` (e.g. "jaxray.bench"): ``--out`` pointed at a sweep's folder cannot destroy its results."""
    path = Path(out_dir) / name
    if not path.exists():
        return
    try:
        owner = json.loads(path.read_text()).get("written_by")
    except (ValueError, AttributeError, OSError):
        owner = None
    if owner != writer:
        raise ValueError(
            f"{path} exists and was not written by {writer}; choose another --out (nothing was changed)"
        )
