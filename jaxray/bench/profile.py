"""Where a compiled step's device time goes: a ``jax.profiler`` trace of a few steps, its per-op times
(read with ``jax.profiler.ProfileData``) grouped by what each HLO op computes: attention (its named
scope, the splash kernels), matmul (a dot or convolution in the op or its fusion: a weight gradient
fused with the optimizer counts here), then the named scopes optimizer, loss, norm and embed, then
collectives and other (element-wise, copies). Shares are of the summed op time; a while loop's own
event is left out (its body's ops are counted)."""

from __future__ import annotations

import re
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
from jax.profiler import ProfileData

SCOPES = ("attention", "optimizer", "loss", "norm", "embed")  # attention, matmul, then the first found
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.+?\s([a-z][a-z0-9\-]*)\(")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_NAME_PARTS = re.compile(r"[/()]")
_EVENT_NAME = re.compile(r"^%?([\w.\-]+)\s*=")  # TPU events are named by the instruction's text
CONTAINERS = ("while", "call", "conditional")  # their time is their body ops' time: not counted twice


def op_groups(hlo_text: str) -> dict[str, str]:
    """{HLO instruction name: group} of a compiled module's text; a fusion is grouped by all it fuses."""
    computations: dict[str, list[tuple[str, str, str, str]]] = defaultdict(list)
    current = ""
    for line in hlo_text.splitlines():
        if (head := _COMPUTATION.match(line)) and "=" not in line.split("{")[0]:
            current = head.group(1)
        elif inst := _INSTRUCTION.match(line):
            calls, name = _CALLS.search(line), _OP_NAME.search(line)
            computations[current].append(
                (inst.group(1), inst.group(2), calls.group(1) if calls else "", name.group(1) if name else "")
            )

    def contents(computation: str, seen: frozenset = frozenset()) -> set[tuple[str, str]]:
        """(opcode, op_name) of every instruction of ``computation`` and of what it calls."""
        found = set()
        for _, opcode, calls, op_name in computations.get(computation, []):
            found.add((opcode, op_name))
            if calls and calls not in seen:
                found |= contents(calls, seen | {computation})
        return found

    groups = {}
    for instructions in computations.values():
        for inst, opcode, calls, op_name in instructions:
            found = (contents(calls) if calls else set()) | {(opcode, op_name)}
            parts = {part for _, n in found for part in _NAME_PARTS.split(n)}  # "transpose(jvp(attention))"
            scopes = [s for s in SCOPES if s in parts]
            if opcode in CONTAINERS:
                groups[inst] = "container"
            elif "attention" in scopes or "splash" in inst:
                groups[inst] = "attention"
            elif any(op in ("dot", "convolution") for op, _ in found):
                groups[inst] = "matmul"
            elif scopes:
                groups[inst] = scopes[0]
            elif any(opcode.startswith(c) for c in COLLECTIVES):
                groups[inst] = "collectives"
            else:
                groups[inst] = "other"
    return groups


def group_of(op: str, groups: dict[str, str]) -> str:
    """``op``'s group; an op the module text does not name is grouped by its own name (the splash
    kernels' custom calls are named ``splash_mha_*``), else "other"."""
    return groups.get(op) or ("attention" if "splash" in op else "other")


def device_op_times(xplane: Path) -> Counter:
    """{HLO op name: summed ns} of the ops the device ran in a trace (TPU/GPU: the device planes'
    "XLA Ops" lines; CPU: the host events that carry an ``hlo_op``)."""
    times: Counter = Counter()
    for plane in ProfileData.from_file(str(xplane)).planes:
        on_device = plane.name.startswith("/device:")
        for line in plane.lines:
            if on_device and line.name != "XLA Ops":
                continue
            for event in line.events:
                stats = dict(event.stats)
                if on_device or "hlo_op" in stats:
                    name = str(stats.get("hlo_op", event.name))
                    times[m.group(1) if (m := _EVENT_NAME.match(name)) else name] += event.duration_ns
    return times


def shares(groups: dict[str, float]) -> str:
    """``profile``'s ``{group: share}`` as a report's words: "matmul 41%, attention 30%, ..."."""
    return ", ".join(f"{g} {share:.0%}" for g, share in groups.items())


def profile(compiled, run_steps: Callable[[], Any], top: int = 25) -> dict[str, Any]:
    """Trace ``run_steps()`` (which runs the ``compiled`` step a few times and returns what to wait on)
    and group its device time: ``{"groups": {group: share}, "group_ms": {group: ms}, "top_ops":
    [{op, group, ms}], "total_ms"}`` (ms summed over the traced steps)."""
    groups = op_groups(compiled.as_text())
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder)
        try:
            jax.block_until_ready(run_steps())
        finally:
            jax.profiler.stop_trace()
        traces = sorted(Path(folder).rglob("*.xplane.pb"))
        times = device_op_times(traces[-1]) if traces else Counter()
    times = Counter({op: ns for op, ns in times.items() if groups.get(op) != "container"})
    by_group: Counter = Counter()
    for op, ns in times.items():
        by_group[group_of(op, groups)] += ns
    total = sum(by_group.values()) or 1
    return {
        "total_ms": total / 1e6,
        "groups": {g: ns / total for g, ns in by_group.most_common()},
        "group_ms": {g: ns / 1e6 for g, ns in by_group.most_common()},
        "top_ops": [
            {"op": op, "group": group_of(op, groups), "ms": ns / 1e6} for op, ns in times.most_common(top)
        ],
    }
