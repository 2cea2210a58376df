"""End to end: `python -m jaxray.tune` on smoke.yaml through Ray Tune and Ray Train on the real data,
then `python -m jaxray.generate` on its result. Starts its own local Ray (RAY_ADDRESS=local)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxray import runs
from jaxray.reporting.sweep import KEY_ORDER

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]  # a real sweep: ~100 s before the first test

# Every row has the summary table's columns but the workload's own (throughput unit, quality).
PER_WORKLOAD = {
    *(
        "examples_per_sec",
        "tokens_per_sec",
        "test_accuracy",
        "val_loss",
        "val_perplexity",
        "best_step",
        "final_val_loss",
    ),
    *("attention", "attention_note"),
}
COMMON = [k for k in KEY_ORDER if k not in PER_WORKLOAD]


def tune(config, out: Path, real_dir: Path, code: int = 0) -> subprocess.CompletedProcess:
    """``python -m jaxray.tune --config config --out out`` on a private Ray, with exit code ``code``."""
    env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.tune", "--config", str(config), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == code, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


@pytest.fixture(scope="module")
def smoke(real_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("smoke")
    proc = tune("tune_configs/smoke.yaml", out, real_dir)
    assert runs.latest_run(out) == runs.run_folders(out)[0]
    return runs.run_folders(out)[0], proc


def test_summary_has_a_row_per_trial(smoke):
    out, _ = smoke
    rows = json.loads((out / "summary.json").read_text())
    assert sorted(r["trial"] for r in rows) == [
        "mlp_b128_bfloat16_w64_lr0.003",
        "mlp_b128_float32_w64_lr0.003",
        "transformer_b8_float32_w32_lr0.0003",
    ]
    for row in rows:
        assert set(COMMON) <= set(row), set(COMMON) - set(row)
        assert not row.get("error")
        assert row["devices"] == 1 and row["ms_per_step"] > 0 and math.isfinite(row["final_train_loss"])
        assert (out / row["checkpoint"] / "model_config.json").is_file()  # relative to the run folder
        if row["workload"] == "mlp":
            assert row["steps"] == 20 and row["examples_per_sec"] > 0
            assert 0.5 < row["test_accuracy"] <= 1 and row["test_examples"] == 10_000
        else:
            assert row["steps"] == 4 and row["tokens_per_sec"] > 0
            assert row["val_loss"] < math.log(256) + 0.5
            assert row["val_perplexity"] == pytest.approx(math.exp(row["val_loss"]), rel=1e-6)
            # auto on the CPU workers: XLA, and why (also in the worker's log line and summary.md)
            assert row["attention"] == "xla", row
            assert row["attention_note"] == "auto: cuDNN attention needs an NVIDIA GPU, this device is cpu"


def run_log(out: Path) -> str:
    """The run's log: Ray's, Tune's and Orbax's output, and the workers' lines."""
    [log] = (out / "logs").glob("tune-*.log")
    return log.read_text()


def test_the_terminal_shows_progress_and_the_results_and_the_log_holds_the_rest(smoke):
    out, proc = smoke
    terminal = proc.stdout.splitlines() + proc.stderr.splitlines()
    assert len(terminal) <= 40, "\n".join(terminal)
    [log] = (out / "logs").glob("tune-*.log")
    assert f"log: {log} (Ray, Tune and Orbax output" in proc.stderr
    for trial, steps in (("mlp_b128_float32_w64_lr0.003", 20), ("transformer_b8_float32_w32_lr0.0003", 4)):
        row = next(ln.rstrip() for ln in proc.stderr.splitlines() if ln.startswith(trial + " "))
        assert f"{steps}/{steps} steps" in row and "loss " in row and row.endswith("done"), row
    assert "## Best per workload" in proc.stdout and "next:" in proc.stdout
    assert f"python -m jaxray.generate --checkpoint {out.parent} " in proc.stdout  # the experiment folder
    assert "tensorboard" not in proc.stdout  # the install has no tensorboard command
    text = run_log(out)
    for theirs in ("Trial status", "orbax", "(RayTrainWorker pid=", "Started a local Ray instance"):
        assert theirs in text and theirs not in proc.stdout + proc.stderr, theirs


def test_the_attention_auto_chose_is_logged_and_summarised(smoke):
    out, proc = smoke
    said = "attention xla (auto: cuDNN attention needs an NVIDIA GPU, this device is cpu)"
    assert said in run_log(out)
    line = next(ln for ln in (out / "summary.md").read_text().splitlines() if "transformer_b8" in ln)
    assert "| xla (auto: cuDNN attention needs an NVIDIA GPU, this device is cpu) |" in line


