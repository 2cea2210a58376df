"""The checks a trial must pass before anything expensive runs (Ray, data, compiling) that config
parsing does not make: they need to know more than the config (which attention implementations
can run) or the devices a process really has.

``check_trial`` is what a training or benchmark process calls before it builds the model;
``check_experiment`` is what ``python -m jaxray.tune`` calls for every grid point before Ray starts.
The device-count arithmetic itself is ``jaxray.config.check_devices`` (parsing checks the
configured workers x devices with it; ``check_trial`` the devices of the mesh).
"""

from __future__ import annotations

from jaxray.config import TrialConfig, check_devices, invalid, parse_trial
from jaxray.config.experiment import ExperimentConfig
from jaxray.models.attention import config_blockers


def check_attention(trial: TrialConfig, source: str = "(trial)", prefix: str = "") -> None:
    """ConfigError when ``trial`` asks for ``model.attention: cudnn`` where the config alone shows
    cuDNN cannot run (no GPU workers, a compute dtype or head dim no GPU supports; see
    ``jaxray.models.attention.config_blockers``). The message starts with ``source``, names the
    field after ``prefix`` and lists every reason. The compute capability is checked where the
    model is built, on the device (``jaxray.models.attention.choose``)."""
    m = trial.model
    if m.workload != "transformer" or m.attention != "cudnn":
        return
    blockers = config_blockers(m.dtype, m.head_dim, trial.workers.use_gpu)
    if blockers:
        raise invalid(
            source,
            f"model.attention 'cudnn' cannot run: {'; '.join(blockers)}; "
            f"use 'auto' (cuDNN where it can run, else XLA) or 'xla'",
            prefix,
        )


def check_trial(trial: TrialConfig, devices: int) -> int:
    """Every check of ``trial`` on a mesh of ``devices`` devices, before the model is built: the
    global batch divides over them and the attention it asks for can run. Returns the per-device
    batch; raises ConfigError."""
    per_device = check_devices(trial.train.global_batch, devices)
    check_attention(trial)
    return per_device


def check_experiment(exp: ExperimentConfig, source: str) -> None:
    """``check_attention`` of every grid point of every sweep of ``exp`` (read from ``source``, which
    the message names with the field path ``sweeps.I``). Raises ConfigError."""
    for i, sweep in enumerate(exp.sweeps):
        for trial in sweep.trial_dicts(exp.base()):
            check_attention(parse_trial(trial, source), source, prefix=f"sweeps.{i}.")
