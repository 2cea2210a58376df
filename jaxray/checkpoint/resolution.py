"""Which checkpoint a path means, and the one line that says so.

``resolve`` turns what a command's ``--checkpoint`` names into a checkpoint folder: a checkpoint
itself, a Ray Train run folder (its newest good ``checkpoint_*``), or a ``runs/<experiment>`` run
folder (the checkpoint of its best trial of a workload, as ``jaxray.runs`` ranks them; when that one
is damaged, the trial's newest good one, with a warning naming the skipped one). ``describe`` is the
line generate, evaluate, export and serve print once they resolved it::

    checkpoint: runs/demo/train/transformer_b16_float32_w128/checkpoint_step_00000300_attempt1
    (trial transformer_b16_float32_w128, step 300, val loss 2.4185, perplexity 11.23)

(one line): the trial the checkpoint's ``trial_config.json`` names (else the Ray Train run folder it
lies in), the step and the metric what the checkpoint's ``train_state.json`` records (the final
checkpoint's summary row: held-out loss and perplexity of a transformer, test accuracy of an MLP;
an earlier one's last training loss).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxray import runs
from jaxray.checkpoint.failures import CheckpointError, reading
from jaxray.checkpoint.layout import (
    HISTORY_FILE,
    MODEL_CONFIG,
    TRAIN_STATE,
    TRIAL_CONFIG,
    load_trial_config,
    manifest_sha256,
    open_for_reading,
    require_checkpoint,
)

log = logging.getLogger(__name__)
CHECKPOINT_PREFIX = "checkpoint_"  # Ray Train's checkpoint folders: train/<trial>/checkpoint_*
TRIAL_NAME = re.compile(r"[a-z_]+_b\d+_[a-z0-9]+_w\d+")  # jaxray.config.grid_point_name's names


def restore_latest(candidates: Sequence[Path], restore: Callable[[Path], Any]) -> tuple[Any, Path]:
    """``restore(path)`` of the newest candidate that restores (``candidates`` newest first),
    logging a warning that names each one skipped, why, and the one used instead. Raises
    CheckpointError listing every reason if none restores."""
    errors = []
    for path in candidates:
        try:
            value = restore(path)
        except CheckpointError as err:
            errors.append(str(err))  # each names its checkpoint
            continue
        if errors:
            log.warning("checkpoint skipped: %s; using %s instead", "; ".join(errors), path)
        return value, path
    raise CheckpointError(
        f"no usable checkpoint of the {len(errors)} tried, newest first: " + "; ".join(errors)
    )


def _usable(directory: Path, recorded: str | None = None) -> Path:
    """``directory`` if it is a checkpoint whose files match their digests and, given the SHA-256
    its run's summary row ``recorded``, the one the row names (``check_identity``); else
    CheckpointError naming it and why."""
    require_checkpoint(directory)
    open_for_reading(directory)
    check_identity(directory, recorded)
    check_trial(directory)
    return directory


def check_trial(directory: Path) -> None:
    """A checkpoint in a trial's folder (``train/<trial>/checkpoint_*``, the folder named as
    python -m jaxray.tune names trials) must be that trial's: its ``trial_config.json`` names the
    same trial (a checkpoint or a whole trial folder moved by hand holds another trial's weights).
    Raises CheckpointError naming both trials; a folder named otherwise is not compared."""
    folder = directory.parent.name
    if not (directory.name.startswith(CHECKPOINT_PREFIX) and TRIAL_NAME.fullmatch(folder)):
        return
    if not (directory / TRIAL_CONFIG).is_file():  # a params-only save: no trial recorded
        return
    saved = load_trial_config(directory).name()
    if saved != folder:
        raise CheckpointError(
            f"{directory} lies in the folder of trial {folder} but is a checkpoint of trial {saved} "
            f"(its {TRIAL_CONFIG}): a checkpoint or trial folder moved by hand?"
        )


def check_identity(directory: Path, recorded: str | None = None) -> None:
    """A checkpoint folder renamed or copied into another's place by hand is consistent with
    itself, so its digests pass: refuse it when its manifest's SHA-256 is not the one the run's
    summary row ``recorded`` (``checkpoint_sha256``; None: a row written before it, nothing to
    compare). Raises CheckpointError naming both values."""
    found = manifest_sha256(directory) if recorded else None
    if found != recorded:
        raise CheckpointError(
            f"{directory} is not the checkpoint the run's {runs.SUMMARY_JSON} names: its manifest's "
            f"SHA-256 is {found}, the summary recorded {recorded} (a checkpoint folder replaced or "
            f"copied in by hand?)"
        )


def trial_checkpoints(named: Path) -> list[Path]:
    """``named``, then the older ``checkpoint_*`` folders beside it (its trial's), newest first; not
    Ray Train's files there (``checkpoint_manager_snapshot.json``), which are no checkpoints."""
    older = sorted(
        (c for c in named.parent.glob(f"{CHECKPOINT_PREFIX}*") if c.name < named.name and c.is_dir()),
        reverse=True,
    )
    return [named, *older]


def resolve(path: str | Path, workload: str | None = None) -> Path:
    """A checkpoint directory from ``path``: a checkpoint itself (as it is: ``restore`` refuses it
    if damaged), a Ray Train run folder (its newest good ``checkpoint_*``), or a
    ``runs/<experiment>`` run folder: the checkpoint of its best trial of ``workload``
    (``jaxray.runs.best_row``: the trial ``summary.md`` names, ranked by the metric the sweep
    saved; default workload: the transformer if the sweep has one). From a run folder, a damaged
    checkpoint, or one that is not the one the summary row recorded (``check_identity``), is
    skipped for the trial's next older good one, with a warning naming it.

    Raises CheckpointError naming the path and what was looked for, or every skipped checkpoint
    and why when none of the trial's is good.
    """
    path = Path(path)
    with reading(path):  # a folder on the way that cannot be opened: the OS error in words
        return _resolve(path, workload)


def _resolve(path: Path, workload: str | None) -> Path:  # ``resolve`` less its OS errors in words
    if (path / MODEL_CONFIG).is_file():
        return path
    inside = sorted(p.parent for p in path.glob(f"{CHECKPOINT_PREFIX}*/{MODEL_CONFIG}"))
    if inside:  # a Ray Train run folder: its newest good checkpoint (names sort by step or time)
        return restore_latest(inside[::-1], _usable)[1]
    if not (path / runs.SUMMARY_JSON).is_file():
        raise CheckpointError(
            f"{path} is neither a checkpoint (no {MODEL_CONFIG}) nor an experiment "
            f"directory (no {runs.SUMMARY_JSON})"
        )
    try:
        row = runs.best_row(path, workload)
        named = runs.checkpoint_of(path, row)
    except runs.RunFolderError as err:
        raise CheckpointError(str(err)) from None
    recorded = row.get("checkpoint_sha256")
    recorded = recorded if isinstance(recorded, str) else None  # rows written before it: none
    return restore_latest(trial_checkpoints(named), lambda c: _usable(c, recorded if c == named else None))[1]


def describe(directory: str | Path) -> str:
    """``checkpoint: PATH (trial T, step S, METRIC)`` for the checkpoint ``directory`` (a resolved
    one): PATH relative to the working directory when inside it; the trial, step and metric where
    the checkpoint records them (see the module docstring), "params only" for a checkpoint without
    a ``train_state.json``. Only reads: a file that cannot be read or parsed leaves its part out
    (the restore that follows says why)."""
    directory = Path(directory)
    shown = (
        Path(os.path.relpath(directory.absolute()))
        if directory.absolute().is_relative_to(Path.cwd())
        else directory
    )
    state, trial = _json(directory / TRAIN_STATE), _saved_trial(directory)
    parts = [f"trial {trial}"] if trial else []
    parts.append(f"step {state['step']}" if isinstance(state, dict) and "step" in state else "params only")
    parts.append(_metric(directory, state))
    return f"checkpoint: {shown} ({', '.join(p for p in parts if p)})"


def _saved_trial(directory: Path) -> str | None:
    """The trial the checkpoint's ``trial_config.json`` names, else its Ray Train run folder's name
    (a params-only checkpoint there), else None."""
    try:
        return load_trial_config(directory).name()
    except CheckpointError:
        return directory.parent.name if directory.name.startswith(CHECKPOINT_PREFIX) else None


def _json(path: Path) -> Any:
    """``path`` parsed; None when it is missing, unreadable or no JSON (``describe`` only shows)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _metric(directory: Path, state: Any) -> str:
    """The held-out metric of the final checkpoint's summary row, else the last training loss."""
    summary = state.get("summary") if isinstance(state, dict) else None
    if isinstance(summary, dict):
        shown = _held_out(summary)
        if shown:
            return shown
    history = _json(directory / HISTORY_FILE) if isinstance(state, dict) else None
    last = history[-1] if isinstance(history, list) and history and isinstance(history[-1], dict) else {}
    if _number(last.get("loss")):
        return f"train loss {last['loss']:.4f} at step {last.get('step', '?')} (no held-out metric saved)"
    return "no metric recorded"


def _held_out(row: dict) -> str:
    """ "val loss L, perplexity P" (transformer) or "test accuracy A, test loss L" (MLPs); '' if none."""
    pairs = (("val_loss", "val loss {:.4f}"), ("val_perplexity", "perplexity {:.2f}"))
    pairs += (("test_accuracy", "test accuracy {:.4f}"), ("test_loss", "test loss {:.4f}"))
    return ", ".join(fmt.format(row[key]) for key, fmt in pairs if _number(row.get(key)))


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
