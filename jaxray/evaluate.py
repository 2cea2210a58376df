"""Evaluate a saved checkpoint on its whole held-out set; ``python -m jaxray.evaluate``.

MLPs: test loss (nats), accuracy, 10x10 confusion matrix and figures over all 10,000 test images.
Transformer: val loss (nats/byte), perplexity = exp(loss), bits/byte = loss / ln 2, a sample.
Writes summary.json (and MLP PNGs) to ``--out`` (default ``runs/eval/<name>``)."""

from __future__ import annotations

import functools
import math
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxray import checkpoint, runs
from jaxray.argtypes import CHECKPOINT_HELP, cli_parser
from jaxray.config import WORKLOADS, ConfigError
from jaxray.data.batching import Arrays, eval_batches
from jaxray.data.fashion_mnist import CLASS_NAMES, NUM_CLASSES
from jaxray.data.sources import DataFileError
from jaxray.data.workloads import load_arrays
from jaxray.folders import exclusive
from jaxray.inference.sampling import Sampling, encode_prompt, generate, printable, prompt_window
from jaxray.models import Model
from jaxray.parallel.mesh import batch_sharding, make_mesh, replicated, shard_batch
from jaxray.reporting import checkpoint_line, eval_figures
from jaxray.reporting.eval_results import (
    CHECKPOINT_SHA256,
    FIGURES,
    checkpoint_sha256,
    default_out,
    results_folder,
    write_results,
)
from jaxray.train.held_out import evaluate
from jaxray.train.loop import jit_eval_step
from jaxray.train.run import eval_batch_size


def predict_step(params: Any, batch: dict[str, jax.Array], *, apply) -> jax.Array:
    """Predicted class per row of an eval batch: [B] int32 argmax of the logits, -1 where ``mask`` is 0."""
    logits = apply(params, batch["image"])
    return jnp.where(batch["mask"] > 0, jnp.argmax(logits, -1), -1).astype(jnp.int32)


def jit_predict_step(model: Model, mesh: Mesh):
    """Params replicated, batch sharded, predictions replicated."""
    step = functools.partial(predict_step, apply=model.apply)
    return jax.jit(
        step, in_shardings=(replicated(mesh), batch_sharding(mesh)), out_shardings=replicated(mesh)
    )


def predict(predict_fn, params: Any, arrays: Arrays, global_batch: int, mesh: Mesh) -> np.ndarray:
    """[N] int32 predicted class of every row of ``arrays``, in order, padding removed."""
    out = [predict_fn(params, shard_batch(mesh, b)) for b in eval_batches(arrays, global_batch)]
    predictions = np.concatenate(jax.device_get(out))
    return predictions[predictions >= 0]


def confusion_matrix(
    labels: np.ndarray, predictions: np.ndarray, num_classes: int = NUM_CLASSES
) -> np.ndarray:
    """[C, C] int64 counts, rows true class, columns predicted, from [N] ints in 0..C-1.
    Raises ValueError if the lengths differ or a value is out of range."""
    labels, predictions = np.asarray(labels), np.asarray(predictions)
    if labels.shape != predictions.shape:
        raise ValueError(f"{len(labels)} labels but {len(predictions)} predictions")
    for name, x in (("label", labels), ("prediction", predictions)):
        if x.size and (x.min() < 0 or x.max() >= num_classes):
            raise ValueError(f"a {name} is outside 0..{num_classes - 1}")
    counts = np.bincount(labels * num_classes + predictions, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes).astype(np.int64)


def evaluate_classifier(model: Model, params: Any, held_out: Arrays, global_batch: int, mesh: Mesh) -> dict:
    """Loss (nats), accuracy, ``count`` (images evaluated), ``dropped`` (images without a prediction:
    0 by design), ``confusion_matrix`` ([10, 10] int64) and ``predictions`` ([N] int32)."""
    metrics = evaluate(jit_eval_step(model, mesh), params, held_out, global_batch, mesh)
    predictions = predict(jit_predict_step(model, mesh), params, held_out, global_batch, mesh)
    matrix = confusion_matrix(held_out["label"], predictions)
    return {
        "loss": metrics["loss"],
        "accuracy": metrics["accuracy"],
        "count": metrics["count"],
        "dropped": len(held_out["label"]) - int(matrix.sum()),
        "confusion_matrix": matrix,
        "predictions": predictions,
    }


def evaluate_language_model(
    model: Model, params: Any, held_out: Arrays, batch: int, mesh: Mesh, prompt: str, sampling: Sampling
) -> dict:
    """Validation ``loss`` (nats per byte), ``perplexity`` = exp(loss), ``bits_per_byte`` = loss / ln 2,
    byte ``accuracy``, ``count`` (sequences) and a ``sample`` of ``max_new_tokens`` bytes after ``prompt``."""
    metrics = evaluate(jit_eval_step(model, mesh), params, held_out, batch, mesh)
    return {
        "loss": metrics["loss"],
        "perplexity": metrics["perplexity"],
        "bits_per_byte": metrics["loss"] / math.log(2),
        "accuracy": metrics["accuracy"],
        "count": metrics["count"],
        "prompt": prompt,
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "seed": sampling.seed,
        "sample": generate(model, params, prompt, sampling),
    }


