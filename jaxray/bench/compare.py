"""``python -m jaxray.bench compare --reference SCRIPT``: jaxray's step against the learning path's own.

The reference script (``../shared/bench/reference_*.py``, the notebooks' training steps) and
``python -m jaxray.bench throughput`` run alternately in fresh processes on the same config
(A B A B ...), each warming up on one step and then timing ``steps`` steps after
``block_until_ready``. Each pair gives a ratio jaxray / reference; the reported figure is the median
of the pairs' ratios, so a slow spell on a shared machine hits both sides of a pair. Both start from
the same params and batches, so their final losses must agree to float tolerance: a faster step
that computes something else would show here.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxray.bench import charts, mfu
from jaxray.bench.columns import columns
from jaxray.bench.output import Report, row_value
from jaxray.config import ModelConfig

# Targets on the 2-core CPU the issue names: tokens/s (transformer) or examples/s (MLP) ratios.
TARGETS = {"transformer": 1.25, "mlp": 1.0}
DEFAULT_BATCH = {"transformer": 16, "mlp": 512}
DEFAULT_STEPS = {"transformer": 10, "mlp": 100}
# Final losses of the two sides after the same steps from the same params: float32 reordering only.
LOSS_RTOL = 1e-4


def infer_workload(script: Path) -> str:
    """ "transformer" or "mlp" from the reference script's name; ValueError if neither appears."""
    for workload in TARGETS:
        if workload in script.name:
            return workload
    raise ValueError(f"cannot tell the workload of {script.name}: pass --workload {' or '.join(TARGETS)}")


def check(workload: str, dtype: str) -> None:
    """ValueError for a dtype the reference script cannot run: only the MLP script takes --dtype."""
    if workload == "transformer" and dtype != "float32":
        raise ValueError(f"--dtype {dtype}: the reference transformer script runs float32 only")


def _run_json(cmd: list[str], env: dict[str, str], timeout_s: float, key: str) -> dict[str, Any]:
    """Run ``cmd`` and parse the last JSON line of its stdout, which must hold a positive ``key``.

    Raises RuntimeError naming the command for a failure, a timeout, or output without that figure.
    """
    shown = " ".join(c if c else "''" for c in cmd)
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{shown} did not finish within {timeout_s:.0f} s (--timeout)") from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip().startswith("{")]
    if proc.returncode != 0:
        raise RuntimeError(f"{shown} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    try:
        out = json.loads(lines[-1]) if lines else None
    except ValueError as err:
        raise RuntimeError(f"{shown} printed a line that is not JSON ({err}): {lines[-1][:200]}") from None
    value = out.get(key) if isinstance(out, dict) else None
    if not isinstance(value, (int, float)) or not value > 0:
        raise RuntimeError(f"{shown} printed no JSON line with a positive {key!r} (got {str(out)[:200]})")
    return out


def commands(
    script: Path, workload: str, batch: int, steps: int, dtype: str, data_dir: str | None
) -> tuple[list[str], list[str]]:
    """(reference command, jaxray command) for one side-by-side run."""
    reference = [sys.executable, str(script), "--steps", str(steps), "--batch", str(batch)]
    if workload == "mlp":
        reference += ["--dtype", dtype]
    ours = [
        sys.executable,
        "-m",
        "jaxray.bench",
        "throughput",
        "--json",
        "--workload",
        workload,
        "--batch",
        str(batch),
        "--steps",
        str(steps),
        "--dtype",
        dtype,
        "--repeats",
        "1",
        "--warmup",
        "1",
        "--out",
        "",
    ]
    if data_dir:
        ours += ["--data-dir", data_dir]
    return reference, ours


def compare(
    script: Path,
    workload: str,
    batch: int,
    steps: int,
    pairs: int,
    dtype: str = "float32",
    data_dir: str | None = None,
    timeout_s: float = 900,
) -> Report:
    """Run ``pairs`` A/B pairs and report each run, the median ratio and the loss agreement.

    Raises RuntimeError if a run fails (its stderr is in the message) or prints no figure, and
    ValueError for a dtype the reference script cannot run (only the MLP script takes --dtype).
    """
    check(workload, dtype)
    env = dict(os.environ)
    if data_dir:
        env["JAXRAY_DATA_DIR"] = str(Path(data_dir).absolute())
    reference_cmd, ours_cmd = commands(script, workload, batch, steps, dtype, data_dir)
    key = "tokens_per_sec" if workload == "transformer" else "examples_per_sec"
    per_example = mfu.flops_per_example(ModelConfig(workload=workload, dtype=dtype), 256)
    rows, ratios = [], []
    for pair in tqdm(range(1, pairs + 1), desc="compare (A B pairs)", unit="pair", file=sys.stderr):
        ref = _run_json(reference_cmd, env, timeout_s, key)
        ours = _run_json(ours_cmd, env, timeout_s, key)
        ratios.append(ours[key] / ref[key])
        for impl, out in (("reference", ref), ("jaxray", ours)):
            rows.append(
                {
                    "pair": pair,
                    "impl": impl,
                    "run": f"{impl} #{pair}",
                    "workload": workload,
                    "global_batch": batch,
                    "dtype": dtype,
                    "steps": steps,
                    key: out[key],
                    "ms_per_step": out["ms_per_step"],
                    "final_loss": out["final_loss"],
                    "achieved_tflops": batch / (out["ms_per_step"] / 1e3) * per_example / 1e12,
                    "ratio_vs_reference": ratios[-1] if impl == "jaxray" else None,
                    **{k: ours[k] for k in ("device_kind", "devices", "jax", "jaxlib")},
                }
            )
    return _report(script, workload, rows, ratios, key)


def _report(script: Path, workload: str, rows: list[dict], ratios: list[float], key: str) -> Report:
    median = statistics.median(ratios)
    target = TARGETS.get(workload)
    losses = [(r["final_loss"], o["final_loss"]) for r, o in zip(rows[::2], rows[1::2])]
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses)
    unit = "tokens/s" if key == "tokens_per_sec" else "examples/s"
    tflops = statistics.median(row_value(r, "achieved_tflops") for r in rows if r["impl"] == "jaxray")
    notes = [
        f"median ratio jaxray / reference ({unit}): **{median:.3f}x** over {len(ratios)} pair(s) "
        f"(each: {', '.join(f'{x:.3f}' for x in ratios)})",
        f"target >= {target:.2f}x: {'met' if median >= target else 'NOT met'}" if target else "no target set",
        f"final loss agreement: worst relative difference {worst:.1e} (tolerance {LOSS_RTOL:.0e}): "
        f"{'same numbers' if worst <= LOSS_RTOL else 'DIFFERENT numbers'}",
        f"jaxray achieved {tflops * 1e3:.1f} GFLOP/s of model FLOPs (median)",
        f"reference: {script}",
    ]
    table = columns(
        "pair impl global_batch steps",
        (unit, key, ",.0f"),
        "ms_per_step",
        ("GFLOP/s", lambda r: r["achieved_tflops"] * 1e3, ".1f"),
        "final_loss ratio_vs_reference",
    )
    summary = {
        "median_ratio": median,
        "target": target,
        "met": target is None or median >= target,
        "max_final_loss_rel_diff": worst,
    }
    return Report(
        "compare",
        f"jaxray vs the learning path's {workload} step",
        rows,
        table,
        notes,
        {"compare.png": functools.partial(charts.bars, label="run", title="reference vs jaxray, A B pairs")},
        summary=summary,
    )
