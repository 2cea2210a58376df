"""tune_configs/sharded_cpu.yaml end to end: 2 Ray Train workers x 2 forced CPU devices on a (fsdp 2,
tensor 2) mesh, fsdp across the workers; each worker writes its shards of every checkpoint, which
then restores onto any mesh and device count with the next step's loss unchanged, and generates
text on one device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_tune_smoke import tune

from jaxray import checkpoint, runs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a real 2-worker sweep: about 2 minutes
LOSS_TOL = 1e-5  # the next step's loss on another mesh: the same sums in another order


@pytest.fixture(scope="module")
def sharded(real_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded")
    tune(ROOT / "tune_configs" / "sharded_cpu.yaml", out, real_dir)
    run = runs.run_folders(out)[0]
    row = json.loads((run / "summary.json").read_text())[0]
    return run, row, runs.open_checkpoint(run).path


def test_a_device_holds_a_quarter_of_the_state(sharded):
    _, row, _ = sharded
    assert row["mesh"] == "fsdp=2,tensor=2" and row["devices"] == 4 and row["restarts"] == 0
    # Norm scales, head-dim biases and the position table's rows stay whole: a little over 1/4.
    assert row["state_bytes"] / 4 <= row["state_bytes_per_device"] < 1.1 * row["state_bytes"] / 4, row


def test_each_worker_wrote_its_own_shards(sharded):
    _, _, final = sharded
    assert checkpoint.open(final, full_state=True).state["step"] == 100
    for item in (checkpoint.PARAMS_DIR, checkpoint.OPT_STATE_DIR):
        writers = sorted(p.name for p in (final / item).glob("ocdbt.process_*"))
        assert writers == ["ocdbt.process_0", "ocdbt.process_1"], writers
    periodic = sorted(final.parent.glob("checkpoint_step_00000050_*"))
    assert len(periodic) == 1 and checkpoint.verify(periodic[0])["step"] == 50  # committed later


def test_restores_onto_any_mesh_with_the_next_steps_loss_unchanged(sharded, real_dir, tmp_path):
    _, _, final = sharded
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env["JAXRAY_DATA_DIR"] = str(real_dir)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("restore_chain.py")), str(final), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    links = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [link["mesh"] for link in links] == ["fsdp=4", "data=1", "data=2,fsdp=2"]
    assert all(link["same"] and link["step"] == 100 for link in links), links  # restores are exact
    losses = [link["loss"] for link in links]
    assert max(losses) - min(losses) < LOSS_TOL, losses


def test_its_checkpoint_generates_on_one_device(sharded, real_dir):
    run, _, _ = sharded
    env = {**os.environ, "JAXRAY_DATA_DIR": str(real_dir), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.generate", "--checkpoint", str(run), "--prompt", "ROMEO:"]
        + ["--max-new-tokens", "20", "--seed", "0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout.strip()) > len("ROMEO:"), proc.stdout
