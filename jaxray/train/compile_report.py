"""The compile report (``compile.json``) of an AOT-compiled program: ``compile_s`` (s), XLA's
``flops`` and ``bytes_accessed`` per device, ``memory`` per device in bytes (``peak_bytes`` =
argument + output - alias + temp, as MaxText's ``print_compiled_memory_stats``),
``device_memory_bytes`` with its ``memory_source`` ("device" or "host RAM") and ``fits``, and
``ops`` counted from the optimised HLO (``hlo_ops``: scatters, gathers, collectives, custom calls,
fusions, dots)."""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

import jax

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
