"""The learning path's comparisons, each a ``Report``: dispatch, precision, devices, shard-map,
batch-sweep, attention and throughput.

Each suite turns a preset's sizes into ``Case``s (run under a progress bar; a case that fails is a
row with its error, and the suite goes on), then adds the comparison (ratio, difference) and notes.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from jaxray.bench import charts
from jaxray.bench.columns import COMMON_COLUMNS, columns
from jaxray.bench.output import Case, Report, row_value, run_cases
from jaxray.bench.parity import param_diffs
from jaxray.bench.presets import Preset, Size
from jaxray.bench.throughput import Measurement, make_spec, measure
from jaxray.config import TrialConfig
from jaxray.data.workloads import load_arrays
from jaxray.models.attention import REQUESTS, AttentionError, choose, target_for

_DATA: dict[tuple, tuple] = {}  # loaded (train, held-out) arrays, shared by the cases of a run


def _data(trial: TrialConfig) -> tuple:
    """``load_arrays(trial)``, read once per data set (both MLPs share Fashion-MNIST)."""
    is_lm = trial.model.workload == "transformer"
    key = (is_lm, trial.data.seq_len if is_lm else 0, trial.train.seed, trial.data.data_dir)
    if key not in _DATA:
        _DATA[key] = load_arrays(trial)
    return _DATA[key]


def preload(sizes: list[Size], data_dir: str | None) -> None:
    """Read and verify the data every size needs, once, before anything is compiled or timed, so
    a missing or damaged file stops the command with the loader's full message (DataFileError)."""
    for size in sizes:
        _data(make_spec(**{"global_batch": 1, **size}, data_dir=data_dir).trial)


def suite_sizes(preset: Preset, name: str) -> list[Size]:
    """The sizes benchmark ``name`` runs under ``preset`` (for ``preload``)."""
    return {
        "dispatch": [preset.dispatch],
        "precision": preset.precision,
        "devices": preset.devices,
        "shard-map": preset.shard_map,
        "batch-sweep": [preset.sweep],
        "attention": [preset.attention],
        "throughput": [preset.throughput],
    }[name]


def run_size(size: Size, data_dir: str | None, **overrides: Any) -> Measurement:
    """Measure one preset size (``overrides`` replace its fields) on real data."""
    spec = make_spec(**{**size, **overrides}, data_dir=data_dir)
    return measure(spec, _data(spec.trial))


def _case(label: str, size: Size, data_dir: str | None, keep: dict | None = None, **overrides) -> Case:
    """A Case measuring ``size`` with ``overrides``; ``keep`` collects the Measurement by label."""
    fields = {
        "case": label,
        "workload": size["workload"],
        **{k: v for k, v in overrides.items() if k != "evaluate"},
    }

    def run() -> dict[str, Any]:
        m = run_size(size, data_dir, **overrides)
        if keep is not None:
            keep[label] = m
        return m.row

    return Case(label, fields, run)


