"""What a worker process's setup may add to the trials it runs (Ray's ``worker_process_setup_hook``,
given in the runtime env of a ``ray.init``, or by ``RAY_RUNTIME_ENV_HOOK``): hooks for
``train(hooks=...)``, a call before each checkpoint's manifest, a call before resume picks a
checkpoint. Empty in a plain run; the fault-tolerance tests inject their faults through them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by every Ray worker's setup: no JAX for Ray Data's task processes
    from jaxray.config import TrialConfig
    from jaxray.train.loop import Hook

# (trial, rank, attempt) -> hooks joining that worker's ``train(hooks=...)``.
TRAIN_HOOKS: list[Callable[[TrialConfig, int, int], Iterable[Hook]]] = []
# (step, attempt), rank 0, after a checkpoint's arrays are written, before its manifest.
BEFORE_MANIFEST: list[Callable[[int, int], None]] = []
# (the trial's checkpoint folders, newest first; attempt), rank 0, before resume picks one (a folder
# storage only: not with object storage).
BEFORE_RESUME: list[Callable[[list[Path], int], None]] = []


def train_hooks(trial: TrialConfig, rank: int, attempt: int) -> tuple[Hook, ...]:
    """Every ``TRAIN_HOOKS`` entry's hooks for this worker."""
    return tuple(hook for add in TRAIN_HOOKS for hook in add(trial, rank, attempt))
