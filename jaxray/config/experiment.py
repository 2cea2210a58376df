"""The experiment YAML: one sweep per workload, a grid over global batch, dtype, width and peak
learning rate, plus shared data and worker settings; ``load_experiment`` reads and validates it,
every grid point included. Sweeps rank trials by ``metric`` (default ``DEFAULT_METRIC``)."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import yaml
from pydantic import Field, Strict, field_validator, model_validator

from jaxray.config import (
    DEFAULT_LEARNING_RATE,
    DEFAULT_WIDTH,
    ConfigError,
    DataConfig,
    DType,
    FrozenConfig,
    ModelConfig,
    ParallelConfig,
    PosFloat,
    PosInt,
    TrainConfig,
    TrialConfig,
    WorkersConfig,
    Workload,
    parse_trial,
    seq_len_error,
    shown,
    validate,
)
from jaxray.config.errors import invalid
from jaxray.config.scaling import compile_cache_error

# What a sweep ranks trials by unless its YAML says otherwise.
DEFAULT_METRIC = {
    "mlp": ("test_accuracy", "max"),
    "shared_block_mlp": ("test_accuracy", "max"),
    "transformer": ("val_loss", "min"),
}
SEARCHABLE = ("global_batch", "dtype", "width", "learning_rate")
# Model keys a sweep may fix, per workload (others would be silently ignored by that model).
MODEL_KEYS = {
    "mlp": (),
    "shared_block_mlp": ("block_repeats",),
    "transformer": (
        "preset",
        "num_layers",
        "num_heads",
        "max_seq_len",
        "attention",
        "remat",
        "scan_layers",
        "dropout",
        "tie_embeddings",
        "init",
    ),
}
# Transformer shapes for ``model: {preset: NAME}``; "width" (D) is the grid's default d_model.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    # GPT-2 small (Radford et al. 2019) on bytes: 12 layers, 12 heads of K = 64, D 768, 1024 tokens.
    "gpt2_small": {"width": 768, "num_layers": 12, "num_heads": 12, "max_seq_len": 1024},
}
METRICS = {
    "mlp": ("test_accuracy", "test_loss", "final_train_loss"),
    "shared_block_mlp": ("test_accuracy", "test_loss", "final_train_loss"),
    "transformer": ("val_loss", "val_perplexity", "final_train_loss"),
}


class SearchSpace(FrozenConfig):
    """Grid values for the axes Tune sweeps; an axis left out keeps the sweep's fixed value."""

    global_batch: list[PosInt] | None = Field(None, min_length=1)
    dtype: list[DType] | None = Field(None, min_length=1)
    width: list[PosInt] | None = Field(None, min_length=1)
    learning_rate: list[PosFloat] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> SearchSpace:
        for axis in SEARCHABLE:
            values = getattr(self, axis) or []
            if len(set(values)) != len(values):
                raise ValueError(f"{axis} lists a value twice: {values}")
        return self


class EarlyStoppingConfig(FrozenConfig):
    """ASHA (``ray.tune.schedulers.ASHAScheduler``) on a ``metric`` reported during training (the
    training ``loss``/``accuracy``, or the held-out ``val_loss``/``val_accuracy`` that
    ``train.eval_every`` adds): at steps grace_period x reduction_factor^i only the best
    1 / reduction_factor of trials go on."""

    type: Literal["asha"] = "asha"
    metric: Literal["loss", "accuracy", "val_loss", "val_accuracy"] = "loss"
    mode: Literal["min", "max"] | None = None
    grace_period: PosInt = 100
    reduction_factor: Annotated[int, Strict(), Field(ge=2)] = 3

    @model_validator(mode="after")
    def _mode(self) -> EarlyStoppingConfig:
        if self.mode is None:
            object.__setattr__(self, "mode", "min" if self.metric.endswith("loss") else "max")
        return self


