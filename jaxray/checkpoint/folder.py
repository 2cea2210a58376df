"""A checkpoint folder as files: their names, the check of every file against the SHA-256 that its
``train_state.json`` records (``verify``), the configs saved beside the params, and the listing of a
folder's or a URI's ``checkpoint_*`` folders. Below ``remote`` and the package, which import it."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import pyarrow.fs as pafs

from jaxray import storage
from jaxray.checkpoint.trees import CheckpointError
from jaxray.config import ModelConfig, TrialConfig

PARAMS_DIR, OPT_STATE_DIR = "params", "opt_state"
MODEL_CONFIG, TRIAL_CONFIG = "model_config.json", "trial_config.json"
HISTORY_FILE, TRAIN_STATE = "history.json", "train_state.json"
CHECKPOINT_PREFIX = "checkpoint_"  # Ray Train's checkpoint folders: train/<trial>/checkpoint_*
# The metrics a checkpoint records (history rows, final summary) that must be finite (``verify``).
RECORDED_METRICS = (
    *("loss", "grad_norm", "accuracy", "perplexity", "final_train_loss"),
    *("val_loss", "val_accuracy", "val_perplexity", "test_loss", "test_accuracy"),
)


def verify(directory: str | Path, digests: bool = True) -> dict[str, Any]:
    """``train_state.json`` of ``directory`` once every file it lists matches its SHA-256 (unless not
    ``digests``). Raises CheckpointError naming the folder: none, incomplete, a file unreadable or not
    matching (naming it and both digests), or a metric of the summary or ``history.json`` NaN or inf
    (naming it, its value, step). ``checkpoint.open(..., full_state=True)`` also wants a train state."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a checkpoint: no such folder")
    manifest = directory / TRAIN_STATE
    if not manifest.is_file():
        what = "" if (directory / PARAMS_DIR).exists() else f" ({MODEL_CONFIG} and {PARAMS_DIR}/ expected)"
        raise CheckpointError(f"{directory} is incomplete: {TRAIN_STATE} is missing{what}")
    try:
        doc = json.loads(manifest.read_text())
        files = dict(doc["files"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest} is damaged: {err}") from err
    for rel, expected in files.items() if digests else ():
        try:
            found = storage.file_sha256(directory / rel)
        except OSError as err:
            raise CheckpointError(f"{directory} is damaged: {rel} cannot be read: {err}") from err
        if found != expected:
            raise CheckpointError(
                f"{directory} is damaged: {rel} does not match its checksum (truncated or "
                f"overwritten): {TRAIN_STATE} records SHA-256 {expected}, the file has {found}"
            )
    rows = [{**doc["summary"], "step": doc.get("step")}] if isinstance(doc.get("summary"), dict) else []
    if HISTORY_FILE in files:
        try:
            rows += json.loads((directory / HISTORY_FILE).read_text())
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{directory / HISTORY_FILE} is damaged: {err}") from err
    for row in (r for r in rows if isinstance(r, dict)):
        # JSON's NaN and Infinity are floats; ints and bools are finite
        bad = next(
            (k for k in RECORDED_METRICS if isinstance(row.get(k), float) and not np.isfinite(row[k])), None
        )
        if bad is not None:
            raise CheckpointError(
                f"{directory} records {bad} {row[bad]} at step {row.get('step')}: its training diverged, so "
                "its params are not a usable model; use an earlier checkpoint of the trial or another trial"
            )
    return doc


@dataclass(frozen=True)
class Verified:
    """A checkpoint folder whose files matched their digests once, which ``restore``/``restore_state``
    hash no more. ``state``: its ``train_state.json``."""

    path: Path
    state: dict[str, Any]

    def require(self, workload: str | None, purpose: str = "used") -> ModelConfig:
        """Its model config, once it is of ``workload`` (None: any). Raises CheckpointError naming
        the folder, both workloads and ``purpose`` (what the command does: served, sampled...)."""
        cfg = load_model_config(self.path)
        if workload is not None and cfg.workload != workload:
            raise CheckpointError(
                f"{self.path} holds a {cfg.workload} checkpoint, not a {workload} one: it cannot be {purpose}"
            )
        return cfg


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig saved beside the params. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, MODEL_CONFIG, ModelConfig)


def load_trial_config(directory: str | Path) -> TrialConfig:
    """The TrialConfig the params were trained with. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, TRIAL_CONFIG, TrialConfig)


def _load_config(directory: str | Path, name: str, cls: type):
    path = Path(directory) / name
    try:
        return cls.model_validate_json(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{directory} is not a jaxray checkpoint: {name} is missing") from err
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} is damaged: {err}") from err


def checkpoints(folder: Path | str, complete: bool | None = True) -> list:
    """The ``checkpoint_*`` folders in ``folder`` (a Path, or a path or URI as a str: the same kind
    back), newest first (``checkpoint_order``): ``complete`` True those with a ``train_state.json``,
    False those without, None all; [] when ``folder`` does not exist or is a file. Raises
    CheckpointError when it cannot be listed."""
    try:
        fs, root = storage.resolve(str(folder))
        found = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
        names = [PurePosixPath(i.path).name for i in found if i.type == pafs.FileType.Directory]
        names = [n for n in names if n.startswith(CHECKPOINT_PREFIX)]
        if complete is not None:
            states = fs.get_file_info([f"{root}/{n}/{TRAIN_STATE}" for n in names])
            names = [n for n, s in zip(names, states) if (s.type == pafs.FileType.File) == complete]
    except NotADirectoryError:  # a file: it holds no checkpoint
        return []
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{storage.display(str(folder))} cannot be listed: {err}") from err
    names.sort(key=checkpoint_order, reverse=True)
    return (
        [folder / n for n in names] if isinstance(folder, Path) else [storage.join(folder, n) for n in names]
    )


def checkpoint_order(path: Path | str) -> tuple[int, ...]:
    """The numbers in a checkpoint folder's name (a folder, URI or name), in order:
    ``checkpoint_step_00000020_attempt10`` is (20, 10), after attempt 9 (unlike the names' order)."""
    return tuple(int(n) for n in re.findall(r"\d+", PurePosixPath(str(path).rstrip("/")).name))
