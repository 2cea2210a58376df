"""Data parallelism on 4 forced CPU devices equals the 1-device step on the same global batch, so does
training through ``train`` on (fsdp 4) and (fsdp 2 x tensor 2) meshes, and the explicit ``shard_map``
step equals the auto-sharded one (test_mesh_parity.py: every mesh's gradients and layouts)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxray.config import DEFAULT_LEARNING_RATE

SCRIPT = Path(__file__).with_name("four_device_parity.py")
TOL = 1e-5  # float32 reductions in another order; fixed, never loosened to pass


# shard_map vs auto-sharded, 5 steps on 4 devices. Both average the same per-example values, in a
# different order (per-device means then pmean, against XLA's partial sums then all-reduce), so
# only float32 rounding separates them: observed max |diff| is ~1e-7 for losses and grad norms and
# ~2e-7 for params. Params are held to the absolute bound alone (stricter than allclose with rtol).
SM_RTOL, SM_ATOL = 1e-5, 1e-6  # fixed, never loosened to pass
SM_STEPS = 5


def _run_script(real_dir, *mode: str) -> dict:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(real_dir), *mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# The parity tests below: one 4-device subprocess training 8 runs (about a minute), so CI's slow
# part runs them; tests/train/test_shard_map_step.py and the data-sharding checks stay fast.
SLOW_PARITY = pytest.mark.slow


@pytest.fixture(scope="module")
def parity(real_dir):
    return _run_script(real_dir)


@pytest.fixture(scope="module")
def shard_map_parity(real_dir):
    return _run_script(real_dir, "shard_map")


@SLOW_PARITY
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_batch_sharded_params_replicated(parity, workload):
    r = parity[workload]
    assert r["devices"] == 4
    assert r["batch_spec"] == ["data"]
    assert [shape[0] for shape in r["batch_shards"]] == [4, 4, 4, 4]  # global batch 16 over 4 devices
    assert r["params_replicated"]


@SLOW_PARITY
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_four_devices_match_one_device(parity, workload):
    r = parity[workload]
    np.testing.assert_allclose(r["loss_4"], r["loss_1"], rtol=TOL, atol=TOL)
    assert r["max_param_diff"] < TOL
    # Zero-gradient key bias: Adam moves it by at most ~learning rate (3e-4) per step either way.
    assert r["max_key_bias_diff"] < 2 * 3e-4 * 4
    assert abs(r["eval_4"] - r["eval_1"]) < TOL


@SLOW_PARITY
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
@pytest.mark.parametrize("mesh", ["fsdp4", "fsdp2_tensor2"])
def test_sharded_state_trains_like_one_device(parity, workload, mesh):
    r = parity[workload]["sharded"][mesh]
    np.testing.assert_allclose(r["loss"], parity[workload]["loss_1"], rtol=TOL, atol=TOL)
    assert r["max_param_diff"] < TOL and abs(r["eval"] - parity[workload]["eval_1"]) < TOL
    assert r["max_key_bias_diff"] < 2 * 3e-4 * 4  # as above
    # XLA gathers the split params (all-gathers) and reduces their gradients: never a scatter
    # (a 16-bit scatter-add is a compare-and-swap loop on NVIDIA GPUs: tests/train/test_no_scatter.py).
    assert r["ops"]["scatter"] == {} and "all-gather" in r["ops"]["collectives"], r["ops"]


@pytest.mark.slow  # a 4-device subprocess per workload (30 s); tests/train/test_shard_map_step.py stays fast
@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_shard_map_step_matches_auto_sharded_step(shard_map_parity, workload):
    r = shard_map_parity[workload]
    auto, explicit = r["auto"], r["shard_map"]
    assert r["devices"] == 4 and len(auto["loss"]) == SM_STEPS
    # grad_norm is the direct check that the grads are averaged, not summed: Adam's scale invariance
    # leaves a devices x too large gradient only faintly visible in the loss and params.
    for metric in ("loss", "accuracy", "grad_norm"):
        np.testing.assert_allclose(explicit[metric], auto[metric], rtol=SM_RTOL, atol=SM_ATOL, err_msg=metric)
    assert r["max_param_diff"] < SM_ATOL
    if workload == "transformer":
        # Zero-gradient key bias (see jaxray.bench.parity): at most ~lr per step either way.
        assert r["max_key_bias_diff"] < 2 * DEFAULT_LEARNING_RATE["transformer"] * SM_STEPS
