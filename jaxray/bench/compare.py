"""Against the learning path's own scripts. ``compare --reference SCRIPT``: jaxray's step vs the script,
alternately in fresh processes (A B A B); the median ratio, final losses agreeing to ``LOSS_RTOL``.
``decode``: new tokens/s of the KV-cache engine (default context_keep, and S) vs full-window recompute
(``sampling.sample``) and the notebook's sampler script when found; medians of ``repeats`` after a warm-up."""

from __future__ import annotations

import functools
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxray import checkpoint, runs
from jaxray.bench import mfu
from jaxray.bench.profile import profile, shares
from jaxray.bench.report import Report, bar_chart, ratio, run_cases
from jaxray.bench.suites import preload
from jaxray.bench.throughput import environment, time_calls
from jaxray.config import ModelConfig
from jaxray.inference.engine import Engine, Request
from jaxray.inference.sampling import check_sampling, context_len, encode_prompt, prompt_window, sample
from jaxray.inference.settings import EngineSettings
from jaxray.models import build

DEFAULTS = {"transformer": (1.25, 16, 10), "mlp": (1.0, 512, 100)}  # ratio target (2 CPU cores), batch, steps
LOSS_RTOL = 1e-4
LAB = ModelConfig(workload="transformer", attention="xla")  # the defaults: lab 7's d 256, 4 layers, T 256
TARGET = 20.0  # KV-cache tokens/s over full-window tokens/s at batch 1
COLUMNS = "sampler batch new_tokens tokens_per_sec ms_per_token vs_full vs_notebook"


