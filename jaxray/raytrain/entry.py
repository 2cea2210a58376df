"""What Ray Train runs in each worker, by name: Ray Train's controller (one a trial) unpickles it
without importing JAX, Flax and Orbax (``worker``'s imports, ~3 s of CPU a process on 2 cores); the
worker imports them when it runs."""

from __future__ import annotations

from typing import Any


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """``jaxray.raytrain.worker.train_loop_per_worker(config)``."""
    from jaxray.raytrain import worker  # here: the reason this module exists

    worker.train_loop_per_worker(config)
