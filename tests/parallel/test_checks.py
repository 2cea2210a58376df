"""jaxray.parallel.checks: what parsing does not refuse is refused before anything expensive runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxray.config import ConfigError, parse_trial
from jaxray.config.experiment import load_experiment
from jaxray.parallel.checks import check_attention, check_experiment, check_trial
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import train

ROOT = Path(__file__).resolve().parents[2]
CUDNN_SWEEP = """
experiment: cudnn
sweeps:
  - workload: transformer
    model: {attention: cudnn}
    search_space: {global_batch: [8], dtype: [bfloat16]}
"""


def cudnn_trial(dtype="bfloat16", use_gpu=False):
    return parse_trial(
        {
            "model": {"workload": "transformer", "dtype": dtype, "attention": "cudnn"},
            "workers": {"use_gpu": use_gpu},
        }
    )


def test_cudnn_without_gpu_workers_parses_but_is_refused():
    trial = cudnn_trial()  # parsing no longer decides: jaxray.config imports no model code
    with pytest.raises(ConfigError) as err:
        check_attention(trial)
    assert str(err.value) == (
        "invalid config (trial):\n  (top level): model.attention 'cudnn' cannot run: it needs GPU "
        "workers (workers.use_gpu: true); use 'auto' (cuDNN where it can run, else XLA) or 'xla'"
    )


def test_every_reason_is_named_and_a_feasible_request_passes():
    with pytest.raises(ConfigError, match="dtype float32 is not bfloat16 or float16"):
        check_attention(cudnn_trial(dtype="float32", use_gpu=True))
    check_attention(cudnn_trial(use_gpu=True))  # the compute capability is the worker's to check
    check_attention(parse_trial({"model": {"workload": "transformer", "attention": "xla"}}))


def test_check_trial_checks_the_mesh_and_the_attention():
    assert check_trial(parse_trial({"model": {"workload": "mlp"}, "train": {"global_batch": 8}}), 4) == 2
    with pytest.raises(ConfigError, match="global_batch 8 is not divisible by the device count 3"):
        check_trial(parse_trial({"model": {"workload": "mlp"}, "train": {"global_batch": 8}}), 3)
    with pytest.raises(ConfigError, match="model.attention 'cudnn' cannot run"):
        check_trial(cudnn_trial(), 1)


def test_check_experiment_names_the_file_and_the_sweep(tmp_path):
    path = tmp_path / "cudnn.yaml"
    path.write_text(CUDNN_SWEEP)
    exp = load_experiment(path)
    with pytest.raises(ConfigError) as err:
        check_experiment(exp, str(path))
    assert str(err.value).startswith(
        f"invalid config {path}:\n  sweeps.0: model.attention 'cudnn' cannot run: it needs GPU workers"
    )


def test_train_refuses_before_compiling():
    with pytest.raises(ConfigError, match="model.attention 'cudnn' cannot run"):
        train(cudnn_trial(), iter(()), {}, make_mesh())


def test_tune_refuses_cudnn_without_gpus_before_starting_ray(tmp_path):
    path = tmp_path / "cudnn.yaml"
    path.write_text(CUDNN_SWEEP)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.tune", "--config", str(path), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: invalid config {path}:\n  sweeps.0: model.attention 'cudnn' cannot run" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
