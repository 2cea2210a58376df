"""Runs a parsed ``python -m jaxray.bench`` command (imports JAX: after ``--cpu-devices`` is applied)."""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import jax

from jaxray.bench import check, checkpointing, compare, compile_step, engine_load, load, suites
from jaxray.bench.presets import MODEL_SIZES, PRESETS
from jaxray.bench.report import WRITER, Report, render, write_report
from jaxray.bench.throughput import TIMING, check_device_count, make_spec
from jaxray.folders import check_overwrite, removed_if_failed
from jaxray.parallel.mesh import trial_mesh
from jaxray.reporting.format import json_safe
from jaxray.train import compile_cache


def throughput_size(args: argparse.Namespace) -> dict:
    """``make_spec`` arguments: the ``--model-preset`` shape, then every option given."""
    lm_only = {"seq_len": args.seq_len, "attention": args.attention, "model_preset": args.model_preset,
               "num_heads": args.num_heads, "remat": args.remat,
               "scan_layers": args.scan_layers or None}  # fmt: skip
    given = [f"--{k.replace('_', '-')}" for k, v in lm_only.items() if v is not None]
    if args.workload != "transformer" and given:
        raise ValueError(f"{', '.join(given)} applies to --workload transformer only, not {args.workload}")
    size = {"workload": args.workload, "global_batch": args.batch, "dtype": args.dtype, "width": args.width}
    size |= {"devices": args.devices, "mesh": args.mesh} | lm_only
    size.pop("model_preset")
    size |= {k: getattr(args, k, None) for k in TIMING}
    return MODEL_SIZES.get(args.model_preset, {}) | {k: v for k, v in size.items() if v is not None}


def _throughput(args, out) -> int:
    suites.preload([size := throughput_size(args)], args.data_dir)
    report = suites.throughput(size, args.data_dir)
    write_report(report, out, echo=not args.json)
    print(json.dumps(json_safe({"impl": "jaxray", **report.rows[0], "ms_per_step_repeats": None})))
    return 0


def _compile(args, out) -> int:
    """XLA's compile report of one config (no data, no training); written to out/compile.json."""
    spec = make_spec(**{k: v for k, v in throughput_size(args).items() if k not in TIMING})
    check_device_count(spec.devices)
    mesh = trial_mesh(spec.trial, jax.devices()[: spec.devices])
    report = json_safe(compile_step.report_for(spec.trial, mesh))
    if out is not None:
        (out / "compile.json").write_text(json.dumps({"written_by": f"{WRITER} compile", **report}, indent=2))
    print(json.dumps(report) if args.json else compile_step.render(report))
    return 0


def _ingest(args) -> Report:
    from jaxray.bench import ingest  # imports Ray Data (seconds): only this command needs it

    sizes = ingest.sizes_for(args)
    suites.preload([{"workload": s.workload, "seq_len": s.seq_len} for s in sizes], args.data_dir)
    return ingest.ingest_benchmark(args, sizes)


def _suites(args, outs: dict[str, Path | None]) -> int:
    """Every suite of ``outs`` in turn; one that measured nothing does not stop the others."""
    preset, devices, start = PRESETS[args.preset], len(jax.devices()), time.perf_counter()
    failed, texts = [], []
    suites.preload([s for name in outs for s in suites.suite_sizes(preset, name)], args.data_dir)
    for name, out in outs.items():
        if name == "throughput":
            report = suites.throughput(preset.throughput, args.data_dir)
        elif name == "batch-sweep":
            report = suites.batch_sweep(preset, args.data_dir, devices, getattr(args, "batches", None))
        else:
            report = suites.SUITES[name](preset, args.data_dir, devices)
        try:
            write_report(report, out)
        except RuntimeError as err:
            failed.append(f"{name}: {err}")
            continue
        texts.append(render(report))
        if name != "batch-sweep":  # a batch size that fails is the sweep's finding
            failed += [f"{name}: {r['case']}: {r['error']}" for r in report.failed]
    if args.command == "all":
        done = f"all benchmarks took {time.perf_counter() - start:.0f} s on {jax.devices()[0].device_kind}"
        print(done)
        if (base := next(iter(outs.values()))) is not None:
            (base.parent / "all.md").write_text("\n".join(texts) + f"\n{done}\n")
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0


REPORTS = {"compare": compare.compare, "decode": compare.decode_benchmark, "ingest": _ingest,
           "serve": load.serve_report, "engine": engine_load.engine_report,
           "checkpoint": checkpointing.checkpoint_benchmark, "check": check.check}  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Run ``args.command``; its exit code. Every ``--out`` is checked first (``folders.check_overwrite``);
    when the run raises, the folders it made for them and left empty are removed."""
    if args.command == "check":  # its parts refused before any folder is made
        check.check_parts(args)
    if hasattr(args, "compile_cache"):
        compile_cache.enable(args.compile_cache)
    base = None if args.out == "" else Path(args.out or f"runs/bench/{args.command}")
    names = [*suites.SUITES, "throughput"] if args.command == "all" else [args.command]
    outs = {name: (base / name if args.command == "all" else base) if base else None for name in names}
    with contextlib.ExitStack() as made:  # a failed run's folders made here and still empty go again
        for name, out in outs.items():
            if out is not None:
                made.enter_context(removed_if_failed(out))
                written = "compile.json" if name == "compile" else "summary.json"
                check_overwrite(out, f"{WRITER} {name}", written)
                try:
                    out.mkdir(parents=True, exist_ok=True)
                except OSError as err:
                    raise ValueError(f"--out {out} cannot be a results folder: {err}") from None
        return _run(args, outs)


def _run(args: argparse.Namespace, outs: dict[str, Path | None]) -> int:
    if args.command in ("throughput", "compile"):
        return (_throughput if args.command == "throughput" else _compile)(args, outs[args.command])
    if args.command not in REPORTS:
        return _suites(args, outs)
    write_report(report := REPORTS[args.command](args), outs[args.command])
    bad = [r for r in report.rows if r.get("errors_5xx") or r.get("dropped")]  # serve, engine: any fails
    for r in bad:
        print(f"failed: {r['case']}: {r['errors_5xx']} 5xx, {r['dropped']} dropped; {r['first_error']}")
    for r in report.failed if args.command == "check" else ():  # the others' are in their tables
        print(f"failed: {r['case']}: {r['error']}")
    return 1 if report.failed or bad else 0
