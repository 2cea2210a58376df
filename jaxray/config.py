"""Typed configs for trials and sweeps, parsed from YAML or Tune dicts and validated in one place.

Every config is a frozen pydantic model with ``extra="forbid"``: a misspelled key is rejected with
its name and the allowed ones, a bad value with the field's path and the allowed values, before Ray
starts or anything compiles. ``check_devices`` holds the checks that need the device count.

Vocabulary used in every docstring of the package: B batch, T time (sequence), D model width,
H heads, K head dim, V vocab. "Global batch" is the batch of one optimizer step over all devices of
all workers; "per-device batch" is global batch / (workers x devices per worker).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, model_validator

Workload = Literal["mlp", "shared_block_mlp", "transformer"]
DType = Literal["float32", "bfloat16", "float16"]
Attention = Literal["auto", "xla", "cudnn"]
WORKLOADS: tuple[str, ...] = Workload.__args__
DTYPES: tuple[str, ...] = DType.__args__

# The learning path's defaults (labs 4, 6 and 7).
DEFAULT_WIDTH = {"mlp": 256, "shared_block_mlp": 1024, "transformer": 256}
DEFAULT_LEARNING_RATE = {"mlp": 3e-3, "shared_block_mlp": 3e-4, "transformer": 3e-4}
# What a sweep ranks trials by unless its YAML says otherwise.
DEFAULT_METRIC = {
    "mlp": ("test_accuracy", "max"),
    "shared_block_mlp": ("test_accuracy", "max"),
    "transformer": ("val_loss", "min"),
}
SEARCHABLE = ("global_batch", "dtype", "width")
# Model keys a sweep may fix, per workload (others would be silently ignored by that model).
MODEL_KEYS = {
    "mlp": (),
    "shared_block_mlp": ("block_repeats",),
    "transformer": ("preset", "num_layers", "num_heads", "max_seq_len", "attention"),
}
# Named transformer shapes a sweep's ``model: {preset: NAME}`` starts from (see SweepConfig).
# "width" (D) is the grid's default d_model, since width is a searchable axis.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    # GPT-2 small (Radford et al. 2019) on bytes: 12 layers, 12 heads of K = 64, D 768, ffn 3072,
    # 1024-token windows (~85M matmul weights; V = 256 instead of 50,257, so no big embedding).
    "gpt2_small": {"width": 768, "num_layers": 12, "num_heads": 12, "max_seq_len": 1024},
}
METRICS = {
    "mlp": ("test_accuracy", "test_loss", "final_train_loss"),
    "shared_block_mlp": ("test_accuracy", "test_loss", "final_train_loss"),
    "transformer": ("val_loss", "val_perplexity", "final_train_loss"),
}


def _no_bool(value: Any) -> Any:
    # YAML's true/false would otherwise pass as 1/0 (pydantic's lax mode accepts bools as numbers).
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    return value


# Integers are strict (no 2.5, "10" or true); floats accept YAML's 3e-3, which PyYAML reads as text.
PosInt = Annotated[int, Strict(), Field(gt=0)]
PosFloat = Annotated[float, BeforeValidator(_no_bool), Field(gt=0, allow_inf_nan=False)]


class ConfigError(ValueError):
    """A config that cannot run; the message names the field and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """Model hyper-parameters. ``width`` is the MLP hidden width or the transformer's d_model (D).

    ``attention`` (transformer only): "xla", "cudnn" (an error where cuDNN cannot run) or "auto"
    (cuDNN where it can run, else XLA); see ``jaxray.models.attention``.
    """

    workload: Workload
    width: PosInt | None = None
    dtype: DType = "float32"
    block_repeats: PosInt = 8
    num_layers: PosInt = 4
    num_heads: PosInt = 4
    max_seq_len: PosInt = 256
    vocab_size: Literal[256] = 256
    attention: Attention = "auto"

    @model_validator(mode="after")
    def _fill_and_check(self) -> ModelConfig:
        if self.width is None:
            object.__setattr__(self, "width", DEFAULT_WIDTH[self.workload])
        if self.workload == "transformer" and self.width % self.num_heads:
            raise ValueError(f"width (d_model) {self.width} must be divisible by num_heads {self.num_heads}")
        if self.workload == "mlp" and self.width < 2:
            raise ValueError("width must be >= 2 for mlp (the second hidden layer is width // 2)")
        return self

    @property
    def ffn_dim(self) -> int:
        return 4 * self.width

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads


class TrainConfig(_Strict):
    """Optimisation and loop settings. ``learning_rate`` defaults to the learning path's per workload."""

    steps: PosInt = 100
    global_batch: PosInt = 256
    learning_rate: PosFloat | None = None
    weight_decay: Annotated[float, BeforeValidator(_no_bool), Field(ge=0, allow_inf_nan=False)] = 1e-4
    seed: Annotated[int, Strict(), Field(ge=0)] = 0
    log_every: PosInt = 25
    report_every: PosInt | None = None
    eval_batch: PosInt | None = None
    # Full train state (params, optimizer state, step, data position) every this many steps and at
    # the end; None: only at the end. keep_checkpoints: the newest kept by Ray Train.
    checkpoint_every: PosInt | None = None
    keep_checkpoints: PosInt = 3

    @property
    def report_interval(self) -> int:
        """Steps between ``ray.train.report`` calls: ``report_every`` or about four reports per run.

        Each report is a barrier across workers that costs about a second here, so it is kept rarer
        than ``log_every`` (history and TensorBoard)."""
        return self.report_every or max(self.log_every, -(-self.steps // 4))


class DataConfig(_Strict):
    """Where the data files are (None: the search order of ``jaxray.data.sources``) and the sequence
    length. ``parquet``: a folder or pyarrow URI (``gs://...``) holding ``tinyshakespeare/`` and/or
    ``fashion-mnist/`` as ``python -m jaxray.data prepare`` writes them; training then streams
    them through Ray Data, each epoch in the order ``train.seed`` draws (``jaxray.data.parquet``).
    ``parquet_cache_mib``: a training split whose decoded rows fit in this many MiB is read through
    Ray Data once and later epochs are reordered in host memory; 0 reads every epoch."""

    data_dir: str | None = None
    seq_len: PosInt = 256
    parquet: str | None = None
    parquet_cache_mib: Annotated[int, Strict(), Field(ge=0)] = 1024

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.seq_len < 2:
            raise ValueError("seq_len must be >= 2 (next-byte prediction needs two tokens)")
        return self


class WorkersConfig(_Strict):
    """Ray Train scaling: ``num_workers`` JAX processes, each owning ``devices_per_worker`` devices."""

    num_workers: PosInt = 1
    devices_per_worker: PosInt = 1
    use_gpu: bool = False
    # Ray Train restarts the worker group this many times after a worker dies; the loop resumes
    # from the last checkpoint (``train.checkpoint_every``).
    max_failures: Annotated[int, Strict(), Field(ge=0)] = 0

    @property
    def total_devices(self) -> int:
        return self.num_workers * self.devices_per_worker


class FaultConfig(_Strict):
    """Fault injection for tests of recovery. ``kill_at_step``: the worker of rank 0 ends its process
    (``os._exit``) once, right after step K; at a checkpoint step, in the middle of that checkpoint's
    save (Orbax has written the arrays, the manifest and the report to Ray are not done). The
    restarted worker does not kill itself again. ``corrupt_latest_checkpoint``: before the first
    restore after a restart, damage the newest checkpoint (one of its array files is truncated), so
    the restore has to fall back to the one before."""

    kill_at_step: PosInt | None = None
    corrupt_latest_checkpoint: bool = False


class TrialConfig(_Strict):
    """Everything one Ray Train run needs; it travels to the workers as a plain dict."""

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    workers: WorkersConfig = WorkersConfig()
    fault: FaultConfig = FaultConfig()

    @model_validator(mode="after")
    def _check(self) -> TrialConfig:
        m, d = self.model, self.data
        if m.workload == "transformer" and d.seq_len > m.max_seq_len:
            raise ValueError(f"data.seq_len {d.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
        if m.workload == "transformer" and m.attention == "cudnn":
            from jaxray.models.attention import config_blockers  # here: jaxray.models imports this module

            blockers = config_blockers(m.dtype, m.head_dim, self.workers.use_gpu)
            if blockers:
                raise ValueError(
                    f"model.attention 'cudnn' cannot run: {'; '.join(blockers)}; "
                    f"use 'auto' (cuDNN where it can run, else XLA) or 'xla'"
                )
        kill = self.fault.kill_at_step
        if kill is not None and kill >= self.train.steps:
            raise ValueError(
                f"fault.kill_at_step {kill} must be below train.steps {self.train.steps} "
                f"(the worker dies after that step, then resumes)"
            )
        if kill is not None and self.workers.max_failures < 1:
            raise ValueError(
                "fault.kill_at_step needs workers.max_failures >= 1 (without a restart the run can only fail)"
            )
        if self.fault.corrupt_latest_checkpoint and kill is None:
            raise ValueError(
                "fault.corrupt_latest_checkpoint needs fault.kill_at_step (it damages the newest "
                "checkpoint before the restore that follows the kill)"
            )
        check_devices(self.train.global_batch, self.workers.total_devices)
        return self

    @property
    def learning_rate(self) -> float:
        return self.train.learning_rate or DEFAULT_LEARNING_RATE[self.model.workload]


def check_devices(global_batch: int, devices: int) -> int:
    """Per-device batch for ``global_batch`` over ``devices``; ConfigError unless it divides evenly."""
    if global_batch % devices:
        raise ConfigError(
            f"global_batch {global_batch} is not divisible by the device count {devices} "
            f"(workers x devices_per_worker); choose a multiple of {devices}"
        )
    return global_batch // devices


class SearchSpace(_Strict):
    """Grid values for the axes Tune sweeps; an axis left out keeps the sweep's fixed value."""

    global_batch: list[PosInt] | None = Field(None, min_length=1)
    dtype: list[DType] | None = Field(None, min_length=1)
    width: list[PosInt] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> SearchSpace:
        for axis in SEARCHABLE:
            values = getattr(self, axis) or []
            if len(set(values)) != len(values):
                raise ValueError(f"{axis} lists a value twice: {values}")
        return self


class EarlyStoppingConfig(_Strict):
    """ASHA (``ray.tune.schedulers.ASHAScheduler``): at steps grace_period, grace_period x
    reduction_factor, ... a trial goes on only if its ``metric`` is in the best 1 / reduction_factor
    of the trials that reached that step. ``metric`` is one the trials report while they train
    (the training ``loss`` or ``accuracy``; held-out metrics arrive only at the end)."""

    type: Literal["asha"] = "asha"
    metric: Literal["loss", "accuracy"] = "loss"
    mode: Literal["min", "max"] | None = None
    grace_period: PosInt = 100
    reduction_factor: Annotated[int, Strict(), Field(ge=2)] = 3

    @model_validator(mode="after")
    def _mode(self) -> EarlyStoppingConfig:
        if self.mode is None:
            object.__setattr__(self, "mode", "min" if self.metric == "loss" else "max")
        return self


class SweepConfig(_Strict):
    """One workload's grid: fixed model/train settings plus the search space; ranked by ``metric``;
    optional ASHA early stopping for long sweeps.

    ``model: {preset: NAME}`` (transformer) starts from ``MODEL_PRESETS[NAME]``: its num_layers,
    num_heads and max_seq_len, each overridden by the same key given in ``model``, and its width as
    the grid's width when ``search_space.width`` is not given. ``model`` keeps the preset's name
    (the sweep re-validates as written); ``model_settings()`` is the expanded mapping. An unknown
    name is a ConfigError naming ``model.preset`` and the allowed names.
    """

    workload: Workload
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    search_space: SearchSpace = SearchSpace()
    early_stopping: EarlyStoppingConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> SweepConfig:
        metric, mode = DEFAULT_METRIC[self.workload]
        if self.metric is None:
            object.__setattr__(self, "metric", metric)
            object.__setattr__(self, "mode", self.mode or mode)
        elif self.mode is None:
            object.__setattr__(self, "mode", "max" if self.metric == "test_accuracy" else "min")
        if self.metric not in METRICS[self.workload]:
            raise ValueError(
                f"metric {self.metric!r} is not reported by workload {self.workload!r}; "
                f"allowed: {', '.join(METRICS[self.workload])}"
            )
        for key in ("workload", *SEARCHABLE):
            if key in self.model or key in self.train:
                raise ValueError(f"{key!r} belongs at the sweep level or in search_space, not in model/train")
        unused = sorted(set(self.model) - set(MODEL_KEYS[self.workload]))
        if unused:
            allowed = ", ".join(MODEL_KEYS[self.workload]) or "none"
            raise ValueError(
                f"model key(s) {', '.join(unused)} do not apply to workload {self.workload!r}; "
                f"allowed: {allowed}"
            )
        preset = self.model.get("preset")
        if "preset" in self.model and not (isinstance(preset, str) and preset in MODEL_PRESETS):
            raise ValueError(
                f"model.preset {preset!r} is not a known preset; allowed: {', '.join(MODEL_PRESETS)}"
            )
        return self

    def _preset(self) -> dict[str, int]:
        return MODEL_PRESETS.get(self.model.get("preset"), {})

    def model_settings(self) -> dict[str, Any]:
        """The sweep's fixed model keys with its preset expanded (keys given in ``model`` win);
        without width, which is a grid axis (``axes``)."""
        preset = {k: v for k, v in self._preset().items() if k != "width"}
        return {**preset, **{k: v for k, v in self.model.items() if k != "preset"}}

    def axes(self) -> dict[str, list]:
        """The grid's values per searchable axis, in SEARCHABLE order; an axis not searched holds
        its default (width: the preset's, else the workload's)."""
        s = self.search_space
        return {
            "global_batch": s.global_batch or [TrainConfig().global_batch],
            "dtype": s.dtype or [ModelConfig.model_fields["dtype"].default],
            "width": s.width or [self._preset().get("width", DEFAULT_WIDTH[self.workload])],
        }

    def trial_dicts(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        """The grid expanded into TrialConfig dicts (validate each with ``parse_trial``)."""
        return [self.trial_dict(base, *point) for point in itertools.product(*self.axes().values())]

    def trial_dict(self, base: dict[str, Any], global_batch: int, dtype: str, width: int) -> dict[str, Any]:
        """One grid point as a TrialConfig dict: ``base`` (data, workers) plus this sweep's settings."""
        model = {**self.model_settings(), "workload": self.workload, "dtype": dtype, "width": width}
        return {**base, "model": model, "train": {**self.train, "global_batch": global_batch}}


class ExperimentConfig(_Strict):
    """A Tune experiment: shared data and worker settings, and one sweep per workload."""

    experiment: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    data: DataConfig = DataConfig()
    workers: WorkersConfig = WorkersConfig()
    # None: derived from the cluster (``jaxray.tune.concurrent_trials``): as many trials as its GPUs
    # hold with use_gpu, else one (CPU trials sharing cores would time each other).
    max_concurrent_trials: PosInt | None = None
    fault: FaultConfig = FaultConfig()
    sweeps: list[SweepConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _one_sweep_per_workload(self) -> ExperimentConfig:
        workloads = [s.workload for s in self.sweeps]
        repeated = sorted({w for w in workloads if workloads.count(w) > 1})
        if repeated:
            raise ValueError(
                f"workload {', '.join(repeated)} appears in more than one sweep; put its grid "
                f"in one sweep (trial names and output folders are per workload and grid point)"
            )
        return self

    def base(self) -> dict[str, Any]:
        return {
            "data": self.data.model_dump(),
            "workers": self.workers.model_dump(),
            "fault": self.fault.model_dump(),
        }


def _allowed_keys(cls: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the model that sits at ``loc`` below ``cls`` (for "unknown key" errors)."""
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = cls.model_fields[part].annotation
        inner = [a for a in getattr(annotation, "__args__", (annotation,)) if isinstance(a, type)]
        models = [a for a in inner if issubclass(a, BaseModel)]
        if not models:
            return []
        cls = models[0]
    return list(cls.model_fields)


def _format(err: ValidationError, source: str, root: type[BaseModel], prefix: str = "") -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        where = (prefix + ".".join(str(p) for p in e["loc"])).rstrip(".") or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = f"unknown key; allowed: {', '.join(_allowed_keys(root, e['loc'][:-1]))}"
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def _validate(cls, data: Any, source: str, prefix: str = ""):
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format(err, source, cls, prefix)) from None
    except ConfigError as err:
        raise ConfigError(f"invalid config {source}: {prefix}{err}") from None


def parse_trial(data: dict[str, Any], source: str = "(trial)", prefix: str = "") -> TrialConfig:
    """A TrialConfig from a plain dict (what Tune and the workers pass around). Raises ConfigError
    whose message starts with ``source`` and gives each field's path after ``prefix``."""
    return _validate(TrialConfig, data, source, prefix)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_experiment(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read and validate an experiment YAML, then expand every sweep so each trial is checked up front.

    Raises ConfigError for a missing file, invalid YAML, unknown keys, wrong types or values, and for
    any grid point that cannot run (for example a global batch the device count does not divide).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML in {path}: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid config {path}: the top level must be a mapping, got {type(raw).__name__}")
    for key, value in (overrides or {}).items():
        section, _, field = key.partition(".")
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][field] = value
    exp = _validate(ExperimentConfig, raw, str(path))
    # Checked here, where the data is read, not in TrialConfig: workers get Ray Datasets, not files.
    if exp.data.data_dir is not None and not Path(exp.data.data_dir).is_dir():
        raise ConfigError(
            f"invalid config {path}:\n  data.data_dir: {exp.data.data_dir!r} is not a directory"
        )
    for i, sweep in enumerate(exp.sweeps):
        for trial in sweep.trial_dicts(exp.base()):
            parse_trial(trial, str(path), prefix=f"sweeps.{i}.")
    return exp
