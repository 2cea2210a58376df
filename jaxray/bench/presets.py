"""Sizes for each benchmark, kept as data in ``presets.yaml`` beside this module: ``cpu`` finishes
``python -m jaxray.bench all`` on a 2-core CPU in under 10 minutes; ``gpu`` uses the learning path's
sizes (labs 4, 6 and 7); ``tiny`` takes seconds per suite (tests, first check on a new machine).

A size is a dict of ``make_spec`` arguments (workload, global_batch, width, seq_len, ... and the
timing fields steps, repeats, warmup). ``MODEL_SIZES``: model shapes ``throughput --model-preset
NAME`` selects (the other options given still win).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxray.config.experiment import MODEL_PRESETS

Size = dict[str, Any]

# GPT-2 small's shape (D 768, 12 layers, 12 heads) over full 1024-byte windows: a GPU-sized step.
_GPT2_SMALL: Size = {
    "workload": "transformer",
    **MODEL_PRESETS["gpt2_small"],
    "seq_len": MODEL_PRESETS["gpt2_small"]["max_seq_len"],
}
MODEL_SIZES: dict[str, Size] = {"gpt2_small": _GPT2_SMALL}


@dataclass(frozen=True)
class Preset:
    """Per-benchmark sizes. In ``devices`` a size's ``global_batch`` is the per-device batch of the
    weak-scaling runs; ``sweep_batches``: the global batches of ``batch-sweep``."""

    name: str
    dispatch: Size
    dispatch_eager_steps: int
    precision: list[Size]
    devices: list[Size]
    shard_map: list[Size]
    sweep: Size
    sweep_batches: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096])
    attention: Size = field(default_factory=dict)
    throughput: Size = field(default_factory=dict)


PRESETS_FILE = Path(__file__).with_name("presets.yaml")


def _load(path: Path) -> dict[str, Preset]:
    """{name: Preset} from ``path``'s ``presets`` mapping (its sizes merge shared model shapes)."""
    doc = yaml.safe_load(path.read_text())
    return {name: Preset(name=name, **fields) for name, fields in doc["presets"].items()}


PRESETS = _load(PRESETS_FILE)