def dispatch(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """Eager (op-by-op Python dispatch) vs jitted MLP step on one device."""
    size = preset.dispatch
    cases = [
        _case("eager", size, data_dir, step="eager", steps=preset.dispatch_eager_steps, warmup=1),
        _case("jit", size, data_dir, step="jit"),
    ]
    rows = run_cases(cases, "dispatch")
    eager, jit = (row_value(r, "examples_per_sec") for r in rows)
    notes = [
        f"jit is {jit / eager:.1f}x the eager step's examples/s" if eager and jit else "a case failed",
        "Eager runs every jnp op as its own dispatch from Python; jit compiles the whole step "
        "into one XLA program.",
    ]
    table = [("step", "case", ""), *columns("workload dtype devices global_batch"), *COMMON_COLUMNS]
    figures = _bars("dispatch.png", "eager vs jit")
    return Report("dispatch", "Python dispatch vs jit (MLP)", rows, table, notes, figures)


def precision(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """float32 vs bfloat16 compute (params stay float32) for each model, with held-out quality."""
    cases = [
        _case(f"{s['workload']} {d}", s, data_dir, dtype=d, evaluate=True)
        for s in preset.precision
        for d in ("float32", "bfloat16")
    ]
    rows = run_cases(cases, "precision")
    notes = ["Params and optimizer state stay float32; only the forward/backward compute is cast."]
    for w in dict.fromkeys(r["workload"] for r in rows):
        pair = {r.get("dtype"): r for r in rows if r["workload"] == w}
        ratio = _ratio(pair.get("bfloat16"), pair.get("float32"))
        if ratio:
            notes.append(
                f"{w}: bfloat16 runs at {ratio:.2f}x float32's throughput on "
                f"{rows[0].get('device_kind', '?')}"
            )
    if rows and rows[0].get("platform") == "cpu":
        notes.append(
            "On CPU bfloat16 matmuls have no native units and are usually slower; "
            "on GPUs with tensor cores they are faster."
        )
    table = [
        *columns("workload dtype"),
        *COMMON_COLUMNS[:2],
        ("final train loss", "final_loss", ".4f"),
        *columns("test_accuracy val_loss val_perplexity"),
    ]
    return Report(
        "precision",
        "float32 vs bfloat16 compute",
        rows,
        table,
        notes,
        _bars("precision.png", "float32 vs bfloat16"),
    )


def devices_scaling(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """Weak scaling: 1 device vs all ``devices`` at the same per-device batch and timed steps."""
    kept: dict[str, Measurement] = {}
    cases = []
    for s in preset.devices:
        per_device = s["global_batch"]
        for n in dict.fromkeys((1, devices)):
            cases.append(
                _case(f"{s['workload']} x{n}", s, data_dir, kept, devices=n, global_batch=per_device * n)
            )
    rows = run_cases(cases, "devices")
    notes = [f"Same per-device batch and the same number of timed steps on 1 and {devices} device(s)."]
    if devices == 1:
        notes.append(
            "Only one device is visible, so there is nothing to compare: on a CPU add --cpu-devices N."
        )
    for s in preset.devices:
        one, many = (
            next((r for r in rows if r["case"] == f"{s['workload']} x{n}"), None) for n in (1, devices)
        )
        ratio = _ratio(many, one)
        if ratio:
            many["speedup_vs_1"] = ratio
            many["scaling_efficiency"] = ratio / devices
            note = (
                f"{s['workload']}: {devices} devices give {ratio:.2f}x the throughput of 1 "
                f"({ratio / devices:.0%} efficiency)"
            )
            if ratio > devices:
                note += "; super-linear (per-device work fits caches better, or 1 device was under-used)"
            notes.append(note)
    if rows and rows[0].get("platform") == "cpu":
        notes.append(
            "Forced host devices share this machine's CPU cores, so near 1x is the expected "
            "result here; on GPUs each device adds its own compute."
        )
    table = [
        *columns("case devices global_batch per_device_batch"),
        *COMMON_COLUMNS[:2],
        *columns("speedup_vs_1 scaling_efficiency"),
    ]
    lm_curves = {label: m for label, m in kept.items() if label.startswith("transformer")}
    return Report(
        "devices",
        f"1 device vs {devices} (weak scaling)",
        rows,
        table,
        notes,
        {
            **_bars("devices_throughput.png", "weak scaling"),
            "devices_transformer_loss.png": functools.partial(charts.lm_curves, kept=lm_curves),
        },
    )


def shard_map(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """Auto-sharded jit step vs explicit ``jax.shard_map`` step with ``pmean``: same results, both speeds."""
    kept: dict[str, Measurement] = {}
    cases = [
        _case(f"{s['workload']} {kind}", s, data_dir, kept, devices=devices, step=kind)
        for s in preset.shard_map
        for kind in ("jit", "shard_map")
    ]
    rows = run_cases(cases, "shard-map")
    notes = [f"Both steps start from the same params and see the same batches on {devices} device(s)."]
    for s in preset.shard_map:
        w = s["workload"]
        auto, explicit = kept.get(f"{w} jit"), kept.get(f"{w} shard_map")
        if auto and explicit:
            diffs = param_diffs(auto.state.params, explicit.state.params)
            loss_diff = max(abs(a - b) for a, b in zip(auto.losses, explicit.losses))
            row = next(r for r in rows if r["case"] == f"{w} shard_map")
            row.update(
                max_param_abs_diff=diffs["max_param_diff"],
                max_key_bias_abs_diff=diffs["max_key_bias_diff"],
                max_loss_abs_diff=loss_diff,
                speed_vs_jit=_ratio(row, next(r for r in rows if r["case"] == f"{w} jit")),
            )
            notes.append(
                f"{w}: max |param diff| {diffs['max_param_diff']:.2e}, max |loss diff| {loss_diff:.2e} "
                f"over {len(auto.losses)} steps; shard_map at {row['speed_vs_jit']:.2f}x jit's throughput"
            )
    if any("max_key_bias_abs_diff" in r for r in rows):
        notes.append(
            "The attention key bias is compared on its own (`max_key_bias_abs_diff` in summary.json): "
            "its gradient is analytically zero, so rounding noise scaled by Adam decides it "
            "(see jaxray.bench.parity)."
        )
    table = [
        *columns("case devices global_batch"),
        *COMMON_COLUMNS[:2],
        *columns("final_loss max_param_abs_diff speed_vs_jit"),
    ]
    return Report(
        "shard-map",
        "jit (auto-sharded) vs explicit shard_map step",
        rows,
        table,
        notes,
        _bars("shard_map.png", "jit vs shard_map"),
    )


def batch_sweep(
    preset: Preset, data_dir: str | None, devices: int, batches: list[int] | None = None
) -> Report:
    """Throughput against global batch on all devices; sizes the device count does not divide are
    skipped with a message, sizes that fail are reported in their row."""
    batches = batches or preset.sweep_batches
    size, rows, cases = preset.sweep, [], []
    for b in batches:
        if b % devices:
            rows.append(
                {
                    "case": f"batch {b}",
                    "workload": size["workload"],
                    "global_batch": b,
                    "devices": devices,
                    "skipped": f"{b} is not divisible by {devices} devices",
                }
            )
        else:
            cases.append(_case(f"batch {b}", size, data_dir, devices=devices, global_batch=b))
    rows += run_cases(cases, "batch-sweep")
    rows.sort(key=lambda r: r["global_batch"])
    notes = [
        f"{size['workload']} on {devices} device(s); skipped: {sum(1 for r in rows if r.get('skipped'))}, "
        f"failed: {sum(1 for r in rows if r.get('error'))}"
    ]
    table = [*columns("global_batch per_device_batch workload dtype"), *COMMON_COLUMNS]
    return Report(
        "batch-sweep",
        "Throughput vs global batch",
        rows,
        table,
        notes,
        {"throughput_vs_batch.png": charts.throughput_vs_batch},
    )


def attention(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """The transformer's attention implementation: xla vs cudnn vs auto (cudnn only where it can run)."""
    model = make_spec(**preset.attention, attention="xla").trial.model
    target = target_for(jax.devices()[0], model.dtype, model.head_dim)
    refused, cases = {}, []
    for req in REQUESTS:
        try:
            choose(req, target)
            cases.append(_case(req, preset.attention, data_dir, attention=req))
        except AttentionError as err:  # refused up front, as training would: a finding, not a failure
            refused[req] = {"case": req, "workload": "transformer", "skipped": str(err)}
    measured = iter(run_cases(cases, "attention"))
    rows = [refused.get(req) or next(measured) for req in REQUESTS]
    notes = [
        "auto picks cuDNN flash attention only on an NVIDIA GPU of compute capability >= 8.0 with "
        "bfloat16/float16 compute and a head dim that is a multiple of 8 up to 128 (256 on Hopper); "
        "otherwise it falls back to XLA and records why."
    ]
    notes += [
        f"auto -> {r['attention']}: {r['attention_note']}"
        for r in rows
        if r["case"] == "auto" and r.get("attention_note")
    ]
    table = [("requested", "case", ""), *columns("attention workload dtype"), *COMMON_COLUMNS]
    figures = _bars("attention.png", "attention")
    return Report("attention", "Attention implementation: xla vs cudnn vs auto", rows, table, notes, figures)


def throughput(size: Size, data_dir: str | None) -> Report:
    """One workload at one config."""
    kept: dict[str, Measurement] = {}
    rows = run_cases([_case(size["workload"], size, data_dir, kept)], "throughput")
    table = [
        *columns("workload dtype devices global_batch width"),
        *COMMON_COLUMNS,
        *columns("final_loss compile_s"),
    ]
    return Report(
        "throughput",
        f"Throughput: {size['workload']}",
        rows,
        table,
        charts={"loss_per_step.png": functools.partial(charts.loss_per_step, kept=kept)},
    )


def _bars(file_name: str, title: str) -> dict:
    """The suites' usual chart: ``file_name`` with a bar per case."""
    return {file_name: functools.partial(charts.bars, label="case", title=title)}


def _ratio(a: dict | None, b: dict | None) -> float | None:
    """a's throughput over b's (tokens/s for the transformer, else examples/s)."""
    if not a or not b:
        return None
    key = "tokens_per_sec" if a.get("tokens_per_sec") is not None else "examples_per_sec"
    x, y = row_value(a, key), row_value(b, key)
    return x / y if x and y else None


SUITES = {
    "dispatch": dispatch,
    "precision": precision,
    "devices": devices_scaling,
    "shard-map": shard_map,
    "batch-sweep": batch_sweep,
    "attention": attention,
}
