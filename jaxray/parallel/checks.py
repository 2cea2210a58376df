"""Pre-flight checks of a trial that need more than the config (which attention can run, the real
device count): ``check_trial`` before a model is built, ``check_experiment`` for every grid point
before Ray starts."""

from __future__ import annotations

from jaxray.config import TrialConfig, check_devices, invalid, parse_trial
from jaxray.config.experiment import ExperimentConfig
from jaxray.models.attention import config_blockers


def check_attention(trial: TrialConfig, source: str = "(trial)", prefix: str = "") -> None:
    """ConfigError when ``trial`` asks for ``model.attention: cudnn`` where the config alone shows
    cuDNN cannot run (``config_blockers``); the message starts with ``source``, names the field
    after ``prefix`` and lists every reason."""
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
    """Every check of ``trial`` on ``devices`` devices (batch divides, attention can run). Returns the
    per-device batch; raises ConfigError."""
    per_device = check_devices(trial.train.global_batch, devices)
    check_attention(trial)
    return per_device


def check_experiment(exp: ExperimentConfig, source: str) -> None:
    """``check_attention`` of every grid point of ``exp`` (fields named ``sweeps.I``); ConfigError."""
    for i, sweep in enumerate(exp.sweeps):
        for trial in sweep.trial_dicts(exp.base()):
            check_attention(parse_trial(trial, source), source, prefix=f"sweeps.{i}.")
