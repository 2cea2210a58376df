"""Run in a subprocess with 4 forced host devices (XLA_FLAGS set before jax is imported).

``restore_chain.py CHECKPOINT WORK_DIR``: a full-state checkpoint (saved by any mesh and process
count) restored onto (fsdp 4) and saved again by this one process, that restored onto 1 device and
saved, that restored onto (data 2, fsdp 2). Prints one JSON line: per link the mesh, the loss of the
next train step on one fixed global batch, and whether its params equal the first link's bitwise.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxray import checkpoint
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build
from jaxray.parallel.mesh import describe, make_mesh, shard_batch
from jaxray.train.loop import compile_train_step
from jaxray.train.step import abstract_state, optimizer_for

LINKS = [("fsdp4", 4, {"fsdp": 4}), ("one", 1, {}), ("data2_fsdp2", 4, {"fsdp": 2})]


def main(source: str, work: str) -> None:
    trial = checkpoint.load_trial_config(source)
    model = build(trial.model)
    tx, _ = optimizer_for(trial)
    rows = next(train_batches(load_arrays(trial)[0], trial.train.global_batch))
    path, first, out = Path(source), None, []
    for name, n, axes in LINKS:
        mesh = make_mesh(jax.devices()[:n], **axes)
        state, doc, history = checkpoint.restore_state(path, abstract_state(model, tx, mesh))
        params = jax.device_get(state.params)
        first = first if first is not None else params
        same = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(params)))
        saved = checkpoint.save_state(Path(work) / name, state, trial, history, {})  # before donating
        batch = shard_batch(mesh, rows)
        step, _ = compile_train_step(model, tx, mesh, state, batch)
        _, metrics = step(state, batch)
        out.append(
            {
                "link": name,
                "mesh": describe(mesh.shape),
                "step": doc["step"],
                "loss": float(metrics["loss"]),
                "same": same,
            }
        )
        path = saved
    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
