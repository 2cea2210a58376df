"""The compile report (``compile.json``) of an AOT-compiled program: ``compile_s`` (s), XLA's
``flops`` and ``bytes_accessed`` per device, ``memory`` per device in bytes (``peak_bytes`` =
argument + output - alias + temp, as MaxText's ``print_compiled_memory_stats``),
``device_memory_bytes`` with its ``memory_source`` ("device" or "host RAM") and ``fits``, and
``ops`` counted from the optimised HLO (``hlo_ops``: scatters, gathers, collectives, custom calls,
fusions, dots)."""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp

from jaxray.config import ConfigError
from jaxray.parallel.checks import check_trial
from jaxray.parallel.mesh import batch_sharding
from jaxray.train.layout import trial_layout
from jaxray.train.loop import compile_train_step
from jaxray.train.step import dropout_keys

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "collective-broadcast",
)
# One HLO instruction: "%name = TYPE opcode(" (TYPE may be a tuple "(f32[2]{0}, s32[])").
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([a-z][a-z0-9\-]*)\(", re.MULTILINE)
_ELEMENT_TYPE = re.compile(r"\b([a-z]+[0-9]*)\[")
# opcode -> (the count it adds to, the attribute naming what is counted)
_LABELLED = {
    "custom-call": ("custom_calls", re.compile(r'custom_call_target="([^"]+)"')),
    "fusion": ("fusions", re.compile(r"\bkind=(k\w+)")),
}


def hlo_ops(text: str) -> dict[str, Any]:
    """Op counts of an HLO module's text (every computation, fused ones included): ``{"scatter":
    {dtype: n}, "gather": {dtype: n}, "collectives": {opcode: n}, "custom_calls": {target: n},
    "fusions": {kind: n}, "dots": n}``; an async collective counts once (its ``-start``)."""
    counts = {k: Counter() for k in ("scatter", "gather", "collectives", "custom_calls", "fusions")}
    dots = 0
    for line in text.splitlines():
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        type_text, opcode = match.groups()
        base = opcode.removesuffix("-start")  # an "-done" is no collective's name
        if opcode in ("scatter", "gather"):
            counts[opcode].update(set(_ELEMENT_TYPE.findall(type_text)))
        elif base in COLLECTIVES:
            counts["collectives"][base] += 1
        elif opcode in _LABELLED:
            key, attribute = _LABELLED[opcode]
            found = attribute.search(line)
            counts[key][found.group(1) if found else "?"] += 1
        elif opcode == "dot":
            dots += 1
    return {**{k: dict(c) for k, c in counts.items()}, "dots": dots}


def _memory(compiled) -> dict[str, int | None]:
    stats = compiled.memory_analysis()
    if stats is None:
        return {}
    memory = {
        "argument_bytes": stats.argument_size_in_bytes,
        "output_bytes": stats.output_size_in_bytes,
        "alias_bytes": stats.alias_size_in_bytes,
        "temp_bytes": stats.temp_size_in_bytes,
        "code_bytes": stats.generated_code_size_in_bytes,
    }
    memory["peak_bytes"] = (
        memory["argument_bytes"] + memory["output_bytes"] - memory["alias_bytes"] + memory["temp_bytes"]
    )
    # XLA's own figure where jaxlib has it; on CPU it leaves temporaries out, so it is only recorded.
    memory["xla_peak_bytes"] = getattr(stats, "peak_memory_in_bytes", None)
    return memory


def device_memory(device: jax.Device | None = None) -> tuple[int | None, str | None]:
    """(bytes, source): what the device's allocator may use ("device"), else for a CPU device the
    host's physical RAM ("host RAM"), else (None, None)."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]), "device"
    if device.platform == "cpu" and hasattr(os, "sysconf"):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host RAM"
    return None, None


def report(compiled, compile_s: float, device: jax.Device | None = None) -> dict[str, Any]:
    """The compile report of ``compiled`` (a ``jax.stages.Compiled``); see the module docstring."""
    device = device or jax.devices()[0]
    memory = _memory(compiled)
    limit, source = device_memory(device)
    peak = memory.get("peak_bytes")
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older jaxlibs: one dict per program
        cost = cost[0] if cost else {}
    cost = cost or {}
    return {
        "compile_s": compile_s,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "flops": cost.get("flops"),
        "bytes_accessed": cost.get("bytes accessed"),
        "memory": memory,
        "device_memory_bytes": limit,
        "memory_source": source,
        "fits": None if limit is None or peak is None else peak <= limit,
        "ops": hlo_ops(compiled.as_text()),
    }


def _size(n: float | None) -> str:
    """Bytes as MiB below 1 GiB, else GiB ("?" when unknown)."""
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def fits_text(rep: dict[str, Any]) -> str:
    """One line on whether the program's peak memory fits in the device's."""
    peak = rep["memory"].get("peak_bytes")
    if peak is None:
        return "peak memory unknown (no memory analysis on this backend)"
    text = f"peak {_size(peak)} per device"
    limit = rep["device_memory_bytes"]
    if limit is None:
        return f"{text}; the {rep['platform']} device reports no memory to compare with"
    verdict = "fits" if rep["fits"] else "does NOT fit"
    return f"{text} of {_size(limit)} ({rep.get('memory_source') or 'device'}): {verdict}"


def describe(trial, mesh) -> dict[str, Any]:
    """The config fields a compile report is read against (a TrialConfig on the jax Mesh it compiled for)."""
    m, batch, devices = trial.model, trial.train.global_batch, mesh.devices.size
    split = mesh.shape.get("data", 1) * mesh.shape.get("fsdp", 1)
    row = {
        "workload": m.workload,
        "dtype": m.dtype,
        "width": m.width,
        "global_batch": batch,
        "per_device_batch": batch // split,
        "devices": devices,
        **{axis: int(n) for axis, n in mesh.shape.items()},
    }
    if m.workload == "transformer":
        row.update(seq_len=trial.data.seq_len, num_layers=m.num_layers, num_heads=m.num_heads)
    return row


def render(rep: dict[str, Any]) -> str:
    """The report as a few lines of text for a terminal."""
    cfg, mem, ops = rep.get("config", {}), rep["memory"], rep["ops"]
    head = ", ".join(f"{k} {v}" for k, v in cfg.items())
    flops = rep.get("flops")
    lines = [
        f"compile report ({head})" if head else "compile report",
        f"  compile {rep['compile_s']:.2f} s on {rep['device_kind']} ({rep['platform']}); per device and "
        f"step: {'?' if flops is None else f'{flops / 1e12:.4g} TFLOP'}, "
        f"{_size(rep.get('bytes_accessed'))} accessed",
        f"  memory per device: arguments {_size(mem.get('argument_bytes'))}, "
        f"outputs {_size(mem.get('output_bytes'))} (aliased to donated arguments "
        f"{_size(mem.get('alias_bytes'))}), temporaries {_size(mem.get('temp_bytes'))}",
        f"  train state {_size(rep.get('state_bytes'))}, "
        f"{_size(rep.get('state_bytes_per_device'))} per device",
        f"  {fits_text(rep)}",
        f"  ops: scatter {ops['scatter'] or 'none'}; gather {ops['gather'] or 'none'}; collectives "
        f"{ops['collectives'] or 'none'}; custom calls {ops['custom_calls'] or 'none'}; fusions "
        f"{sum(ops['fusions'].values())} {ops['fusions'] or ''}; dots {ops['dots']}",
    ]
    return "\n".join(lines)


def abstract_batch(trial, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one global batch of ``trial``: ``tokens`` [B, T] int32, or ``image`` [B, 784]
    float32 and ``label`` [B] int32, split over the devices as training splits them."""
    b, sharding = trial.train.global_batch, batch_sharding(mesh)
    if trial.model.workload == "transformer":
        shapes = {"tokens": ((b, trial.data.seq_len), jnp.int32)}
    else:
        shapes = {"image": ((b, 784), jnp.float32), "label": ((b,), jnp.int32)}
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k, (shape, dtype) in shapes.items()}


