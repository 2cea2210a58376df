"""jaxray.parallel.checks: what parsing does not refuse is refused before anything expensive runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jaxray.config import ConfigError, parse_trial
from jaxray.config.experiment import load_experiment
from jaxray.models.attention import AttentionError
from jaxray.parallel.checks import check_attention, check_trial, plan_experiment
from jaxray.parallel.mesh import make_mesh
from jaxray.train.layout import trial_layout

ROOT = Path(__file__).resolve().parents[2]
CUDNN_SWEEP = """
experiment: cudnn
sweeps:
  - workload: transformer
    model: {attention: cudnn}
    search_space: {global_batch: [8], dtype: [bfloat16]}
"""


def cudnn_trial(dtype="bfloat16", accelerator="cpu", attention="cudnn", seq=256):
    return parse_trial(
        {
            "model": {"workload": "transformer", "dtype": dtype, "attention": attention, "max_seq_len": seq},
            "data": {"seq_len": seq},
            "workers": {"accelerator": accelerator},
        }
    )


def test_cudnn_without_gpu_workers_parses_but_is_refused():
    trial = cudnn_trial()  # parsing no longer decides: jaxray.config imports no model code
    with pytest.raises(ConfigError) as err:
        check_attention(trial)
    assert str(err.value) == (
        "invalid config (trial):\n  (top level): model.attention 'cudnn' cannot run: it needs GPU "
        "workers (workers.accelerator: gpu); use 'auto' (chosen for the device) or 'xla'"
    )


def test_every_reason_is_named_and_a_feasible_request_passes():
    with pytest.raises(ConfigError, match="dtype float32 is not bfloat16 or float16"):
        check_attention(cudnn_trial(dtype="float32", accelerator="gpu"))
    check_attention(cudnn_trial(accelerator="gpu"))  # the compute capability is the worker's to check
    check_attention(parse_trial({"model": {"workload": "transformer", "attention": "xla"}}))


def test_check_trial_checks_the_mesh_and_the_attention():
    mlp = parse_trial({"model": {"workload": "mlp"}, "train": {"global_batch": 8}})
    assert check_trial(mlp, {"data": 4, "fsdp": 1, "tensor": 1}) == 2
    with pytest.raises(
        ConfigError, match="global_batch 8 is not divisible by the 3 devices it is split over"
    ):
        check_trial(mlp, {"data": 3, "fsdp": 1, "tensor": 1})
    with pytest.raises(ConfigError, match="model.attention 'cudnn' cannot run"):
        check_trial(cudnn_trial(), {"data": 1})


def test_plan_experiment_names_the_file_and_the_sweep(tmp_path):
    path = tmp_path / "cudnn.yaml"
    path.write_text(CUDNN_SWEEP)
    exp = load_experiment(path)
    with pytest.raises(ConfigError) as err:
        plan_experiment(exp, str(path))
    assert str(err.value).startswith(
        f"invalid config {path}:\n  sweeps.0: model.attention 'cudnn' cannot run: it needs GPU workers"
    )


def test_an_elastic_sweep_is_checked_on_the_mesh_of_every_size(tmp_path):
    """num_workers [3, 4] with fsdp -1: 4 workers split width 32 on fsdp 4, 3 workers cannot (fsdp 3)."""
    path = tmp_path / "elastic.yaml"
    path.write_text(
        """
experiment: elastic
data: {seq_len: 32}
workers: {num_workers: [3, 4]}
sweeps:
  - workload: transformer
    model: {num_layers: 1, num_heads: 2, max_seq_len: 32}
    train: {steps: 4}
    parallel: {fsdp: -1}
    search_space: {width: [32], global_batch: [12]}
"""
    )
    with pytest.raises(ConfigError) as err:
        plan_experiment(load_experiment(path), str(path))
    assert "sweeps.0: the mesh data=1,fsdp=3,tensor=1 cannot split the params" in str(err.value)


def test_the_layout_refuses_an_attention_that_cannot_run_here():
    """The layout decides for the device it runs on, whatever checks came before it."""
    with pytest.raises(AttentionError, match="cudnn"):
        trial_layout(cudnn_trial(), make_mesh())


def refused_before_ray(tmp_path, config: str) -> str:
    """``python -m jaxray.tune`` on ``config``: exit 2 with no traceback and no run folder; its stderr."""
    path = tmp_path / "exp.yaml"
    path.write_text(config)
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.tune", "--config", str(path), "--out", str(tmp_path / "o")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "o").exists()
    return proc.stderr.replace(str(path), "EXP")


def test_tune_refuses_cudnn_without_gpus_before_starting_ray(tmp_path):
    stderr = refused_before_ray(tmp_path, CUDNN_SWEEP)
    assert "error: invalid config EXP:\n  sweeps.0: model.attention 'cudnn' cannot run" in stderr


UNEVEN_MESH = """
experiment: uneven
data: {seq_len: 32}
workers: {num_workers: 1, devices_per_worker: 3}
sweeps:
  - workload: transformer
    model: {num_layers: 1, num_heads: 4, max_seq_len: 32}
    parallel: {tensor: 3}
    search_space: {global_batch: [6], width: [48]}
"""


def test_tune_refuses_a_mesh_that_cannot_split_the_params_before_starting_ray(tmp_path):
    stderr = refused_before_ray(tmp_path, UNEVEN_MESH)
    assert (
        "error: invalid config EXP:\n  sweeps.0: the mesh data=1,fsdp=1,tensor=3 cannot split the params "
        "of the transformer of width 48: parallel.tensor 3 does not divide 'heads' of size 4 (dimension 0 "
        "of blocks.0.attn.key.bias [4, 12], and 6 more params); parallel.tensor 3 does not divide 'vocab' of "
        "size 256 (dimension 1 of lm_head.kernel [48, 256], and 1 more params)\n" in stderr
    ), stderr


def test_splash_is_refused_before_compiling_where_it_cannot_run():
    with pytest.raises(ConfigError) as err:
        check_attention(cudnn_trial(accelerator="gpu", attention="splash", seq=200))
    message = str(err.value)
    assert "model.attention 'splash' cannot run: it needs TPU workers (workers.accelerator: tpu)" in message
    assert "sequence length 200 is not a multiple of 128" in message
    check_attention(cudnn_trial(accelerator="tpu", attention="splash", seq=1024))
