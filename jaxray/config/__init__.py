"""Typed configs of one trial (model, train, data, workers), parsed from Tune dicts and
validated in one place; ``jaxray.config.experiment`` holds the sweep and experiment configs.

Every config is a frozen pydantic model with ``extra="forbid"``; errors name the field path, what is
allowed and the value received. ``check_devices`` holds the checks that need the device count."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    model_validator,
)

from jaxray.argtypes import MAX_CPU_DEVICES
from jaxray.config.errors import ConfigError, invalid, shown, validate

__all__ = ["ConfigError", "invalid", "shown", "validate"]

Workload = Literal["mlp", "shared_block_mlp", "transformer"]
DType = Literal["float32", "bfloat16", "float16"]
Attention = Literal["auto", "xla", "cudnn"]
WORKLOADS: tuple[str, ...] = Workload.__args__
DTYPES: tuple[str, ...] = DType.__args__
# The reported metrics a checkpoint may be ranked by (``train.checkpoint_score``).
ScoreMetric = Literal["val_loss", "val_accuracy", "loss", "accuracy"]
SCORE_METRICS: tuple[str, ...] = ScoreMetric.__args__

# The learning path's defaults (labs 4, 6 and 7).
DEFAULT_WIDTH = {"mlp": 256, "shared_block_mlp": 1024, "transformer": 256}
DEFAULT_LEARNING_RATE = {"mlp": 3e-3, "shared_block_mlp": 3e-4, "transformer": 3e-4}
Schedule = Literal["cosine", "linear", "constant"]
# The optimizer recipe per workload where ``train`` leaves a key out. The transformer's follows
# nanoGPT's small character-level models (warmup, cosine decay to 0.1x, clipping at 1.0, weight
# decay 0.1 on matrices, beta2 0.99); the MLPs keep the learning path's constant AdamW.
RECIPE: dict[str, dict[str, Any]] = {
    "transformer": {"schedule": "cosine", "grad_clip_norm": 1.0, "weight_decay": 0.1, "beta2": 0.99},
    "mlp": {"schedule": "constant", "grad_clip_norm": 0.0, "weight_decay": 1e-4, "beta2": 0.999},
}
RECIPE["shared_block_mlp"] = RECIPE["mlp"]
MAX_DEFAULT_WARMUP = 100  # the transformer's default warmup: min(100, steps // 10) steps


def _finite_number(value: Any) -> Any:
    """A float field's input as given; ValueError for a boolean (pydantic would take it as 1/0) or
    NaN/infinity (checked before the range so the message says "not finite")."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number")
    if isinstance(value, (int, float, str)):
        try:
            number = float(value)
        except (ValueError, OverflowError):  # not a number: pydantic's own message says so
            return value
        if not math.isfinite(number):
            raise ValueError("not finite (NaN and infinity are not allowed)")
    return value


# Integers are strict (no 2.5, "10" or true); floats accept YAML's 3e-3, which PyYAML reads as text.
PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
FiniteFloat = Annotated[float, BeforeValidator(_finite_number), Field(allow_inf_nan=False)]
PosFloat = Annotated[FiniteFloat, Field(gt=0)]
NonNegFloat = Annotated[FiniteFloat, Field(ge=0)]
Beta = Annotated[FiniteFloat, Field(ge=0, lt=1)]


