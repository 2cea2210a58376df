"""Runs a parsed ``python -m jaxray.bench`` command: builds the sizes, runs suites, writes reports."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import jax

from jaxray.bench import checkpointing, compare, decode, serving, suites
from jaxray.bench.output import WRITER, Report, render, write_report
from jaxray.bench.presets import MODEL_SIZES, PRESETS
from jaxray.bench.suites import suite_sizes
from jaxray.bench.throughput import make_spec
from jaxray.data.manifest import read_manifest
from jaxray.inference.sampling import check_sampling, encode_prompt, prompt_window
from jaxray.parallel.mesh import make_mesh
from jaxray.reporting.format import json_safe
from jaxray.runs import check_overwrite
from jaxray.train import compile_report

OutFn = Callable[[argparse.Namespace, str], Path | None]
# The learning path's sampler script: beside the checkout, or beside the data folder.
SAMPLER_SCRIPT = "reference_generate.py"
COMPILE_WRITER = "jaxray.bench compile"


def _sampler_script() -> Path | None:
    data = os.environ.get("JAXRAY_DATA_DIR")
    places = [Path("../shared/bench"), *([Path(data).parent / "bench"] if data else [])]
    return next((p / SAMPLER_SCRIPT for p in places if (p / SAMPLER_SCRIPT).is_file()), None)


def _write(report: Report, out: Path | None, echo: bool = True) -> None:
    """Print and (with ``out``) write ``report``. A report where no case was measured is printed but
    never written: it must not replace earlier results in ``out``. Raises RuntimeError then."""
    measured = [r for r in report.rows if not r.get("error") and not r.get("skipped")]
    if out is None or not measured:
        if echo:
            print(render(report))
        if not measured:
            kept = f"; {out} was left as it was" if out is not None else ""
            first = next((r.get("error") or r.get("skipped") for r in report.rows), "no cases")
            raise RuntimeError(f"no case of {report.name} could be measured{kept} (first: {first})")
        return
    write_report(report, out, echo)


def throughput_size(args: argparse.Namespace) -> dict:
    """``make_spec`` arguments from ``throughput``'s (or ``compile``'s) options: the ``--model-preset`` shape
    (``presets.MODEL_SIZES``), then every option given. Raises ValueError for a transformer-only
    option with another workload."""
    size = {
        "workload": args.workload,
        "global_batch": args.batch,
        "dtype": args.dtype,
        "width": args.width,
        "devices": args.devices,
    }
    # Timing options (``compile`` has none: it only compiles).
    size.update({k: getattr(args, k, None) for k in ("steps", "repeats", "warmup", "step", "steps_per_call")})
    transformer_only = {
        "seq_len": args.seq_len,
        "attention": args.attention,
        "model_preset": args.model_preset,
    }
    given = [f"--{k.replace('_', '-')}" for k, v in transformer_only.items() if v is not None]
    if args.workload != "transformer" and given:
        raise ValueError(f"{', '.join(given)} applies to --workload transformer only, not {args.workload}")
    size.update({k: v for k, v in transformer_only.items() if k != "model_preset"})
    return {**MODEL_SIZES.get(args.model_preset, {}), **{k: v for k, v in size.items() if v is not None}}


def _throughput(args: argparse.Namespace, out: Path | None) -> int:
    size = throughput_size(args)
    suites.preload([size], args.data_dir)  # validates the size, then reads the data, before any compile
    report = suites.throughput(size, args.data_dir)
    row = report.rows[0]
    if row.get("error"):  # nothing measured: say why, and leave earlier results in --out alone
        raise RuntimeError(row["error"])
    _write(report, out, echo=not args.json)
    line = {"impl": "jaxray", **{k: v for k, v in row.items() if k != "ms_per_step_repeats"}}
    print(json.dumps(json_safe(line)))  # a NaN loss becomes null: the line stays valid JSON
    return 0


def _compile(args: argparse.Namespace, out: Path | None) -> int:
    """The compile report of one config (``jaxray.train.compile_report.report_for``): printed, and
    written to ``out/compile.json``. Needs no data: the step is compiled from shapes."""
    size = throughput_size(args)
    spec = make_spec(
        **{k: v for k, v in size.items() if k not in ("steps", "repeats", "warmup", "step", "steps_per_call")}
    )
    if spec.devices > len(jax.devices()):
        raise ValueError(
            f"--devices {spec.devices} is more than the {len(jax.devices())} available"
            + ("; add --cpu-devices N to force N host devices" if jax.devices()[0].platform == "cpu" else "")
        )
    target = out / "compile.json" if out is not None else None
    if out is not None:  # a trial's train/<trial>/compile.json records what that trial ran: never replace it
        check_overwrite(out, COMPILE_WRITER, "compile.json")
    report = json_safe(compile_report.report_for(spec.trial, make_mesh(jax.devices()[: spec.devices])))
    if target is not None:
        target.write_text(json.dumps({"written_by": COMPILE_WRITER, **report}, indent=2) + "\n")
    print(json.dumps(report) if args.json else compile_report.render(report))
    return 0


def _compare(args: argparse.Namespace, out: Path | None) -> int:
    if not args.reference.is_file():
        raise FileNotFoundError(f"--reference {args.reference}: not a file")
    workload = args.workload or compare.infer_workload(args.reference)
    compare.check(workload, args.dtype)
    suites.preload([{"workload": workload}], args.data_dir)  # jaxray's side can read its data
    report = compare.compare(
        args.reference,
        workload,
        args.batch or compare.DEFAULT_BATCH[workload],
        args.steps or compare.DEFAULT_STEPS[workload],
        args.pairs,
        args.dtype,
        args.data_dir,
        args.timeout,
    )
    _write(report, out)
    return 0


def _serve(args: argparse.Namespace, out: Path | None) -> int:
    """The Serve app under HTTP load; 1 when any level saw a 5xx or a dropped connection."""
    report, log = serving.run(args)
    _write(report, out)
    if out is not None and log is not None:
        shutil.copy(log, out / "serve.log")
    bad = [r for r in report.rows if r.get("errors_5xx") or r.get("dropped")]
    for r in bad:
        print(
            f"failed: {r['case']}: {r['errors_5xx']} 5xx, {r['dropped']} dropped (first: {r['first_error']})"
        )
    return 1 if bad else 0


def _decode(args: argparse.Namespace, out: Path | None) -> int:
    check_sampling(args.new_tokens, args.temperature, None)
    prompt_window(encode_prompt(args.prompt), 1)
    if args.reference is not None and not args.reference.is_file():
        raise FileNotFoundError(f"--reference {args.reference}: not a file")
    report = decode.decode_benchmark(
        args.new_tokens,
        tuple(args.batch_sizes),
        args.repeats,
        args.prompt,
        args.temperature,
        args.reference or _sampler_script(),
        args.checkpoint,
        args.timeout,
    )
    _write(report, out)
    return 1 if report.failed else 0


def _ingest(args: argparse.Namespace, out: Path | None) -> int:
    from jaxray.bench import ingest  # imports Ray Data (about 1.5 s): only this command needs it

    workloads = ["mlp", "transformer"] if args.workload in (None, "all") else [args.workload]
    seq_len = args.seq_len
    if args.parquet is not None:
        manifest = read_manifest(args.parquet)
        dataset, seq_len = manifest.dataset, seq_len or manifest.seq_len
        if seq_len != (manifest.seq_len or seq_len):
            raise ValueError(
                f"--seq-len {seq_len}: --parquet {args.parquet} holds sequences of {manifest.seq_len}"
            )
        workload = next(w for w, d in ingest.DATASET.items() if d == dataset)
        if args.workload not in (None, workload):
            raise ValueError(
                f"--parquet {args.parquet} holds {dataset}, the data of --workload {workload}, "
                f"not {args.workload}"
            )
        workloads = [workload]
    if args.seq_len is not None and "transformer" not in workloads:
        raise ValueError("--seq-len applies to the transformer only")
    sizes = [
        ingest.size_for(w, args.batch, args.warmup, args.steps, args.repeats, seq_len) for w in workloads
    ]
    suites.preload([{"workload": s.workload, "seq_len": s.seq_len} for s in sizes], args.data_dir)
    report = ingest.ingest_benchmark(sizes, args.parquet, args.data_dir, args.prefetch_batches)
    _write(report, out)
    return 1 if report.failed else 0


def _checkpoint(args: argparse.Namespace, out: Path | None) -> int:
    workloads = ["mlp", "transformer"] if args.workload == "all" else [args.workload]
    runs = [
        checkpointing.CostRun(
            w,
            args.batch or (16 if w == "transformer" else 512),
            args.steps or 2 * args.every + 1,
            args.every,
            args.width or (128 if w == "transformer" else None),
            args.seq_len,
        )
        for w in workloads
    ]
    report = checkpointing.checkpoint_benchmark(runs, args.repeats, args.data_dir)
    _write(report, out)
    return 1 if report.failed else 0


def _suite(name: str, args: argparse.Namespace, out: Path | None) -> Report:
    preset, devices = PRESETS[args.preset], len(jax.devices())
    if name == "throughput":
        report = suites.throughput(preset.throughput, args.data_dir)
    elif name == "batch-sweep":
        report = suites.batch_sweep(preset, args.data_dir, devices, getattr(args, "batches", None))
    else:
        report = suites.SUITES[name](preset, args.data_dir, devices)
    _write(report, out)
    return report


def _outs(args: argparse.Namespace, out_for: OutFn) -> dict[str, Path | None]:
    """{benchmark name: output folder or None}, each checked up front so that no run can replace a
    summary.json another tool wrote (a sweep's ``runs/<experiment>``, an evaluation)."""
    if args.command == "all":
        base = out_for(args, "all")
        outs = {name: base / name if base else None for name in [*suites.SUITES, "throughput"]}
    else:
        outs = {args.command: out_for(args, args.command)}
    for name, out in outs.items():
        if out is not None:
            check_overwrite(out, f"{WRITER} {name}")
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise ValueError(f"--out {out} cannot be a results folder: {err}") from None
    return outs


def run(args: argparse.Namespace, out_for: OutFn) -> int:
    """Run ``args.command``; returns the exit code (1 if a case failed unexpectedly).

    Raises ConfigError/ValueError for sizes that cannot run or an ``--out`` holding another
    tool's summary.json, before compiling.
    """
    outs = _outs(args, out_for)
    one_report = {
        "throughput": _throughput,
        "compare": _compare,
        "compile": _compile,
        "serve": _serve,
        "decode": _decode,
        "ingest": _ingest,
        "checkpoint": _checkpoint,
    }
    if args.command in one_report:
        return one_report[args.command](args, outs[args.command])
    suites.preload([size for name in outs for size in suite_sizes(PRESETS[args.preset], name)], args.data_dir)
    start, failed, texts = time.perf_counter(), [], []
    for name, out in outs.items():
        try:
            report = _suite(name, args, out)
        except RuntimeError as err:  # nothing of this suite ran: note it, keep the others going
            failed.append(f"{name}: {err}")
            continue
        texts.append(render(report))
        # A batch size that fails is a finding the sweep reports; anywhere else a failure is a bug.
        failed += (
            [] if name == "batch-sweep" else [f"{name}: {r['case']}: {r['error']}" for r in report.failed]
        )
    if args.command == "all":
        took = time.perf_counter() - start
        done = f"all benchmarks finished in {took:.0f} s on {jax.devices()[0].device_kind}"
        print(done)
        base = next(iter(outs.values()))
        if base is not None:  # every table in one file, beside the per-benchmark folders
            (base.parent / "all.md").write_text("\n".join(texts) + f"\n{done}\n")
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0
