"""Fault injection for the fault-tolerance tests, through the product's worker seams
(``jaxray.raytrain.seams``), installed in every Ray worker process by Ray's
``worker_process_setup_hook`` (``runtime_env()`` for a test's own ``ray.init``; ``env()`` for a
``python -m jaxray.tune`` subprocess, via Ray's ``RAY_RUNTIME_ENV_HOOK``). The fault (JSON) is
``JAXRAY_FAULT``, else the file ``JAXRAY_FAULT_FILE`` names (``inject``), read at each trial's start:
a worker exits at ``kill_at_step`` (mid-save at a checkpoint step), the newest checkpoint is damaged
(``corrupt_latest_checkpoint``), every worker pauses at ``pause_at_steps`` (``pause_s``: one length
for all, or one per step; a test removes or drains their node meanwhile). Each fires on the worker
group's first attempt only (the damage: on the second, before the restore), so Ray Train's restart
runs undisturbed."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FAULT_ENV = "JAXRAY_FAULT"
FAULT_FILE_ENV = "JAXRAY_FAULT_FILE"
HERE = Path(__file__).resolve().parent  # tests/: on the workers' PYTHONPATH, so they import this
SETUP_HOOK = "faults.install"


@dataclass(frozen=True)
class Fault:
    kill_at_step: int | None = None
    corrupt_latest_checkpoint: bool = False
    pause_at_steps: tuple[int, ...] = ()
    pause_attempts: tuple[int, ...] = (1,)
    pause_s: float | tuple[float, ...] = 15.0


def injected() -> Fault:
    """The fault ``JAXRAY_FAULT`` asks for, else the one in ``JAXRAY_FAULT_FILE`` (none: neither)."""
    text = os.environ.get(FAULT_ENV)
    path = os.environ.get(FAULT_FILE_ENV)
    if not text and path and Path(path).is_file():
        text = Path(path).read_text()
    return Fault(**json.loads(text)) if text else Fault()


def _python_path() -> str:
    return os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)


def runtime_env(fault_file: Path | None = None, base: dict | None = None) -> dict:
    """``base`` (a Ray runtime env) with this module's setup hook, tests/ on the workers' path and,
    given, the fault file."""
    env = dict(base or {})
    env_vars = {**env.get("env_vars", {}), "PYTHONPATH": _python_path()}
    if fault_file is not None:
        env_vars[FAULT_FILE_ENV] = str(fault_file)
    return {**env, "env_vars": env_vars, "worker_process_setup_hook": SETUP_HOOK}


def runtime_env_hook(base: dict | None) -> dict:
    """Ray's ``RAY_RUNTIME_ENV_HOOK``: the driver's runtime env with the setup hook added."""
    return runtime_env(base=base)


def fault_env(env: dict[str, str], fault: dict) -> dict[str, str]:
    """``env`` for a ``python -m jaxray.tune`` subprocess whose workers take ``fault``: Ray's
    ``RAY_RUNTIME_ENV_HOOK`` adds the setup hook to the runtime env of its ``ray.init``."""
    python_path = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    return {
        **env,
        FAULT_ENV: json.dumps(fault),
        "RAY_RUNTIME_ENV_HOOK": "faults.runtime_env_hook",
        "PYTHONPATH": python_path,
    }


def env(fault: dict, **more: str) -> dict[str, str]:
    """This process's environment and ``more``, with ``fault`` (``fault_env``)."""
    return fault_env({**os.environ, **more}, fault)


def set_fault(fault_file: Path, fault: dict | None) -> None:
    """``fault`` in ``fault_file`` for the trials started from now on (None: no fault)."""
    if fault:
        fault_file.write_text(json.dumps(fault))
    else:
        fault_file.unlink(missing_ok=True)


@contextlib.contextmanager
def inject(fault_file: Path, fault: dict | None) -> Iterator[None]:
    """``set_fault`` for the trials started inside; none after."""
    set_fault(fault_file, fault)
    try:
        yield
    finally:
        set_fault(fault_file, None)


def install() -> None:
    """Ray's ``worker_process_setup_hook``: the three faults join the product's worker seams."""
    from jaxray.raytrain import seams

    for seam, call in (
        (seams.TRAIN_HOOKS, fault_hooks),
        (seams.BEFORE_MANIFEST, kill_in_save),
        (seams.BEFORE_RESUME, damage_latest),
    ):
        if call not in seam:  # once, however often the hook runs
            seam.append(call)


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


def fault_hooks(trial, rank: int, attempt: int) -> tuple:
    """The ``kill_at_step`` hook (rank 0, first attempt, not at a checkpoint step: there
    ``kill_in_save`` does it) and the ``pause_at_steps`` hook (every rank, in ``pause_attempts``)."""
    from jaxray.train.loop import Hook

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


def kill_in_save(step: int, attempt: int) -> None:
    """A ``BEFORE_MANIFEST`` seam (rank 0, after the arrays, before the manifest): ``die`` when
    ``kill_at_step`` is this step on the first attempt."""
    if injected().kill_at_step == step and attempt == 1:
        die(step)


def damage_latest(found: list[Path], attempt: int) -> None:
    """A ``BEFORE_RESUME`` seam: ``corrupt_latest_checkpoint`` damages the newest checkpoint at
    attempt 2, before rank 0 picks the one to restore."""
    if injected().corrupt_latest_checkpoint and attempt == 2 and found:
        print(f"jaxray fault injection: damaged {damage(found[0])}", flush=True)


def damage(checkpoint_dir: Path) -> Path:
    """Truncate the largest file of a checkpoint to half its size; returns that file's path."""
    victim = max((f for f in checkpoint_dir.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    return victim
