"""``python -m jaxray.local``: one trial of a sweep in this process, without Ray (what a TPU host that
opens no sockets can run): checkpoints, compile report, TensorBoard events and summary as a Ray run's
worker writes them; refusals before anything compiles."""

import json
import subprocess
import sys

import pytest

from jaxray import checkpoint, local

QUICK = "tune_configs/quick.yaml"  # one transformer trial
RUN = """
import sys
from jaxray import local
rc = local.main(sys.argv[1:])
assert not [m for m in sys.modules if m == "ray" or m.startswith("ray.")], "a local run imported Ray"
sys.exit(rc)
"""


def _local(*args):
    args = [str(a) for a in args]
    return subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # ~30 s: a trial, a resume and a subprocess: make test-all
def test_a_local_trial_writes_what_a_ray_worker_writes_and_resumes(real_dir, tmp_path, capsys):
    out = tmp_path / "trial"
    (out / checkpoint.checkpoint_name(20, 1) / "params").mkdir(
        parents=True
    )  # a crashed run's unfinished save
    proc = _local("--config", QUICK, "--steps", "20", "--out", str(out), "--data-dir", str(real_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "removed checkpoint_step_00000020_attempt1, a checkpoint never finished" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["name"] == "transformer_b16_float32_w128_lr0.003" and summary["steps"] == 20
    assert (out / "compile.json").is_file() and any((out / "tensorboard").iterdir())
    final = out / checkpoint.checkpoint_name(20, 1)
    model, params = checkpoint.restore(final)
    assert model.config.width == 128 and params is not None
    assert json.loads(proc.stdout.strip().splitlines()[-2])["steps"] == 20
    assert proc.stdout.strip().splitlines()[-1] == f"written: {out}"

    # Refusals come before anything compiles: run here, in this process.
    again = local.main(["--config", QUICK, "--steps", "20", "--out", str(out), "--data-dir", str(real_dir)])
    assert again == 2 and "already holds checkpoints" in capsys.readouterr().err
    (out / checkpoint.checkpoint_name(30, 1)).mkdir()  # a save killed before its commit
    resumed = _local(
        "--config", QUICK, "--steps", "20", "--out", str(out), "--resume", "--data-dir", str(real_dir)
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["resumed_from_step"] == 20
    assert "removed checkpoint_step_00000030_attempt1, a checkpoint never finished" in resumed.stdout
    assert not (out / checkpoint.checkpoint_name(30, 1)).exists()

    # More steps: the schedule is rebuilt over them (said); another trial's settings: refused.
    longer = _local(
        "--config", QUICK, "--steps", "25", "--out", str(out), "--resume", "--data-dir", str(real_dir)
    )
    assert longer.returncode == 0, longer.stderr[-3000:]
    assert (
        "train.steps 20 -> 25: the learning-rate schedule is rebuilt over 25 steps; at step 20"
        in longer.stdout
    )
    other = tmp_path / "other.yaml"
    other.write_text(open(QUICK).read().replace("learning_rate: [3.0e-3]", "learning_rate: [1.0e-3]"))
    capsys.readouterr()
    refused = local.main(["--config", str(other), "--out", str(out), "--resume", "--data-dir", str(real_dir)])
    assert refused == 2 and "train.learning_rate 0.003 -> 0.001" in capsys.readouterr().err
    shorter = local.main(["--config", QUICK, "--steps", "10", "--out", str(out), "--resume"])
    assert shorter == 2
    assert "train.steps 10 is below checkpoint_step_00000025_attempt1's step 25" in capsys.readouterr().err


def test_an_unknown_trial_names_the_trials_there_are(capsys):
    assert local.main(["--config", "tune_configs/demo.yaml", "--trial", "nope"]) == 2
    err = capsys.readouterr().err
    assert "--trial 'nope' is not a trial of tune_configs/demo.yaml; allowed: mlp_b256_float32_w128" in err
    assert "transformer_b16_float32_w128_lr0.002" in err


def test_a_trial_that_cannot_run_here_is_refused_before_compiling(tmp_path, capsys):
    quick = open(QUICK).read()
    cases = {
        "model: {num_layers: 2,": (
            "model: {attention: splash, num_layers: 2,",
            "model.attention 'splash' cannot run",
        ),
        "workers: {num_workers: 1, devices_per_worker: 1}": (
            "workers: {num_workers: 1, devices_per_worker: 1, accelerator: tpu}",
            "workers.accelerator is tpu but JAX here runs on cpu",
        ),
    }
    for old, (new, message) in cases.items():
        assert old in quick
        path = tmp_path / "x.yaml"
        path.write_text(quick.replace(old, new))
        assert local.main(["--config", str(path), "--out", str(tmp_path / "out")]) == 2
        assert message in capsys.readouterr().err
    assert local.main(["--config", "tune_configs/demo.yaml"]) == 2
    assert "--trial is required: tune_configs/demo.yaml has 10 trials" in capsys.readouterr().err


def test_a_diverged_trial_says_where_and_keeps_no_checkpoint(real_dir, tmp_path, capsys):
    """A peak learning rate of 1e30: exit 1, the summary names the step and metric (valid JSON, no
    NaN), and no checkpoint of the broken params is left."""
    path = tmp_path / "x.yaml"
    path.write_text(
        "experiment: x\n"
        f"data: {{data_dir: {real_dir}}}\n"
        "sweeps:\n"
        "  - workload: mlp\n"
        "    train: {steps: 6, log_every: 2, checkpoint_every: 2, learning_rate: 1.0e+30}\n"
        "    search_space: {global_batch: [32], width: [16]}\n"
    )
    out = tmp_path / "out"
    assert local.main(["--config", str(path), "--out", str(out)]) == 1
    printed, err = capsys.readouterr()
    assert "error: the trial diverged at step" in err
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"name", "step", "diverged_step", "diverged_metric", "diverged_value"}
    assert json.loads(printed.strip().splitlines()[-2]) == {"name": summary["name"]}
    assert summary["diverged_step"] <= 2 and not checkpoint.checkpoints(out)


def test_ctrl_c_says_how_to_continue_and_leaves_no_stale_summary(real_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C during training (raised where the trial runs): exit 130 with the command that continues,
    no traceback; an earlier summary.json, which may name a checkpoint the run then pruned, is gone."""
    from jaxray import local_run  # imports JAX: the other tests here need none

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(local_run, "run_trial", interrupted)
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text('{"checkpoint": "checkpoint_step_00000180_attempt1"}')
    assert (
        local.main(["--config", QUICK, "--steps", "4", "--out", str(out), "--data-dir", str(real_dir)]) == 130
    )
    assert f"interrupted; continue with --resume --out {out}" in capsys.readouterr().err
    assert not (out / "summary.json").exists()
