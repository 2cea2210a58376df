"""``python -m jaxray.bench SUB-COMMAND``: see ``--help``.

  python -m jaxray.bench all                          # every suite, CPU sizes (<= 10 min on 2 cores)
  python -m jaxray.bench all --preset gpu             # the learning path's sizes
  python -m jaxray.bench throughput --workload transformer --batch 16 --steps 10
  python -m jaxray.bench throughput --model-preset gpt2_small --dtype bfloat16 --batch 16   # on a GPU
  python -m jaxray.bench compare --reference ../shared/bench/reference_transformer.py
  python -m jaxray.bench serve --checkpoint runs/demo   # the Serve app under HTTP load (1..64 clients)
  python -m jaxray.bench decode                       # KV-cache sampler vs full-window recompute, 300 tokens
  python -m jaxray.bench ingest                       # the step fed pre-staged vs streamed by Ray Data
  python -m jaxray.bench checkpoint                   # checkpoint size, save/restore time, cost every N steps

``--cpu-devices N`` sets ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before JAX starts,
so a CPU-only machine shows N devices (default 4 for devices, shard-map, batch-sweep and all); the
flag only affects the CPU backend, so GPU runs use their real devices.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from jaxray.argtypes import (
    cpu_device_count,
    folder,
    non_negative_float,
    non_negative_int,
    port,
    positive_int,
    positive_int_list,
)
from jaxray.bench.loadtest import add_load_options, url_arg
from jaxray.bench.presets import MODEL_SIZES  # imports no jax: --cpu-devices must act before JAX starts
from jaxray.data.sources import DataFileError  # imports no jax either
from jaxray.inference.settings import add_engine_options  # imports no jax, as presets
from jaxray.serve.settings import add_replica_options  # nor does this

SUITE_NAMES = ("dispatch", "precision", "devices", "shard-map", "batch-sweep", "attention")
FORCE_FLAG = "xla_force_host_platform_device_count"
MULTI_DEVICE = {"devices", "shard-map", "batch-sweep", "all"}
DEFAULT_CPU_DEVICES = 4


def _batches(text: str) -> list[int]:
    try:
        return list(positive_int_list(text))
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(
            str(err).replace("a value is listed", "a global batch is listed")
        ) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; argparse exits 2 (naming the option) on a bad one."""
    common = _common_options()
    p = argparse.ArgumentParser(
        prog="python -m jaxray.bench", description="The learning path's measurements."
    )
    sub = p.add_subparsers(dest="command", required=True)
    _add_suites(sub, _sized_options(common))
    _add_throughput(sub, common)
    _add_compare(sub, common)
    _add_serve(sub)
    _add_decode(sub, common)
    _add_ingest(sub, common)
    _add_checkpoint(sub, common)
    _add_compile(sub, common)
    return p.parse_args(argv)


def _common_options() -> argparse.ArgumentParser:
    """The options every sub-command but ``serve`` takes: --out, --data-dir, --cpu-devices."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--out", default=None, help="output folder (default runs/bench/<name>); '' writes nothing"
    )
    common.add_argument(
        "--data-dir",
        type=folder,
        default=None,
        help="folder with the data files (default: JAXRAY_DATA_DIR, then jaxray's search order)",
    )
    common.add_argument(
        "--cpu-devices",
        type=cpu_device_count,
        default=None,
        help=f"forced CPU device count (default {DEFAULT_CPU_DEVICES} for multi-device "
        "benchmarks, else unchanged)",
    )
    return common


def _sized_options(common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``common`` plus --preset: the options of the suites and ``all``."""
    sized = argparse.ArgumentParser(add_help=False, parents=[common])
    sized.add_argument(
        "--preset",
        choices=("cpu", "gpu", "tiny"),
        default="cpu",
        help="sizes: cpu (2-core CPU, <= 10 min for all), gpu (the learning path's), tiny (seconds)",
    )
    return sized


def _add_suites(sub, sized: argparse.ArgumentParser) -> None:
    """One sub-command per suite (``SUITE_NAMES``) and ``all``; ``batch-sweep`` adds --batches."""
    for name in (*SUITE_NAMES, "all"):
        s = sub.add_parser(
            name, parents=[sized], help=f"the {name} benchmark" if name != "all" else "every suite"
        )
        if name == "batch-sweep":
            s.add_argument(
                "--batches",
                type=_batches,
                default=None,
                help="comma-separated global batches (default 256,512,1024,2048,4096)",
            )


