"""Pre-flight checks that need more than the config (attention, even param splits, the device count):
``check_trial`` before a model is built, ``plan_experiment`` for every grid point before Ray starts."""

from __future__ import annotations

import functools
from collections.abc import Mapping

import jax

from jaxray.config import ModelConfig, TrialConfig, check_devices, invalid
from jaxray.config.experiment import ExperimentConfig, TrialPlan
from jaxray.models import build
from jaxray.models.attention import config_blockers
from jaxray.parallel.mesh import unsplittable


def check_attention(trial: TrialConfig, source: str = "(trial)", prefix: str = "") -> None:
    """ConfigError when ``trial`` asks for ``model.attention`` cudnn or splash where the config alone
    shows it cannot run (``config_blockers``); the message starts with ``source``, names the field
    after ``prefix`` and lists every reason."""
    m = trial.model
    if m.workload != "transformer" or m.attention not in ("cudnn", "splash"):
        return
    # The sequence the step trains on (a sweep's equals max_seq_len; a benchmark's may be shorter).
    blockers = config_blockers(
        m.attention, m.dtype, m.head_dim, trial.data.seq_len, trial.workers.accelerator
    )
    if blockers:
        raise invalid(
            source,
            f"model.attention {m.attention!r} cannot run: {'; '.join(blockers)}; "
            f"use 'auto' (chosen for the device) or 'xla'",
            prefix,
        )


@functools.cache
def abstract_params(model: ModelConfig):
    """The params of ``model`` as ``jax.ShapeDtypeStruct``s (nothing allocated)."""
    return jax.eval_shape(build(model, attention="xla").init, jax.random.key(0))


def check_mesh(
    trial: TrialConfig, mesh_shape: Mapping[str, int], source: str = "(trial)", prefix: str = ""
) -> None:
    """ConfigError when a mesh of ``mesh_shape`` cannot split ``trial``'s params evenly, naming each
    param, dimension and axis size (``jaxray.parallel.mesh.unsplittable``)."""
    if mesh_shape.get("fsdp", 1) * mesh_shape.get("tensor", 1) == 1:
        return  # params replicated: nothing to split
    problems = unsplittable(abstract_params(trial.model), mesh_shape)
    if problems:
        shown = "; ".join(problems)
        mesh = ",".join(f"{axis}={n}" for axis, n in mesh_shape.items())
        model = f"{trial.model.workload} of width {trial.model.width}"
        raise invalid(source, f"the mesh {mesh} cannot split the params of the {model}: {shown}", prefix)


def check_trial(trial: TrialConfig, shape: Mapping[str, int]) -> int:
    """Every check of ``trial`` on a mesh of ``shape`` (``{data, fsdp, tensor}`` sizes; a jax Mesh's
    ``shape``): batch divides over ``data`` x ``fsdp``, params split evenly, attention can run.
    Returns the per-device batch; raises ConfigError."""
    per_device = check_devices(trial.train.global_batch, shape.get("data", 1) * shape.get("fsdp", 1))
    check_mesh(trial, shape)
    check_attention(trial)
    return per_device


def plan_experiment(exp: ExperimentConfig, source: str) -> list[TrialPlan]:
    """Every grid point of ``exp`` parsed (``ExperimentConfig.plans``) and checked by
    ``check_attention`` and ``check_mesh`` on each mesh it may run on: what Tune's trials and their
    workers receive. Raises ConfigError starting with ``source``, fields named ``sweeps.I``."""
    plans = exp.plans(source)
    for i, trial in plans:
        check_attention(trial, source, prefix=f"sweeps.{i}.")
        for shape in trial.mesh_shapes.values():  # an elastic trial's at every size
            check_mesh(trial, shape, source, prefix=f"sweeps.{i}.")
    return plans