# XLA aborts the process (not an exception) when an array's element count overflows int64.
MAX_ELEMENTS = 2**62


def check_extents(trial) -> None:
    """ConfigError when the largest array of ``trial``'s step has more elements than XLA can index."""
    m, b = trial.model, trial.train.global_batch
    rows = b * (trial.data.seq_len if m.workload == "transformer" else 1)
    largest = max(rows * max(4 * m.width, m.vocab_size, 784), 4 * m.width * m.width)
    if largest > MAX_ELEMENTS:
        raise ConfigError(
            f"global_batch {b} and width {m.width} make arrays of ~{largest:.2e} elements, more than "
            f"XLA can index (2**62); choose smaller sizes"
        )


def report_for(trial, mesh) -> dict[str, Any]:
    """Compile ``trial``'s train step for ``mesh`` from shapes alone and return its compile report
    with the config under ``config``. Raises ConfigError for a batch that does not divide, arrays
    too big for XLA, or cuDNN attention that cannot run."""
    check_trial(trial, mesh.shape)
    check_extents(trial)
    layout = trial_layout(trial, mesh)
    compiled, compile_s = compile_train_step(
        layout.model,
        layout.tx,
        mesh,
        layout.state,
        abstract_batch(trial, mesh),
        dropout=dropout_keys(trial),
        shardings=layout.shardings,
    )
    return {
        "config": describe(trial, mesh),
        **report(compiled, compile_s, mesh.local_devices[0]),
        **state_bytes(layout.state),
    }


def state_bytes(state) -> dict[str, int]:
    """``state_bytes``: the train state's bytes; ``state_bytes_per_device``: one device's share as
    training lays it out, from shapes alone (``state``: ``Layout.state``, leaves carrying shardings)."""
    leaves = jax.tree.leaves(state)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    return {"state_bytes": total, "state_bytes_per_device": per_device}
