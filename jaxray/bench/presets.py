"""Sizes (dicts of ``make_spec`` arguments) per benchmark from ``presets.yaml``: ``cpu``, ``gpu``, ``tiny``;
``MODEL_SIZES``: the shapes ``--model-preset NAME`` selects. Imports no JAX."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from jaxray.config.experiment import MODEL_PRESETS

Size = dict[str, Any]
_GPT2 = MODEL_PRESETS["gpt2_small"]
MODEL_SIZES = {"gpt2_small": {"workload": "transformer", **_GPT2, "seq_len": _GPT2["max_seq_len"]}}


@dataclass(frozen=True)
class Preset:
    """Per-benchmark sizes; in ``devices`` a ``global_batch`` is the per-device batch."""

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
    check_attention: Size = field(default_factory=dict)
    check: list[Size] = field(default_factory=list)
    check_sweep: str | None = None  # a jaxray.tune config, run under Ray first by ``bench check``


_DOC = yaml.safe_load(Path(__file__).with_name("presets.yaml").read_text())
PRESETS = {name: Preset(name=name, **fields) for name, fields in _DOC["presets"].items()}
