"""Typed configs of one trial (model, train, data, workers, parallel), parsed from Tune dicts and
validated in one place (``check_devices``: the checks that need the device count);
``jaxray.config.experiment`` holds the sweep and experiment configs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, Strict, StrictBool, field_validator, model_validator

from jaxray.config.errors import ConfigError, invalid, shown, validate
from jaxray.config.scaling import MESH_AXES, ParallelConfig, WorkersConfig
from jaxray.config.types import Beta, FiniteFloat, FrozenConfig, NonNegFloat, NonNegInt, PosFloat, PosInt

__all__ = ["MESH_AXES", "invalid", "shown"]  # re-exported; the rest is used here too

Workload = Literal["mlp", "shared_block_mlp", "transformer"]
DType = Literal["float32", "bfloat16", "float16"]
# xla: jaxray's block-skipping XLA attention; dense: XLA's full [T, T] scores; splash: the Pallas TPU
# kernel (jaxray.models.splash); cudnn: cuDNN flash attention; auto: jaxray.models.attention.choose.
Attention = Literal["auto", "xla", "dense", "splash", "cudnn"]
# Rematerialisation of each block in the backward pass (jax.checkpoint policies): none keeps every
# activation, full keeps only the block's input, dots keeps the matmul outputs without batch dims.
Remat = Literal["none", "full", "dots"]
REMATS: tuple[str, ...] = Remat.__args__
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


class ModelConfig(FrozenConfig):
    """Model hyper-parameters. ``width``: MLP hidden width or transformer d_model (D). Transformer only:
    ``attention`` (``Attention``; ``jaxray.models.attention``), ``remat`` (``Remat``) and ``scan_layers``
    (the blocks run as one ``lax.scan``: compile time independent of depth). ``remat`` and
    ``scan_layers`` change how the step runs, not the params: checkpoints restore across them.
    ``dropout``: training's rate after the embeddings, on the attention weights and on each residual
    branch (nanoGPT's places; 0: off); ``tie_embeddings``: the LM head is the token embedding's
    transpose (nanoGPT's weight tying); ``init``: ``flax`` (Flax's default initializers) or ``gpt2``
    (GPT-2's and nanoGPT's: weights and embeddings normal(0, 0.02), the residual branches' output
    projections 0.02 / sqrt(2 x num_layers)). None of the three applies to the MLPs."""

    workload: Workload
    width: PosInt | None = None
    dtype: DType = "float32"
    block_repeats: PosInt = 8
    num_layers: PosInt = 4
    num_heads: PosInt = 4
    max_seq_len: PosInt = 256
    vocab_size: Literal[256] = 256
    attention: Attention = "auto"
    remat: Remat = "none"
    scan_layers: StrictBool = False
    # Masks drop round(256 x rate) of 256 byte values: 0.99 at most (a whole byte range would divide by 0).
    dropout: Annotated[FiniteFloat, Field(ge=0, le=0.99)] = 0.0
    tie_embeddings: StrictBool = False
    init: Literal["flax", "gpt2"] = "flax"

    @model_validator(mode="after")
    def _fill_and_check(self) -> ModelConfig:
        if self.width is None:
            object.__setattr__(self, "width", DEFAULT_WIDTH[self.workload])
        if self.workload != "transformer" and (self.dropout or self.tie_embeddings or self.init != "flax"):
            raise ValueError(
                f"dropout, tie_embeddings and init are transformer settings, not {self.workload}'s"
            )
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
    matrices only. ``eval_every``: held-out metrics over the whole held-out split every that many
    steps (a multiple of ``log_every``), reported to Tune as ``val_loss``/``val_accuracy``."""

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
    # The PRNG of dropout's masks (keys from (seed, step)); "unsafe_rbg" (MaxText's default) costs
    # least on a TPU: docs/benchmarks.md.
    dropout_prng: Literal["threefry2x32", "rbg", "unsafe_rbg"] = "unsafe_rbg"
    log_every: PosInt = 25
    eval_every: PosInt | None = None
    # Stop when val_loss has not improved by ``min_delta`` in ``patience`` evaluations (None: never).
    patience: PosInt | None = None
    min_delta: NonNegFloat = 0.0
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
        if self.patience is not None and self.eval_every is None:
            raise ValueError("train.patience counts evaluations: it needs train.eval_every")
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
    folder or pyarrow URI as ``python -m jaxray.data prepare`` writes, read through Ray Data. A
    relative folder is made absolute where the config is parsed (workers start elsewhere).
    ``parquet_cache_mib``: the most host memory a prepared training split may take decoded (each training
    process reads it once and draws its batches there); a larger one is refused before Ray starts."""

    data_dir: str | None = None
    seq_len: PosInt = 256
    parquet: str | None = None
    parquet_cache_mib: Annotated[int, Strict(), Field(ge=1)] = 1024

    @field_validator("data_dir", "parquet")
    @classmethod
    def _absolute(cls, value: str | None) -> str | None:
        if not value:  # "" as None: no folder given
            return None
        return value if "://" in value else str(Path(value).absolute())

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.seq_len < 2:
            raise ValueError(
                f"seq_len must be >= 2 (next-byte prediction needs two tokens), got {self.seq_len}"
            )
        return self


def trial_name(workload: str, global_batch: int, dtype: str, width: int, learning_rate: float) -> str:
    """``<workload>_b<global_batch>_<dtype>_w<width>_lr<peak rate>``, the one name of a trial's Tune and
    Ray Train folders, TensorBoard run, progress and summary rows and checkpoint. The rate is Python's
    shortest repr of the float (0.003, 1e-05), so two different rates never share a name."""
    return f"{workload}_b{global_batch}_{dtype}_w{width}_lr{float(learning_rate)!r}"


class TrialConfig(FrozenConfig):
    """Everything one Ray Train run needs; parsed once before Ray starts (``ExperimentConfig.plans``),
    it travels to the Tune trial and its workers as it is."""

    model: ModelConfig
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    workers: WorkersConfig = WorkersConfig()
    parallel: ParallelConfig = ParallelConfig()

    def name(self) -> str:
        """``trial_name`` of this trial, as python -m jaxray.tune names its folders."""
        m = self.model
        return trial_name(m.workload, self.train.global_batch, m.dtype, m.width, self.learning_rate)

    @model_validator(mode="after")
    def _check(self) -> TrialConfig:
        if error := seq_len_error(self.model, self.data.seq_len):
            raise ValueError(error)
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
        t, workload = self.train, self.model.workload
        recipe = {k: v if getattr(t, k) is None else getattr(t, k) for k, v in RECIPE[workload].items()}
        default_warmup = min(MAX_DEFAULT_WARMUP, t.steps // 10) if workload == "transformer" else 0
        warmup = default_warmup if t.warmup_steps is None else t.warmup_steps
        fixed = {"learning_rate": self.learning_rate, "warmup_steps": warmup, "min_lr_ratio": t.min_lr_ratio}
        return {**recipe, **fixed, "beta1": t.beta1, "steps": t.steps}


def seq_len_error(model: ModelConfig, seq_len: int, sweep: bool = False) -> str | None:
    """What is wrong with training windows of ``seq_len`` tokens for ``model`` (None: nothing): a
    transformer's may not exceed ``model.max_seq_len``; a sweep's must equal it, since the loss never
    trains the positions beyond and generation reads them (a benchmark's step may be shorter)."""
    top = model.max_seq_len
    if model.workload != "transformer" or seq_len == top or (seq_len < top and not sweep):
        return None
    if seq_len > top:
        return f"data.seq_len {seq_len} exceeds model.max_seq_len {top}"
    return (
        f"data.seq_len {seq_len} is below model.max_seq_len {top}: positions {seq_len - 1}..{top - 2} "
        f"would never be trained, and generation reads them; make the two equal"
    )


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
