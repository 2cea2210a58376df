"""What each step of ``scripts/gpu-check.sh`` measured, parsed from its log and the files it wrote
(``figures_for``), and the small formatting helpers the report shares. Standard library only.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------- small helpers


def load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def json_lines(path: Path) -> list[dict]:
    """Every line of a log that is a JSON object (the commands that print one, e.g. --json)."""
    found = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return found
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return found


def num(value: Any) -> float | None:
    return (
        float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        else None
    )


def ratio(a: Any, b: Any) -> float | None:
    a, b = num(a), num(b)
    return a / b if a is not None and b else None


def fmt(value: Any, spec: str = ",.0f") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return format(value, spec) if math.isfinite(value) else str(value)
    return str(value)


def mib(value: Any) -> str:
    return "-" if num(value) is None else f"{value / 2**20:,.1f} MiB"


def throughput(row: dict) -> tuple[float | None, str]:
    if num(row.get("tokens_per_sec")) is not None:
        return row["tokens_per_sec"], "tok/s"
    return num(row.get("examples_per_sec")), "ex/s"


def rows_of(summary: Any) -> list[dict]:
    """A bench summary.json's rows, or a sweep summary.json (a list of rows)."""
    if isinstance(summary, list):
        return [r for r in summary if isinstance(r, dict)]
    if isinstance(summary, dict):
        return [r for r in summary.get("rows", []) if isinstance(r, dict)]
    return []


def row_problem(row: dict) -> str | None:
    return row.get("error") or row.get("skipped")


# --------------------------------------------------------------------------- per-step figures


def doctor_figures(log: Path, out: Path) -> dict:
    doc = next(iter(json_lines(log)[::-1]), None)
    if not doc:
        return {"error": "no JSON line in the log"}
    kinds = sorted({d.get("device_kind") for d in doc.get("devices", []) if isinstance(d, dict)} - {None})
    return {
        k: doc.get(k)
        for k in (
            "backend",
            "device_count",
            "jax_version",
            "jaxlib_version",
            "cuda_version",
            "cudnn_version",
            "driver_cuda_version",
            "cpu_only_reason",
            "backend_error",
        )
    } | {"device_kinds": kinds}


def precision_figures(log: Path, out: Path) -> dict:
    rows = rows_of(load_json(out / "bench-precision" / "summary.json"))
    if not rows:
        return {"error": "no bench-precision/summary.json"}
    figures: dict[str, Any] = {"rows": []}
    by = {}
    for r in rows:
        value, unit = throughput(r)
        by[(r.get("workload"), r.get("dtype"))] = value
        figures["rows"].append(
            {
                "workload": r.get("workload"),
                "dtype": r.get("dtype"),
                "throughput": value,
                "unit": unit,
                "ms_per_step": r.get("ms_per_step"),
                "mfu": r.get("mfu"),
                "compile_s": r.get("compile_s"),
                "test_accuracy": r.get("test_accuracy"),
                "val_loss": r.get("val_loss"),
                "problem": row_problem(r),
            }
        )
    figures["bf16_vs_fp32"] = {
        w: ratio(by.get((w, "bfloat16")), by.get((w, "float32"))) for w in dict.fromkeys(w for w, _ in by)
    }
    figures["device_kind"] = next((r.get("device_kind") for r in rows if r.get("device_kind")), None)
    return figures


def attention_figures(log: Path, out: Path) -> dict:
    rows = rows_of(load_json(out / "bench-attention" / "summary.json"))
    if not rows:
        return {"error": "no bench-attention/summary.json"}
    return {
        "rows": [
            {
                "requested": r.get("case"),
                "ran": r.get("attention"),
                "dtype": r.get("dtype"),
                "tokens_per_sec": r.get("tokens_per_sec"),
                "mfu": r.get("mfu"),
                "note": r.get("attention_note") or row_problem(r),
            }
            for r in rows
        ]
    }