class FrozenConfig(BaseModel):
    """Base of every config: unknown keys are errors, values cannot change after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(FrozenConfig):
    """Model hyper-parameters. ``width``: MLP hidden width or transformer d_model (D). ``attention``
    (transformer only): "xla", "cudnn" or "auto" (``jaxray.models.attention``)."""

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
            raise ValueError(
                f"width must be >= 2 for mlp (the second hidden layer is width // 2), got {self.width}"
            )
        return self

    @property
    def ffn_dim(self) -> int:
        return 4 * self.width

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads


class TrainConfig(FrozenConfig):
    """Optimisation and loop settings; a key left out (None) takes the workload's ``RECIPE`` value.
    ``learning_rate`` is the peak rate, reached after ``warmup_steps`` (linear from 0), then held
    (``constant``) or decayed to ``min_lr_ratio`` x peak at ``steps`` (``cosine``, ``linear``).
    ``grad_clip_norm``: clip by global norm (0: off). ``weight_decay``: decoupled (AdamW), on weight
    matrices only. ``eval_every``: held-out metrics over ``eval_batches`` fixed batches every that
    many steps (a multiple of ``log_every``), reported to Tune as ``val_loss``/``val_accuracy``."""

    steps: PosInt = 100
    global_batch: PosInt = 256
    learning_rate: PosFloat | None = None
    schedule: Schedule | None = None
    warmup_steps: NonNegInt | None = None
    min_lr_ratio: Annotated[FiniteFloat, Field(ge=0, le=1)] = 0.1
    grad_clip_norm: NonNegFloat | None = None
    weight_decay: NonNegFloat | None = None
    beta1: Beta = 0.9
    beta2: Beta | None = None
    seed: Annotated[int, Strict(), Field(ge=0)] = 0
    log_every: PosInt = 25
    eval_every: PosInt | None = None
    eval_batches: PosInt = 8
    report_every: PosInt | None = None
    eval_batch: PosInt | None = None
    # Checkpoint every this many steps and at the end (None: about every tenth of ``steps``).
    checkpoint_every: PosInt | None = None
    # Ray keeps the best ``keep_checkpoints`` by ``checkpoint_score`` and always the latest.
    keep_checkpoints: PosInt = 3
    checkpoint_score: ScoreMetric | None = None

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.warmup_steps is not None and self.warmup_steps > self.steps:
            raise ValueError(
                f"train.warmup_steps {self.warmup_steps} is beyond train.steps {self.steps} "
                f"(allowed: 0..{self.steps})"
            )
        if self.eval_every is not None and self.eval_every % self.log_every:
            raise ValueError(
                f"train.eval_every {self.eval_every} must be a multiple of train.log_every {self.log_every}"
            )
        if (self.checkpoint_score or "").startswith("val_") and self.eval_every is None:
            allowed = ", ".join(m for m in SCORE_METRICS if not m.startswith("val_"))
            raise ValueError(
                f"train.checkpoint_score {self.checkpoint_score} needs train.eval_every (the held-out "
                f"metrics); without it use one of {allowed}"
            )
        return self

    @property
    def checkpoint_interval(self) -> int:
        """Steps between checkpoints: ``checkpoint_every``, or about a tenth of ``steps`` rounded up to
        a multiple of ``log_every`` (a checkpoint is reported with a logged row of its step), so that
        a lost worker costs at most that much training."""
        tenth = -(-self.steps // 10)
        return self.checkpoint_every or min(self.steps, -(-tenth // self.log_every) * self.log_every)

    @property
    def score(self) -> tuple[str, Literal["min", "max"]]:
        """(metric, order) ranking checkpoints: ``checkpoint_score``, else ``val_loss`` with
        ``eval_every`` and the training ``loss`` without; accuracies are maximised, the rest minimised."""
        metric = self.checkpoint_score or ("val_loss" if self.eval_every else "loss")
        return metric, "max" if metric.endswith("accuracy") else "min"

    @property
    def report_interval(self) -> int:
        """Steps between ``ray.train.report`` calls (each a cross-worker barrier): ``report_every``
        or about four reports per run."""
        return self.report_every or max(self.log_every, -(-self.steps // 4))


class DataConfig(FrozenConfig):
    """Data files (None: ``jaxray.data.sources`` search order) and sequence length. ``parquet``: a
    folder or pyarrow URI as ``python -m jaxray.data prepare`` writes, streamed through Ray Data.
    ``parquet_cache_mib``: a split that fits is read once; 0 reads every epoch."""

    data_dir: str | None = None
    seq_len: PosInt = 256
    parquet: str | None = None
    parquet_cache_mib: Annotated[int, Strict(), Field(ge=0)] = 1024

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.seq_len < 2:
            raise ValueError(
                f"seq_len must be >= 2 (next-byte prediction needs two tokens), got {self.seq_len}"
            )
        return self


def _worker_count(value: Any) -> Any:
    """``num_workers`` as given: a positive integer, or [min, max] of them; ValueError saying so."""
    pair = isinstance(value, list | tuple)
    items = list(value) if pair else [value]
    positive = all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in items)
    if not positive or (pair and len(items) != 2):
        raise ValueError("num_workers must be a positive integer or [min, max] of them")
    return tuple(items) if pair else value


class WorkersConfig(FrozenConfig):
    """Ray Train scaling: ``num_workers`` JAX processes, or ``[min, max]`` of them (Ray's elastic
    ``ScalingConfig``: fewer while nodes are missing, the same global batch), each owning
    ``devices_per_worker`` devices (on CPU at most ``jaxray.argtypes.MAX_CPU_DEVICES``, else
    ValueError)."""

    num_workers: Annotated[int | tuple[int, int], BeforeValidator(_worker_count)] = 1
    devices_per_worker: PosInt = 1
    use_gpu: StrictBool = False
    # Worker-group restarts after a worker or its node dies (-1: no limit); the loop resumes from
    # the newest checkpoint. Preemptions (a drain notice, then the node gone) are counted apart.
    max_failures: Annotated[int, Strict(), Field(ge=-1)] = 1
    max_preemption_failures: Annotated[int, Strict(), Field(ge=-1)] = -1
    # Sweeps: Tune's restarts of a trial whose driver died with its node (-1: no limit).
    max_driver_failures: Annotated[int, Strict(), Field(ge=-1)] = 1
    # Elastic only: how often Ray checks whether more workers fit again, seconds (Ray's default).
    elastic_resize_monitor_interval_s: PosFloat = 60.0

    @model_validator(mode="after")
    def _cpu_devices(self) -> WorkersConfig:
        low, high = self.worker_range
        if low > high:
            raise ValueError(f"num_workers [min, max] needs min <= max, got [{low}, {high}]")
        if not self.use_gpu and self.devices_per_worker > MAX_CPU_DEVICES:
            raise ValueError(
                f"devices_per_worker must be at most {MAX_CPU_DEVICES} forced host devices on CPU "
                f"(use_gpu is false), got {self.devices_per_worker}; use more workers instead"
            )
        return self

    @property
    def worker_range(self) -> tuple[int, int]:
        """(min, max) workers; both ``num_workers`` when it is one number."""
        n = self.num_workers
        return (n, n) if isinstance(n, int) else n

    @property
    def elastic(self) -> bool:
        return self.worker_range[0] != self.worker_range[1]

    @property
    def total_devices(self) -> int:
        """Devices of the trial at its most workers."""
        return self.worker_range[1] * self.devices_per_worker


AxisSize = Annotated[int, Strict(), Field(ge=-1)]
MESH_AXES = ("data", "fsdp", "tensor")


class ParallelConfig(FrozenConfig):
    """The trial's (``data``, ``fsdp``, ``tensor``) device mesh (``jaxray.parallel.mesh``): sizes whose
    product is the trial's device count over all its workers; one of them may be -1, the rest.
    ``data`` left out is the rest, or 1 when ``fsdp`` or ``tensor`` is -1 (default: every device on
    ``data``). ``fsdp`` splits params and optimizer state on their ``embed`` dimension, ``tensor``
    on ``heads``, ``mlp`` and ``vocab`` (``jaxray.parallel.mesh.RULES``); batches are split over
    ``data`` x ``fsdp``. ``data`` and ``fsdp`` may span workers, ``tensor`` stays within one."""

    data: AxisSize | None = None
    fsdp: AxisSize = 1
    tensor: AxisSize = 1

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        given = {a: getattr(self, a) for a in MESH_AXES if getattr(self, a) is not None}
        if any(n == 0 for n in given.values()) or list(given.values()).count(-1) > 1:
            raise ValueError(f"parallel sizes must be positive, with at most one -1 (the rest); got {given}")
        return self

    def shape(self, devices: int) -> dict[str, int]:
        """``{data, fsdp, tensor}`` sizes on ``devices`` devices, the -1 resolved; ValueError naming the
        numbers when their product cannot be ``devices``."""
        data = self.data if self.data is not None else (1 if -1 in (self.fsdp, self.tensor) else -1)
        sizes = {"data": data, "fsdp": self.fsdp, "tensor": self.tensor}
        known = math.prod(n for n in sizes.values() if n != -1)
        if -1 in sizes.values() and devices % known == 0:
            return {a: devices // known if n == -1 else n for a, n in sizes.items()}
        if -1 not in sizes.values() and known == devices:
            return sizes
        named = [a for a in MESH_AXES if a != "data" or self.data is not None]
        given = " x ".join(f"parallel.{a} {sizes[a]}" for a in named)
        need = (
            f"the fixed sizes' product ({known}) must divide {devices}"
            if -1 in sizes.values()
            else f"their product ({known}) must be {devices}, or one size -1 for the rest"
        )
        raise ValueError(
            f"{given} cannot make a mesh of the trial's {devices} devices (workers.num_workers x "
            f"workers.devices_per_worker): {need}"
        )


def trial_name(workload: str, global_batch: int, dtype: str, width: int, learning_rate: float) -> str:
    """A trial's name, ``<workload>_b<global_batch>_<dtype>_w<width>_lr<peak learning rate>``: the one
    name of its Tune and Ray Train folders, TensorBoard run, progress row, summary row and checkpoint.
    The rate is written as Python's shortest repr of the float (0.003, 1e-05), so two different
    rates never share a name."""
    return f"{workload}_b{global_batch}_{dtype}_w{width}_lr{float(learning_rate)!r}"


class TrialConfig(FrozenConfig):
    """Everything one Ray Train run needs; it travels to the workers as a plain dict."""

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    workers: WorkersConfig = WorkersConfig()
    parallel: ParallelConfig = ParallelConfig()

    def name(self) -> str:
        """The trial's name (``trial_name``), as python -m jaxray.tune names its folders."""
        m = self.model
        return trial_name(m.workload, self.train.global_batch, m.dtype, m.width, self.learning_rate)

    @model_validator(mode="after")
    def _check(self) -> TrialConfig:
        m, d = self.model, self.data
        if m.workload == "transformer" and d.seq_len > m.max_seq_len:
            raise ValueError(f"data.seq_len {d.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
        low, high = self.workers.worker_range
        for workers, mesh in self.mesh_shapes.items():  # elastic: every size the group may run at
            try:
                check_devices(self.train.global_batch, mesh["data"] * mesh["fsdp"])
            except ConfigError as err:
                if low == high:
                    raise
                raise ValueError(f"{err} (with {workers} of workers.num_workers [{low}, {high}])") from None
            tensor, per_worker = mesh["tensor"], self.workers.devices_per_worker
            if per_worker % tensor:
                allowed = ", ".join(str(n) for n in range(1, per_worker + 1) if per_worker % n == 0)
                raise ValueError(
                    f"parallel.tensor {tensor} must divide workers.devices_per_worker {per_worker} (allowed: "
                    f"{allowed}): a tensor-parallel group all-reduces every layer, so it stays within one "
                    f"worker; data and fsdp may span workers"
                )
        return self

    @property
    def mesh_shapes(self) -> dict[int, dict[str, int]]:
        """{workers: ``{data, fsdp, tensor}`` over their devices (``ParallelConfig.shape``)} for every
        number of workers the trial may run with (one, unless ``workers.num_workers`` is [min, max])."""
        low, high = self.workers.worker_range
        per_worker = self.workers.devices_per_worker
        return {n: self.parallel.shape(n * per_worker) for n in range(low, high + 1)}

    @property
    def mesh_shape(self) -> dict[str, int]:
        """``{data, fsdp, tensor}`` over ``workers.total_devices`` (``ParallelConfig.shape``)."""
        return self.parallel.shape(self.workers.total_devices)

    @property
    def learning_rate(self) -> float:
        return self.train.learning_rate or DEFAULT_LEARNING_RATE[self.model.workload]

    def recipe(self) -> dict[str, Any]:
        """The optimizer settings this trial trains with: ``train``'s, else the workload's ``RECIPE``."""
        t, defaults = self.train, RECIPE[self.model.workload]
        given = {k: getattr(t, k) for k in ("schedule", "grad_clip_norm", "weight_decay", "beta2")}
        recipe = {k: defaults[k] if v is None else v for k, v in given.items()}
        default_warmup = min(MAX_DEFAULT_WARMUP, t.steps // 10) if self.model.workload == "transformer" else 0
        warmup = default_warmup if t.warmup_steps is None else t.warmup_steps
        return {
            **recipe,
            "learning_rate": self.learning_rate,
            "warmup_steps": warmup,
            "min_lr_ratio": t.min_lr_ratio,
            "beta1": t.beta1,
            "steps": t.steps,
        }


def check_devices(global_batch: int, devices: int) -> int:
    """Per-device batch for ``global_batch`` split over ``devices`` (the mesh's ``data`` x ``fsdp``
    devices); ConfigError unless it divides evenly."""
    if global_batch % devices:
        raise ConfigError(
            f"global_batch {global_batch} is not divisible by the {devices} devices it is split over "
            f"(parallel.data x parallel.fsdp); choose a multiple of {devices}"
        )
    return global_batch // devices


def parse_trial(data: dict[str, Any], source: str = "(trial)", prefix: str = "") -> TrialConfig:
    """A TrialConfig from a plain dict; raises ConfigError as ``validate``."""
    return validate(TrialConfig, data, source, prefix)