def run(
    path: str | Path,
    out: str | Path | None = None,
    data_dir: str | None = None,
    workload: str | None = None,
    prompt: str = "ROMEO:",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    seed: int = 0,
    overwrite: bool = False,
) -> dict:
    """Evaluate the checkpoint ``path`` names into ``out``; returns the summary. Raises CheckpointError,
    ConfigError, ValueError, DataFileError and ResultsWriteError (nothing in ``out`` changed)."""
    sampling = Sampling(max_new_tokens, temperature, seed)
    sampling.check()
    prompt_window(encode_prompt(prompt), 1)  # an empty prompt fails here, not after the restore
    if data_dir is not None and not Path(data_dir).is_dir():  # else a typo falls to the default search
        raise ConfigError(f"--data-dir {data_dir} is not a directory")
    opened = runs.open_checkpoint(path, workload)
    directory = opened.path
    print(checkpoint_line.describe(directory), file=sys.stderr, flush=True)  # which one, before the work
    opened.require(workload, "evaluated as one")
    trial = checkpoint.load_trial_config(directory)
    out = results_folder(out or default_out(checkpoint.source(directory)), directory, overwrite)
    with exclusive(out, "python -m jaxray.evaluate"):  # two evaluations into one --out: one refused
        results_folder(out, directory, overwrite)  # again, now that it is held
        data_dir = data_dir or trial.data.data_dir
        _, held_out = load_arrays(
            trial.model_copy(update={"data": trial.data.model_copy(update={"data_dir": data_dir})})
        )
        mesh = make_mesh(jax.devices()[:1])  # one device: small, and no batch must divide
        model, params = checkpoint.restore(opened, replicated(mesh))
        batch = eval_batch_size(trial, 1)
        head = {"checkpoint": checkpoint.source(directory), CHECKPOINT_SHA256: checkpoint_sha256(directory)}
        head |= {"workload": trial.model.workload, "data_dir": data_dir}
        if trial.model.workload != "transformer":
            result = evaluate_classifier(model, params, held_out, batch, mesh)
            return write_results(out, *_classifier_files(head | result, held_out, out))
        sampled = evaluate_language_model(model, params, held_out, batch, mesh, prompt, sampling)
        return write_results(out, head | {"seq_len": trial.data.seq_len} | sampled, {})


def _classifier_files(result: dict, held_out: Arrays, out: Path) -> tuple[dict, dict]:
    """(summary: ``result`` less predictions, plus class names and figure paths; figures to draw)."""
    paths = {name: out / name for name in FIGURES}
    predictions = result.pop("predictions")
    n = eval_figures.GRID_SIDE**2
    draw = {
        FIGURES[0]: functools.partial(
            eval_figures.plot_confusion_matrix, result["confusion_matrix"], CLASS_NAMES
        ),
        FIGURES[1]: functools.partial(
            eval_figures.plot_predictions_grid,
            held_out["image"][:n],
            held_out["label"][:n],
            predictions[:n],
            CLASS_NAMES,
        ),
    }
    summary = result | {
        "class_names": list(CLASS_NAMES),
        "confusion_matrix_png": str(paths[FIGURES[0]]),
        "predictions_grid_png": str(paths[FIGURES[1]]),
    }
    return summary, draw


def format_summary(s: dict) -> str:
    """The lines ``main`` prints for ``run``'s summary."""
    lines = [f"checkpoint     {s['checkpoint']} ({s['workload']})"]
    if s["workload"] == "transformer":
        lines += [
            f"val sequences  {s['count']} of {s['seq_len']} bytes ({s['seq_len'] - 1} predicted in each)",
            f"val loss       {s['loss']:.4f} nats/byte",
            f"perplexity     {s['perplexity']:.3f}",
            f"bits per byte  {s['bits_per_byte']:.4f}",
            f"byte accuracy  {s['accuracy']:.4f}",
            f"sample         ({s['max_new_tokens']} bytes, temperature {s['temperature']}, "
            f"seed {s['seed']}):",
            printable(s["prompt"] + s["sample"]),
        ]
    else:
        total = s["count"] + s["dropped"]
        dropped = "none dropped" if s["dropped"] == 0 else f"WARNING: {s['dropped']} DROPPED"
        correct = int(np.trace(s["confusion_matrix"]))
        lines += [
            f"test images    {s['count']} evaluated of {total} ({dropped})",
            f"test loss      {s['loss']:.4f} nats",
            f"accuracy       {s['accuracy']:.4f} ({correct} correct)",
            f"figures        {s['confusion_matrix_png']}",
            f"               {s['predictions_grid_png']}",
        ]
    return "\n".join(lines + [f"summary        {s['summary_json']}"])


def main(argv: list[str] | None = None) -> int:
    p = cli_parser("python -m jaxray.evaluate", "Evaluate a saved checkpoint.")
    p.add_argument("--checkpoint", dest="path", metavar="CHECKPOINT", required=True, help=CHECKPOINT_HELP)
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        help="in runs/<experiment>: whose best trial (default: the transformer if any)",
    )
    p.add_argument(
        "--out",
        help="output folder, created once the results are ready (default: runs/eval/<name>, one "
        "per checkpoint: the checkpoint folder's name, or <trial>/<checkpoint_...> for a Ray Train "
        "checkpoint, under <experiment>/<run>/ in a run folder)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the evaluation of another checkpoint in --out (the earlier results are kept "
        "until the new ones are written)",
    )
    p.add_argument(
        "--data-dir", help="data folder (default: the checkpoint's data.data_dir, else the usual search)"
    )
    p.add_argument("--prompt", default="ROMEO:", help="transformer: text to continue")
    p.add_argument("--max-new-tokens", type=int, default=200, help="transformer: bytes to sample")
    p.add_argument(
        "--temperature", type=float, default=0.8, help="transformer: softmax temperature; 0 is greedy"
    )
    p.add_argument("--seed", type=int, default=0, help="transformer: PRNG seed of the sample")
    args = p.parse_args(argv)
    try:
        summary = run(**vars(args))
    except (checkpoint.CheckpointError, ConfigError, ValueError, DataFileError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_summary(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