def _add_throughput(sub, common: argparse.ArgumentParser) -> None:
    """``throughput``: one workload at one config, one JSON line (jaxray.bench.suites.throughput)."""
    t = sub.add_parser(
        "throughput", parents=[common], help="one workload at one config; prints one JSON line"
    )
    t.add_argument("--workload", choices=("mlp", "shared_block_mlp", "transformer"), default="transformer")
    t.add_argument("--batch", type=positive_int, default=16, help="global batch")
    t.add_argument("--steps", type=positive_int, default=10, help="timed steps per repeat")
    t.add_argument("--repeats", type=positive_int, default=3, help="timed windows; the median is reported")
    t.add_argument(
        "--warmup", type=non_negative_int, default=1, help="untimed calls first (compile, first touch)"
    )
    t.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    t.add_argument(
        "--width", type=positive_int, default=None, help="MLP width or d_model (default: the lab's)"
    )
    t.add_argument(
        "--seq-len", type=positive_int, default=None, help="transformer sequence length T (default 256)"
    )
    t.add_argument("--devices", type=positive_int, default=1, help="devices in the mesh")
    t.add_argument("--step", choices=("jit", "shard_map", "eager"), default="jit")
    t.add_argument(
        "--steps-per-call", type=positive_int, default=1, help="optimizer steps per dispatch (lax.scan)"
    )
    t.add_argument(
        "--attention", choices=("auto", "xla", "cudnn"), default=None, help="transformer only (default auto)"
    )
    t.add_argument(
        "--model-preset",
        choices=tuple(MODEL_SIZES),
        default=None,
        help="transformer shape; gpt2_small: 12 layers, 12 heads, d_model 768, max_seq_len and "
        "--seq-len 1024 (--width and --seq-len given still win)",
    )
    t.add_argument("--json", action="store_true", help="print only the JSON line")


def _add_compare(sub, common: argparse.ArgumentParser) -> None:
    """``compare``: jaxray against a reference script, runs alternating A B (jaxray.bench.compare)."""
    c = sub.add_parser("compare", parents=[common], help="jaxray vs a reference script, A B A B")
    c.add_argument(
        "--reference", required=True, type=Path, help="e.g. ../shared/bench/reference_transformer.py"
    )
    c.add_argument(
        "--workload", choices=("mlp", "transformer"), default=None, help="default: from the script name"
    )
    c.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default 16 transformer, 512 MLP)"
    )
    c.add_argument("--steps", type=positive_int, default=None, help="timed steps per run (default 10 / 100)")
    c.add_argument("--pairs", type=positive_int, default=3, help="A B pairs; the median ratio is reported")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="bfloat16: MLP only")
    c.add_argument("--timeout", type=positive_int, default=900, help="seconds one run may take")


def _add_compile(sub, common: argparse.ArgumentParser) -> None:
    """``compile``: the compile report of one config's train step, without training
    (jaxray.train.compile_report)."""
    c = sub.add_parser(
        "compile",
        parents=[common],
        help="compile one config's train step and print XLA's report (FLOPs, memory per device, "
        "ops) without training; writes compile.json",
    )
    c.add_argument("--workload", choices=("mlp", "shared_block_mlp", "transformer"), default="transformer")
    c.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    c.add_argument("--batch", type=positive_int, default=16, help="global batch (default 16)")
    c.add_argument(
        "--width", type=positive_int, default=None, help="MLP width or d_model (default: the lab's)"
    )
    c.add_argument(
        "--seq-len", type=positive_int, default=None, help="transformer sequence length T (default 256)"
    )
    c.add_argument(
        "--model-preset",
        choices=tuple(MODEL_SIZES),
        default=None,
        help="transformer shape, e.g. gpt2_small (explicit options win)",
    )
    c.add_argument("--devices", type=positive_int, default=1, help="devices in the mesh (default 1)")
    c.add_argument(
        "--attention", choices=("auto", "xla", "cudnn"), default=None, help="transformer only (default auto)"
    )
    c.add_argument("--json", action="store_true", help="print only the report as one JSON line")


def _add_checkpoint(sub, common: argparse.ArgumentParser) -> None:
    """``checkpoint``: full-state checkpoint size, save/restore time and step-time cost
    (jaxray.bench.checkpointing)."""
    c = sub.add_parser(
        "checkpoint",
        parents=[common],
        help="full-state checkpoints: size, save/restore s, step-time cost of saving every N steps",
    )
    c.add_argument(
        "--workload",
        choices=("mlp", "transformer", "all"),
        default="transformer",
        help="the cost run's workload (default transformer); size rows are for both lab models",
    )
    c.add_argument("--every", type=positive_int, default=100, help="steps between checkpoints (default 100)")
    c.add_argument("--steps", type=positive_int, default=None, help="steps per run (default 2 x --every + 1)")
    c.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default 16 transformer, 512 MLP)"
    )
    c.add_argument(
        "--seq-len", type=positive_int, default=128, help="transformer sequence length T (default 128)"
    )
    c.add_argument(
        "--width", type=positive_int, default=None, help="cost run's width (default 128 transformer; lab MLP)"
    )
    c.add_argument("--repeats", type=positive_int, default=3, help="alternating repeats, median reported")