def sweep_figures(log: Path, out: Path) -> dict:
    rows = rows_of(load_json(out / "bench-batch-sweep" / "summary.json"))
    if not rows:
        return {"error": "no bench-batch-sweep/summary.json"}
    measured = [r for r in rows if not row_problem(r)]
    best = max(measured, key=lambda r: throughput(r)[0] or 0, default={})
    mfus = [r["mfu"] for r in measured if num(r.get("mfu")) is not None]
    return {
        "workload": rows[0].get("workload"),
        "dtype": best.get("dtype"),
        "rows": [
            {
                "global_batch": r.get("global_batch"),
                "throughput": throughput(r)[0],
                "unit": throughput(r)[1],
                "mfu": r.get("mfu"),
                "problem": row_problem(r),
            }
            for r in rows
        ],
        "best_global_batch": best.get("global_batch"),
        "best_throughput": throughput(best)[0] if best else None,
        "max_mfu": max(mfus) if mfus else None,
    }


def compile_summary(doc: dict) -> dict:
    mem = doc.get("memory") or {}
    ops = doc.get("ops") or {}
    fusions = ops.get("fusions")
    return {
        "compile_s": doc.get("compile_s"),
        "flops": doc.get("flops"),
        "bytes_accessed": doc.get("bytes_accessed"),
        "argument_bytes": mem.get("argument_bytes"),
        "output_bytes": mem.get("output_bytes"),
        "temp_bytes": mem.get("temp_bytes"),
        "peak_bytes": mem.get("peak_bytes"),
        "device_memory_bytes": doc.get("device_memory_bytes"),
        "fits": doc.get("fits"),
        "scatter": ops.get("scatter"),
        "gather": ops.get("gather"),
        "collectives": ops.get("collectives"),
        "custom_calls": ops.get("custom_calls"),
        "fusions": sum(fusions.values()) if isinstance(fusions, dict) else fusions,
        "platform": doc.get("platform"),
        "device_kind": doc.get("device_kind"),
    }


def compile_figures(log: Path, out: Path, dtype: str) -> dict:
    doc = load_json(out / f"compile-{dtype}" / "compile.json") or next(
        (d for d in json_lines(log)[::-1] if "memory" in d or "compile_s" in d), None
    )
    if not doc:
        return {"error": "no compile report (compile JSON line or compile.json)"}
    return {"dtype": dtype, **compile_summary(doc)}


def tune_figures(log: Path, out: Path, mode: str) -> dict:
    rows = rows_of(load_json(out / "tune" / "summary.json"))
    figures: dict[str, Any] = {}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    worker_lines = sorted(
        {
            re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
            for line in text.splitlines()
            if "jaxray worker rank" in line
        }
    )
    uuids = sorted({u for line in worker_lines for u in re.findall(r"GPU-[0-9a-fA-F-]{8,}", line)})
    figures["worker_lines"] = worker_lines
    figures["gpu_uuids"] = uuids
    if mode == "gpu":
        figures["gpu_line"] = "found" if uuids else "MISSING: no 'GPUs [GPU-...]' in the worker lines"
    else:
        figures["gpu_line"] = "not expected on CPU (accelerator cpu; the worker logs no GPUs)"
    if not rows:
        figures["error"] = "no tune/summary.json"
        return figures
    by_dtype = {}
    for r in rows:
        by_dtype[r.get("dtype")] = {
            k: r.get(k)
            for k in (
                "trial",
                "tokens_per_sec",
                "ms_per_step",
                "compile_s",
                "steps",
                "val_loss",
                "val_perplexity",
                "final_train_loss",
                "peak_bytes_per_device",
                "error",
            )
        }
        doc = load_json(out / "tune" / f"compile-{r.get('trial')}.json")
        if doc:
            by_dtype[r.get("dtype")]["compile_json"] = compile_summary(doc)
    figures["trials"] = by_dtype
    figures["bf16_vs_fp32"] = ratio(
        (by_dtype.get("bfloat16") or {}).get("tokens_per_sec"),
        (by_dtype.get("float32") or {}).get("tokens_per_sec"),
    )
    return figures


# The figures kept per client count of the serve step (gpu_check_report.py tabulates the same).
SERVE_LEVEL_KEYS = (
    "new_tokens_per_s",
    "rps",
    "p50_ms",
    "p95_ms",
    "errors_5xx",
    "dropped",
    "ttft_p50_ms",
    "ttft_p99_ms",
)


def serve_figures(log: Path, out: Path) -> dict:
    summary = load_json(out / "serve" / "summary.json")
    rows = rows_of(summary)
    if not rows:
        return {"error": "no serve/summary.json"}
    by = {r.get("clients"): r for r in rows}
    levels = {str(c): {k: r.get(k) for k in SERVE_LEVEL_KEYS} for c, r in by.items()}
    return {
        "levels": levels,
        "new_tokens_per_s_1": (by.get(1) or {}).get("new_tokens_per_s"),
        "new_tokens_per_s_16": (by.get(16) or {}).get("new_tokens_per_s"),
        "ratio_16_vs_1": ratio(
            (by.get(16) or {}).get("new_tokens_per_s"), (by.get(1) or {}).get("new_tokens_per_s")
        ),
        "errors_5xx": sum(r.get("errors_5xx") or 0 for r in rows),
        "dropped": sum(r.get("dropped") or 0 for r in rows),
    }


def decode_figures(log: Path, out: Path) -> dict:
    summary = load_json(out / "decode" / "summary.json")
    rows = rows_of(summary)
    if not rows:
        return {"error": "no decode/summary.json"}
    kv = {
        r.get("batch"): r.get("tokens_per_sec")
        for r in rows
        if str(r.get("sampler", "")).startswith("kv-cache") and r.get("sampler") == rows[0].get("sampler")
    }
    batches = sorted(b for b in kv if isinstance(b, int))
    return {
        "new_tokens": rows[0].get("new_tokens"),
        "kv_tokens_per_sec": {str(b): kv[b] for b in batches},
        "largest_batch_vs_1": ratio(kv.get(batches[-1]), kv.get(1)) if batches else None,
        "kv_vs_full": (summary or {}).get("summary", {}).get("kv_vs_full"),
        "kv_vs_notebook": (summary or {}).get("summary", {}).get("kv_vs_notebook"),
        "rows": [
            {
                "sampler": r.get("sampler"),
                "batch": r.get("batch"),
                "tokens_per_sec": r.get("tokens_per_sec"),
                "problem": row_problem(r),
            }
            for r in rows
        ],
    }


def pytest_figures(log: Path, out: Path) -> dict:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return {"error": "no log"}
    pattern = re.compile(r"\b\d+ (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")
    final = next((line.strip(" =") for line in reversed(lines) if pattern.search(line)), None)
    counts = {
        m.group(2): int(m.group(1))
        for m in re.finditer(r"(\d+) (passed|failed|skipped|deselected|errors?)", final or "")
    }
    failed = [line.split(" ", 1)[1] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    return {"result": final, **counts, **({"failures": failed[:20]} if failed else {})}


def throughput_figures(log: Path, out: Path) -> dict:
    line = next((d for d in json_lines(log)[::-1] if "ms_per_step" in d), None)
    if not line:
        return {"error": "no JSON line in the log"}
    return {
        k: line.get(k)
        for k in (
            "workload",
            "dtype",
            "global_batch",
            "width",
            "num_layers",
            "seq_len",
            "params",
            "tokens_per_sec",
            "ms_per_step",
            "mfu",
            "achieved_tflops",
            "compile_s",
            "final_loss",
            "device_kind",
        )
    }


def figures_for(name: str, log: Path, out: Path, mode: str) -> dict:
    if name == "doctor":
        return doctor_figures(log, out)
    if name == "precision":
        return precision_figures(log, out)
    if name == "attention":
        return attention_figures(log, out)
    if name == "batch-sweep":
        return sweep_figures(log, out)
    if name.startswith("compile-"):
        return compile_figures(log, out, name.removeprefix("compile-"))
    if name == "tune":
        return tune_figures(log, out, mode)
    if name == "serve":
        return serve_figures(log, out)
    if name == "decode":
        return decode_figures(log, out)
    if name.startswith("pytest"):
        return pytest_figures(log, out)
    if name.startswith("throughput"):
        return throughput_figures(log, out)
    return {}