class SweepConfig(FrozenConfig):
    """One workload's grid: fixed model/train/parallel settings, the search space, ranking ``metric``
    and optional ASHA. ``model: {preset: NAME}`` starts from ``MODEL_PRESETS[NAME]`` (keys in ``model``
    override); unknown names raise ConfigError."""

    workload: Workload
    metric: str | None = None
    mode: Literal["min", "max"] | None = None
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    parallel: ParallelConfig = ParallelConfig()
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
        rule = self.early_stopping
        if rule is not None and rule.metric.startswith("val_") and not self.train.get("eval_every"):
            raise ValueError(
                f"early_stopping.metric {rule.metric} needs train.eval_every (the held-out metric is "
                f"measured every that many steps)"
            )
        rate = self.train.get("learning_rate")
        if isinstance(rate, str):  # YAML 1.1 reads 1.0e7 as a string: a number from here on
            with contextlib.suppress(ValueError):
                if math.isfinite(float(rate)):  # else the trial's checks name it
                    object.__setattr__(self, "train", {**self.train, "learning_rate": float(rate)})
        for key in ("workload", *SEARCHABLE):
            fixed_lr = key == "learning_rate" and not self.search_space.learning_rate  # train may fix it
            if not fixed_lr and (key in self.model or key in self.train):
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

    def axes(self) -> dict[str, list]:
        """Grid values per searchable axis, in SEARCHABLE order; an unsearched axis holds its one
        value (the learning rate: ``train``'s, a float after ``_check``, else the workload's default)."""
        s, fixed_lr = self.search_space, self.train.get("learning_rate")
        return {
            "global_batch": s.global_batch or [TrainConfig().global_batch],
            "dtype": s.dtype or [ModelConfig.model_fields["dtype"].default],
            "width": s.width or [self._preset().get("width", DEFAULT_WIDTH[self.workload])],
            "learning_rate": s.learning_rate
            or [DEFAULT_LEARNING_RATE[self.workload] if fixed_lr is None else fixed_lr],
        }

    def grid_size(self) -> int:
        """How many trials the grid holds."""
        return math.prod(len(values) for values in self.axes().values())

    def points(self) -> list[dict[str, Any]]:
        """The grid's points in order, each ``{axis: value}`` over every axis of ``axes``."""
        axes = self.axes()
        return [dict(zip(axes, point)) for point in itertools.product(*axes.values())]

    def trial_dicts(self, base: dict[str, Any]) -> list[dict[str, Any]]:
        """The grid expanded into TrialConfig dicts (validate each with ``parse_trial``)."""
        return [self.trial_dict(base, **point) for point in self.points()]

    def trial_dict(
        self, base: dict[str, Any], global_batch: int, dtype: str, width: int, learning_rate: float
    ) -> dict[str, Any]:
        """One grid point as a TrialConfig dict: ``base`` (data, workers) plus this sweep's settings
        (its fixed model keys with the preset expanded, ``model`` winning over it)."""
        preset = {k: v for k, v in self._preset().items() if k != "width"}
        fixed = {k: v for k, v in self.model.items() if k != "preset"}
        model = {**preset, **fixed, "workload": self.workload, "dtype": dtype, "width": width}
        train = {**self.train, "global_batch": global_batch, "learning_rate": learning_rate}
        return {**base, "model": model, "train": train, "parallel": self.parallel.model_dump()}


class TrialPlan(NamedTuple):
    """One grid point of an experiment: its sweep's index in ``sweeps`` and its parsed TrialConfig."""

    sweep: int
    trial: TrialConfig

    @property
    def name(self) -> str:
        return self.trial.name()


