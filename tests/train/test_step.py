"""train_step / eval_step: gradient tree, masked sums, real-data learning."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.config import ModelConfig, parse_trial
from jaxray.data.batching import eval_batches, train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import train
from jaxray.train.step import LOSSES, eval_step, model_inputs


@pytest.mark.parametrize(
    "workload",
    ["mlp", "shared_block_mlp", pytest.param("transformer", marks=pytest.mark.slow)],  # 12 s
)
def test_gradient_tree_matches_params(workload):
    model = build(ModelConfig(workload=workload, width=16, num_layers=1, block_repeats=2))
    params = model.init(jax.random.key(0))
    batch = (
        {"tokens": jnp.ones((2, 8), jnp.int32)}
        if workload == "transformer"
        else {"image": jnp.ones((2, 784)), "label": jnp.array([1, 2])}
    )

    def loss(p):
        return LOSSES[workload](model.apply(p, model_inputs(batch)), batch)[0].mean()

    grads = jax.grad(loss)(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    assert all(g.shape == p.shape for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params)))


def test_eval_padding_counts_every_row_once():
    arrays = {"image": np.arange(7 * 784, dtype=np.float32).reshape(7, 784) / 1e4, "label": np.arange(7) % 10}
    batches = list(eval_batches(arrays, 4))
    assert [b["mask"].tolist() for b in batches] == [[1, 1, 1, 1], [1, 1, 1, 0]]
    model = build(ModelConfig(workload="mlp", width=8))
    params = model.init(jax.random.key(0))
    sums = [eval_step(params, b, apply=model.apply, loss_fn=LOSSES["mlp"]) for b in batches]
    assert sum(float(s["count"]) for s in sums) == 7


def test_train_batches_drop_the_partial_tail_and_cycle():
    arrays = {"x": np.arange(10)}
    got = [b["x"].tolist() for b in itertools.islice(train_batches(arrays, 4), 3)]
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3]]


@pytest.mark.parametrize("workload,steps,batch", [("mlp", 60, 128), ("transformer", 30, 8)])
def test_a_few_steps_on_real_data_lower_the_loss(real_dir, workload, steps, batch):
    trial = parse_trial(
        {
            "model": {"workload": workload, "width": 64, "num_layers": 1, "max_seq_len": 64},
            "data": {"data_dir": str(real_dir), "seq_len": 64},
            "train": {"steps": steps, "global_batch": batch, "log_every": 10, "learning_rate": 3e-3},
        }
    )
    train_arrays, held_out = load_arrays(trial)
    held_out = {k: v[:500] for k, v in held_out.items()}
    result = train(trial, train_batches(train_arrays, batch, trial.train.seed), held_out, make_mesh())
    losses = [row["loss"] for row in result.history]
    untrained = np.log(10 if workload == "mlp" else 256)  # uniform prediction over the classes / bytes
    assert losses[-1] < losses[0] and losses[-1] < 0.7 * untrained, losses
    s = result.summary
    assert s["steps"] == steps and s["ms_per_step"] > 0 and s["compile_s"] > 0
    if workload == "mlp":
        assert s["test_accuracy"] > 0.6 and s["test_examples"] == 500
    else:
        assert s["val_loss"] < 4.0 and s["tokens_per_sec"] > 0
