"""Where ``python -m jaxray.evaluate`` puts its results (``runs/eval/<name>``, one per checkpoint) and
how it writes them (temporary names renamed over the earlier ones)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from jaxray import checkpoint
from jaxray.config import ConfigError
from jaxray.folders import TRAIN_DIR, check_overwrite, removed_if_failed
from jaxray.reporting.format import json_safe
from jaxray.runs import RUN_NAME

DEFAULT_OUT_ROOT = Path("runs") / "eval"
CHECKPOINT_SHA256 = "checkpoint_sha256"  # summary.json: which weights the evaluation is of
WRITER = "jaxray.evaluate"  # summary.json's "written_by": what --out may overwrite (folders.check_overwrite)
FIGURES = ("confusion_matrix.png", "predictions_grid.png")


def default_out(directory: str | Path) -> Path:
    """``runs/eval/<name>``: the checkpoint folder's name, or ``<trial>/<checkpoint>`` for a Ray
    Train ``checkpoint_*`` folder, prefixed ``<experiment>/<run>/`` when inside a run folder
    (``<run>/`` alone when that folder is not named as ``runs.new_run`` names runs)."""
    directory = Path(directory).absolute()
    if not directory.name.startswith("checkpoint"):
        return DEFAULT_OUT_ROOT / directory.name
    trial = directory.parent
    run = trial.parent.parent
    if trial.parent.name != TRAIN_DIR:
        prefix = []
    elif RUN_NAME.fullmatch(run.name):
        prefix = [run.parent.name, run.name]
    else:
        prefix = [run.name]
    return DEFAULT_OUT_ROOT.joinpath(*prefix, trial.name, directory.name)


def checkpoint_sha256(directory: Path) -> str | None:
    """SHA-256 of the checkpoint's ``train_state.json`` (its weights' digests), None if unreadable."""
    try:
        return checkpoint.manifest_sha256(directory)
    except OSError:
        return None


class ResultsWriteError(OSError):
    """The results could not be written into --out (a full disk, say); nothing there was changed."""


def results_folder(out: str | Path, directory: Path, overwrite: bool) -> Path:
    """``out``, absolute, checked (not created) before any data is read: ValueError if it holds
    another tool's summary.json; ConfigError if it holds another checkpoint's evaluation (unless
    ``overwrite``), foreign figure-named files, or cannot be created."""
    out = Path(out).absolute()
    check_overwrite(out, WRITER)
    if (out / "summary.json").is_file() and not overwrite:  # check_overwrite: it is an evaluation's
        earlier = json.loads((out / "summary.json").read_text())
        recorded, digest = earlier.get("checkpoint"), earlier.get(CHECKPOINT_SHA256)
        same = recorded == checkpoint.source(directory)
        same = same or Path(recorded or "").resolve() == directory.resolve()
        changed = same and digest is not None and digest != checkpoint_sha256(directory)
        if recorded and (not same or changed):
            when = " before its weights changed" if changed else ""
            raise ConfigError(
                f"--out {out} holds the evaluation of {recorded}{when}; pass --overwrite or another --out "
                f"(nothing was changed)"
            )
    theirs = [n for n in FIGURES if (out / n).exists()] if not (out / "summary.json").is_file() else []
    if theirs:  # figure names with no evaluation beside them: someone else's files, never replaced
        raise ConfigError(
            f"--out {out} holds {', '.join(theirs)} but no evaluation (no summary.json), so they are "
            f"not an earlier evaluation's and would be replaced; choose another --out (nothing was changed)"
        )
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        kind = "not a directory" if not existing.is_dir() else "not writable"
        raise ConfigError(f"--out {out} cannot be a results folder: {existing} is {kind}")
    return out


def write_results(out: Path, summary: dict, figures: dict[str, Callable[[Path], None]]) -> dict:
    """Creates ``out`` and writes ``figures`` (name -> draw(path)) and ``summary.json`` via temporary
    files renamed over the earlier ones (stale figures removed); returns ``summary`` with its path
    and ``written_by``. Raises ResultsWriteError, having cleaned up."""
    summary["summary_json"] = str(out / "summary.json")
    summary["written_by"] = WRITER
    partial = {out / f".partial-{name}": out / name for name in [*figures, "summary.json"]}
    try:
        with removed_if_failed(out):
            try:
                out.mkdir(parents=True, exist_ok=True)
                for name, draw in figures.items():
                    draw(out / f".partial-{name}")
                # allow_nan=False: a NaN that slipped past json_safe fails here, not in the reader's parser
                text = json.dumps(json_safe(summary), indent=2, allow_nan=False) + "\n"
                (out / ".partial-summary.json").write_text(text)
                for name in set(FIGURES) - set(figures):
                    (out / name).unlink(missing_ok=True)
                for tmp, final in partial.items():  # summary.json last: it marks the results complete
                    os.replace(tmp, final)
            except BaseException:
                for tmp in partial:  # before the folders this run created are removed
                    tmp.unlink(missing_ok=True)
                raise
    except OSError as err:
        raise ResultsWriteError(
            f"the evaluation could not be written to {out}: {err}; nothing there was changed"
        ) from None
    return summary
