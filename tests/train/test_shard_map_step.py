"""The explicit shard_map step on a 1-device mesh equals ``train_step`` (the 4-device parity with the
auto-sharded step is in tests/parallel/test_data_parallel.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh, replicate, shard_batch
from jaxray.train.loop import compile_shard_map_train_step, compile_train_step
from jaxray.train.step import init_state, make_optimizer

STEPS = 3
# On one device pmean over a size-1 axis is the identity, so both programs do the same float32
# arithmetic (observed: bit-identical); the bound only leaves XLA room to fuse them differently.
RTOL, ATOL = 1e-6, 1e-7


@pytest.mark.parametrize(
    "workload,batch", [("mlp", 32), pytest.param("transformer", 4, marks=pytest.mark.slow)]
)
def test_one_device_shard_map_step_equals_train_step(real_dir, workload, batch):
    trial = parse_trial(
        {
            "model": {"workload": workload, "width": 32, "num_layers": 1, "max_seq_len": 32},
            "data": {"data_dir": str(real_dir), "seq_len": 32},
            "train": {"steps": STEPS, "global_batch": batch},
        }
    )
    train_arrays, _ = load_arrays(trial)
    model = build(trial.model)
    tx = make_optimizer(trial.learning_rate, trial.train.weight_decay)
    params = jax.device_get(model.init(jax.random.key(0)))  # host copy: the device states are donated
    mesh = make_mesh(jax.devices()[:1])
    batches = train_batches(train_arrays, batch, trial.train.seed)
    batches = [shard_batch(mesh, next(batches)) for _ in range(STEPS)]
    runs = []
    for compile_step in (compile_train_step, compile_shard_map_train_step):
        state = replicate(init_state(params, tx), mesh)
        step, compile_s = compile_step(model, tx, mesh, state, batches[0])
        assert compile_s > 0
        metrics = []
        for b in batches:
            state, m = step(state, b)
            metrics.append(jax.device_get(m))
        runs.append((jax.device_get(state), metrics))
    (state, metrics), (sm_state, sm_metrics) = runs
    assert int(sm_state.step) == int(state.step) == STEPS
    for key in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(
            [m[key] for m in sm_metrics], [m[key] for m in metrics], rtol=RTOL, atol=ATOL, err_msg=key
        )
    for got, want in zip(jax.tree.leaves(sm_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
