"""The same numbers on any (data, fsdp, tensor) mesh of 4 forced CPU devices: logits, loss, every
gradient (the token embedding's too: openxla/xla#42481 put a gather's gradient in the wrong rows
under a sharded reduction on jaxlib 0.10.2) and the params after 3 AdamW steps, for the transformer
and both MLPs; each param and Adam moment laid out as ``jaxray.parallel.mesh.RULES`` says, each
device holding its share, and the tensor meshes' compiled step all-reducing over the tensor groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxray.config import DEFAULT_LEARNING_RATE
from jaxray.models.axes import PARAM_AXES
from jaxray.parallel.mesh import RULES

SCRIPT = Path(__file__).with_name("mesh_parity.py")
WORKLOADS = ["mlp", "shared_block_mlp", "transformer"]
MESHES = {  # name: (data, fsdp, tensor), as mesh_parity.MESHES builds them on 4 devices
    "data4": (4, 1, 1),
    "fsdp4": (1, 4, 1),
    "tensor4": (1, 1, 4),
    "data2_tensor2": (2, 1, 2),
    "fsdp2_tensor2": (1, 2, 2),
}
STEPS = 3
# Stated tolerances (float32). Observed on jaxlib 0.10.2: logits 2.7e-6, loss 9.5e-7, gradients 1.4e-6
# of their largest magnitude.
LOGITS_TOL, LOSS_TOL, GRAD_RTOL = 1e-5, 1e-5, 1e-5
# Adam divides each gradient by its own running magnitude, so rounding in a near-zero gradient can
# move that param's update by a fraction of the learning rate: params within lr / 30. The largest
# difference depends on the CPU's kernels: lr / 270 (MLP) on one 2026-12-04 machine; lr / 107 (MLP)
# and lr / 91 (transformer, data 2 x tensor 2) on an AVX-512 Xeon the same day, where lr / 100 failed.
PARAM_TOL = {w: DEFAULT_LEARNING_RATE[w] / 30 for w in WORKLOADS}


@pytest.fixture(scope="module")
def parity(real_dir):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(real_dir)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


pytestmark = pytest.mark.slow  # one 4-device subprocess, 18 meshes x workloads (about 75 s)


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_same_numbers_on_every_mesh(parity, workload, mesh):
    r = parity[workload][mesh]
    assert r["logits"] < LOGITS_TOL and r["loss"] < LOSS_TOL, r
    worst = max(r["grads"].items(), key=lambda kv: kv[1])
    assert worst[1] < GRAD_RTOL, worst
    assert r["max_param_diff"] < PARAM_TOL[workload]
    # The zero-gradient key bias: Adam moves it by at most ~lr per step either way.
    assert r["max_key_bias_diff"] < 2 * DEFAULT_LEARNING_RATE[workload] * STEPS


def test_every_gradient_is_compared_including_the_embeddings(parity):
    grads = parity["transformer"]["fsdp2_tensor2"]["grads"]
    assert {"token_embed.embedding", "pos_embed.embedding", "lm_head.kernel"} <= set(grads)
    assert len(grads) == 2 + 16 * 2 + 3  # embeddings, 16 per block, final norm (2) and LM head
    assert grads["token_embed.embedding"] < GRAD_RTOL


def _expected(name: str, mesh: tuple[int, int, int]) -> list:
    """The spec RULES give param ``name`` on a mesh of (data, fsdp, tensor) sizes, size-1 axes left out."""
    keys = [k for k in name.split(".") if not k.isdigit()]
    axes = PARAM_AXES.get(tuple(keys[-2:])) or PARAM_AXES[tuple(keys[-1:])]
    sizes = dict(zip(("data", "fsdp", "tensor"), mesh))
    spec = []
    for logical in axes:
        rule = RULES.get(logical)
        kept = [a for a in ([rule] if isinstance(rule, str) else rule or []) if sizes[a] > 1]
        spec.append(kept[0] if len(kept) == 1 else (kept or None))
    return spec


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("mesh", list(MESHES))
def test_params_and_adam_moments_follow_the_rules(parity, workload, mesh):
    r = parity[workload][mesh]
    specs = r["specs"]
    for name, spec in specs["params"].items():
        assert spec == _expected(name, MESHES[mesh]), name
        assert specs["mu"][name] == spec and specs["nu"][name] == spec, name
    data, fsdp, tensor = MESHES[mesh]
    split = fsdp * tensor
    # Norm scales, head-dim biases and the like stay whole: a device holds a little over 1/split.
    assert 1 / split <= r["params_share"] < 1.1 / split, r["params_share"]
    assert 1 / split <= r["opt_state_share"] < 1.1 / split, r["opt_state_share"]
    assert not r["scatter"]  # a 16-bit scatter-add is a compare-and-swap loop on NVIDIA GPUs


def test_the_rules_as_the_field_names_them():
    named = {  # on (fsdp 2 x tensor 2): embed -> fsdp; heads, mlp, vocab -> tensor; the rest whole
        "token_embed.embedding": ["tensor", "fsdp"],
        "blocks.0.attn.query.kernel": ["fsdp", "tensor", None],
        "blocks.0.attn.out.kernel": ["tensor", None, "fsdp"],
        "blocks.0.fc_up.kernel": ["fsdp", "tensor"],
        "blocks.0.fc_down.kernel": ["tensor", "fsdp"],
        "blocks.0.ln1.scale": [None],
        "lm_head.kernel": ["fsdp", "tensor"],
        "w1": ["fsdp", "tensor"],
        "w2": ["tensor", "fsdp"],
    }
    assert {name: _expected(name, (1, 2, 2)) for name in named} == named
    assert RULES["batch"] == ("data", "fsdp")


# The transformer on every tensor mesh; the MLP (width 32) where fsdp does not also split it: with
# fsdp 2 x tensor 2 XLA all-gathers its small activations over tensor instead of all-reducing them.
@pytest.mark.parametrize(
    ("workload", "mesh"),
    [("transformer", m) for m in ("tensor4", "data2_tensor2", "fsdp2_tensor2")]
    + [("mlp", m) for m in ("tensor4", "data2_tensor2")],
)
def test_tensor_meshes_all_reduce_over_the_tensor_groups(parity, workload, mesh):
    data, fsdp, tensor = MESHES[mesh]
    groups = np.arange(4).reshape(-1, tensor).tolist()  # consecutive devices: tensor is the last axis
    assert groups in parity[workload][mesh]["all_reduce_groups"], parity[workload][mesh]["all_reduce_groups"]
