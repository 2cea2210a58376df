"""A trial's layout on its mesh, decided once (``trial_layout``) and handed down to the step, the
evaluation, the init and the restore: the model with its attention chosen, the optimizer, the train
state's shardings and whether the loop waits for each step. Checks are the plan's (``check_trial``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jaxray.config import TrialConfig
from jaxray.models import Model, build
from jaxray.parallel.mesh import needs_sync_per_step
from jaxray.train.step import TrainState, abstract_state, optimizer_for


@dataclass(frozen=True)
class Layout:
    """``state``: the TrainState as ``jax.ShapeDtypeStruct`` leaves carrying training's NamedShardings
    (the restore target)."""

    mesh: Mesh
    model: Model
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    state: TrainState

    @property
    def shardings(self) -> Any:
        """The TrainState of NamedShardings the step takes and returns."""
        return jax.tree.map(lambda leaf: leaf.sharding, self.state)

    @property
    def sync_each_step(self) -> bool:
        """Whether the loop waits for each step (``needs_sync_per_step``)."""
        return needs_sync_per_step(self.mesh)


def trial_layout(trial: TrialConfig, mesh: Mesh) -> Layout:
    """``trial`` on ``mesh``: the model built once (attention decided for ``data.seq_len`` on this
    process's first device; AttentionError where the request cannot run), its optimizer and
    ``abstract_state``. Raises ValueError where a mesh axis does not divide a param (the plan's
    ``check_mesh`` refuses such trials first)."""
    model = build(trial.model, seq_len=trial.data.seq_len)
    tx, schedule = optimizer_for(trial)
    return Layout(mesh, model, tx, schedule, abstract_state(model, tx, mesh))
