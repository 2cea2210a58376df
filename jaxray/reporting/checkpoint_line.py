"""One line naming a resolved checkpoint for the terminal: its path, trial, step and held-out metric."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from jaxray import checkpoint
from jaxray.checkpoint import (
    CHECKPOINT_PREFIX,
    HISTORY_FILE,
    TRAIN_STATE,
    CheckpointError,
    load_trial_config,
)
from jaxray.reporting.format import number


def describe(directory: str | Path) -> str:
    """``checkpoint: PATH (trial T, step S, METRIC)``: PATH relative to the working directory when
    inside it; the trial its ``trial_config.json``, else its Ray Train folder, names; METRIC as
    ``_metric``. Only reads: what cannot be read is left out."""
    directory = Path(directory)
    here = directory.absolute()
    shown: str | Path = checkpoint.source(directory)  # a cached copy: the URI it was fetched from
    if shown == str(directory) and here.is_relative_to(Path.cwd()):
        shown = Path(os.path.relpath(here))
    state = _json(directory / TRAIN_STATE)
    state = state if isinstance(state, dict) else {}
    try:  # the trial's own name; a local run's --out folder is named by its user
        parts = [f"trial {load_trial_config(directory).name()}"]
    except CheckpointError:  # in its trial's Ray Train folder, named by the sweep
        parts = [f"trial {directory.parent.name}"] if directory.name.startswith(CHECKPOINT_PREFIX) else []
    parts.append(f"step {state['step']}" if "step" in state else "")
    parts.append(_metric(directory, state))
    return f"checkpoint: {shown} ({', '.join(p for p in parts if p)})"


def _json(path: Path) -> Any:
    """``path`` parsed; None when it is missing, unreadable or no JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _metric(directory: Path, state: dict) -> str:
    """The held-out metric of this checkpoint's params: the validation loss its history records at
    its step, else its summary row's (a final checkpoint's: an MLP's test metrics), else the newest
    validation loss in its history (an earlier step's), else the last training loss. A final
    checkpoint's summary ``val_loss`` is the trial's best, not this step's."""
    history = _json(directory / HISTORY_FILE) if "step" in state else None
    rows = [r for r in history if isinstance(r, dict)] if isinstance(history, list) else []
    own = next((r for r in reversed(rows) if r.get("step") == state.get("step")), {})
    if number(own.get("val_loss")) is not None:
        return f"val loss {own['val_loss']:.4f}, perplexity {math.exp(own['val_loss']):.2f}"
    row = state.get("summary") if isinstance(state.get("summary"), dict) else {}
    pairs = (("val_loss", "val loss {:.4f}"), ("val_perplexity", "perplexity {:.2f}"))
    pairs += (("test_accuracy", "test accuracy {:.4f}"), ("test_loss", "test loss {:.4f}"))
    shown = ", ".join(fmt.format(row[key]) for key, fmt in pairs if number(row.get(key)) is not None)
    if shown:
        return shown
    held = next((r for r in reversed(rows) if number(r.get("val_loss")) is not None), None)
    if held is not None:
        return f"val loss {held['val_loss']:.4f} at step {held.get('step', '?')}"
    last = rows[-1] if rows else {}
    if number(last.get("loss")) is not None:
        return f"train loss {last['loss']:.4f} at step {last.get('step', '?')} (no held-out metric saved)"
    return "no metric recorded"
