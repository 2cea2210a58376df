"""Sizes for each benchmark: ``cpu`` finishes ``python -m jaxray.bench all`` on a 2-core CPU in
under 10 minutes; ``gpu`` uses the learning path's sizes (labs 4, 6 and 7); ``tiny`` takes seconds
per suite (tests, first check on a new machine).

A size is a dict of ``make_spec`` arguments (workload, global_batch, width, seq_len, ... and the
timing fields steps, repeats, warmup). ``MODEL_SIZES``: model shapes ``throughput --model-preset
NAME`` selects (the other options given still win).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxray.config.experiment import MODEL_PRESETS

Size = dict[str, Any]

# A small transformer keeps CPU runs short; the GPU preset uses lab 7's model (d_model 256, 4 layers).
_CPU_LM: Size = {"workload": "transformer", "width": 128, "seq_len": 128, "max_seq_len": 128}
_GPU_LM: Size = {"workload": "transformer", "width": 256, "seq_len": 256}
# GPT-2 small's shape (D 768, 12 layers, 12 heads) over full 1024-byte windows: a GPU-sized step.
_GPT2_SMALL: Size = {
    "workload": "transformer",
    **MODEL_PRESETS["gpt2_small"],
    "seq_len": MODEL_PRESETS["gpt2_small"]["max_seq_len"],
}
MODEL_SIZES: dict[str, Size] = {"gpt2_small": _GPT2_SMALL}


@dataclass(frozen=True)
class Preset:
    """Per-benchmark sizes. ``devices_per_device_batch``: per-device batch of the weak-scaling runs;
    ``sweep_batches``: the global batches of ``batch-sweep``."""

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


CPU = Preset(
    name="cpu",
    dispatch={"workload": "mlp", "global_batch": 512, "steps": 100, "repeats": 5},
    dispatch_eager_steps=5,
    precision=[
        {"workload": "mlp", "global_batch": 512, "steps": 100, "repeats": 5},
        {"workload": "shared_block_mlp", "width": 512, "global_batch": 256, "steps": 20, "repeats": 5},
        {**_CPU_LM, "global_batch": 16, "steps": 4, "repeats": 5},
    ],
    devices=[
        {"workload": "mlp", "global_batch": 256, "steps": 50, "repeats": 5},
        {**_CPU_LM, "global_batch": 4, "steps": 4, "repeats": 5},
    ],
    shard_map=[
        {"workload": "mlp", "global_batch": 512, "steps": 50, "repeats": 5},
        {**_CPU_LM, "global_batch": 16, "steps": 4, "repeats": 5},
    ],
    sweep={"workload": "mlp", "steps": 30, "repeats": 5},
    attention={**_CPU_LM, "global_batch": 16, "steps": 4, "repeats": 5},
    throughput={"workload": "transformer", "global_batch": 16, "seq_len": 256, "steps": 5, "repeats": 3},
)

GPU = Preset(
    name="gpu",
    dispatch={"workload": "mlp", "global_batch": 512, "steps": 200, "repeats": 5},
    dispatch_eager_steps=10,
    precision=[
        {"workload": "mlp", "global_batch": 512, "steps": 200, "repeats": 3},
        {"workload": "shared_block_mlp", "width": 1024, "global_batch": 2048, "steps": 50, "repeats": 3},
        {**_GPU_LM, "global_batch": 64, "steps": 50, "repeats": 3},
    ],
    devices=[
        {"workload": "shared_block_mlp", "width": 1024, "global_batch": 1024, "steps": 50, "repeats": 3},
        {**_GPU_LM, "global_batch": 32, "steps": 50, "repeats": 3},
    ],
    shard_map=[
        {"workload": "shared_block_mlp", "width": 1024, "global_batch": 4096, "steps": 50, "repeats": 3},
        {**_GPU_LM, "global_batch": 64, "steps": 50, "repeats": 3},
    ],
    sweep={"workload": "shared_block_mlp", "width": 1024, "steps": 50, "repeats": 3},
    sweep_batches=[256, 512, 1024, 2048, 4096, 8192, 16384],
    attention={**_GPU_LM, "dtype": "bfloat16", "global_batch": 64, "steps": 50, "repeats": 3},
    throughput={**_GPU_LM, "global_batch": 64, "steps": 50, "repeats": 3},
)


# Seconds per suite: what the tests run (and a quick check that everything works on a new machine).
# Its sweep holds a size 4 devices do not divide (6) and one larger than the data (120000), so the
# skip and failure rows are exercised on real runs.
_TINY_LM: Size = {"workload": "transformer", "width": 32, "num_layers": 1, "seq_len": 32, "max_seq_len": 32}
TINY = Preset(
    name="tiny",
    dispatch={"workload": "mlp", "width": 32, "global_batch": 32, "steps": 4, "repeats": 2},
    dispatch_eager_steps=2,
    precision=[
        {"workload": "mlp", "width": 32, "global_batch": 64, "steps": 4, "repeats": 2},
        {**_TINY_LM, "global_batch": 4, "steps": 2, "repeats": 2},
    ],
    devices=[
        {"workload": "mlp", "width": 32, "global_batch": 16, "steps": 4, "repeats": 2},
        {**_TINY_LM, "global_batch": 2, "steps": 2, "repeats": 2},
    ],
    shard_map=[
        {"workload": "mlp", "width": 32, "global_batch": 32, "steps": 4, "repeats": 2},
        {**_TINY_LM, "global_batch": 8, "steps": 2, "repeats": 2},
    ],
    sweep={"workload": "mlp", "width": 32, "steps": 2, "repeats": 2},
    sweep_batches=[6, 64, 128, 120000],
    attention={**_TINY_LM, "global_batch": 4, "steps": 2, "repeats": 2},
    throughput={"workload": "mlp", "width": 32, "global_batch": 64, "steps": 4, "repeats": 2},
)

PRESETS = {"cpu": CPU, "gpu": GPU, "tiny": TINY}
