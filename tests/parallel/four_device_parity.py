"""Run in a subprocess with 4 forced host devices (XLA_FLAGS set before jax is imported).

Trains the same steps on the same global batches on a 1-device mesh and on a 4-device mesh and
prints one JSON line comparing them, plus where the batch and params live.
"""
from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.parallel.mesh import make_mesh, shard_batch
from jaxray.train.run import train


def param_diffs(a, b) -> dict:
    """Max |a - b| over all params, and separately over the attention key bias.

    The key bias has an analytically zero gradient (it adds the same q.b to every score of a query,
    which softmax ignores), so its gradient is pure rounding noise that Adam scales up to
    learning-rate-sized steps; reduction order then decides its value, not the data.
    """
    diffs = {"max_param_diff": 0.0, "max_key_bias_diff": 0.0}
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        name = "max_key_bias_diff" if "['key']['bias']" in jax.tree_util.keystr(path) else "max_param_diff"
        diffs[name] = max(diffs[name], float(np.max(np.abs(np.asarray(x) - np.asarray(y)))))
    return diffs


def run(workload: str, data_dir: str) -> dict:
    trial = parse_trial({"model": {"workload": workload, "width": 32, "num_layers": 1, "max_seq_len": 32},
                         "data": {"data_dir": data_dir, "seq_len": 32},
                         "train": {"steps": 4, "global_batch": 16, "log_every": 1}})
    train_arrays, held_out = load_arrays(trial)
    held_out = {k: v[:64] for k, v in held_out.items()}
    results = {}
    for n in (1, 4):
        mesh = make_mesh(jax.devices()[:n])
        results[n] = train(trial, train_batches(train_arrays, 16), held_out, mesh)
    one, four = results[1], results[4]
    mesh4 = make_mesh()
    batch = shard_batch(mesh4, next(train_batches(train_arrays, 16)))
    leaf = jax.tree.leaves(four.state.params)[0]
    first = next(iter(batch.values()))
    return {
        "devices": jax.device_count(),
        "batch_shards": [tuple(s.data.shape) for s in first.addressable_shards],
        "batch_spec": list(first.sharding.spec),
        "params_replicated": bool(leaf.sharding.is_fully_replicated) and len(leaf.sharding.device_set) == 4,
        "loss_1": [r["loss"] for r in one.history], "loss_4": [r["loss"] for r in four.history],
        **param_diffs(one.state.params, four.state.params),
        "eval_1": one.summary.get("test_loss", one.summary.get("val_loss")),
        "eval_4": four.summary.get("test_loss", four.summary.get("val_loss")),
    }


if __name__ == "__main__":
    print(json.dumps({w: run(w, sys.argv[1]) for w in ("mlp", "transformer")}))
