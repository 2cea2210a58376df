"""Run in a subprocess with 4 forced host devices (XLA_FLAGS set before jax is imported).

``four_device_parity.py DATA_DIR``: trains the same steps on the same global batches on a 1-device
mesh and on a 4-device mesh and prints one JSON line comparing them, plus where the batch and
params live. ``four_device_parity.py DATA_DIR shard_map``: on the 4-device mesh, runs the
auto-sharded step and the explicit ``shard_map`` step from the same init on the same batches and
prints one JSON line with both runs' per-step metrics and their final param differences. The
first mode also trains through ``train`` (its jit init straight into the shardings, its held-out
evaluation) on (fsdp 4) and (fsdp 2 x tensor 2) meshes; ``mesh_parity.py`` checks every mesh's
gradients and layouts.
"""

from __future__ import annotations

import json
import sys

import jax

from jaxray.bench.compile_step import report_for
from jaxray.bench.parity import param_diffs
from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh, replicate, shard_batch
from jaxray.train.loop import compile_shard_map_train_step, compile_train_step
from jaxray.train.run import train
from jaxray.train.step import init_state, make_optimizer

SHARD_MAP_STEPS = 5
# Global batch 64 (16 rows per device) for the MLP, 8 (2 per device) for the transformer.
SHARD_MAP_TRIALS = {
    "mlp": {"model": {"workload": "mlp"}, "train": {"global_batch": 64}},
    "transformer": {
        "model": {"workload": "transformer", "width": 64, "num_layers": 2, "max_seq_len": 64},
        "train": {"global_batch": 8},
    },
}


def run(workload: str, data_dir: str) -> dict:
    trial = parse_trial(
        {
            "model": {"workload": workload, "width": 32, "num_layers": 1, "max_seq_len": 32},
            "data": {"data_dir": data_dir, "seq_len": 32},
            "train": {"steps": 4, "global_batch": 16, "log_every": 1},
        }
    )
    train_arrays, held_out = load_arrays(trial)
    held_out = {k: v[:64] for k, v in held_out.items()}
    meshes = {
        1: make_mesh(jax.devices()[:1]),
        4: make_mesh(),
        "fsdp4": make_mesh(fsdp=4),
        "fsdp2_tensor2": make_mesh(fsdp=2, tensor=2),
    }
    results = {
        k: train(trial, train_batches(train_arrays, 16, trial.train.seed), held_out, mesh)
        for k, mesh in meshes.items()
    }
    one, four = results[1], results[4]
    sharded = {
        name: {
            "mesh": dict(meshes[name].shape),
            "loss": [r["loss"] for r in results[name].history],
            **param_diffs(one.state.params, results[name].state.params),
            "eval": results[name].summary.get("test_loss", results[name].summary.get("val_loss")),
            "ops": report_for(trial, meshes[name])["ops"],
        }
        for name in ("fsdp4", "fsdp2_tensor2")
    }
    mesh4 = make_mesh()
    batch = shard_batch(mesh4, next(train_batches(train_arrays, 16, trial.train.seed)))
    leaf = jax.tree.leaves(four.state.params)[0]
    first = next(iter(batch.values()))
    return {
        "devices": jax.device_count(),
        "batch_shards": [tuple(s.data.shape) for s in first.addressable_shards],
        "batch_spec": list(first.sharding.spec),
        "params_replicated": bool(leaf.sharding.is_fully_replicated) and len(leaf.sharding.device_set) == 4,
        "loss_1": [r["loss"] for r in one.history],
        "loss_4": [r["loss"] for r in four.history],
        **param_diffs(one.state.params, four.state.params),
        "eval_1": one.summary.get("test_loss", one.summary.get("val_loss")),
        "eval_4": four.summary.get("test_loss", four.summary.get("val_loss")),
        "sharded": sharded,
    }


def run_shard_map(workload: str, data_dir: str) -> dict:
    spec = SHARD_MAP_TRIALS[workload]
    trial = parse_trial(
        {
            "model": spec["model"],
            "data": {"data_dir": data_dir, "seq_len": 64},
            "train": {"steps": SHARD_MAP_STEPS, **spec["train"]},
        }
    )
    train_arrays, _ = load_arrays(trial)
    model = build(trial.model)
    tx = make_optimizer(trial.learning_rate, trial.train.weight_decay)
    # On the host, so donating one run's device state cannot touch the other run's init.
    params = jax.device_get(model.init(jax.random.key(trial.train.seed)))
    mesh = make_mesh()
    batches = train_batches(train_arrays, trial.train.global_batch, trial.train.seed)
    batches = [shard_batch(mesh, next(batches)) for _ in range(SHARD_MAP_STEPS)]
    result, final = {"devices": mesh.devices.size}, {}
    for name, compile_step in (("auto", compile_train_step), ("shard_map", compile_shard_map_train_step)):
        state = replicate(init_state(params, tx), mesh)
        step, _ = compile_step(model, tx, mesh, state, batches[0])
        rows = []
        for batch in batches:
            state, metrics = step(state, batch)
            rows.append({k: float(v) for k, v in jax.device_get(metrics).items()})
        result[name] = {k: [row[k] for row in rows] for k in rows[0]}
        final[name] = jax.device_get(state.params)
    return {**result, **param_diffs(final["auto"], final["shard_map"])}


if __name__ == "__main__":
    mode = run_shard_map if sys.argv[2:] == ["shard_map"] else run
    print(json.dumps({w: mode(w, sys.argv[1]) for w in ("mlp", "transformer")}))
