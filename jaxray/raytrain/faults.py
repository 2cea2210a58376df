"""Fault injection for the fault-tolerance tests, set only by them in ``JAXRAY_FAULT`` (JSON, passed on
to the workers): a worker exits at ``kill_at_step`` (mid-save at a checkpoint step), the newest
checkpoint is damaged (``corrupt_latest_checkpoint``), every worker pauses at ``pause_at_steps``
(``pause_s``: one length for all, or one per step; a test removes or drains their node meanwhile).
Each fires on the worker group's first attempt only (the damage: on the second, before the
restore), so Ray Train's restart runs undisturbed."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jaxray.config import TrialConfig
from jaxray.train.loop import Hook

FAULT_ENV = "JAXRAY_FAULT"


@dataclass(frozen=True)
class Fault:
    kill_at_step: int | None = None
    corrupt_latest_checkpoint: bool = False
    pause_at_steps: tuple[int, ...] = ()
    pause_attempts: tuple[int, ...] = (1,)
    pause_s: float | tuple[float, ...] = 15.0


def injected() -> Fault:
    """The fault ``JAXRAY_FAULT`` asks for (none when unset)."""
    text = os.environ.get(FAULT_ENV)
    return Fault(**json.loads(text)) if text else Fault()


# Before an injected exit: several of Ray Train's 2 s polls, also under load. Its controller collects
# reports (and their checkpoints) when it polls: without the pause, a report just before the exit
# could be lost on one run and not another.
FAULT_PAUSE_S = 10.0
EXIT_CODE = 17  # of a worker process killed by ``die``


def die(step: int) -> None:
    """End this worker process at once (no cleanup, exit code 17), after ``FAULT_PAUSE_S``."""
    time.sleep(FAULT_PAUSE_S)
    print(f"jaxray fault injection: worker process exits at step {step}", flush=True)
    os._exit(EXIT_CODE)


def fault_hooks(trial: TrialConfig, rank: int, attempt: int) -> tuple[Hook, ...]:
    """The ``kill_at_step`` hook (rank 0, first attempt, not at a checkpoint step: there
    ``kill_in_save`` does it) and the ``pause_at_steps`` hook (every rank, in ``pause_attempts``)."""
    fault, every = injected(), trial.train.checkpoint_interval
    hooks = []
    if fault.pause_at_steps and attempt in fault.pause_attempts:
        pauses = pause_lengths(fault)
        hooks.append(Hook(1, lambda step, state, metrics: _pause(pauses[step]) if step in pauses else None))
    kill = fault.kill_at_step
    if kill is not None and rank == 0 and attempt == 1 and kill % every:
        hooks.append(Hook(kill, lambda step, state, metrics: die(step) if step == kill else None))
    return tuple(hooks)


def pause_lengths(fault: Fault) -> dict[int, float]:
    """Step -> seconds of ``fault``'s pauses. Raises ValueError where ``pause_s`` is a list whose
    length is not ``pause_at_steps``'."""
    steps, seconds = fault.pause_at_steps, fault.pause_s
    if not isinstance(seconds, (list, tuple)):
        return dict.fromkeys(steps, float(seconds))
    if len(seconds) != len(steps):
        raise ValueError(f"{FAULT_ENV}: pause_s has {len(seconds)} lengths for {len(steps)} pause_at_steps")
    return dict(zip(steps, map(float, seconds), strict=True))


def _pause(seconds: float) -> None:
    print(f"jaxray fault injection: workers pause {seconds:g} s", flush=True)
    time.sleep(seconds)


def kill_in_save(step: int, attempt: int) -> Callable[[], None] | None:
    """The save's ``before_manifest`` at ``step`` (after the arrays, before the manifest): ``die`` when
    ``kill_at_step`` is this step on the first attempt, else None."""
    if injected().kill_at_step == step and attempt == 1:
        return lambda: die(step)
    return None


def damages_latest(attempt: int) -> bool:
    """Whether ``corrupt_latest_checkpoint`` damages the newest checkpoint now: at attempt 2, before
    rank 0 picks the one to restore."""
    return injected().corrupt_latest_checkpoint and attempt == 2


def damage(checkpoint_dir: Path) -> Path:
    """Truncate the largest file of a checkpoint to half its size; returns that file's path."""
    victim = max((f for f in checkpoint_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim
