"""What ``python -m jaxray.tune --overwrite`` does with the earlier run in ``--out``: checked before
anything runs (``check_out``), set aside in ``DIR/.overwritten/`` once every check has passed
(``set_aside``), and, when the new run ends, deleted only if it is complete, put back if none of
its trials finished, else kept beside it (``settle_aside``). Nothing of an earlier run is deleted
before a new one has replaced it whole. A sweep stopped by a full disk says so (``full_disk``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from jaxray import checkpoint
from jaxray.config import ConfigError
from jaxray.raytrain.sweep import TrialRows
from jaxray.reporting import terminal
from jaxray.runs import EXPERIMENT_FILE, FILES, RUN_DIRS, SUMMARY_JSON, TRAIN_DIR, check_not_nested

# Where --overwrite keeps the earlier run's results until the new run ends complete (settle_aside).
ASIDE_DIR = ".overwritten"
# Below this much free space on the run folder's disk, a sweep that stops is said to have filled it.
FULL_DISK_BYTES = 64 << 20


def check_out(out: Path, overwrite: bool) -> list[Path]:
    """The earlier run's results in the folder ``out`` (what jaxray writes there; ``runs.exclusive``
    refuses a file), checked before anything runs: refuse a folder in a checkpoint folder
    (``checkpoint.check_outside``), earlier results without ``overwrite``,
    and a folder that still holds the results an earlier ``--overwrite`` set aside. Raises
    ConfigError, or RunFolderError for a folder in another run's or holding one (``check_not_nested``)."""
    if (out / ASIDE_DIR).exists():
        raise ConfigError(
            f"{out / ASIDE_DIR} holds the results of a run that an interrupted --overwrite set aside; "
            f"move what you want to keep out of it and delete it, or choose another --out"
        )
    ours = [out / name for name in (*FILES, *RUN_DIRS, EXPERIMENT_FILE) if (out / name).exists()]
    if ours and not any((out / marker).is_file() for marker in (EXPERIMENT_FILE, SUMMARY_JSON)):
        # Folders named like a run's (train/, tensorboard/) without the files every run writes are
        # someone else's: never replaced, whatever --overwrite says.
        raise ConfigError(
            f"{out} holds {', '.join(p.name for p in ours)} but no {EXPERIMENT_FILE} or "
            f"{SUMMARY_JSON}, so it is not a run folder of python -m jaxray.tune and nothing in it is "
            f"replaced; choose another --out (a new or empty folder)"
        )
    if ours and not overwrite:
        resume = f", --resume {out} to finish that run" if (out / EXPERIMENT_FILE).is_file() else ""
        raise ConfigError(
            f"{out} already holds the results of an earlier run ({', '.join(p.name for p in ours)}); "
            f"pass --overwrite to replace them{resume}, or choose another --out"
        )
    check_not_nested(out, ours)
    try:
        checkpoint.check_outside(out, run=True)  # a run inside a checkpoint folder is deleted with it
    except checkpoint.CheckpointError as err:
        raise ConfigError(str(err)) from None
    return ours


def set_aside(out: Path, ours: list[Path]) -> Path | None:
    """Move the earlier run's results into ``out/.overwritten/`` (renames within the folder, so
    nothing is copied or lost) and return that folder; None when there were none."""
    if not ours:
        return None
    aside = out / ASIDE_DIR
    aside.mkdir()
    for path in ours:
        path.rename(aside / path.name)
    return aside


def settle_aside(out: Path, aside: Path | None, results: list[TrialRows], complete: bool) -> None:
    """When the new run ends: the earlier results are deleted only if it is ``complete`` (every
    trial of every sweep finished and the reports written: exit 0). If no trial finished, the new
    run's files are removed and the earlier ones put back; otherwise (a trial failed, or the run was
    interrupted, after one finished) both are kept. The terminal says which."""
    if aside is None:
        return
    if not aside.is_dir():  # moved: run_sweeps' caller has said so
        return
    if complete:  # renamed first: an rmtree cut short leaves no half of the earlier run under its name
        doomed = aside.with_name(f"{ASIDE_DIR}.deleting")
        shutil.rmtree(doomed, ignore_errors=True)  # one a killed deletion left: condemned already
        shutil.rmtree(aside.rename(doomed))
        return
    if finished(results):
        print(
            f"error: the new run did not finish every trial, so the earlier run's results are kept in "
            f"{aside}; delete that folder once you do not need them",
            file=terminal.err(),
        )
        return
    for name in (*FILES, *RUN_DIRS, EXPERIMENT_FILE):
        path = out / name
        if path.exists():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in aside.iterdir():
        path.rename(out / path.name)
    aside.rmdir()
    print(
        f"no trial of the new run finished, so there is nothing of it to keep or resume: the earlier "
        f"run's results are back in {out}",
        file=terminal.err(),
    )


def finished(results: list[TrialRows]) -> bool:
    """True once a trial has finished without an error."""
    return any(not row.get("error") for row, _ in results)


def resume_hint(out: Path, resume: bool, results: list[TrialRows]) -> str:
    """How to finish an interrupted run; empty when there is nothing of it to resume: with earlier
    results set aside and no trial finished, settle_aside puts them back."""
    kept = resume or finished(results) or not (out / ASIDE_DIR).exists()
    kept = kept and (out / EXPERIMENT_FILE).is_file()  # else the new run had not started
    return f"; the state is saved. Resume with: python -m jaxray.tune --resume {out}" if kept else ""


def full_disk(out: Path, err: Exception, keeps_new: bool = True) -> str | None:
    """The message for a sweep stopped by ``err`` while the disk holding ``out`` is full (less than
    ``FULL_DISK_BYTES`` free), else None. Ray Tune and Train write their own state into the run
    folder too; with the disk full to the last byte they fail in ways of their own (Tune 2.60 then
    raises ``EOFError`` reading an empty ``error.pkl``), so the cause is told from the disk. Unless
    the run ``keeps_new`` (an ``--overwrite`` none of whose trials finished: its files are removed and
    the earlier run's put back), it names the checkpoints the new run saved."""
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        return None
    if free >= FULL_DISK_BYTES:
        return None
    return (
        f"the sweep stopped ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}) with "
        f"the disk holding {out} full ({free} bytes free), so neither the trials nor Ray could save "
        f"their state.{f' The checkpoints saved before are kept in {out / TRAIN_DIR};' if keeps_new else ''} "
        f"Free space, then run the sweep again"
    )
