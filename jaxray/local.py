"""``python -m jaxray.local --config X --trial NAME``: one trial of a sweep in this process, without Ray:
to debug a trial, or to train where Ray cannot start (a TPU host that opens no sockets). The same
step, data order, checkpoints (``checkpoint_step_<step>_attempt1``; the best and the newest kept),
compile report, TensorBoard events and summary as the trial's Ray Train worker, in ``--out`` (default
``runs/<experiment>/local/<trial>``).
Ray's own local mode (``ScalingConfig(num_workers=0)``) is not used: it needs Ray installed and its
storage context, which jaxray's worker writes checkpoints through."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxray import argtypes as at
from jaxray.config import ConfigError, TrialConfig, parse_trial
from jaxray.config.experiment import ExperimentConfig, load_experiment
from jaxray.data.sources import DataFileError
from jaxray.reporting.format import json_safe


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = at.cli_parser("python -m jaxray.local", "One trial of a sweep in this process, without Ray.")
    p.add_argument("--config", required=True, help="experiment YAML, e.g. tune_configs/quick.yaml")
    p.add_argument(
        "--trial", help="the trial's name, as python -m jaxray.tune names it (optional if only one)"
    )
    p.add_argument("--out", help="the trial's folder (default runs/<experiment>/local/<trial>)")
    p.add_argument("--steps", type=at.positive_int, help="train.steps for this run (default: the config's)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--data-dir", type=at.folder, help="data folder (default: $JAXRAY_DATA_DIR, the cache)")
    return p.parse_args(argv)


def pick(exp: ExperimentConfig, source: str, name: str | None, steps: int | None) -> TrialConfig:
    """The trial ``name`` (the only one when None) with ``steps`` set; ConfigError naming the choices."""
    found = {plan.name: plan.trial for plan in exp.plans(source)}
    if name is None and len(found) == 1:
        name = next(iter(found))
    if name is None:
        raise ConfigError(f"--trial is required: {source} has {len(found)} trials: {', '.join(found)}")
    if name not in found:
        raise ConfigError(f"--trial {name!r} is not a trial of {source}; allowed: {', '.join(found)}")
    trial = found[name]
    if steps is not None:  # a warmup longer than the run is cut to it
        raw = trial.model_dump()
        raw["train"]["steps"] = steps
        if trial.train.warmup_steps is not None and trial.train.warmup_steps > steps:
            raw["train"]["warmup_steps"] = steps
            print(f"jaxray local: train.warmup_steps {trial.train.warmup_steps} -> {steps} (--steps {steps})")
        trial = parse_trial(raw, f"{source} with --steps {steps}")
    return trial


def set_cpu_devices(trial: TrialConfig) -> None:
    """CPU trials: JAX on the CPU with the trial's devices forced, set before JAX is imported."""
    if trial.workers.accelerator == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = at.cpu_xla_flags(trial.workers.total_devices, flags)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        overrides = {"data.data_dir": args.data_dir} if args.data_dir else None
        exp = load_experiment(args.config, overrides)
        trial = pick(exp, args.config, args.trial, args.steps)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out or f"runs/{exp.experiment}/local/{trial.name()}")
    set_cpu_devices(trial)
    from jaxray import local_run  # imports JAX: after the devices are set
    from jaxray.checkpoint import CheckpointError, CheckpointSaveError  # imports JAX too

    try:
        summary = local_run.run(trial, out, args.resume)
    except (ConfigError, DataFileError, CheckpointError, CheckpointSaveError, local_run.LocalRunError) as err:
        print(f"error: {err}", file=sys.stderr)  # CheckpointError: a damaged or unwritable checkpoint
        return 2
    except KeyboardInterrupt:  # the save under way was committed
        print(f"interrupted; continue with --resume --out {out}", file=sys.stderr)
        return 130
    keys = ("name", "val_loss", "best_step", "final_val_loss", "test_accuracy", "final_train_loss")
    keys += ("steps", "last_step", "ms_per_step", "tokens_per_sec", "compile_s", "checkpoint")
    print(json.dumps(json_safe({k: summary.get(k) for k in keys if k in summary})))
    print(f"written: {out}")
    if "diverged_step" in summary:
        print(f"error: the trial diverged at step {summary['diverged_step']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
