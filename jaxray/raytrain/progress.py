"""A sweep's live progress on the terminal: one rich progress row per trial (trial, step / steps,
loss, throughput, ETA), fed by a Ray Tune callback in the driver. ``TrialProgress`` is pickled into
``tuner.pkl``, so it holds only plain values and draws on whatever display is ``showing``."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from ray import tune
from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeRemainingColumn

from jaxray.raytrain.failures import ATTEMPT_KEY
from jaxray.reporting import terminal
from jaxray.reporting.format import diverged_error, step_rates

# Throughput from a log row's counters (tokens or examples); the final report's own figure replaces it.
COUNTERS = (("tokens", "tok/s", "tokens_per_sec"), ("examples", "ex/s", "examples_per_sec"))
WIDTH = 120  # columns of the rows when the terminal is not one (a pipe or file has no width)
MAX_ERROR_CHARS = 300  # of the error line printed when a trial fails


class SweepDisplay:
    """The rows of one sweep's trials on ``file``, updated in place on a terminal; elsewhere the final
    state is printed once."""

    def __init__(self, steps: int, file: TextIO) -> None:
        self.steps = steps
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(bar_width=24),
            TextColumn("{task.completed:>6.0f}/{task.total:.0f} steps"),
            TextColumn("{task.fields[loss]}"),
            TextColumn("{task.fields[speed]}"),
            TimeRemainingColumn(elapsed_when_finished=True),
            TextColumn("{task.fields[status]}"),
            console=Console(file=file, width=None if file.isatty() else WIDTH),
            # Rich must not redirect sys.stdout/stderr: Ray's and Tune's output belongs in the log.
            redirect_stdout=False,
            redirect_stderr=False,
        )
        self.tasks: dict[str, TaskID] = {}
        self.last: dict[str, tuple[float, float]] = {}  # trial -> (counter, seconds) of its last row

    def row(self, name: str) -> TaskID:
        """The task of trial ``name``, added on first use."""
        if name not in self.tasks:
            self.tasks[name] = self.progress.add_task(
                name, total=self.steps, loss="", speed="", status="running"
            )
        return self.tasks[name]

    def result(self, name: str, result: dict[str, Any]) -> None:
        """A log row of trial ``name`` (Tune's result: step, loss, examples or tokens, ``ms_per_step``
        from the second row on, and Tune's ``time_total_s``, seconds since the trial started): the
        throughput from ``ms_per_step`` where there is one, else over the time since the last row."""
        task, fields = self.row(name), {}
        if "loss" in result:
            fields["loss"] = f"loss {float(result['loss']):.4f}"
        if "val_loss" in result:
            fields["loss"] += f" val {float(result['val_loss']):.4f}"
        rates = {**step_rates(result), **result}  # a final report's own figure wins
        for key, unit, final in COUNTERS:
            if key in result and "time_total_s" in result:
                count, seconds = float(result[key]), float(result["time_total_s"])
                before = self.last.get(name, (0.0, 0.0))
                if seconds > before[1]:
                    fields["speed"] = f"{(count - before[0]) / (seconds - before[1]):,.0f} {unit}"
                self.last[name] = (count, seconds)
            if final in rates:  # as the summary table computes it (a trial stopped here keeps it)
                fields["speed"] = f"{float(rates[final]):,.0f} {unit}"
            if final in rates or key in result:
                break
        if result.get(ATTEMPT_KEY, 1) > 1:  # the worker group restarted
            fields["status"] = f"running (attempt {result[ATTEMPT_KEY]})"
        self.progress.update(task, completed=result.get("step", 0), **fields)

    def end(self, name: str, status: str) -> None:
        """Trial ``name`` ended: ``done`` (its bar full), ``failed`` or stopped early (``status``)."""
        task = self.row(name)
        done = status.startswith("done")
        self.progress.update(task, status=status, **({"completed": self.steps} if done else {}))


_showing: SweepDisplay | None = None


@contextlib.contextmanager
def showing(title: str, steps: int) -> Iterator[SweepDisplay | None]:
    """Inside: one sweep's progress rows (``steps`` per trial) on ``terminal.display()`` under ``title``;
    nothing with ``--verbose``."""
    global _showing
    if not terminal.is_quiet():
        yield None
        return
    print(title, file=terminal.err(), flush=True)
    display = SweepDisplay(steps, terminal.display())
    _showing = display
    try:
        with display.progress:
            yield display
    finally:
        _showing = None


def error_line(trial: Any) -> str:
    """The last line of a failed trial's traceback (the exception), and where the whole one is."""
    path = Path(trial.error_file) if trial.error_file else None
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except (OSError, AttributeError):
        lines = []
    cause = (lines[-1] if lines else "no error file was written")[:MAX_ERROR_CHARS]
    where = Path(trial.path) / path.name if path and trial.path else path
    return f"{cause} (traceback: {where})"


class TrialProgress(tune.Callback):
    """Tune callback: trials' starts, log rows and ends to the display ``showing``; ``name``: a grid
    point's trial name."""

    def __init__(self, name: Callable[[dict], str]) -> None:
        self.name = name

    def on_trial_start(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if _showing:
            _showing.row(self.name(trial.config))

    def on_trial_result(self, iteration: int, trials: list, trial: Any, result: dict, **info: Any) -> None:
        if _showing:
            _showing.result(self.name(trial.config), result)

    def on_trial_complete(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if _showing:
            last = trial.last_result or {}
            early = f"stopped early at step {last.get('step')}"  # by the scheduler: no final report
            done = "done" + (f" after a restart ({last['restart_causes']})" if last.get("restarts") else "")
            self._end(trial, done if last.get("final") else early, diverged_error(last))

    def on_trial_error(self, iteration: int, trials: list, trial: Any, **info: Any) -> None:
        if _showing:
            self._end(trial, "failed", f"{error_line(trial)}{terminal.log_hint()}")

    def _end(self, trial: Any, status: str, error: str | None) -> None:
        """The trial's row ends with ``status``, or with ``failed`` and its ``error`` printed."""
        name = self.name(trial.config)
        _showing.end(name, "failed" if error else status)
        if error:
            line = f"error: trial {name} failed: {error}"
            print(line, file=sys.stderr, flush=True)  # the log, while the terminal is quiet
            _showing.progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
