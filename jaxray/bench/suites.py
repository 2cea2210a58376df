"""The learning path's comparisons, each a ``Report``: dispatch, precision, devices, shard-map,
batch-sweep, attention and throughput. A case that fails is a row with its error; the suite goes on."""

from __future__ import annotations

import functools

import jax

from jaxray.bench.parity import param_diffs
from jaxray.bench.presets import Preset, Size
from jaxray.bench.report import SPEED, Report, bar_chart, curve, line_chart, ratio, run_cases
from jaxray.bench.throughput import make_spec, measure
from jaxray.data.workloads import load_arrays
from jaxray.models.attention import REQUESTS, AttentionError, choose, target_for

_DATA: dict[tuple, tuple] = {}  # (train, held-out) arrays per data set, read once a run


def _data(trial) -> tuple:
    lm = trial.model.workload == "transformer"
    if (key := (lm, trial.data.seq_len if lm else 0, trial.train.seed, trial.data.data_dir)) not in _DATA:
        _DATA[key] = load_arrays(trial)
    return _DATA[key]


def preload(sizes: list[Size], data_dir: str | None) -> None:
    """Check every size and read its data before anything compiles (DataFileError names a bad file)."""
    for size in sizes:
        _data(make_spec(**{"global_batch": 1, **size}, data_dir=data_dir).trial)


def suite_sizes(preset: Preset, name: str) -> list[Size]:
    one = {"dispatch": preset.dispatch, "batch-sweep": preset.sweep, "attention": preset.attention}
    many = {"precision": preset.precision, "devices": preset.devices, "shard-map": preset.shard_map}
    return many[name] if name in many else [one.get(name, preset.throughput)]


def _case(label: str, size: Size, data_dir: str | None, keep: dict | None = None, **overrides):
    """(fields, run) measuring ``size`` with ``overrides``; ``keep`` collects Measurements by label."""

    def run() -> dict:
        spec = make_spec(**{**size, **overrides}, data_dir=data_dir)
        m = measure(spec, _data(spec.trial))
        if keep is not None:
            keep[label] = m
        return m.row

    return {"case": label, "workload": size["workload"], **overrides}, run


def _bars(name: str, title: str) -> dict:
    return {name: functools.partial(bar_chart, title=title)}


