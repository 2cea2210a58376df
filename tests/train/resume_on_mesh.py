"""Run in a subprocess with 4 forced host devices: train on a mesh of ``--save-devices`` devices
(params split ``--save-fsdp`` ways) with a full-state checkpoint at step K, continue there to step
N, then restore that checkpoint onto a mesh of ``--restore-devices`` devices (``--restore-fsdp``)
and continue to N. Prints one JSON line: both runs' logged losses after K, and each run's largest
param's devices and shard shape."""

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

from jaxray.checkpoint import save_state  # noqa: E402
from jaxray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig  # noqa: E402
from jaxray.data.batching import train_batches  # noqa: E402
from jaxray.data.workloads import load_arrays  # noqa: E402
from jaxray.parallel.mesh import make_mesh  # noqa: E402
from jaxray.train.run import train  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--save-devices", type=int, required=True)
p.add_argument("--restore-devices", type=int, required=True)
p.add_argument("--save-fsdp", type=int, default=1)
p.add_argument("--restore-fsdp", type=int, default=1)
a = p.parse_args()
K, N = 6, 12
trial = TrialConfig(
    model=ModelConfig(workload="transformer", width=64, num_layers=2, num_heads=2, max_seq_len=64),
    train=TrainConfig(steps=N, global_batch=16, learning_rate=3e-3, log_every=1, checkpoint_every=K),
    data=DataConfig(seq_len=64),
)
train_arrays, held_out = load_arrays(trial)
saved = {}


def save(step, state, history):
    saved[step] = save_state(tempfile.mkdtemp() + "/ckpt", state, trial, history, {})


def batches():
    return train_batches(train_arrays, 16, trial.train.seed)


first_mesh = make_mesh(jax.devices()[: a.save_devices], fsdp=a.save_fsdp)
first = train(trial, batches(), held_out, first_mesh, save=save)
second_mesh = make_mesh(jax.devices()[: a.restore_devices], fsdp=a.restore_fsdp)
second = train(trial, batches(), held_out, second_mesh, resume=saved[K])


def largest(params) -> dict:
    x = max(jax.tree.leaves(params), key=lambda leaf: leaf.size)
    shard = x.addressable_shards[0].data.shape
    return {"devices": len(x.sharding.device_set), "shape": x.shape, "shard": shard}


print(
    json.dumps(
        {
            "continued": [r["loss"] for r in first.history if r["step"] > K],
            "restored": [r["loss"] for r in second.history if r["step"] > K],
            "restored_steps": [r["step"] for r in second.history],
            "largest": [largest(first.state.params), largest(second.state.params)],
            "resumed_from_step": second.summary["resumed_from_step"],
        }
    )
)
sys.stdout.flush()
