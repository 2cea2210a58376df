"""Evaluation over a whole held-out set (Fashion-MNIST test images, TinyShakespeare validation bytes)."""

from __future__ import annotations

import math

import jax
from jax.sharding import Mesh

from jaxray.data.batching import Arrays, eval_batches, num_rows
from jaxray.parallel.mesh import needs_sync_per_step, shard_batch


def evaluate(eval_fn, params, arrays: Arrays, global_batch: int, mesh: Mesh) -> dict[str, float]:
    """Mean loss and accuracy over every row of ``arrays`` (padding masked out, nothing dropped).
    ``eval_fn(params, batch) -> {"loss_sum", "correct_sum", "count"}``. Returns ``loss`` (nats),
    ``accuracy``, ``perplexity`` = exp(loss) and ``count``; ValueError if ``count`` is not the row count."""
    totals, sync = None, needs_sync_per_step(mesh)
    for batch in eval_batches(arrays, global_batch):
        sums = eval_fn(params, shard_batch(mesh, batch))
        if sync:
            jax.block_until_ready(sums)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    totals = jax.device_get(totals)
    count = int(totals["count"])
    if count != num_rows(arrays):
        raise ValueError(f"evaluated {count} rows, expected {num_rows(arrays)}")
    loss = float(totals["loss_sum"]) / count
    return {
        "loss": loss,
        "accuracy": float(totals["correct_sum"]) / count,
        "perplexity": math.exp(loss),
        "count": count,
    }
