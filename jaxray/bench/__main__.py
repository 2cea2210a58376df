"""``python -m jaxray.bench NAME``: the learning path's measurements; ``--help`` lists them. E.g.
``all --preset gpu``, or ``serve --url http://127.0.0.1:8000`` against a running ``python -m jaxray.serve``.
``--cpu-devices N`` sets XLA_FLAGS before JAX is imported, so a CPU shows N devices."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from urllib.parse import urlsplit

import jaxray.argtypes as at
from jaxray.bench.presets import MODEL_SIZES  # imports no JAX, nor does anything above
from jaxray.config import DTYPES, REMATS, WORKLOADS, Attention
from jaxray.data.sources import DataFileError
from jaxray.inference.settings import OPTIONS as ENGINE_OPTIONS
from jaxray.inference.settings import add_engine_options  # imports neither JAX nor Ray

SUITE_NAMES = ("dispatch", "precision", "devices", "shard-map", "batch-sweep", "attention")
MULTI_DEVICE = {"devices", "shard-map", "batch-sweep", "all"}
STEPS, ALL, ATTENTION = ("jit", "shard_map", "eager"), ("mlp", "transformer", "all"), Attention.__args__
INT, INTS, COUNT, RATE = at.positive_int, at.positive_int_list, at.non_negative_int, at.non_negative_float
FOLDER, SECONDS = at.folder, at.positive_float


def url(text: str) -> str:
    """An ``http(s)://HOST:PORT`` base URL (argparse type)."""
    with contextlib.suppress(ValueError):  # urlsplit and .port raise on malformed text
        p = urlsplit(text)
        if p.scheme in ("http", "https") and p.hostname and p.path in ("", "/") and p.port:
            return text
    raise argparse.ArgumentTypeError(f"expected http://HOST:PORT, got {text!r}")