class ExperimentConfig(FrozenConfig):
    """A Tune experiment: shared data and worker settings, and one sweep per workload."""

    experiment: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    data: DataConfig = DataConfig()
    workers: WorkersConfig = WorkersConfig()
    # None: derived from the cluster (``concurrent_trials``).
    max_concurrent_trials: PosInt | None = None
    # Where Ray Train keeps the checkpoints: a pyarrow URI (s3://bucket/prefix, gs://...) or a folder
    # every node mounts (file://); a new run resolves it to <storage>/<experiment>/<run folder>-<8 hex>
    # (its experiment.yaml records that), each trial's checkpoints in <trial>/ there. None: the run
    # folder's train/.
    storage: str | None = None
    sweeps: list[SweepConfig] = Field(min_length=1)

    @field_validator("storage")
    @classmethod
    def _a_uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return None
        if not uri.strip():
            raise ValueError("expected a URI such as s3://bucket/prefix or gs://bucket/prefix, or a folder")
        if "://" not in uri and not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", uri):  # a folder, as file://
            if not Path(uri).expanduser().is_absolute():
                raise ValueError(
                    f"{uri!r} is a relative folder: it would mean another place from each working "
                    f"directory (and every node); give an absolute folder, file:///path or a URI"
                )
            return Path(uri).expanduser().as_uri()
        parts = urllib.parse.urlsplit(uri)  # the scheme lower-cased: pyarrow knows s3, not S3
        if parts.scheme == "file" and (parts.netloc or not parts.path.startswith("/")):
            raise ValueError("expected file:///absolute/path (no host)")
        if "://" not in uri or parts.scheme != "file" and not parts.netloc.strip("@"):
            raise ValueError("expected a URI such as s3://bucket/prefix or gs://bucket/prefix, or a folder")
        if parts.query or "@" in parts.netloc:
            raise ValueError(
                "give the endpoint, region and credentials in the environment (AWS_ENDPOINT_URL, "
                "AWS_DEFAULT_REGION, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS...), not in the "
                "URI, which the run folder records"
            )
        return urllib.parse.urlunsplit(parts).rstrip("/")

    @field_validator("experiment")
    @classmethod
    def _a_folder_name(cls, name: str) -> str:  # the default --out is runs/<experiment>
        if name in (".", ".."):
            raise ValueError(
                f"{name!r} is not a folder name of its own (the run would be written into runs/ or its "
                f"parent); use letters, digits, _ . - (not '.' or '..')"
            )
        return name

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
        return {"data": self.data.model_dump(), "workers": self.workers.model_dump()}

    def plans(self, source: str = "(experiment)") -> list[TrialPlan]:
        """Every grid point of every sweep, in grid order, each parsed into its TrialConfig; plan once
        and hand the plans on (``jaxray.tune`` gives them to Tune's trials and the workers). Raises
        ConfigError naming ``source`` and ``sweeps.I``, or ``workers`` when ``compile_cache`` is unset
        and ``$JAX_COMPILATION_CACHE_DIR`` names a file (``compile_cache_error``)."""
        base = self.base()
        plans = [
            TrialPlan(i, parse_trial(sweep.trial_dict(base, **point), source, f"sweeps.{i}."))
            for i, sweep in enumerate(self.sweeps)
            for point in sweep.points()
        ]
        unset = any(plan.trial.workers.compile_cache is None for plan in plans)
        if unset and (error := compile_cache_error(None)) is not None:  # before a worker's mkdir fails
            raise invalid(source, error, "workers.")
        return plans


BOOL_TAG = "tag:yaml.org,2002:bool"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys and reads only true/false as booleans (YAML 1.2)."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != BOOL_TAG]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

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


_UniqueKeyLoader.add_implicit_resolver(
    BOOL_TAG, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)


def load_experiment(path: str | Path, overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """Read and validate an experiment YAML, expanding every sweep so each trial is checked up front.
    Raises ConfigError for a missing, empty or non-UTF-8 file, invalid YAML, unknown keys, bad types
    or values, an invalid grid point, or a transformer whose data.seq_len is below its max_seq_len
    (positions its loss never trains). What needs the models (attention, mesh splits) is checked by
    ``jaxray.parallel.checks.plan_experiment``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text: {err}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"invalid YAML in {path}: {err}") from None
    if raw is None:  # nothing but whitespace and comments
        raise ConfigError(
            f"invalid config {path}: the file is empty; it needs at least experiment and sweeps"
        )
    if not isinstance(raw, dict):
        raise ConfigError(
            f"invalid config {path}: the top level must be a mapping of keys (experiment, sweeps, ...), "
            f"got a {type(raw).__name__}: {shown(raw)}"
        )
    for key, value in (overrides or {}).items():
        section, _, field = key.partition(".")
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][field] = value
    exp = validate(ExperimentConfig, raw, str(path))
    # Checked here, where the data is read, not in TrialConfig: workers get Ray Datasets, not files.
    if exp.data.data_dir is not None and not Path(exp.data.data_dir).is_dir():
        raise ConfigError(
            f"invalid config {path}:\n  data.data_dir: {exp.data.data_dir!r} is not a directory"
        )
    for i, trial in exp.plans(str(path)):
        if error := seq_len_error(trial.model, trial.data.seq_len, sweep=True):
            raise ConfigError(f"invalid config {path}:\n  sweeps.{i}: {error}")
    return exp
