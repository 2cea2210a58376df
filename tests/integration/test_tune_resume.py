"""`python -m jaxray.tune --resume DIR` after Ctrl+C: a 2-trial sweep is interrupted (SIGINT to the
driver) once its first trial has finished; the resumed run trains only the second trial, keeps the
first one's files untouched and writes the reports of both, ranked by the sweep's own metric. Starts
its own local Ray (RAY_ADDRESS=local)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxray import checkpoint, runs

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.ray, pytest.mark.slow]

# smoke.yaml's MLP sizes, two grid points run one after the other (one trial at a time on CPU).
# Ranked by the highest test loss: the worse trial, which the default metric (the highest test
# accuracy) would never pick; widths 8 and 64 train to clearly different losses and accuracies.
TWO_TRIALS = """
experiment: resume
workers: {num_workers: 1, devices_per_worker: 1}
max_concurrent_trials: 1
sweeps:
  - workload: mlp
    metric: test_loss
    mode: max
    train: {steps: 20, log_every: 10}
    search_space:
      global_batch: [128]
      width: [8, 64]
"""
TRIALS = ("mlp_b128_float32_w8_lr0.003", "mlp_b128_float32_w64_lr0.003")


def final_report(out: Path, trial: str) -> dict | None:
    """The trial's final report in Tune's result.json, or None while it has not arrived."""
    path = out / "tune" / "mlp" / trial / "result.json"
    rows = (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    )
    return next((r for r in rows if r.get("final")), None)


def files(out: Path, trial: str) -> dict[str, tuple[int, int]]:
    """path -> (mtime_ns, size) of everything the trial wrote: its Ray Train run, Tune trial folder
    and TensorBoard events."""
    paths = [*(out / "train").glob(f"{trial}*"), out / "tune" / "mlp" / trial, out / "tensorboard" / trial]
    found = {}
    for top in paths:
        for path in [top, *top.rglob("*")] if top.exists() else []:
            found[str(path.relative_to(out))] = (path.stat().st_mtime_ns, path.stat().st_size)
    return found


def interrupt_after_first_trial(cmd: list[str], env: dict, out: Path, log: Path) -> tuple[int, str]:
    """Run ``cmd`` (a run into the experiment folder ``out``) in its own process group; once one
    trial has its final report and the other has
    started (so Tune has marked the first one finished), send SIGINT to the driver. Returns (exit
    code, the finished trial); SIGKILLs the group if the driver does not exit within 120 s."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 240
        first = None
        while time.monotonic() < deadline and proc.poll() is None:
            run = next(iter(runs.run_folders(out)), out)  # the run's own folder, once it made it
            first = first or next((t for t in TRIALS if final_report(run, t)), None)
            second = next((t for t in TRIALS if t != first), None)
            if first and ((run / "train" / second).exists() or (run / "tensorboard" / second).exists()):
                break
            time.sleep(0.5)
        assert proc.poll() is None, f"the sweep ended before it was interrupted:\n{log.read_text()[-3000:]}"
        assert first, f"no trial finished within 240 s:\n{log.read_text()[-3000:]}"
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=120), first
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_resume_finishes_the_unfinished_trial_only(real_dir, tmp_path):
    """The interrupted run is never what its experiment folder resolves to. Its experiment folder is
    then moved elsewhere (a copy whose original is gone) and resumed through it: the resume finds
    the newest run there and uses that folder, never the path the run was started in."""
    config, experiment = tmp_path / "two.yaml", tmp_path / "out"
    config.write_text(TWO_TRIALS)
    env = {**os.environ, "RAY_ADDRESS": "local", "JAXRAY_DATA_DIR": str(real_dir)}
    rc, first = interrupt_after_first_trial(
        [sys.executable, "-m", "jaxray.tune", "--config", str(config), "--out", str(experiment)],
        env,
        experiment,
        tmp_path / "first.log",
    )
    out = runs.run_folders(experiment)[0]
    second = next(t for t in TRIALS if t != first)
    first_log = (tmp_path / "first.log").read_text()
    assert rc == 130, first_log[-3000:]
    assert f"Resume with: python -m jaxray.tune --resume {out}" in first_log
    assert not (out / "summary.json").exists()  # an interrupted run writes no reports
    with pytest.raises(runs.RunFolderError, match="has no finished run"):
        runs.latest_run(experiment)
    assert final_report(out, second) is None

    saved = (out / "experiment.yaml").read_text()
    first_ckpt = final_report(out, first)["checkpoint_path"]
    before_first = files(out, first)
    # What the resume may remove: the checkpoints the interrupt left unfinished (no train_state.json).
    unfinished = [c for c in out.glob("train/*/checkpoint_*") if not (c / checkpoint.TRAIN_STATE).is_file()]
    before_all = {p for p in out.rglob("*") if not any(p == c or c in p.parents for c in unfinished)}
    assert (Path(first_ckpt) / "history.json").is_file() and before_first
    started_in, moved = out, tmp_path / "elsewhere" / "copy"
    moved.parent.mkdir()
    experiment.rename(moved)
    out = moved / started_in.name
    first_ckpt = str(out / Path(first_ckpt).relative_to(started_in))
    before_all = {out / p.relative_to(started_in) for p in before_all}

    logs = set((out / "logs").iterdir())
    proc = subprocess.run(  # --verbose: Ray's and Tune's output here, as before the quiet terminal
        [
            sys.executable,
            "-m",
            "jaxray.tune",
            "--resume",
            str(moved),
            "--verbose",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    assert f"resuming the mlp sweep from {out / 'tune' / 'mlp'}" in proc.stderr
    assert str(started_in) not in proc.stdout + proc.stderr, proc.stderr[-5000:]
    assert "Failed to fetch metrics" not in proc.stderr, proc.stderr[-5000:]
    assert "Trial status" in proc.stdout and set((out / "logs").iterdir()) == logs  # no log: all shown

    rows = {r["trial"]: r for r in json.loads((out / "summary.json").read_text())}
    assert sorted(rows) == sorted(TRIALS)
    for row in rows.values():
        assert not row.get("error"), row
        assert row["steps"] == 20 and 0.3 < row["test_accuracy"] <= 1 and row["test_examples"] == 10_000
        assert (out / row["checkpoint"] / "history.json").is_file()  # relative to the run folder
    # The second trial, begun by the interrupted run: a restart of it says why.
    assert rows[second].get("restart_causes") in (None, "interrupted"), rows[second]
    # The first trial was not trained again: same checkpoint, and not one of its files was rewritten.
    assert out / rows[first]["checkpoint"] == Path(first_ckpt)
    assert files(out, first) == before_first
    assert Path(final_report(out, second)["checkpoint_path"]) == out / rows[second]["checkpoint"]
    # Nothing saved before the resume was removed.
    assert before_all <= set(out.rglob("*"))
    assert (out / "experiment.yaml").read_text() == saved
    assert {"summary.md", "loss_curves.png"} <= {p.name for p in out.iterdir()}

    # The sweep's metric ranks the resumed run: summary.md names the trial with the highest test loss,
    # which `--checkpoint <experiment>` (runs.open_checkpoint) loads; the default metric would pick the other.
    worst = max(rows.values(), key=lambda r: r["test_loss"])
    assert runs.saved_ranking(out) == {"mlp": ("test_loss", "max")}
    assert runs.best_trial(list(rows.values()), "mlp")["trial"] != worst["trial"]
    named = re.search(r"- \*\*mlp\*\*: `([^`]+)`, test loss", (out / runs.SUMMARY_MD).read_text())
    assert named and named.group(1) == worst["trial"], (out / runs.SUMMARY_MD).read_text()
    resolved = runs.open_checkpoint(moved).path
    assert resolved == out / worst["checkpoint"]
    assert checkpoint.load_trial_config(resolved).model.width == worst["width"]
