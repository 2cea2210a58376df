"""Losses, ``train_step`` and ``eval_step``: pure functions, no I/O.

Batches: ``{"image": [B, 784] float32, "label": [B] int32}`` (MLPs) or ``{"tokens": [B, T] int32}``
(transformer); eval batches add ``"mask": [B] float32`` (1 real row, 0 padding)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxray.checkpoint.trees import key_names
from jaxray.models import Model
from jaxray.parallel.mesh import shards_state, state_shardings

Batch = dict[str, jax.Array]


class TrainState(NamedTuple):
    """params (float32 PyTree), opt_state (Optax state, float32) and step (int32 scalar)."""

    params: Any
    opt_state: Any
    step: jax.Array


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """logits [..., V] float32, labels [...] int32 -> cross-entropy [...] float32 (nats), against
    one-hot targets: the integer-label version's scatter-add gradient is slow on NVIDIA GPUs
    (openxla/xla#46225)."""
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype))


def classification_losses(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """logits [B, 10] float32 -> per-example (cross-entropy [B], correct [B]) against ``batch["label"]``."""
    labels = batch["label"]
    return cross_entropy(logits, labels), (jnp.argmax(logits, -1) == labels).astype(jnp.float32)


def next_token_losses(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """logits [B, T, V] float32 -> per-sequence mean (cross-entropy [B], accuracy [B]) of next-byte
    prediction: logits[:, :-1] against tokens[:, 1:] (T - 1 predictions per sequence)."""
    targets = batch["tokens"][:, 1:]
    logits = logits[:, :-1]
    loss = cross_entropy(logits, targets).mean(-1)
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32).mean(-1)
    return loss, correct


def model_inputs(batch: Batch) -> jax.Array:
    return batch["tokens"] if "tokens" in batch else batch["image"]


LossFn = Callable[[jax.Array, Batch], tuple[jax.Array, jax.Array]]
LOSSES: dict[str, LossFn] = {
    "mlp": classification_losses,
    "shared_block_mlp": classification_losses,
    "transformer": next_token_losses,
}


def make_optimizer(learning_rate: float, weight_decay: float | None = None) -> optax.GradientTransformation:
    """The learning path's AdamW: a constant rate, decay on every parameter (None: 1e-4; Loshchilov &
    Hutter 2019; Optax defaults b1=0.9, b2=0.999). ``bench compare`` trains with it, like for like."""
    return optax.adamw(learning_rate, weight_decay=1e-4 if weight_decay is None else weight_decay)


def learning_rate_schedule(
    peak: float, schedule: str, warmup_steps: int, steps: int, min_lr_ratio: float
) -> optax.Schedule:
    """The learning rate at each update count n = 0 .. steps - 1: linear from 0 to ``peak`` over
    ``warmup_steps``, then ``peak`` (constant), or decaying to ``min_lr_ratio`` x peak at ``steps``:
    cosine, peak_end + (peak - peak_end) (1 + cos(pi t)) / 2 with t the decay's fraction done (SGDR,
    Loshchilov & Hutter 2017; Optax's warmup_cosine_decay_schedule), or linear."""
    end, decay = peak * min_lr_ratio, max(steps - warmup_steps, 1)
    if schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay, alpha=min_lr_ratio)
    elif schedule == "linear":
        after = optax.linear_schedule(peak, end, decay)
    else:
        after = optax.constant_schedule(peak)
    if warmup_steps == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup_steps), after], [warmup_steps])


def decay_mask(params: Any) -> Any:
    """True for the weight matrices (a layer's ``kernel``, an MLP's ``w*``, and the token embedding
    when it is also the LM head: ``tie_embeddings``), False for biases, norm scales and other
    embeddings: what decoupled weight decay applies to (MaxText; nanoGPT decays every 2-D tensor)."""
    tied = "token_embed" in params and "lm_head" not in params

    def is_matrix(path, leaf) -> bool:
        names = key_names(path) or ("",)
        if tied and names[0] == "token_embed":
            return True
        return names[-1] == "kernel" or (names[-1].startswith("w") and getattr(leaf, "ndim", 0) >= 2)

    return jax.tree_util.tree_map_with_path(is_matrix, params)


def optimizer_for(trial) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(the optimizer, its learning-rate schedule) of ``trial`` (a TrialConfig; ``trial.recipe()``):
    clipping by global norm, then AdamW on the schedule with weight decay on matrices only. The
    schedule's count lives in the optimizer state, so a restored state resumes mid-schedule."""
    r = trial.recipe()
    schedule = learning_rate_schedule(
        r["learning_rate"], r["schedule"], r["warmup_steps"], r["steps"], r["min_lr_ratio"]
    )
    adamw = optax.adamw(
        schedule, b1=r["beta1"], b2=r["beta2"], weight_decay=r["weight_decay"], mask=decay_mask
    )
    return optax.chain(clipping(r["grad_clip_norm"]), adamw), schedule