def dispatch(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """Eager (op-by-op dispatch from Python) vs jitted MLP step on one device."""
    eager = _case("eager", preset.dispatch, data_dir, step="eager", steps=preset.dispatch_eager_steps)
    rows = run_cases([eager, _case("jit", preset.dispatch, data_dir, step="jit")], "dispatch")
    notes = [f"jit: {r:.1f}x eager's examples/s" if (r := ratio(rows[1], rows[0])) else "a case failed"]
    cols = f"case workload dtype devices global_batch {SPEED}"
    title = "Python dispatch vs jit (MLP)"
    return Report("dispatch", title, rows, cols, notes, _bars("dispatch.png", "dispatch"))


def precision(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """float32 vs bfloat16 compute (params stay float32) per model, with held-out quality."""
    cases = [_case(f"{s['workload']} {d}", s, data_dir, dtype=d, evaluate=True)
             for s in preset.precision for d in ("float32", "bfloat16")]  # fmt: skip
    rows, notes = run_cases(cases, "precision"), ["Params and optimizer state stay float32."]
    for w in dict.fromkeys(r["workload"] for r in rows):
        pair = {r.get("dtype"): r for r in rows if r["workload"] == w}
        if r := ratio(pair.get("bfloat16"), pair.get("float32")):
            notes.append(f"{w}: bfloat16 runs at {r:.2f}x float32's throughput")
    cols = f"case {SPEED} final_loss test_accuracy val_loss val_perplexity"
    title = "float32 vs bfloat16 compute"
    return Report("precision", title, rows, cols, notes, _bars("precision.png", "dtype"))


def _loss_chart(kept: dict, rows, path) -> None:
    """Training loss against tokens processed (step i: i x global batch x (T - 1))."""
    series = {}
    for label, m in kept.items():
        per_step = m.row["global_batch"] * (m.row["seq_len"] - 1)
        series[label] = ([per_step * (i + 1) for i in range(len(m.losses))], m.losses)
    line_chart(path, series, "tokens processed", "training loss (nats)")


def devices_scaling(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """Weak scaling: 1 device vs all ``devices`` at the same per-device batch."""
    kept, counts = {}, dict.fromkeys((1, devices))
    cases = [_case(f"{s['workload']} x{n}", s, data_dir, kept, devices=n, global_batch=s["global_batch"] * n)
             for s in preset.devices for n in counts]  # fmt: skip
    rows = run_cases(cases, "devices")
    by_case, notes = {r["case"]: r for r in rows}, [f"Same per-device batch on 1 and {devices} device(s)."]
    for w in (s["workload"] for s in preset.devices):
        if r := ratio(many := by_case.get(f"{w} x{devices}"), by_case.get(f"{w} x1")):
            many |= {"speedup_vs_1": r, "scaling_efficiency": r / devices}
            notes.append(f"{w}: {devices} devices give {r:.2f}x 1 device ({r / devices:.0%} efficiency)")
    if rows and rows[0].get("platform") == "cpu":
        notes.append("Forced host devices (--cpu-devices) share the CPU's cores: near 1x is expected.")
    cols = f"case devices global_batch per_device_batch {SPEED} speedup_vs_1 scaling_efficiency"
    charts = _bars("devices_throughput.png", "weak scaling")
    lm = {k: m for k, m in kept.items() if k.startswith("transformer")}
    charts["devices_transformer_loss.png"] = functools.partial(_loss_chart, lm)
    return Report("devices", f"1 device vs {devices} (weak scaling)", rows, cols, notes, charts)


def shard_map(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """Auto-sharded jit step vs explicit ``shard_map`` step: same numbers, both speeds."""
    kept = {}
    cases = [_case(f"{s['workload']} {kind}", s, data_dir, kept, devices=devices, step=kind)
             for s in preset.shard_map for kind in ("jit", "shard_map")]  # fmt: skip
    rows = run_cases(cases, "shard-map")
    by_case, notes = {r["case"]: r for r in rows}, [f"Same params and batches on {devices} device(s)."]
    for w in (s["workload"] for s in preset.shard_map):
        auto, explicit, row = kept.get(f"{w} jit"), kept.get(f"{w} shard_map"), by_case[f"{w} shard_map"]
        if auto and explicit:
            diffs = param_diffs(auto.state.params, explicit.state.params)
            loss = max(abs(a - b) for a, b in zip(auto.losses, explicit.losses))
            row |= {"max_param_abs_diff": diffs["max_param_diff"], "max_loss_abs_diff": loss}
            row |= {"max_key_bias_abs_diff": diffs["max_key_bias_diff"]}
            row["speed_vs_jit"] = ratio(row, by_case[f"{w} jit"])
            notes.append(f"{w}: max |param diff| {diffs['max_param_diff']:.2e}, max |loss diff| {loss:.2e}")
    notes.append("The attention key bias (zero gradient: jaxray.bench.parity) is max_key_bias_abs_diff.")
    cols = f"case devices global_batch {SPEED} final_loss max_param_abs_diff speed_vs_jit"
    title = "jit (auto-sharded) vs explicit shard_map step"
    return Report("shard-map", title, rows, cols, notes, _bars("shard_map.png", "jit vs shard_map"))


def batch_sweep(preset: Preset, data_dir: str | None, devices: int, batches=None) -> Report:
    """Throughput against global batch on all devices; indivisible sizes skipped, failures kept."""
    size, rows, cases = preset.sweep, [], []
    for b in batches or preset.sweep_batches:
        fields = {"case": f"batch {b}", "workload": size["workload"], "global_batch": b}
        if b % devices:
            rows.append(fields | {"skipped": f"{b} is not divisible by {devices} devices"})
        else:
            cases.append(_case(f"batch {b}", size, data_dir, devices=devices, global_batch=b))
    rows = sorted(rows + run_cases(cases, "batch-sweep"), key=lambda r: r["global_batch"])
    n = {k: sum(bool(r.get(k)) for r in rows) for k in ("skipped", "error")}
    notes = [f"{size['workload']} on {devices} device(s); skipped {n['skipped']}, failed {n['error']}"]
    key = "tokens_per_sec" if size["workload"] == "transformer" else "examples_per_sec"

    def chart(rows, path):
        line_chart(path, {"": curve(rows, "global_batch", key)}, "global batch (log2)", key, log2x=True)

    cols = f"global_batch per_device_batch workload dtype {SPEED}"
    charts = {"throughput_vs_batch.png": chart}
    return Report("batch-sweep", "Throughput vs global batch", rows, cols, notes, charts)


def attention(preset: Preset, data_dir: str | None, devices: int) -> Report:
    """The transformer's attention: xla vs cudnn vs auto (cudnn only where it can run)."""
    model = make_spec(**preset.attention, attention="xla").trial.model
    target = target_for(jax.devices()[0], model.dtype, model.head_dim, model.max_seq_len)
    refused, cases = {}, []
    for req in REQUESTS:
        try:
            choose(req, target)
            cases.append(_case(req, preset.attention, data_dir, attention=req))
        except AttentionError as err:  # refused up front, as training would: a finding
            refused[req] = {"case": req, "workload": "transformer", "skipped": str(err)}
    measured = iter(run_cases(cases, "attention"))
    rows = [refused.get(req) or next(measured) for req in REQUESTS]
    notes = ["auto picks cuDNN flash attention only where it can run (NVIDIA GPU, bf16/f16, head dim)."]
    notes += [f"auto -> {r['attention']}: {r['attention_note']}" for r in rows if r.get("attention_note")]
    title, cols = "Attention implementation: xla vs cudnn vs auto", f"case attention workload dtype {SPEED}"
    return Report("attention", title, rows, cols, notes, _bars("attention.png", "attention"))


def throughput(size: Size, data_dir: str | None) -> Report:
    """One workload at one config, with the loss of every step run."""
    kept = {}
    rows = run_cases([_case(size["workload"], size, data_dir, kept)], "throughput")

    def chart(rows, path):
        series = {k: (list(range(1, len(m.losses) + 1)), m.losses) for k, m in kept.items()}
        line_chart(path, series, "step (warm-up first)", "training loss (nats)")

    cols = f"workload dtype devices global_batch width {SPEED} final_loss compile_s"
    charts = {"loss_per_step.png": chart}
    return Report("throughput", f"Throughput: {size['workload']}", rows, cols, [], charts)


SUITES = {"dispatch": dispatch, "precision": precision, "devices": devices_scaling, "shard-map": shard_map,
          "batch-sweep": batch_sweep, "attention": attention}  # fmt: skip
