"""``checkpoint``: per lab model, size on disk and the medians (after a warm-up) of ``save_state`` and
``restore_state`` (checksums verified); and ms/step (host time, saves included) of runs without
checkpoints, with one every ``every`` steps written synchronously, and written in the background
(committed at the next save, as the Ray workers do), in turn, with the time a save blocks the step."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxray.bench.report import Report, run_cases
from jaxray.bench.throughput import environment, make_spec
from jaxray.checkpoint import restore_state, save_state, start_save_state
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build, param_count
from jaxray.parallel.mesh import make_mesh, replicate
from jaxray.train.run import train
from jaxray.train.step import abstract_state, init_state, make_optimizer

TARGET = 1.05  # ms/step with a checkpoint every 100 steps over ms/step without
COLUMNS = "case params size_mb save_s restore_s every mode ms_per_step blocked_ms vs_none"
MODES = ("none", "sync", "async")


def size_row(workload: str, repeats: int, data_dir: str | None) -> dict[str, Any]:
    """Save/restore seconds and size of the lab model's full train state."""
    trial = make_spec(workload, 16 if workload == "transformer" else 512, data_dir=data_dir).trial
    model, tx = build(trial.model), make_optimizer(trial.learning_rate, trial.train.weight_decay)
    mesh = make_mesh(jax.devices()[:1])
    state, rng = replicate(init_state(model.init(jax.random.key(0)), tx), mesh), np.random.default_rng(0)

    def noisy(x):  # fresh Adam moments are zeros, which compress to nothing: make them a trained state's
        floating = jnp.issubdtype(x.dtype, jnp.floating) and x.ndim
        return x + rng.standard_normal(x.shape).astype(x.dtype) * 1e-3 if floating else x

    state = state._replace(opt_state=jax.tree.map(noisy, state.opt_state))
    saves, restores = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats + 1):  # the first of each is warm-up
            stored, start = Path(tmp) / f"stored{i}", time.perf_counter()
            save_state(stored, state, trial, [], {})
            saves.append(time.perf_counter() - start)
            start = time.perf_counter()
            jax.block_until_ready(restore_state(stored, abstract_state(model, tx, mesh))[0])
            restores.append(time.perf_counter() - start)
        size = sum(f.stat().st_size for f in (Path(tmp) / "stored0").rglob("*") if f.is_file())
    return {"case": f"{workload} (lab size) save / restore", "workload": workload,
            "params": param_count(state.params), "size_mb": size / 1e6,
            "save_s": statistics.median(saves[1:]), "restore_s": statistics.median(restores[1:]),
            "repeats": repeats, **environment(1)}  # fmt: skip


def _ms_per_step(trial, every: int, mode: str, arrays, held_out, tmp: Path) -> tuple[float, float | None]:
    """(ms/step, median ms a save blocked the loop or None) of one run of ``trial`` in ``mode`` (``MODES``);
    "async" copies to host memory and writes while training goes on, committed at the next save."""
    every = None if mode == "none" else every
    trial = trial.model_copy(update={"train": trial.train.model_copy(update={"checkpoint_every": every})})
    blocked, pending = [], []

    def save(step, state, history):
        start = time.perf_counter()
        if pending:
            pending.pop().commit()
        job = start_save_state(tmp / f"step{step}", state, trial, history, {})
        if mode == "sync":
            job.commit()
        else:
            pending.append(job)
        blocked.append(time.perf_counter() - start)

    batches = train_batches(arrays, trial.train.global_batch, trial.train.seed)
    result = train(trial, batches, held_out, make_mesh(jax.devices()[:1]), save=save if every else None)
    for job in pending:
        job.commit()
    ms = result.summary["ms_per_step"] + result.summary["hook_s"] * 1e3 / (trial.train.steps - 1)
    return ms, (statistics.median(blocked) * 1e3 if blocked else None)


def cost_rows(workload: str, args) -> list[dict[str, Any]]:
    """A row per ``MODES`` entry (checkpoints every ``args.every`` steps), medians over ``args.repeats``."""
    lm, steps = workload == "transformer", args.steps or 2 * args.every + 1
    batch, width = args.batch or (16 if lm else 512), args.width or (128 if lm else None)
    shape = {"width": width, "seq_len": args.seq_len, **({"max_seq_len": args.seq_len} if lm else {})}
    spec = make_spec(workload, batch, **shape, data_dir=args.data_dir)
    train_cfg = spec.trial.train.model_copy(update={"steps": steps, "log_every": max(1, steps // 4)})
    trial = spec.trial.model_copy(update={"train": train_cfg})
    arrays, held_out = load_arrays(trial)
    held_out = {k: v[:batch] for k, v in held_out.items()}
    times: dict[str, list[tuple[float, float | None]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for mode in MODES:
                folder = Path(tmp) / f"{i}-{mode}"
                times[mode].append(_ms_per_step(trial, args.every, mode, arrays, held_out, folder))
                shutil.rmtree(folder, ignore_errors=True)
    env = environment(1) | {"workload": workload, "steps": steps}
    env["case"] = f"{workload} d{trial.model.width} batch {batch}, {steps} steps"
    rows = []
    for mode, runs in times.items():
        blocked = [b for _, b in runs if b is not None]
        rows.append({"every": "none" if mode == "none" else args.every, "mode": mode,
                     "ms_per_step": statistics.median(ms for ms, _ in runs),
                     "ms_per_step_repeats": [ms for ms, _ in runs],
                     "blocked_ms": statistics.median(blocked) if blocked else None})  # fmt: skip
    return [env | r | {"vs_none": r["ms_per_step"] / rows[0]["ms_per_step"]} for r in rows]


def checkpoint_benchmark(args) -> Report:
    """Size rows for both lab models, then the cost rows of ``checkpoint``'s options."""
    cases = [({"case": f"{w} save / restore"}, lambda w=w: size_row(w, args.repeats, args.data_dir))
             for w in ("mlp", "transformer")]  # fmt: skip
    for w in ["mlp", "transformer"] if args.workload == "all" else [args.workload]:
        cases.append(({"case": f"{w} every {args.every}"}, lambda w=w: {"rows": cost_rows(w, args)}))
    rows = [r for res in run_cases(cases, "checkpoint") for r in res.pop("rows", [res])]
    cost = (r for r in rows if r.get("every") not in (None, "none"))
    summary = {f"{r['workload']}_every_{r['every']}_{r['mode']}": r["vs_none"] for r in cost}
    summary["target"] = TARGET
    notes = [
        f"Target: a checkpoint every 100 steps costs <= {TARGET:g}x the step time without.",
        "save s: save_state, committed; restore s: restore_state onto the mesh, checksums verified; medians "
        "after a warm-up. ms/step: the loop's host time a step, saves included; blocked ms: the loop's "
        "wait per save (sync: the whole save; async: the copy to host memory and the previous commit).",
    ]
    title = "Checkpoints: size, save and restore time, step-time cost"
    return Report("checkpoint", title, rows, COLUMNS, notes, summary=summary)
