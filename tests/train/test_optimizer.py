"""The optimizer recipe (``jaxray.train.step.optimizer_for``): the learning-rate schedule against its
formula, weight decay on weight matrices only, clipping by global norm, and bad values refused."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxray.config import ConfigError, parse_trial
from jaxray.config.experiment import load_experiment
from jaxray.models import build
from jaxray.train.step import clipping, decay_mask, learning_rate_schedule, optimizer_for

PEAK, WARMUP, STEPS, RATIO = 1e-3, 100, 1100, 0.1


def cosine(n: int) -> float:
    """The formula: linear warmup, then PEAK_end + (PEAK - PEAK_end)(1 + cos(pi t)) / 2."""
    if n < WARMUP:
        return PEAK * n / WARMUP
    t = (n - WARMUP) / (STEPS - WARMUP)
    return PEAK * RATIO + (PEAK - PEAK * RATIO) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize("n", [0, 50, WARMUP, WARMUP + (STEPS - WARMUP) // 2, STEPS - 1, STEPS])
def test_the_cosine_schedule_follows_its_formula(n):
    schedule = learning_rate_schedule(PEAK, "cosine", WARMUP, STEPS, RATIO)
    assert float(schedule(n)) == pytest.approx(cosine(n), rel=1e-5, abs=1e-12)


def test_linear_and_constant_schedules():
    linear = learning_rate_schedule(PEAK, "linear", WARMUP, STEPS, RATIO)
    assert float(linear(0)) == 0 and float(linear(WARMUP)) == pytest.approx(PEAK)
    assert float(linear(WARMUP + 500)) == pytest.approx(PEAK - (PEAK - PEAK * RATIO) / 2)
    assert float(linear(STEPS)) == pytest.approx(PEAK * RATIO)
    constant = learning_rate_schedule(PEAK, "constant", 0, STEPS, RATIO)
    assert [float(constant(n)) for n in (0, 500, STEPS)] == pytest.approx([PEAK] * 3)


def transformer_trial(**train):
    return parse_trial(
        {
            "model": {
                "workload": "transformer",
                "width": 32,
                "num_layers": 1,
                "num_heads": 2,
                "max_seq_len": 16,
            },
            "data": {"seq_len": 16},
            "train": {"steps": 1000, **train},
        }
    )


def test_the_workload_recipes():
    r = transformer_trial().recipe()
    assert (r["schedule"], r["warmup_steps"], r["grad_clip_norm"], r["weight_decay"], r["beta2"]) == (
        "cosine",
        100,
        1.0,
        0.1,
        0.99,
    )
    assert transformer_trial(steps=300).recipe()["warmup_steps"] == 30  # min(100, steps // 10)
    mlp = parse_trial({"model": {"workload": "mlp"}}).recipe()
    assert (mlp["schedule"], mlp["warmup_steps"], mlp["grad_clip_norm"], mlp["beta2"]) == (
        "constant",
        0,
        0.0,
        0.999,
    )
    given = transformer_trial(
        schedule="linear", warmup_steps=0, grad_clip_norm=0.5, weight_decay=0.0
    ).recipe()
    assert (given["schedule"], given["warmup_steps"], given["grad_clip_norm"], given["weight_decay"]) == (
        "linear",
        0,
        0.5,
        0.0,
    )


@pytest.mark.slow  # 9 s; CI runs it
def test_weight_decay_leaves_biases_norms_and_embeddings_untouched():
    trial = transformer_trial(schedule="constant", warmup_steps=0, learning_rate=0.1, weight_decay=0.5)
    params = build(trial.model).init(jax.random.key(0))
    tx, _ = optimizer_for(trial)
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = tx.update(zero, tx.init(params), params)
    after = optax.apply_updates(params, updates)
    mask = decay_mask(params)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    decayed = {jax.tree_util.keystr(k) for (k, _), m in zip(flat, jax.tree.leaves(mask)) if m}
    assert decayed and all("kernel" in k for k in decayed)
    for (key, before), new in zip(flat, jax.tree.leaves(after)):
        name = jax.tree_util.keystr(key)
        if name in decayed:  # shrunk by lr * weight_decay, the gradient being zero
            np.testing.assert_allclose(new, before * (1 - 0.1 * 0.5), rtol=1e-6)
        else:  # biases, layer-norm scales, token and position embeddings
            assert any(part in name for part in ("bias", "scale", "embedding")), name
            np.testing.assert_array_equal(new, before)
    mlp_mask = decay_mask(
        build(parse_trial({"model": {"workload": "mlp", "width": 8}}).model).init(jax.random.key(0))
    )
    assert {k for k, m in mlp_mask.items() if m} == {"w1", "w2", "w3"}


def test_clipping_bounds_the_global_norm():
    grads = {"a": jnp.full((10,), 3.0), "b": jnp.full((4, 4), -2.0)}
    clipped, _ = clipping(1.0).update(grads, clipping(1.0).init(grads))
    assert float(optax.tree.norm(clipped)) == pytest.approx(1.0, rel=1e-6)
    small = jax.tree.map(lambda g: g * 1e-3, grads)  # below the bound: as it is
    kept, _ = clipping(1.0).update(small, clipping(1.0).init(small))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(kept), jax.tree.leaves(small)))
    unclipped, _ = clipping(0.0).update(grads, clipping(0.0).init(grads))
    assert float(optax.tree.norm(unclipped)) == pytest.approx(float(optax.tree.norm(grads)))


@pytest.mark.parametrize(
    "train, message",
    [
        (
            "{steps: 100, warmup_steps: 200}",
            "train.warmup_steps 200 is beyond train.steps 100 (allowed: 0..100)",
        ),
        ("{grad_clip_norm: -1.0}", "grad_clip_norm: Input should be greater than or equal to 0"),
        ("{min_lr_ratio: 1.5}", "min_lr_ratio: Input should be less than or equal to 1"),
        ("{schedule: exponential}", "schedule: Input should be 'cosine', 'linear' or 'constant'"),
        ("{log_every: 10, eval_every: 15}", "train.eval_every 15 must be a multiple of train.log_every 10"),
    ],
)
def test_bad_values_are_refused_naming_the_field(tmp_path, train, message):
    path = tmp_path / "exp.yaml"
    path.write_text(f"experiment: t\nsweeps:\n  - workload: transformer\n    train: {train}\n")
    with pytest.raises(ConfigError) as err:
        load_experiment(path)
    assert message in str(err.value), str(err.value)


def test_a_learning_rate_sweep_names_its_trials_and_asha_needs_eval_every(tmp_path):
    from jaxray.raytrain.trainable import trial_name

    path = tmp_path / "exp.yaml"
    path.write_text(
        "experiment: t\nsweeps:\n  - workload: mlp\n    search_space: {learning_rate: [1.0e-3, 3.0e-3]}\n"
    )
    [sweep] = load_experiment(path).sweeps
    assert sweep.grid_size() == 2 and sweep.axes()["learning_rate"] == [1e-3, 3e-3]
    rates = [d["train"]["learning_rate"] for d in sweep.trial_dicts({})]
    assert rates == [1e-3, 3e-3]
    point = {"global_batch": 256, "dtype": "float32", "width": 256, "learning_rate": 0.003}
    assert trial_name("mlp", point) == "mlp_b256_float32_w256_lr0.003"
    path.write_text("experiment: t\nsweeps:\n  - workload: mlp\n    early_stopping: {metric: val_accuracy}\n")
    with pytest.raises(ConfigError, match="early_stopping.metric val_accuracy needs train.eval_every"):
        load_experiment(path)