def clipping(max_norm: float) -> optax.GradientTransformation:
    """Gradients scaled to a global L2 norm of at most ``max_norm`` (Pascanu et al. 2013); 0: as they are."""
    return optax.clip_by_global_norm(max_norm) if max_norm > 0 else optax.identity()


def init_state(params: Any, tx: optax.GradientTransformation) -> TrainState:
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))


def placed_init_state(
    model: Model, tx: optax.GradientTransformation, mesh: Mesh, key: jax.Array, shardings: Any = None
) -> TrainState:
    """``init_state(model.init(key), tx)`` placed on ``mesh`` as training shards it (``shardings``, a
    TrainState of NamedShardings; None: ``state_shardings``). On a mesh that splits the state
    (``fsdp`` or ``tensor`` > 1) it is computed by one jit straight into its shardings, so no device
    ever holds the whole state (values can differ from the eager init's in the last bit); otherwise
    eagerly, then replicated."""

    def init(k: jax.Array) -> TrainState:
        return init_state(model.init(k), tx)

    if shardings is None:
        shardings = state_shardings(jax.eval_shape(init, key), mesh)
    if not shards_state(mesh):
        return jax.device_put(init(key), shardings)
    return jax.jit(init, out_shardings=shardings)(key)


def abstract_state(model: Model, tx: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """The TrainState as ``jax.ShapeDtypeStruct`` leaves with training's shardings on ``mesh``: the
    target ``jaxray.checkpoint.restore_state`` restores into, whatever mesh the save ran on."""
    shapes = jax.eval_shape(lambda: init_state(model.init(jax.random.key(0)), tx))
    shardings = state_shardings(shapes, mesh)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


# Folded into the seed's key before the step: dropout's keys are not the init's (``nnx.Rngs`` folds
# counts 0, 1, ... into ``key(seed)``).
DROPOUT_STREAM = 0x64726F70  # "drop"


def dropout_keys(trial) -> tuple[int, str] | None:
    """(seed, PRNG implementation) of ``trial``'s dropout masks (``step_key``); None without dropout."""
    if not trial.model.dropout:
        return None
    return trial.train.seed, trial.train.dropout_prng


def step_key(seed: int, impl: str, step: jax.Array) -> jax.Array:
    """The dropout key of update ``step`` (int32 scalar): a function of (seed, step) alone, so a
    resumed run draws the masks it would have drawn, with nothing saved (with ``unsafe_rbg`` and
    ``rbg``, on the same mesh: their bits may differ on another; ``threefry2x32``'s do not).
    ``impl``: "threefry2x32", "rbg" or "unsafe_rbg" (``jax.random.key``)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed, impl=impl), DROPOUT_STREAM), step)


def loss_and_grads(
    params: Any, batch: Batch, *, apply: Callable, loss_fn: LossFn, key: jax.Array | None = None
) -> tuple[tuple[jax.Array, jax.Array], Any]:
    """((mean loss, mean accuracy) over ``batch``, gradient of the mean loss w.r.t. ``params``);
    ``key``: the dropout key passed to ``apply`` (None: none)."""

    def mean_loss(params):
        inputs = model_inputs(batch)
        logits = apply(params, inputs) if key is None else apply(params, inputs, key)
        with jax.named_scope("loss"):
            loss, correct = loss_fn(logits, batch)
            return loss.mean(), correct.mean()

    return jax.value_and_grad(mean_loss, has_aux=True)(params)


def apply_gradients(
    state: TrainState, grads: Any, loss: jax.Array, accuracy: jax.Array, *, tx: optax.GradientTransformation
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer update for ``grads`` -> (new state, metrics ``loss``, ``accuracy``, ``grad_norm``)."""
    with jax.named_scope("optimizer"):  # a name the profile (jaxray.bench.profile) groups by
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = {"loss": loss, "accuracy": accuracy, "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state, state.step + 1), metrics


def train_step(
    state: TrainState,
    batch: Batch,
    *,
    apply: Callable,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    dropout: tuple[int, str] | None = None,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One AdamW step on the mean loss of ``batch``. Returns the new state and float32 scalar
    ``loss``, ``accuracy`` and ``grad_norm`` (global L2 norm of the gradients before the update).
    ``dropout``: ``dropout_keys``' (seed, impl): the masks of ``step_key`` at ``state.step``."""
    key = None if dropout is None else step_key(*dropout, state.step)
    (loss, accuracy), grads = loss_and_grads(state.params, batch, apply=apply, loss_fn=loss_fn, key=key)
    return apply_gradients(state, grads, loss, accuracy, tx=tx)


def eval_step(params: Any, batch: Batch, *, apply: Callable, loss_fn: LossFn) -> dict[str, jax.Array]:
    """Masked float32 sums over ``batch``: ``loss_sum``, ``correct_sum`` and ``count`` (real rows)."""
    loss, correct = loss_fn(apply(params, model_inputs(batch)), batch)
    mask = batch["mask"]
    return {"loss_sum": jnp.sum(loss * mask), "correct_sum": jnp.sum(correct * mask), "count": jnp.sum(mask)}