def run_json(cmd: list[str], env: dict[str, str] | None, timeout_s: float, key: str) -> dict[str, Any]:
    """Run ``cmd``; its last JSON line, which must hold a positive ``key``. RuntimeError otherwise."""
    shown = " ".join(c or "''" for c in cmd)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{shown} did not finish within {timeout_s:.0f} s (--timeout)") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{shown} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    try:
        out = json.loads([ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")][-1])
    except (IndexError, ValueError):  # no JSON line, or not JSON: the message below
        out = None
    if not isinstance(out, dict) or not isinstance(out.get(key), (int, float)) or not out[key] > 0:
        raise RuntimeError(f"{shown} printed no JSON line with a positive {key!r} (got {str(out)[:200]})")
    return out


def compare(args) -> Report:
    """``args.pairs`` A/B pairs: a row per run; the median ratio and loss agreement in the summary."""
    if not args.reference or not Path(args.reference).is_file():
        raise FileNotFoundError(f"--reference {args.reference}: not a file")
    name = Path(args.reference).name  # the workload, unless given, is the one this name holds
    if not (workload := args.workload or next((w for w in DEFAULTS if w in name), None)):
        raise ValueError(f"cannot tell the workload of {name}: pass --workload {' or '.join(DEFAULTS)}")
    if workload == "transformer" and args.dtype != "float32":  # only the MLP script takes --dtype
        raise ValueError(f"--dtype {args.dtype}: the reference transformer script runs float32 only")
    preload([{"workload": workload}], args.data_dir)
    target, batch, steps = DEFAULTS[workload]
    batch, steps = args.batch or batch, args.steps or steps
    env = os.environ | ({"JAXRAY_DATA_DIR": str(Path(args.data_dir).absolute())} if args.data_dir else {})
    sizes = ["--steps", str(steps), "--batch", str(batch)]
    ref_cmd = [sys.executable, args.reference, *sizes, *(["--dtype", args.dtype] * (workload == "mlp"))]
    ours_cmd = [sys.executable, "-m", "jaxray.bench", "throughput", "--json", "--workload", workload, *sizes]
    ours_cmd += ["--dtype", args.dtype, "--repeats", "1", "--warmup", "1", "--out", ""]
    ours_cmd += ["--data-dir", args.data_dir] if args.data_dir else []
    key = "tokens_per_sec" if workload == "transformer" else "examples_per_sec"
    per_example = mfu.flops_per_example(ModelConfig(workload=workload, dtype=args.dtype), 256)
    rows, ratios = [], []
    for pair in range(1, args.pairs + 1):
        ref, ours = (run_json(cmd, env, args.timeout, key) for cmd in (ref_cmd, ours_cmd))
        ratios.append(ours[key] / ref[key])
        for impl, out in (("reference", ref), ("jaxray", ours)):
            rows.append({
                "pair": pair, "impl": impl, "run": f"{impl} #{pair}", "workload": workload,
                "global_batch": batch, "dtype": args.dtype, "steps": steps, key: out[key],
                "ms_per_step": out["ms_per_step"], "final_loss": out["final_loss"],
                "achieved_tflops": batch / out["ms_per_step"] * per_example / 1e9,
                "ratio_vs_reference": ratios[-1] if impl == "jaxray" else None,
                **{k: ours[k] for k in ("device_kind", "devices", "jax", "jaxlib")},
            })  # fmt: skip
    median = statistics.median(ratios)
    losses = [(r["final_loss"], o["final_loss"]) for r, o in zip(rows[::2], rows[1::2])]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses)
    notes = [
        f"median ratio jaxray / reference ({key}): **{median:.3f}x** over {len(ratios)} pair(s) "
        f"({', '.join(f'{x:.3f}' for x in ratios)}); target >= {target:.2f}x",
        f"final loss agreement: worst relative difference {worst:.1e} (tolerance {LOSS_RTOL:.0e})",
        f"reference: {args.reference}",
    ]
    summary = {"median_ratio": median, "target": target, "met": median >= target}
    summary["max_final_loss_rel_diff"] = worst
    cols = f"pair impl global_batch steps {key} ms_per_step achieved_tflops final_loss ratio_vs_reference"
    chart = {"compare.png": functools.partial(bar_chart, label="run", title="reference vs jaxray, A B pairs")}
    title = f"jaxray vs the learning path's {workload} step"
    return Report("compare", title, rows, cols, notes, chart, summary)


def _rates(s: float, tokens: int, batch: int) -> dict[str, float]:
    return {"seconds": s, "tokens_per_sec": tokens / s, "ms_per_token": s * batch / tokens * 1e3}


HLO_OPS = ("scatter", "gather", "copy", "copy-start", "while", "conditional")  # counted in the decode program


def decode_profile(engine: Engine, requests: list[Request], steps: int) -> dict:
    """The compiled ``decode_chunk`` of ``len(requests)`` rows: {"hlo_ops": {op: count in its optimized
    HLO}, "op_us_per_step": summed op time per step (us; on a CPU ops of parallel threads add up, past
    the wall time), "groups": {group: share}, "top_ops": [{"op", "group", "us"}]} from a ``jax.profiler``
    trace of one ``steps``-step call after ``engine.start(requests)`` (``jaxray.bench.profile``)."""
    program = engine.compiled[("decode_chunk", None, len(requests))]
    text = program.as_text()
    state, _ = engine.start(requests)
    traced = profile(program, lambda: program(engine.params, state, np.int32(steps)), top=8)
    return {
        "hlo_ops": {op: len(re.findall(rf"\s{re.escape(op)}\(", text)) for op in HLO_OPS},
        "op_us_per_step": traced["total_ms"] / steps * 1e3,
        "groups": {g: round(share, 3) for g, share in traced["groups"].items()},
        "top_ops": [
            {"op": o["op"], "group": o["group"], "us": o["ms"] / steps * 1e3} for o in traced["top_ops"]
        ],
    }


def profile_note(batch: int, trace: dict, keep: int) -> str:
    """One line of the report for ``decode_profile``'s ``trace`` of the context_keep ``keep`` row."""
    top = ", ".join(f"{o['op']} ({o['group']}) {o['us']:.1f} us" for o in trace["top_ops"][:5])
    ops = ", ".join(f"{op} {k}" for op, k in trace["hlo_ops"].items())
    return (
        f"Profile of the context_keep {keep} row, batch {batch}: {trace['op_us_per_step']:.1f} us of ops "
        f"per step (summed: a CPU's parallel threads add up past the wall time), by group "
        f"{shares(trace['groups'])}; top ops {top}; in its HLO: {ops}."
    )


def _cases(
    model, params, prompt: bytes, new_tokens: int, batches, temperature: float, repeats: int, profiled: bool
):
    size = model.config.max_seq_len
    context = context_len(size)

    def kv(batch: int, keep: int | None):
        shapes = {"buckets": (min(len(prompt), context),), "batch_sizes": (batch,), "chunk": new_tokens}
        settings = EngineSettings(**shapes, max_new_tokens=new_tokens, context_keep=keep, prefix_cache_mib=0)

        def run():
            engine = Engine.for_model(model, params, settings)
            compile_s = engine.compile()["compile_s"]
            requests = [Request(prompt, new_tokens, temperature, None, seed) for seed in range(batch)]
            median_s, _ = time_calls(lambda i: engine.generate(requests), calls=1, repeats=repeats)
            row = {"compile_s": compile_s, **_rates(median_s, new_tokens * batch, batch)}
            if profiled and keep is None:
                row["profile"] = decode_profile(engine, requests, new_tokens - 1)
            return row

        return {"sampler": f"kv-cache, context_keep {keep or size // 2}", "batch": batch}, run

    def full():
        window, length = prompt_window(prompt, context)
        logits_fn = jax.tree_util.Partial(model.apply, params)
        args = (jnp.asarray(window), jnp.int32(length))

        def call(i: int) -> jax.Array:
            return sample(logits_fn, *args, jax.random.key(i), jnp.float32(temperature), new_tokens)

        return _rates(time_calls(call, calls=1, repeats=repeats)[0], new_tokens, 1)

    cases = [kv(b, None) for b in batches] + [kv(1, context)]
    return cases + [({"sampler": "full recompute (jaxray.inference.sampling.sample)", "batch": 1}, full)]


def decode_benchmark(args) -> Report:
    """The report of the module docstring from ``decode``'s options; the notebook row where its script is."""
    check_sampling(args.new_tokens, args.temperature, None)
    prompt_window(encode_prompt(args.prompt), 1)
    data = os.environ.get("JAXRAY_DATA_DIR")
    places = [Path(args.reference or "/nonexistent"), Path("../shared/bench/reference_generate.py")]
    places += [Path(data).parent / "bench" / "reference_generate.py"] if data else []
    if args.reference and not places[0].is_file():
        raise FileNotFoundError(f"--reference {args.reference}: not a file")
    reference = next((p for p in places if p.is_file()), None)
    if args.checkpoint:
        model, params = checkpoint.restore(runs.open_checkpoint(args.checkpoint, workload="transformer"))
    else:  # the lab's model, fresh weights
        model = build(LAB)
        params = model.init(jax.random.key(0))
    cfg, prompt, n = model.config, args.prompt.encode("utf-8"), args.new_tokens
    cases = _cases(model, params, prompt, n, args.batch_sizes, args.temperature, args.repeats, args.profile)
    if reference is not None:
        cmd = [sys.executable, str(reference), "--new-tokens", str(n), "--temperature", str(args.temperature)]

        def notebook():
            rates = [run_json(cmd, None, args.timeout, "new_tokens_per_sec") for _ in range(args.repeats)]
            return _rates(n / statistics.median(r["new_tokens_per_sec"] for r in rates), n, 1)

        cases.append(({"sampler": f"notebook ({reference.name})", "batch": 1}, notebook))
    cases = [({**fields, "new_tokens": n}, run) for fields, run in cases]
    rows = [r | environment(1) for r in run_cases(cases, "decode")]
    traces = {r["batch"]: r.pop("profile") for r in rows if "profile" in r}  # to the notes and summary

    def first(prefix: str) -> dict | None:  # the sampler's batch-1 row
        return next((r for r in rows if r["sampler"].startswith(prefix) and r["batch"] == 1), None)

    full, notebook, tps = first("full recompute"), first("notebook"), "tokens_per_sec"
    kv = first(f"kv-cache, context_keep {cfg.max_seq_len // 2}")
    for r in rows:
        r |= {"vs_full": ratio(r, full, tps), "vs_notebook": ratio(r, notebook, tps)}
    summary = {"kv_vs_full": ratio(kv, full, tps), "target": TARGET}
    summary["kv_vs_notebook"] = ratio(kv, notebook, tps)
    fills = context_len(cfg.max_seq_len) - len(prompt)
    window = (
        f"the window fills after {fills} new tokens, so the context_keep policy is exercised"
        if n > fills
        else "the window never fills, so both context_keep rows do the same work"
    )
    notes = [
        f"Model: d_model {cfg.width}, {cfg.num_layers} layers, {cfg.num_heads} heads, max_seq_len "
        f"{cfg.max_seq_len}, {cfg.dtype}; prompt {len(prompt)} bytes + {n} new tokens: {window}.",
        f"Target: KV-cache >= {TARGET:g}x the full-window sampler's tokens/s at batch 1; batch > 1 rows "
        "count the tokens of every row.",
    ]
    if reference is None:
        notes.append("The notebook row was skipped: no reference_generate.py found (pass --reference).")
    notes += [profile_note(batch, trace, cfg.max_seq_len // 2) for batch, trace in traces.items()]
    summary |= {"profile": traces} if args.profile else {}
    title = "Decode: KV cache vs full-window recompute"
    return Report("decode", title, rows, COLUMNS, notes, summary=summary)
