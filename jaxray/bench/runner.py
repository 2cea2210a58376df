"""Runs a parsed ``python -m jaxray.bench`` command: builds the sizes, runs suites, writes reports."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Callable, Optional

import jax

from jaxray.bench import compare, suites
from jaxray.bench.output import Report, render, write_report
from jaxray.bench.presets import PRESETS
from jaxray.bench.throughput import make_spec

OutFn = Callable[[argparse.Namespace, str], Optional[Path]]


def _write(report: Report, out: Optional[Path], echo: bool = True) -> None:
    if out is None:
        if echo:
            print(render(report))
        return
    write_report(report, out, echo)


def _throughput(args: argparse.Namespace, out: Optional[Path]) -> int:
    size = {"workload": args.workload, "global_batch": args.batch, "steps": args.steps, "repeats": args.repeats,
            "warmup": args.warmup, "dtype": args.dtype, "width": args.width, "seq_len": args.seq_len,
            "devices": args.devices, "step": args.step, "steps_per_call": args.steps_per_call}
    if args.workload == "transformer":
        size["attention"] = args.attention
    make_spec(**size, data_dir=args.data_dir)  # a bad size fails here, before any data or compile
    report = suites.throughput(size, args.data_dir)
    _write(report, out, echo=not args.json)
    row = report.rows[0]
    if row.get("error"):
        raise RuntimeError(row["error"])
    print(json.dumps({"impl": "jaxray", **{k: v for k, v in row.items() if k != "ms_per_step_repeats"}}))
    return 0


def _compare(args: argparse.Namespace, out: Optional[Path]) -> int:
    if not args.reference.is_file():
        raise FileNotFoundError(f"--reference {args.reference}: no such file")
    workload = args.workload or compare.infer_workload(args.reference)
    report = compare.compare(args.reference, workload, args.batch or compare.DEFAULT_BATCH[workload],
                             args.steps or compare.DEFAULT_STEPS[workload], args.pairs, args.dtype, args.data_dir)
    _write(report, out)
    return 0


def _suite(name: str, args: argparse.Namespace, out: Optional[Path]) -> Report:
    preset, devices = PRESETS[args.preset], len(jax.devices())
    if name == "throughput":
        report = suites.throughput(preset.throughput, args.data_dir)
    elif name == "batch-sweep":
        report = suites.batch_sweep(preset, args.data_dir, devices, getattr(args, "batches", None))
    else:
        report = suites.SUITES[name](preset, args.data_dir, devices)
    _write(report, out)
    return report


def run(args: argparse.Namespace, out_for: OutFn) -> int:
    """Run ``args.command``; returns the exit code (1 if a case failed unexpectedly).

    Raises ConfigError/ValueError for sizes that cannot run, before compiling.
    """
    if args.command == "throughput":
        return _throughput(args, out_for(args, "throughput"))
    if args.command == "compare":
        return _compare(args, out_for(args, "compare"))
    names = [*suites.SUITES, "throughput"] if args.command == "all" else [args.command]
    base = out_for(args, "all") if args.command == "all" else None
    start, failed = time.perf_counter(), []
    for name in names:
        out = (base / name if base else None) if args.command == "all" else out_for(args, name)
        report = _suite(name, args, out)
        # A batch size that fails is a finding the sweep reports; anywhere else a failure is a bug.
        failed += [] if name == "batch-sweep" else [f"{name}: {r['case']}: {r['error']}" for r in report.failed]
    if args.command == "all":
        print(f"all benchmarks finished in {time.perf_counter() - start:.0f} s on {jax.devices()[0].device_kind}")
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0

