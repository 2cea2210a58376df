"""``compare --reference SCRIPT``: jaxray's step against the learning path's own script, run
alternately in fresh processes on the same config (A B A B). Each pair gives a ratio jaxray /
reference; the median ratio is reported. Both start from the same params and batches, so their
final losses must agree to ``LOSS_RTOL``."""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from jaxray.bench import mfu
from jaxray.bench.report import Report, bar_chart
from jaxray.config import ModelConfig

TARGETS = {"transformer": 1.25, "mlp": 1.0}  # ratio targets on the 2-core CPU
DEFAULT_BATCH = {"transformer": 16, "mlp": 512}
DEFAULT_STEPS = {"transformer": 10, "mlp": 100}
LOSS_RTOL = 1e-4


def infer_workload(script: Path) -> str:
    """ "transformer" or "mlp" from the script's name; ValueError if neither appears."""
    for workload in TARGETS:
        if workload in script.name:
            return workload
    raise ValueError(f"cannot tell the workload of {script.name}: pass --workload {' or '.join(TARGETS)}")


def check(workload: str, dtype: str) -> None:
    """ValueError for a dtype the reference script cannot run (only the MLP script takes --dtype)."""
    if workload == "transformer" and dtype != "float32":
        raise ValueError(f"--dtype {dtype}: the reference transformer script runs float32 only")


def run_json(cmd: list[str], env: dict[str, str] | None, timeout_s: float, key: str) -> dict[str, Any]:
    """Run ``cmd``; its last JSON line, which must hold a positive ``key``. RuntimeError otherwise."""
    shown = " ".join(c or "''" for c in cmd)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{shown} did not finish within {timeout_s:.0f} s (--timeout)") from None
    if proc.returncode != 0:
        raise RuntimeError(f"{shown} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    try:
        out = json.loads(lines[-1]) if lines else None
    except ValueError as err:
        raise RuntimeError(f"{shown} printed a line that is not JSON ({err})") from None
    if not isinstance(out, dict) or not isinstance(out.get(key), (int, float)) or not out[key] > 0:
        raise RuntimeError(f"{shown} printed no JSON line with a positive {key!r} (got {str(out)[:200]})")
    return out


def commands(script: Path, workload: str, batch: int, steps: int, dtype: str, data_dir: str | None):
    """(reference command, jaxray command) of one pair."""
    sizes = ["--steps", str(steps), "--batch", str(batch)]
    reference = [sys.executable, str(script), *sizes, *(["--dtype", dtype] if workload == "mlp" else [])]
    ours = [sys.executable, "-m", "jaxray.bench", "throughput", "--json", "--workload", workload, *sizes]
    ours += ["--dtype", dtype, "--repeats", "1", "--warmup", "1", "--out", ""]
    return reference, ours + (["--data-dir", data_dir] if data_dir else [])


def compare(args, workload: str) -> Report:
    """``args.pairs`` A/B pairs: a row per run; the median ratio and loss agreement in the summary."""
    batch, steps = args.batch or DEFAULT_BATCH[workload], args.steps or DEFAULT_STEPS[workload]
    env = dict(os.environ) | (
        {"JAXRAY_DATA_DIR": str(Path(args.data_dir).absolute())} if args.data_dir else {}
    )
    ref_cmd, ours_cmd = commands(Path(args.reference), workload, batch, steps, args.dtype, args.data_dir)
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
    return _report(args.reference, workload, rows, ratios, key)


def _report(script: Path, workload: str, rows: list[dict], ratios: list[float], key: str) -> Report:
    median, target = statistics.median(ratios), TARGETS[workload]
    losses = [(r["final_loss"], o["final_loss"]) for r, o in zip(rows[::2], rows[1::2])]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses)
    notes = [
        f"median ratio jaxray / reference ({key}): **{median:.3f}x** over {len(ratios)} pair(s) "
        f"({', '.join(f'{x:.3f}' for x in ratios)}); target >= {target:.2f}x",
        f"final loss agreement: worst relative difference {worst:.1e} (tolerance {LOSS_RTOL:.0e})",
        f"reference: {script}",
    ]
    summary = {
        "median_ratio": median,
        "target": target,
        "met": median >= target,
        "max_final_loss_rel_diff": worst,
    }
    cols = f"pair impl global_batch steps {key} ms_per_step achieved_tflops final_loss ratio_vs_reference"
    chart = {"compare.png": functools.partial(bar_chart, label="run", title="reference vs jaxray, A B pairs")}
    return Report(
        "compare", f"jaxray vs the learning path's {workload} step", rows, cols, notes, chart, summary
    )
