"""The report of ``scripts/gpu-check.sh``: reads what each step left behind, writes ``gpu-check.json``
and ``gpu-check.md`` (the per-step figures are parsed by ``gpu_check_figures.py`` beside it).
Standard library only, so it runs under a GPU host's bare ``python3`` too.

    python3 scripts/gpu_check_report.py report OUTDIR    # after the steps; exit 1 if a step failed
    python3 scripts/gpu_check_report.py exec CMD ARGS... # run CMD with SIGINT at its default

``exec``: a script started in the background inherits SIGINT ignored (and Python then never raises
KeyboardInterrupt); the steps run under ``timeout -s INT`` so that a step out of time stops cleanly
(Tune saves its state, the serve benchmark stops its server), so SIGINT is reset before the exec.

Inputs, all under OUTDIR (written by gpu-check.sh):

- ``logs/steps.tsv``: one line per step: name, status (ran | skipped), exit code, start and end
  (epoch s), timeout s, log path (relative to OUTDIR), the exit codes that count as success, optional
  (0/1), a note, the command;
- ``logs/run.json``: mode (gpu | cpu), budget, python, data dir, bundle, work folder, start time;
- ``logs/gpu-samples.tsv`` (GPU only): epoch s, GPU utilization %, memory used MiB, every second;
- each step's log (``logs/<step>.log``) and the benchmarks' ``summary.json`` under ``bench-<name>/``,
  ``tune/``, ``serve/``, ``decode/``; the compile reports ``compile-<dtype>/compile.json`` and
  ``tune/compile-<trial>.json`` (copied from the sweep's ``train/<trial>/compile.json``).
"""

from __future__ import annotations

import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# beside this file: on sys.path
from gpu_check_figures import SERVE_LEVEL_KEYS, figures_for, fmt, load_json, mib, num

ROOT = Path(__file__).resolve().parents[1]  # the project: git is asked about its commit
MIN_GPU_MIB = 500  # GPU memory a step must have used (nvidia-smi) to count as having run on the GPU
BARS = {  # (figure, target, what): checked on a GPU run only
    "tune_bf16_vs_fp32": (1.5, "tune: bfloat16 / float32 tokens/s of the lab-7 transformer in Ray Train"),
    "serve_16_vs_1": (8.0, "serve: new tokens/s at 16 clients / at 1"),
}


# --------------------------------------------------------------------------- GPU samples


def gpu_samples(out: Path) -> list[tuple[float, float, float]]:
    samples = []
    try:
        lines = (out / "logs" / "gpu-samples.tsv").read_text().splitlines()
    except OSError:
        return samples
    for line in lines:
        parts = re.split(r"[\s,]+", line.strip())
        try:
            samples.append((float(parts[0]), float(parts[1]), float(parts[2])))
        except (IndexError, ValueError):
            continue
    return samples


def gpu_use(samples: list[tuple[float, float, float]], start: float, end: float) -> dict | None:
    inside = [s for s in samples if start <= s[0] <= end]
    if not inside:
        return None
    return {
        "max_util_pct": max(s[1] for s in inside),
        "max_memory_mib": max(s[2] for s in inside),
        "samples": len(inside),
    }


# --------------------------------------------------------------------------- the report


def read_steps(out: Path) -> list[dict]:
    steps = []
    path = out / "logs" / "steps.tsv"
    for line in path.read_text().splitlines() if path.is_file() else []:
        parts = line.split("\t")
        if len(parts) < 10:
            continue
        name, status, rc, start, end, limit, log, ok, optional, note = parts[:10]
        command = "\t".join(parts[10:])
        steps.append(
            {
                "name": name,
                "status": status,
                "exit_code": int(rc) if rc.lstrip("-").isdigit() else None,
                "start": float(start),
                "end": float(end),
                "seconds": round(float(end) - float(start), 1),
                "timeout_s": int(limit) if limit.isdigit() else None,
                "log": log,
                "ok_codes": [int(c) for c in ok.split(",") if c.strip().lstrip("-").isdigit()],
                "optional": optional == "1",
                "note": note,
                "command": command,
            }
        )
    return steps


def log_tail(path: Path, lines: int = 15) -> list[str]:
    """The log's last lines (ANSI colours removed): where a failed step says why."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [re.sub(r"\x1b\[[0-9;]*m", "", line)[:300] for line in text.splitlines()[-lines:]]


def judge(step: dict) -> str:
    """passed | failed | timed out | skipped."""
    if step["status"] == "skipped":
        return "skipped"
    if step["exit_code"] in (124, 137):
        return "timed out"
    return "passed" if step["exit_code"] in step["ok_codes"] else "failed"


def is_failure(step: dict) -> bool:
    verdict = judge(step)
    return verdict in ("failed", "timed out") or (verdict == "skipped" and not step["optional"])


def _ask(command: list[str], timeout: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``command``'s completed process, its output captured as text; raises OSError (not found) or
    SubprocessError (``timeout`` s passed)."""
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def environment(run: dict, steps: list[dict]) -> dict:
    env = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "report_python": sys.version.split()[0],
        **run,
    }
    doctor = next((s.get("figures") for s in steps if s["name"] == "doctor"), None) or {}
    for key in ("backend", "device_kinds", "device_count", "jax_version", "cuda_version", "cudnn_version"):
        env.setdefault(key, doctor.get(key))
    try:
        smi = _ask(
            ["nvidia-smi", "--query-gpu=name,uuid,driver_version,memory.total", "--format=csv,noheader"], 20
        )
        env["nvidia_smi"] = smi.stdout.strip().splitlines() if smi.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        env["nvidia_smi"] = None
    try:
        commit = _ask(["git", "rev-parse", "HEAD"], 10, cwd=ROOT)
        env["git_commit"] = commit.stdout.strip() or None
        dirty = _ask(["git", "status", "--porcelain", "--untracked-files=no"], 10, cwd=ROOT)
        env["git_dirty"] = bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def bars(steps: list[dict], mode: str) -> list[dict]:
    by = {s["name"]: s.get("figures") or {} for s in steps}
    values = {
        "tune_bf16_vs_fp32": by.get("tune", {}).get("bf16_vs_fp32"),
        "serve_16_vs_1": by.get("serve", {}).get("ratio_16_vs_1"),
    }
    result = []
    for key, (target, what) in BARS.items():
        value = values[key]
        verdict = (
            "n/a on CPU"
            if mode != "gpu"
            else "no figure"
            if value is None
            else "met"
            if value >= target
            else "NOT met"
        )
        result.append({"name": key, "what": what, "value": value, "target": target, "verdict": verdict})
    return result


def checks(steps: list[dict], mode: str) -> list[dict]:
    """Yes/no facts a GPU run must show (none on a CPU run): JAX saw the GPU, the Ray Train worker
    owned it, and the sweep and the Serve replica put memory on it (nvidia-smi samples)."""
    if mode != "gpu":
        return []
    by = {s["name"]: s for s in steps}

    def used_gpu(name: str) -> bool | None:
        use = by.get(name, {}).get("gpu")
        return None if use is None else use["max_memory_mib"] > MIN_GPU_MIB

    facts = [
        (
            "JAX's backend is gpu (doctor)",
            (by.get("doctor", {}).get("figures") or {}).get("backend") == "gpu",
        ),
        (
            "the Ray Train worker logs its GPU's UUID (tune)",
            bool((by.get("tune", {}).get("figures") or {}).get("gpu_uuids")),
        ),
        (f"the sweep put > {MIN_GPU_MIB} MiB on the GPU (tune, nvidia-smi)", used_gpu("tune")),
        (f"the Serve replica put > {MIN_GPU_MIB} MiB on the GPU (serve, nvidia-smi)", used_gpu("serve")),
    ]
    return [
        {"check": what, "verdict": "no samples" if ok is None else "yes" if ok else "NO"}
        for what, ok in facts
    ]


def jax_summary(f: dict) -> str:
    """The JAX line of doctor-style facts: backend, devices, jax, CUDA and cuDNN versions."""
    return (
        f"backend {f.get('backend')}, {f.get('device_count')} x {', '.join(f.get('device_kinds') or [])}, "
        f"jax {f.get('jax_version')}, CUDA {f.get('cuda_version') or '-'}, "
        f"cuDNN {f.get('cudnn_version') or '-'}"
    )


def headline(step: dict) -> str:
    """The step's key figures in one table cell."""
    f, name = step.get("figures") or {}, step["name"]
    if step["status"] == "skipped":
        return step["note"]
    if f.get("error") and name not in ("tune",):
        return f"({f['error']})"
    if name == "doctor":
        return jax_summary(f)
    if name == "precision":
        return "bf16/fp32: " + ", ".join(
            f"{w} {fmt(v, '.2f')}x" for w, v in f.get("bf16_vs_fp32", {}).items()
        )
    if name == "tune":
        t = f.get("trials") or {}
        parts = [f"{d} {fmt((t.get(d) or {}).get('tokens_per_sec'))} tok/s" for d in ("float32", "bfloat16")]
        return (
            ", ".join(parts)
            + f", bf16/fp32 {fmt(f.get('bf16_vs_fp32'), '.2f')}x; GPU line: {f.get('gpu_line')}"
            + (f" ({f['error']})" if f.get("error") else "")
        )
    if name == "serve":
        return (
            f"{fmt(f.get('new_tokens_per_s_1'))} / {fmt(f.get('new_tokens_per_s_16'))} new tok/s at 1 / 16 "
            f"clients: {fmt(f.get('ratio_16_vs_1'), '.2f')}x; 5xx {f.get('errors_5xx')}, "
            f"dropped {f.get('dropped')}"
        )
    if name.startswith("compile-"):
        return (
            f"peak {mib(f.get('peak_bytes'))}, temp {mib(f.get('temp_bytes'))}, fits {fmt(f.get('fits'))}, "
            f"scatter {json.dumps(f.get('scatter'))}, custom calls {json.dumps(f.get('custom_calls'))}, "
            f"compile {fmt(f.get('compile_s'), '.1f')} s"
        )
    if name.startswith("pytest"):
        return f.get("result") or "-"
    if name == "decode":
        kv = f.get("kv_tokens_per_sec") or {}
        return (
            ", ".join(f"batch {b} {fmt(v)} tok/s" for b, v in kv.items())
            + f"; KV / full recompute {fmt(f.get('kv_vs_full'), '.1f')}x"
        )
    if name == "attention":
        return ", ".join(
            f"{r['requested']}->{r['ran'] or 'refused'} {fmt(r['tokens_per_sec'])}" for r in f.get("rows", [])
        )
    if name == "batch-sweep":
        return (
            f"{f.get('workload')}: best {fmt(f.get('best_throughput'))} "
            f"at batch {f.get('best_global_batch')}, max MFU {fmt(f.get('max_mfu'), '.1%')}"
        )
    if name.startswith("throughput"):
        return (
            f"{fmt(f.get('tokens_per_sec'))} tok/s, {fmt(f.get('ms_per_step'), '.1f')} ms/step, "
            f"MFU {fmt(f.get('mfu'), '.1%')}, {fmt(f.get('params'))} params"
        )
    return ""


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def details(step: dict) -> list[str]:
    """Markdown lines with the step's figures in full (tables where there are rows)."""
    f, name = step.get("figures") or {}, step["name"]
    lines = [
        f"### {name}",
        "",
        f"`{cell(step['command'])}`",
        "",
        f"{judge(step)}; exit {step['exit_code']}; {step['seconds']} s (timeout {step['timeout_s']} s); "
        f"log `{step['log']}`" + (f"; {step['note']}" if step["note"] else ""),
        "",
    ]
    if step.get("gpu"):
        g = step["gpu"]
        lines += [
            f"GPU while it ran: up to {g['max_util_pct']:.0f} % utilization, {g['max_memory_mib']:,.0f} MiB "
            f"used ({g['samples']} samples).",
            "",
        ]
    if f.get("error"):
        lines += [f"Figures: {f['error']}.", ""]
    if step.get("log_tail"):
        lines += ["Last lines of the log:", "", "```"] + step["log_tail"] + ["```", ""]
    if name in ("precision", "batch-sweep") and f.get("rows"):
        keys = (
            [
                "workload",
                "dtype",
                "throughput",
                "unit",
                "ms_per_step",
                "mfu",
                "test_accuracy",
                "val_loss",
                "problem",
            ]
            if name == "precision"
            else ["global_batch", "throughput", "unit", "mfu", "problem"]
        )
        lines += table(f["rows"], keys)
    elif name == "attention" and f.get("rows"):
        lines += table(f["rows"], ["requested", "ran", "dtype", "tokens_per_sec", "mfu", "note"])
    elif name == "decode" and f.get("rows"):
        lines += table(f["rows"], ["sampler", "batch", "tokens_per_sec", "problem"])
    elif name == "serve" and f.get("levels"):
        lines += table(
            [{"clients": c, **v} for c, v in f["levels"].items()],
            ["clients", *SERVE_LEVEL_KEYS],
        )
    elif name == "tune":
        trials = f.get("trials") or {}
        flat = [
            {
                "dtype": d,
                **{k: v for k, v in t.items() if k != "compile_json"},
                "compile_json_peak_bytes": (t.get("compile_json") or {}).get("peak_bytes"),
                "compile_json_scatter": (t.get("compile_json") or {}).get("scatter"),
            }
            for d, t in trials.items()
        ]
        if flat:
            lines += table(
                flat,
                [
                    "dtype",
                    "trial",
                    "tokens_per_sec",
                    "ms_per_step",
                    "compile_s",
                    "val_loss",
                    "peak_bytes_per_device",
                    "compile_json_peak_bytes",
                    "compile_json_scatter",
                    "error",
                ],
            )
        lines += (
            [f"Worker lines ({len(f.get('worker_lines', []))}):", ""]
            + [f"    {line}" for line in f.get("worker_lines", [])[:8]]
            + [""]
        )
    rest = {k: v for k, v in f.items() if k not in ("rows", "levels", "trials", "worker_lines", "error")}
    if rest:
        lines += ["```json", json.dumps(rest, indent=1, sort_keys=True), "```", ""]
    return lines


def table(rows: list[dict], keys: list[str]) -> list[str]:
    def show(key: str, v: Any) -> str:
        if key == "mfu" and num(v) is not None:
            return f"{v:.1%}"
        if "bytes" in key and num(v) is not None:
            return mib(v)
        if isinstance(v, float):
            return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
        if isinstance(v, (dict, list)):
            return json.dumps(v)
        return fmt(v)

    out = ["| " + " | ".join(keys) + " |", "|" + "|".join("---" for _ in keys) + "|"]
    out += ["| " + " | ".join(cell(show(k, r.get(k))) for k in keys) + " |" for r in rows]
    return out + [""]


def render(doc: dict) -> str:
    env, steps = doc["environment"], doc["steps"]
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(env.get("started", 0)))
    lines = [
        f"# GPU check ({env.get('mode')} run, {started})",
        "",
        f"{doc['result']}: {len(steps)} steps, {doc['failed']} failed; {doc['total_seconds']:.0f} s in all "
        f"(budget {env.get('budget_s')} s).",
        "",
    ]
    smi = env.get("nvidia_smi")
    lines += [
        f"- host {env.get('host')}, {env.get('platform')}",
        f"- GPUs: {'; '.join(smi) if smi else 'none (nvidia-smi not available)'}",
        f"- JAX: {jax_summary(env)}",
        f"- python: {env.get('python')} ({env.get('python_version')}); "
        f"PYTHONPATH {env.get('pythonpath') or '-'}; bundle {env.get('bundle') or '-'}",
        f"- data: {env.get('data_dir')}; work folder (checkpoints): {env.get('work_dir')}",
        f"- commit {env.get('git_commit') or '-'}{' (with local changes)' if env.get('git_dirty') else ''}",
        "",
    ]
    lines += ["| step | result | exit | s | key figures |", "|---|---|---|---|---|"]
    for s in steps:
        lines.append(
            f"| {s['name']} | {judge(s)} | {'' if s['exit_code'] is None else s['exit_code']} | "
            f"{s['seconds']:.0f} | {cell(headline(s))} |"
        )
    lines += ["", "## Bars", "", "| figure | value | target | verdict |", "|---|---|---|---|"]
    for b in doc["bars"]:
        lines.append(f"| {b['what']} | {fmt(b['value'], '.2f')}x | >= {b['target']:g}x | {b['verdict']} |")
    if doc.get("checks"):
        lines += ["", "## Checks", "", "| check | verdict |", "|---|---|"]
        lines += [f"| {c['check']} | {c['verdict']} |" for c in doc["checks"]]
    lines += ["", "## Steps", ""]
    for s in steps:
        lines += details(s)
    return "\n".join(lines) + "\n"


def report(out: Path) -> int:
    run = load_json(out / "logs" / "run.json") or {}
    mode = run.get("mode", "gpu")
    samples = gpu_samples(out)
    steps = read_steps(out)
    for s in steps:
        if s["status"] == "ran":
            s["figures"] = figures_for(s["name"], out / s["log"], out, mode)
            s["gpu"] = gpu_use(samples, s["start"], s["end"])
        s["result"] = judge(s)
        if s["result"] in ("failed", "timed out"):
            s["log_tail"] = log_tail(out / s["log"])
    failed = [s["name"] for s in steps if is_failure(s)]
    started = run.get("started") or (steps[0]["start"] if steps else time.time())
    doc = {
        "written_by": "scripts/gpu-check.sh",
        "result": "FAILED" if failed else "passed",
        "failed": len(failed),
        "failed_steps": failed,
        "total_seconds": round(max([s["end"] for s in steps] or [time.time()]) - started, 1),
        "environment": environment(run, steps),
        "steps": steps,
    }
    doc["bars"] = bars(steps, mode)
    doc["checks"] = checks(steps, mode)
    (out / "gpu-check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    (out / "gpu-check.md").write_text(render(doc))
    print(
        f"[gpu-check] {doc['result']}: {len(steps)} steps, {len(failed)} failed"
        + (f" ({', '.join(failed)})" if failed else "")
        + f"; {out / 'gpu-check.md'}"
    )
    return 1 if failed else 0


def exec_with_default_sigint(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    os.execvp(argv[0], argv)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "exec":
        exec_with_default_sigint(argv[1:])
    if len(argv) == 2 and argv[0] == "report":
        return report(Path(argv[1]))
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
