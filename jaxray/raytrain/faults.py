"""Fault injection for the fault-tolerance tests, set only by them through the environment
(``JAXRAY_FAULT``, JSON; the trainer passes it on to the workers): a worker process that exits at a
step (``kill_at_step``; in the middle of the save at a checkpoint step), a damaged newest
checkpoint (``corrupt_latest_checkpoint``) and a pause of every worker at each of ``pause_at_steps``
(``pause_s``: one length for all, or one per step; a test removes or drains their node meanwhile).
Each fault fires on the first attempt of the worker group only (the damage: on the second, before
the restore), so Ray Train's restart runs undisturbed."""

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


# Before an injected exit: several of Ray Train's 2 s health-check polls, also under load.
FAULT_PAUSE_S = 10.0
EXIT_CODE = 17  # of a worker process killed by ``die``


def die(step: int) -> None:
    """End this worker process at once (no cleanup, exit code 17), after ``FAULT_PAUSE_S``."""
    # Ray Train's controller collects reports (and registers their checkpoints) when it polls the
    # workers, every 2 s: a worker that dies sooner after a report loses that report. The pause
    # makes the injected fault the same on every run: every checkpoint reported before it counts.
    time.sleep(FAULT_PAUSE_S)
    print(f"jaxray fault injection: worker process exits at step {step}", flush=True)
    os._exit(EXIT_CODE)


def fault_hooks(trial: TrialConfig, rank: int, attempt: int) -> tuple[Hook, ...]:
    """The ``kill_at_step`` hook: rank 0, first attempt only, and not at a checkpoint step (there the
    save itself dies half-way, ``kill_in_save``); the ``pause_at_steps`` hook: every rank, in the
    ``pause_attempts`` (the first); () otherwise."""
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
    """What the save of the checkpoint at ``step`` runs after writing the arrays and before its
    manifest (``checkpoint.save_state``'s ``before_manifest``): ``die`` when ``kill_at_step`` is this
    step on the first attempt, else None."""
    if injected().kill_at_step == step and attempt == 1:
        return lambda: die(step)
    return None


def damages_latest(attempt: int) -> bool:
    """Whether ``corrupt_latest_checkpoint`` damages the newest checkpoint now: on the first restart
    (attempt 2), before rank 0 picks the one to restore."""
    return injected().corrupt_latest_checkpoint and attempt == 2


def damage(checkpoint_dir: Path) -> Path:
    """Truncate the largest file of a checkpoint to half its size; returns that file's path."""
    victim = max((f for f in checkpoint_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim
