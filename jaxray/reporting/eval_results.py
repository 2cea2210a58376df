"""Where ``python -m jaxray.evaluate`` puts its results and how it writes them: ``runs/eval/<name>``
by default, one folder per checkpoint (``default_out``); an ``--out`` checked before any data is read
(``results_folder``); the files written to temporary names and renamed over the earlier ones, so a
failed write changes nothing there (``write_results``)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from jaxray import checkpoint
from jaxray.config import ConfigError
from jaxray.reporting.format import json_safe
from jaxray.runs import TRAIN_DIR, check_overwrite, removed_if_failed

DEFAULT_OUT_ROOT = Path("runs") / "eval"
WRITER = "jaxray.evaluate"  # summary.json's "written_by": what --out may overwrite (runs.check_overwrite)
FIGURES = ("confusion_matrix.png", "predictions_grid.png")


def default_out(directory: str | Path) -> Path:
    """``runs/eval/<name>``, one per checkpoint: the checkpoint folder's name or, for a Ray Train
    ``checkpoint_<step or timestamp>`` folder, ``<trial>/<checkpoint>`` (the name alone says nothing
    about the model; the trial alone is shared by all its checkpoints), with ``<experiment>/`` first
    when the trial folder is in a run folder's ``train/``."""
    directory = Path(directory).absolute()
    if not directory.name.startswith("checkpoint"):
        return DEFAULT_OUT_ROOT / directory.name
    trial = directory.parent
    experiment = [trial.parent.parent.name] if trial.parent.name == TRAIN_DIR else []
    return DEFAULT_OUT_ROOT.joinpath(*experiment, trial.name, directory.name)


class ResultsWriteError(OSError):
    """The results could not be written into --out (a full disk, say); nothing there was changed."""


def results_folder(out: str | Path, directory: Path, weights: str | None, overwrite: bool) -> Path:
    """``out``, absolute, checked (not created) before any data is read: CheckpointError if it is
    in a checkpoint folder, ValueError if it holds another tool's summary.json, ConfigError if it
    holds the evaluation of other weights than ``directory``'s (another path, or the same path
    whose digest manifest's SHA-256 ``weights`` differs: a folder replaced or a symlink moved
    since) unless ``overwrite``, holds files named like the figures without an evaluation's
    summary.json, or cannot be created (its nearest existing folder is not a writable directory)."""
    out = Path(out).absolute()
    checkpoint.check_outside(out)
    check_overwrite(out, WRITER)
    if (out / "summary.json").is_file() and not overwrite:  # check_overwrite: it is an evaluation's
        earlier = json.loads((out / "summary.json").read_text())
        recorded, digest = earlier.get("checkpoint"), earlier.get("checkpoint_sha256")
        if recorded and Path(recorded).resolve() != directory.resolve():
            raise ConfigError(
                f"--out {out} holds the evaluation of {recorded}; pass --overwrite or another --out "
                f"(nothing was changed)"
            )
        if digest and digest != weights:
            raise ConfigError(
                f"--out {out} holds the evaluation of the weights that were in {recorded} (digest "
                f"manifest SHA-256 {digest}), not of those there now ({weights}); pass --overwrite "
                f"or another --out (nothing was changed)"
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
    """Creates ``out`` and writes ``figures`` (name -> draw(path)) and ``out/summary.json``, each to
    a temporary file first, then renamed over the earlier ones (figures an earlier evaluation left
    and this one does not write are removed); returns ``summary`` with its path and ``written_by``.
    Raises ResultsWriteError, having removed its temporary files and the folders it created."""
    summary["summary_json"] = str(out / "summary.json")
    summary["written_by"] = WRITER
    partial = {out / f".partial-{name}": out / name for name in [*figures, "summary.json"]}
    try:
        with removed_if_failed(out):
            try:
                _write_files(out, summary, figures, partial)
            except BaseException:
                for tmp in partial:  # before the folders this run created are removed
                    tmp.unlink(missing_ok=True)
                raise
    except OSError as err:
        raise ResultsWriteError(
            f"the evaluation could not be written to {out}: {err}; nothing there was changed"
        ) from None
    return summary


def _write_files(
    out: Path, summary: dict, figures: dict[str, Callable[[Path], None]], partial: dict[Path, Path]
) -> None:
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