def _add_ingest(sub, common: argparse.ArgumentParser) -> None:
    """``ingest``: the step on pre-staged batches vs batches streamed from Parquet (jaxray.bench.ingest)."""
    i = sub.add_parser(
        "ingest", parents=[common], help="ms/step: pre-staged device batches vs Ray Data from Parquet"
    )
    i.add_argument(
        "--workload",
        choices=("mlp", "transformer", "all"),
        default=None,
        help="default: all, or the workload of --parquet's dataset",
    )
    i.add_argument(
        "--parquet",
        type=folder,
        default=None,
        help="a folder from python -m jaxray.data prepare (default: prepare one in a temporary folder)",
    )
    i.add_argument(
        "--batch", type=positive_int, default=None, help="global batch (default 1024 MLP, 16 transformer)"
    )
    i.add_argument(
        "--steps", type=positive_int, default=None, help="timed steps a repeat (150 MLP, 10 transformer)"
    )
    i.add_argument(
        "--warmup", type=non_negative_int, default=None, help="untimed steps first (10 MLP, 2 transformer)"
    )
    i.add_argument("--repeats", type=positive_int, default=3, help="A B repeats; the median is reported")
    i.add_argument(
        "--seq-len", type=positive_int, default=None, help="transformer sequence length T (default 256)"
    )
    i.add_argument(
        "--prefetch-batches",
        type=non_negative_int,
        default=2,
        help="Ray Data blocks fetched ahead while an epoch is read (default 2)",
    )


def _add_decode(sub, common: argparse.ArgumentParser) -> None:
    """``decode``: KV-cache sampler vs full-window recompute (jaxray.bench.decode)."""
    d = sub.add_parser(
        "decode", parents=[common], help="new tokens/s: KV-cache sampler vs full-window recompute"
    )
    d.add_argument(
        "--new-tokens", type=positive_int, default=300, help="new tokens per request (default 300)"
    )
    d.add_argument(
        "--batch-sizes", type=_batches, default=[1, 16], help="KV-cache batch sizes (default 1,16)"
    )
    d.add_argument(
        "--repeats", type=positive_int, default=3, help="timed calls after warm-up, median reported"
    )
    d.add_argument("--prompt", default="ROMEO:", help="prompt text (default ROMEO:)")
    d.add_argument(
        "--temperature", type=non_negative_float, default=0.8, help="sampling temperature; 0 is greedy"
    )
    d.add_argument(
        "--checkpoint",
        type=folder,
        default=None,
        help="a transformer checkpoint or runs/<experiment> (default: the lab's model, fresh weights)",
    )
    d.add_argument(
        "--reference",
        type=Path,
        default=None,
        help="the notebook sampler script (default ../shared/bench/reference_generate.py if present)",
    )
    d.add_argument("--timeout", type=positive_int, default=900, help="seconds one notebook run may take")


def _add_serve(sub) -> None:
    """``serve``: python -m jaxray.serve under HTTP load from python -m jaxray.bench.loadtest."""
    s = sub.add_parser("serve", help="the Serve app under HTTP load from a second process (1..64 clients)")
    s.add_argument("--out", default=None, help="output folder (default runs/bench/serve); '' writes nothing")
    app = s.add_mutually_exclusive_group(required=True)
    app.add_argument(
        "--checkpoint", type=folder, help="start python -m jaxray.serve on this checkpoint or run folder"
    )
    app.add_argument(
        "--url", type=url_arg, help="measure an app already running there instead (http://HOST:PORT)"
    )
    add_load_options(s)
    s.add_argument("--port", type=port, default=8000, help="port of the app started here (default 8000)")
    passed = "; passed to jaxray.serve"
    add_replica_options(s, ("max_batch_size", "batch_wait_ms", "num_gpus"), note=passed)
    add_engine_options(s, ("batch_sizes", "chunk"), note=passed)
    s.add_argument(
        "--startup-timeout",
        type=positive_int,
        default=600,
        help="seconds until /healthz answers (compiles first)",
    )


def set_cpu_devices(args: argparse.Namespace) -> None:
    """Force the CPU device count before JAX is imported (it reads XLA_FLAGS once, at start). An
    explicit ``--cpu-devices`` replaces a count already in XLA_FLAGS; the default keeps it."""
    flags = os.environ.get("XLA_FLAGS", "")
    has_count = FORCE_FLAG in flags
    default = DEFAULT_CPU_DEVICES if args.command in MULTI_DEVICE and not has_count else None
    # serve has no --cpu-devices: the server is its own process
    count = getattr(args, "cpu_devices", None) or default
    if count:
        flags = re.sub(rf"--{FORCE_FLAG}=\S*", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} --{FORCE_FLAG}={count}".strip()


def _out(args: argparse.Namespace, name: str) -> Path | None:
    if args.out == "":
        return None
    return Path(args.out) if args.out else Path("runs/bench") / name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    set_cpu_devices(args)
    from jaxray.bench import runner  # imports JAX: only after XLA_FLAGS is final

    try:
        return runner.run(args, _out)
    except (ValueError, FileNotFoundError, RuntimeError, DataFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
