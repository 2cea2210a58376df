"""One trial on one mesh, whichever process hosts it: the Ray Train worker (``raytrain.worker``) and
``python -m jaxray.local`` (``local_run``) are two hosts of ``run_trial``. A host brings the data,
the resume point and its outputs (``Host``: log lines, log rows, checkpoint saves); the layout, the
compile cache, TensorBoard, a divergence and the final row are decided here, once for both."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from jax.sharding import Mesh

from jaxray import checkpoint
from jaxray.config import TrialConfig
from jaxray.data.batching import Arrays
from jaxray.reporting.tensorboard import TensorBoardLogger
from jaxray.train import compile_cache
from jaxray.train.layout import trial_layout
from jaxray.train.loop import Hook
from jaxray.train.run import Diverged, train


class Host(Protocol):
    """What a process that runs a trial gives ``run_trial``."""

    def say(self, line: str) -> None:
        """Print a line of the trial's log (the Ray worker group's rank 0)."""

    def log(self, row: dict[str, float]) -> None:
        """Every logged row (``train``'s ``on_log``)."""

    def save(self, step: int, state: Any, history: list[dict], row: dict | None = None) -> None:
        """Start a checkpoint of ``state`` after ``step`` (``train``'s ``save``)."""

    def finish(self, step: int, state: Any, history: list[dict], row: dict) -> None:
        """The final checkpoint with the final ``row`` (a resumed final checkpoint: the row alone)."""

    def abandon(self) -> None:
        """Remove the save under way unreported: the run diverged, its params may be broken."""


def run_trial(
    trial: TrialConfig,
    mesh: Mesh,
    batches: Iterator[Arrays],
    held_out: Arrays,
    host: Host,
    resume: checkpoint.Verified | None = None,
    tensorboard: str | Path | None = None,
    hooks: Sequence[Hook] = (),
    on_compile: Callable[[dict[str, Any]], None] | None = None,
    notes: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train ``trial`` (checked on ``mesh`` by its plan: ``check_trial``) from ``resume`` on ``batches``
    (this process's rows of each global batch) and evaluate on ``held_out``. Returns the final row:
    the last logged metrics, the summary and ``notes()`` (called once trained), ``final`` True (given
    to ``host.finish``); for a diverged trial ``step`` and ``diverged_*`` (nothing of it saved).
    ``tensorboard``: the events folder (None: none), an earlier run's past ``resume`` redone.
    Raises as ``train`` does."""
    layout = trial_layout(trial, mesh)
    if layout.model.attention is not None:
        host.say(f"{trial.name()}: {layout.model.attention.describe()}")
    compile_cache.enable(trial.workers.compile_cache)
    first = 1 if resume is None else int(resume.state["step"]) + 1
    with TensorBoardLogger(tensorboard, first) if tensorboard else contextlib.nullcontext() as tb:
        try:
            result = train(
                trial,
                batches,
                held_out,
                layout,
                on_log=[host.log, *([tb] if tb else [])],
                resume=resume,
                save=host.save,
                hooks=hooks,
                on_compile=on_compile,
            )
        except Diverged as err:  # a failed trial, not a crash: no restart
            host.say(f"{err}; the trial stops")
            host.abandon()
            return {"step": err.step, **err.row()}
        summary = {**result.summary, **(notes() if notes else {})}
        last = summary.get("last_step", trial.train.steps)  # earlier when train.patience stopped it
        if tb:
            tb.add_final(summary, last)
    # The final row carries the last logged metrics too: ASHA reads them in every report.
    row = {**result.history[-1], **summary, "final": True}
    if trial.model.workload != "transformer":  # its held-out metrics are the summary's test_*
        row = {k: v for k, v in row.items() if not k.startswith("val_")}
    host.finish(last, result.state, result.history, row)
    return row