def test_every_trial_writes_its_compile_report(smoke):
    out, _ = smoke
    rows = json.loads((out / "summary.json").read_text())
    for row in rows:
        report = json.loads((out / "train" / row["trial"] / "compile.json").read_text())
        assert (
            report["config"]["dtype"] == row["dtype"]
            and report["config"]["global_batch"] == row["global_batch"]
        )
        assert report["memory"]["peak_bytes"] == row["peak_bytes_per_device"] > 0
        assert report["flops"] > 0 and report["ops"]["scatter"] == {}
    assert "peak MiB/device" in (out / "summary.md").read_text()


def test_ray_path_equals_the_in_memory_path(smoke, real_dir):
    """Same seed, same batches, same steps: the Ray Data + Ray Train run reproduces an in-process run."""
    from jaxray.config import TrialConfig
    from jaxray.data.batching import train_batches
    from jaxray.data.workloads import load_arrays
    from jaxray.parallel.mesh import make_mesh
    from jaxray.train.run import train

    out, _ = smoke
    row = next(
        r
        for r in json.loads((out / "summary.json").read_text())
        if r["trial"] == "mlp_b128_float32_w64_lr0.003"
    )
    trial = TrialConfig.model_validate_json((out / row["checkpoint"] / "trial_config.json").read_text())
    history = json.loads((out / row["checkpoint"] / "history.json").read_text())
    train_arrays, held_out = load_arrays(trial)
    local = train(
        trial, train_batches(train_arrays, trial.train.global_batch, trial.train.seed), held_out, make_mesh()
    )
    assert [h["loss"] for h in history] == pytest.approx(
        [h["loss"] for h in local.history], rel=1e-6, abs=1e-6
    )
    assert row["test_accuracy"] == pytest.approx(local.summary["test_accuracy"], abs=1e-6)


def test_reports_plots_and_tensorboard(smoke):
    out, proc = smoke
    for name in ("summary.md", "throughput_vs_batch.png", "loss_curves.png"):
        assert (out / name).stat().st_size > 1000, name
    assert (out / "throughput_vs_batch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = list((out / "tensorboard").glob("*/events.out.tfevents.*"))
    assert len(events) == 3
    assert all(b"train/loss" in e.read_bytes() and b"train/lr" in e.read_bytes() for e in events)
    [lm] = [e for e in events if "transformer" in str(e)]
    assert b"val/loss" in lm.read_bytes()  # train.eval_every: the held-out loss during training
    assert "mlp_b128_float32_w64_lr0.003" in proc.stdout  # the table is printed


def test_the_held_out_loss_reaches_tune_during_training(smoke):
    """smoke.yaml's transformer sweep: eval_every 2 of 4 steps and ASHA on val_loss; Tune's results
    carry val_loss before the final one (the metric ASHA reads)."""
    out, _ = smoke
    [trial] = (out / "tune" / "transformer").glob("transformer_*/result.json")
    results = [json.loads(line) for line in trial.read_text().splitlines() if line.strip()]
    early = [r for r in results if not r.get("final")]
    assert early and all(math.isfinite(r["val_loss"]) and r["lr"] > 0 for r in early), early


def test_generate_from_the_experiment(smoke):
    out, _ = smoke
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxray.generate",
            "--checkpoint",
            str(out.parent),
            "--prompt",
            "ROMEO:",
            "--max-new-tokens",
            "20",
            "--temperature",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ROMEO:") and len(proc.stdout.rstrip("\n")) >= len("ROMEO:") + 1


DIVERGING = """
experiment: smoke
workers: {num_workers: 1, devices_per_worker: 1}
sweeps:
  - workload: mlp
    train: {steps: 6, log_every: 2}
    search_space: {global_batch: [64], width: [16], learning_rate: [1.0e30]}
"""


def test_a_diverged_sweep_fails_and_leaves_the_earlier_run_reachable(smoke, real_dir, tmp_path):
    """A peak learning rate of 1e30: the loss of step 2 is not finite. The trial stops there and is
    failed (progress row, summary, summary.json, exit 1, no generate/serve hint); the experiment
    folder still resolves to the smoke run before it."""
    out, _ = smoke
    config = tmp_path / "diverging.yaml"
    config.write_text(DIVERGING)
    proc = tune(config, out.parent, real_dir, code=1)
    diverged = runs.run_folders(out.parent)[0]
    [row] = json.loads((diverged / "summary.json").read_text())
    assert row["trial"] == "mlp_b64_float32_w16_lr1e+30" and not row.get("checkpoint")
    assert (row["diverged_step"], row["diverged_metric"]) == (2, "loss")
    assert row["error"] == f"diverged at step 2: loss {row['diverged_value']} (not finite)"
    assert row["diverged_value"] in ("nan", "inf")
    assert f"error: trial {row['trial']} failed: {row['error']}" in proc.stderr
    assert "1 trial(s), 1 failed" in proc.stdout and "next:" not in proc.stdout
    assert "jaxray.generate" not in proc.stdout + proc.stderr
    assert runs.latest_run(out.parent) == out