def prompt(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("the prompt is empty")
    return text


def _add(p: argparse.ArgumentParser, *options: tuple) -> argparse.ArgumentParser:
    for flag, kind, default, text in options:
        how = {"choices": kind} if isinstance(kind, tuple) else {"type": kind}
        how = {"action": "store_true"} if kind is bool else how | {"default": default}
        p.add_argument(flag, help=text, **how)
    return p


# (flag, type | choices tuple | bool for a switch, default, help)
# fmt: off
OUT = [("--out", str, None, "results folder (default runs/bench/NAME); '' writes nothing")]
COMMON = [("--data-dir", FOLDER, None, "data folder (default JAXRAY_DATA_DIR)"),
          ("--cpu-devices", at.cpu_device_count, None, "CPU devices (multi-device: 4)"),
          ("--compile-cache", str, None, "JAX compilation cache folder ('' off; default "
           "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/jaxray/jax-compilation-cache)")]
SIZED = [("--preset", ("cpu", "gpu", "tiny"), "cpu", "sizes: 2-core CPU, the learning path's, seconds")]
MODEL = [("--workload", WORKLOADS, "transformer", None), ("--dtype", DTYPES, "float32", None),
         ("--batch", INT, 16, "global batch"), ("--width", INT, None, "width or d_model"),
         ("--seq-len", INT, None, "(default 256)"), ("--devices", INT, 1, None), ("--json", bool, None, None),
         ("--mesh", at.mesh_sizes, None, "data=D,fsdp=F,tensor=T over --devices (default: all data)"),
         ("--model-preset", tuple(MODEL_SIZES), None, "options win"), ("--attention", ATTENTION, None, None),
         ("--num-heads", INT, None, None), ("--remat", REMATS, None, None),
         ("--scan-layers", bool, None, None)]
LOAD = [("--clients", INTS, (1, 4, 16, 64), None), ("--duration", SECONDS, 20.0, "s per level"),
        ("--max-new-tokens", INT, 64, None), ("--prompt", prompt, "ROMEO:", ""), ("--top-k", INT, None, None),
        ("--temperature", RATE, 0.8, None), ("--seed", COUNT, 0, None),
        ("--prompt-bytes", COUNT, 0, "random prompts of this many bytes instead of --prompt"),
        ("--shared-bytes", COUNT, 0, "with --prompt-bytes: each level twice, random prompts then "
         "prompts sharing their first this many bytes (prefix caching's TTFT)"),
        ("--long-clients", COUNT, 0, "more clients sending --long-bytes prompts meanwhile (chunked prefill)"),
        ("--long-bytes", INT, 1000, "their prompts' bytes")]
COMMANDS = {  # name: (help, options); all but serve also take COMMON
    **{name: (f"the {name} suite", SIZED) for name in SUITE_NAMES},
    "batch-sweep": ("throughput vs global batch", [*SIZED, ("--batches", INTS, None, None)]),
    "all": ("every suite", SIZED),
    "check": ("the accelerator check: a sweep under Ray where it is installed, then attention, steps and "
              "a profile in this process", [*SIZED, ("--only", at.name_list, None,
              "parts to run (sweep, attention, lab7_f32, ...)"), ("--sweep", str, None,
              "a jaxray.tune config run first under Ray (default: the preset's, in the checkout's "
              "tune_configs/; '' none)")]),
    "throughput": ("one workload at one config", [*MODEL, ("--steps", INT, 10, "timed steps a repeat"),
        ("--repeats", INT, 3, None), ("--warmup", COUNT, 1, None), ("--step", STEPS, "jit", None),
        ("--steps-per-call", INT, 1, "optimizer steps a dispatch")]),
    "compile": ("XLA's compile report of one config's step", MODEL),
    "compare": ("jaxray vs a reference script, A B A B", [("--reference", str, None, "the script"),
        ("--workload", ("mlp", "transformer"), None, "default: from the script's name"),
        ("--batch", INT, None, "default 16 transformer, 512 MLP"), ("--steps", INT, None, "default 10 / 100"),
        ("--pairs", INT, 3, ""), ("--dtype", DTYPES[:2], "float32", ""), ("--timeout", INT, 900, "s a run")]),
    "decode": ("KV-cache sampler vs full-window recompute", [("--new-tokens", INT, 300, None),
        ("--batch-sizes", INTS, (1, 16), None), ("--repeats", INT, 3, None), ("--prompt", str, "ROMEO:", ""),
        ("--temperature", RATE, 0.8, None), ("--checkpoint", FOLDER, None, "default: new weights"),
        ("--reference", str, None, "the notebook's sampler script"), ("--timeout", INT, 900, None),
        ("--profile", bool, False, "each KV row's decode program: HLO op counts and a jax.profiler trace")]),
    "ingest": ("pre-staged batches vs Ray Data from Parquet", [("--workload", ALL, None, "default: all"),
        ("--parquet", FOLDER, None, "a python -m jaxray.data prepare folder"), ("--batch", INT, None, None),
        ("--steps", INT, None, None), ("--warmup", COUNT, None, None), ("--repeats", INT, 3, None),
        ("--seq-len", INT, None, None), ("--prefetch-batches", COUNT, 2, None)]),
    "checkpoint": ("checkpoint size, save/restore s, cost every N steps", [("--every", INT, 100, ""),
        ("--workload", ALL, "transformer", ""), ("--steps", INT, None, "default 2 x --every + 1"),
        ("--batch", INT, None, None), ("--seq-len", INT, 128, None), ("--width", INT, None, None),
        ("--repeats", INT, 3, None)]),
    "serve": ("HTTP load on a running python -m jaxray.serve", [("--url", url, "http://127.0.0.1:8000", None),
        ("--timeout", SECONDS, 120.0, "s before a request counts as dropped"), *LOAD]),
    "engine": ("serve's load on the serving engine in this process: no HTTP, no Ray",
               [("--checkpoint", FOLDER, None, "a trained transformer (runs/<experiment>)"), *LOAD]),
}
# fmt: on


def build_parser() -> argparse.ArgumentParser:
    p = at.cli_parser("python -m jaxray.bench", "The learning path's measurements.")
    sub = p.add_subparsers(dest="command", required=True)
    out, common = (_add(argparse.ArgumentParser(add_help=False), *opts) for opts in (OUT, COMMON))
    for name, (text, options) in COMMANDS.items():
        parents = [out] if name == "serve" else [out, common]
        parser = sub.add_parser(name, help=text, parents=parents, formatter_class=p.formatter_class)
        _add(parser, *options)
        if name == "engine":
            add_engine_options(
                parser, [k for k in ENGINE_OPTIONS if k != "max_new_tokens"]
            )  # --max-new-tokens: LOAD's
    return p


def set_cpu_devices(args: argparse.Namespace) -> None:
    """Set XLA_FLAGS' host device count before JAX starts; one already there stays unless --cpu-devices."""
    flags = os.environ.get("XLA_FLAGS", "")
    default = 4 if args.command in MULTI_DEVICE and at.FORCE_DEVICES_FLAG not in flags else None
    if count := getattr(args, "cpu_devices", None) or default:
        os.environ["XLA_FLAGS"] = at.cpu_xla_flags(count, flags)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    set_cpu_devices(args)
    from jaxray.bench import runner  # imports JAX: only once XLA_FLAGS is final

    try:
        return runner.run(args)
    except (ValueError, FileNotFoundError, RuntimeError, DataFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
