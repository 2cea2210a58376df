"""Run in a subprocess with N forced host devices (XLA_FLAGS set before jax is imported).

``single_process_reference.py TRIAL_JSON OUT_NPZ``: trains the trial in this one process on a mesh of
every local device, on the global batches ``train_batches(arrays, global_batch)`` gives (with
``data.parquet`` set: the unshuffled arrays in the seeded per-epoch order the Parquet path follows),
evaluates on the first ``eval_rows`` held-out rows (a key of TRIAL_JSON beside ``trial``), and
writes the final params (flattened, ``jax.tree_util.keystr`` keys), the logged losses and gradient
norms to OUT_NPZ.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import WORKLOAD_DATASET, held_out_split, load_arrays, natural_splits, train_source
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import train


def flat_params(params) -> dict[str, np.ndarray]:
    """``{keystr(path): array}`` of every leaf: the same keys for live and restored params."""
    return {
        jax.tree_util.keystr(path): np.asarray(leaf)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    }


def main(trial_json: str, out: str) -> None:
    spec = json.loads(open(trial_json).read())
    trial = parse_trial(spec["trial"])
    if trial.data.parquet:
        splits = natural_splits(
            WORKLOAD_DATASET[trial.model.workload], trial.data.data_dir, trial.data.seq_len
        )
        dataset = WORKLOAD_DATASET[trial.model.workload]
        train_arrays, held_out = (
            train_source(dataset, splits["train"]),
            splits[held_out_split(trial.model.workload)],
        )
    else:
        train_arrays, held_out = load_arrays(trial)
    seed = trial.train.seed
    held_out = {k: v[: spec["eval_rows"]] for k, v in held_out.items()}
    result = train(trial, train_batches(train_arrays, trial.train.global_batch, seed), held_out, make_mesh())
    np.savez(
        out,
        losses=np.array([row["loss"] for row in result.history]),
        grad_norms=np.array([row["grad_norm"] for row in result.history]),
        devices=jax.device_count(),
        **{f"param:{k}": v for k, v in flat_params(result.state.params).items()},
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
