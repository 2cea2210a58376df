"""``python -m jaxray.bench check``: the accelerator check (GPU or TPU). First, where Ray is installed,
a real sweep under Ray Tune and Ray Train in a child process (the preset's ``check_sweep``); then in
this process, without Ray (a TPU host may allow no sockets): attention alone (forward + backward) per
implementation and sequence length, the preset's ``check`` model steps (ms/step, MFU, compile s, from
the compilation cache or not), the first of them profiled (``jaxray.bench.profile``). One Report."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxray.bench.presets import PRESETS
from jaxray.bench.profile import shares
from jaxray.bench.report import SPEED, Report, run_cases
from jaxray.bench.suites import _case
from jaxray.bench.throughput import environment, time_calls
from jaxray.models import splash
from jaxray.models.transformer import causal_attention

ATTENTION_IMPLS = ("xla", "dense", "splash")
ATTENTION_SEQS = (256, 1024, 2048)


def attention_case(
    impl: str, seq: int, tokens: int, heads: int, head_dim: int, dtype: str, tiles: dict | None = None
) -> dict[str, Any]:
    """Causal attention alone, forward and backward, on q, k, v [tokens // seq, seq, heads, head_dim]:
    ``{"ms", "compile_s", "max_abs_diff"}`` (the output's largest difference from dense XLA's)."""
    shape = (max(1, tokens // seq), seq, heads, head_dim)
    q, k, v = (jax.random.normal(key, shape, dtype) for key in jax.random.split(jax.random.key(0), 3))

    def loss(impl, q, k, v):
        return jnp.sum(causal_attention(q, k, v, implementation=impl).astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=(0, 1, 2)))
    with splash.tiling(splash.Tiling(**(tiles or {}))):
        start = time.perf_counter()
        compiled = grad.lower(q, k, v).compile()
        compile_s = time.perf_counter() - start
        out = jax.jit(functools.partial(causal_attention, implementation=impl))(q, k, v)
    median_s, _ = time_calls(lambda _: compiled(q, k, v), calls=10, repeats=3, warmup=2)
    ref = jax.jit(functools.partial(causal_attention, implementation="dense"))(q, k, v)
    diff = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    return {"batch": shape[0], "ms": median_s * 1e3, "compile_s": compile_s, "max_abs_diff": diff}


def attention_rows(sizes: dict[str, Any]) -> list[dict[str, Any]]:
    """``attention_case`` for every implementation and sequence length of ``sizes`` (``seqs``,
    ``tokens``, ``heads``, ``head_dim``, ``dtype``); a case that fails is a row with its error."""
    seqs = sizes.get("seqs", ATTENTION_SEQS)
    shape = {k: sizes[k] for k in ("tokens", "heads", "head_dim", "dtype")}
    cases = [
        ({"case": f"attention {impl} T{seq}", "attention": impl, "seq_len": seq, **shape},
         functools.partial(attention_case, impl, seq, **shape))
        for seq in seqs for impl in ATTENTION_IMPLS
    ]  # fmt: skip
    for variant in sizes.get("splash_tilings", []):  # {seq, heads, head_dim, tiles}
        fields = shape | {k: variant[k] for k in ("heads", "head_dim") if k in variant}
        label = (
            f"attention splash T{variant['seq']} h{fields['heads']}x{fields['head_dim']} {variant['tiles']}"
        )
        run = functools.partial(attention_case, "splash", variant["seq"], **fields, tiles=variant["tiles"])
        cases.append(({"case": label, "attention": "splash", "seq_len": variant["seq"], **fields}, run))
    return run_cases(cases, "attention")


NO_ACCELERATOR = "no accelerator here: JAX runs on the CPU, so these are the CPU's figures, not a chip's"


CHECKOUT = Path(__file__).resolve().parents[2]  # the presets' sweep configs are its tune_configs/
# A sweep trial's summary row -> the check's columns.
SWEEP_FIELDS = ("dtype", "global_batch", "tokens_per_sec", "ms_per_step", "compile_s", "val_loss", "error")
SWEEP_TIMEOUT_S = 1800


def sweep_rows(config: str, args) -> tuple[list[dict[str, Any]], list[str]]:
    """(rows, notes) of ``python -m jaxray.tune --config config`` in a child process with a private
    local Ray (``RAY_ADDRESS=local``; ``args``' data folder and compilation cache passed on), into a
    temporary folder removed after a clean run (kept, and named, after a failed one): a row per trial
    of its summary (``case`` "sweep <trial>", ``SWEEP_FIELDS``), or one row with the error; no rows
    and a note where Ray is not installed. Call it before this process opens the accelerator."""
    if importlib.util.find_spec("ray") is None:
        return [], [f"sweep {config} not run: Ray is not installed here (the rows below ran without it)"]
    if not Path(config).is_file():
        return [{"case": f"sweep {config}", "error": f"no such experiment config: {config}"}], []
    env = {**os.environ, "RAY_ADDRESS": "local"}
    env |= {"JAX_COMPILATION_CACHE_DIR": args.compile_cache} if args.compile_cache else {}
    folder = tempfile.mkdtemp(prefix="jaxray-check-sweep-")
    command = [sys.executable, "-m", "jaxray.tune", "--config", config, "--out", folder]
    command += ["--data-dir", args.data_dir] if args.data_dir else []
    print(f"sweep: {' '.join(command[1:])} (under Ray, before the steps)", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=SWEEP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return [{"case": f"sweep {config}", "error": f"over {SWEEP_TIMEOUT_S} s; its folder: {folder}"}], []
    seconds, found = time.perf_counter() - start, sorted(Path(folder).glob("*/summary.json"))
    trials = json.loads(found[-1].read_text()) if found else []
    rows = [{"case": f"sweep {t['trial']}", **{k: t[k] for k in SWEEP_FIELDS if k in t}} for t in trials]
    if proc.returncode or not rows:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        why = [line for line in lines if line.startswith("error")] or lines[-3:]
        rows.append({"case": f"sweep {config}", "error": f"jaxray.tune exited {proc.returncode}: "
                     f"{' | '.join(why)} (its run and log: {folder})"})  # fmt: skip
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return rows, [f"sweep {config}: {len(trials)} trial(s) under Ray Tune and Ray Train in {seconds:.0f} s"]


def check_parts(args) -> None:
    """ValueError for a ``--preset`` without check cases or an ``--only`` name that is not a part of it
    (``sweep``, ``attention`` or a case), naming the allowed ones."""
    preset = PRESETS[args.preset]
    if not preset.check:
        raise ValueError(f"--preset {args.preset} has no check cases: --preset gpu (or tiny on a CPU)")
    known = {"sweep", "attention", *(size["case"] for size in preset.check)}
    if unknown := sorted(set(args.only or ()) - known):
        raise ValueError(f"--only {','.join(unknown)}: not a part of --preset {args.preset}'s check "
                         f"(one of {', '.join(sorted(known))})")  # fmt: skip


def check(args) -> Report:
    """The preset's sweep under Ray (``--sweep``), then the attention table and the model steps of
    ``--preset``'s ``check`` (``--only``: those labels; "sweep" and "attention" name those parts), the
    parts already refused by ``check_parts`` (the runner calls it before making any folder)."""
    preset, only = PRESETS[args.preset], args.only
    config = args.sweep  # given: run even if --only leaves "sweep" out
    if config is None and preset.check_sweep and (not only or "sweep" in only):
        config = str(CHECKOUT / preset.check_sweep)
    sweep, notes = sweep_rows(config, args) if config else ([], [])
    env = environment(len(jax.devices()))  # opens the accelerator: after the sweep's child process
    if env["platform"] == "cpu":  # said before the in-process figures: the check is of an accelerator
        print(NO_ACCELERATOR, file=sys.stderr, flush=True)
    rows = sweep + (attention_rows(preset.check_attention) if not only or "attention" in only else [])
    cases = []
    for size in (s for s in preset.check if not only or s["case"] in only):
        tiles, fields = size.get("tiles"), {k: v for k, v in size.items() if k not in ("case", "tiles")}
        fields, run = _case(size["case"], fields, args.data_dir)
        cases.append((fields | {"tiles": tiles}, functools.partial(_tiled, run, tiles)))
    rows += [{**env, **row} for row in run_cases(cases, "check")]
    cols = (
        f"case attention dtype global_batch seq_len remat scan_layers ms {SPEED} compile_s compile_from_cache"
    ) + (" val_loss" if sweep else "")
    notes = [f"{env['device_kind']} ({env['platform']}), jax {env['jax']}", *notes]
    notes += [NO_ACCELERATOR] if env["platform"] == "cpu" else []
    for r in (r for r in rows if r.get("profile")):
        notes.append(f"profile of {r['case']}: {shares(r['profile']['groups'])}")
    title = "Accelerator check: a sweep under Ray, attention and training steps"
    return Report("check", title, rows, cols, notes)


def _tiled(run, tiles: dict | None):
    """``run()`` under splash's ``tiles``; a bad ``tiles`` fails this case's row, not the whole check."""
    with splash.tiling(splash.Tiling(**(tiles or {}))):
        return run()
