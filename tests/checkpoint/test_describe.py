"""Generate, evaluate and export name on stderr, in one line,
the checkpoint ``runs/<experiment>`` resolved to (path, trial, step, the held-out metric its final
save recorded), stdout keeping its own output; ``checkpoint.describe`` words it for every kind of
checkpoint. On a transformer trained here on real TinyShakespeare bytes and saved as a sweep's
final full-state checkpoint, in a run folder written by the sweep's report writer."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from jaxray import checkpoint, runs
from jaxray import evaluate as evaluate_cli
from jaxray import export as export_cli
from jaxray import generate as generate_cli
from jaxray.checkpoint import checkpoint_name
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.parallel.mesh import make_mesh
from jaxray.reporting import checkpoint_line
from jaxray.reporting.sweep import write_reports
from jaxray.serve import __main__ as serve_cli
from jaxray.train.run import train

# Trains its own 20 steps on top of the session's transformer (about 40 s in all): CI's slow part;
# tests/checkpoint/test_checkpoint.py refuses a diverged checkpoint fast.
pytestmark = pytest.mark.slow

TRIAL_NAME = "transformer_b16_float32_w64_lr0.003"
STEPS = 20


@pytest.fixture(scope="module")
def trained(trained_transformer):
    """(the trial, its TrainResult): ``trained_transformer``'s trial (tests/conftest.py), 20 steps."""
    trial = checkpoint.load_trial_config(trained_transformer)
    trial = trial.model_copy(update={"train": trial.train.model_copy(update={"steps": STEPS})})
    train_arrays, held_out = load_arrays(trial)
    return trial, train(
        trial, train_batches(train_arrays, trial.train.global_batch, trial.train.seed), held_out, make_mesh()
    )


@pytest.fixture(scope="module")
def run(trained, tmp_path_factory) -> tuple[Path, dict]:
    """(a run folder holding the trial's final checkpoint, that save's summary row)."""
    trial, result = trained
    root = tmp_path_factory.mktemp("runs") / "demo"
    row = {**result.summary, "final": True}
    folder = root / "train" / TRIAL_NAME / checkpoint_name(STEPS, 1)
    saved = checkpoint.save_state(folder, result.state, trial, result.history, {}, summary=row)
    write_reports(
        root, [{**row, "trial": TRIAL_NAME, "checkpoint": str(saved)}], {TRIAL_NAME: result.history}
    )
    return root, row


def chosen_line(run: tuple[Path, dict]) -> str:
    root, row = run
    named = root / "train" / TRIAL_NAME / checkpoint_name(STEPS, 1)
    return (
        f"checkpoint: {named} (trial {TRIAL_NAME}, step {STEPS}, val loss {row['val_loss']:.4f}, "
        f"perplexity {row['val_perplexity']:.2f})"
    )


def test_describe_names_trial_step_and_held_out_metric(run):
    root, _ = run
    assert checkpoint_line.describe(runs.open_checkpoint(root).path) == chosen_line(run)


def test_describe_shows_a_path_inside_the_working_directory_relative(run, monkeypatch):
    root, _ = run
    monkeypatch.chdir(root.parent)
    line = checkpoint_line.describe(runs.open_checkpoint("demo").path)
    assert line.startswith(f"checkpoint: demo/train/{TRIAL_NAME}/{checkpoint_name(STEPS, 1)} (trial ")


def test_describe_of_an_earlier_save_and_of_a_fresh_state(trained, trained_transformer, tmp_path):
    trial, result = trained  # saved without the summary row, as the saves before the last are
    earlier = checkpoint.save_state(
        tmp_path / TRIAL_NAME / "checkpoint_x", result.state, trial, result.history, {}
    )
    last = result.history[-1]
    assert checkpoint_line.describe(earlier) == (
        f"checkpoint: {earlier} (trial {TRIAL_NAME}, step {STEPS}, train loss {last['loss']:.4f} at "
        f"step {last['step']} (no held-out metric saved))"
    )
    evaluated = [*result.history[:-1], {**last, "val_loss": 2.0697}]  # an eval step's row
    evaluated_at = tmp_path / TRIAL_NAME / "checkpoint_y"
    earlier = checkpoint.save_state(evaluated_at, result.state, trial, evaluated, {})
    assert checkpoint_line.describe(earlier) == (  # its own step's: its params' figure
        f"checkpoint: {earlier} (trial {TRIAL_NAME}, step {STEPS}, val loss 2.0697, perplexity 7.92)"
    )
    before = [{**last, "step": 10, "val_loss": 2.1}, last]  # an earlier step's evaluation only
    evaluated_at = tmp_path / TRIAL_NAME / "checkpoint_z"
    earlier = checkpoint.save_state(evaluated_at, result.state, trial, before, {})
    assert checkpoint_line.describe(earlier) == (
        f"checkpoint: {earlier} (trial {TRIAL_NAME}, step {STEPS}, val loss 2.1000 at step 10)"
    )
    assert checkpoint_line.describe(trained_transformer) == (
        f"checkpoint: {trained_transformer} (trial {TRIAL_NAME}, step 0, no metric recorded)"
    )


def stderr_lines(capsys) -> tuple[str, list[str]]:
    captured = capsys.readouterr()
    return captured.out, [line for line in captured.err.splitlines() if line.startswith("checkpoint: ")]


def test_generate_names_the_checkpoint_on_stderr_and_keeps_stdout_the_text(run, capsys):
    root, _ = run
    assert generate_cli.main(["--checkpoint", str(root), "--max-new-tokens", "8", "--temperature", "0"]) == 0
    out, named = stderr_lines(capsys)
    assert named == [chosen_line(run)] and "checkpoint" not in out and out.startswith("ROMEO:")


def test_evaluate_names_the_checkpoint_it_resolved(run, tmp_path, capsys):
    root, _ = run
    argv = ["--checkpoint", str(root), "--out", str(tmp_path / "eval"), "--max-new-tokens", "8"]
    assert evaluate_cli.main(argv) == 0
    _, named = stderr_lines(capsys)
    assert named == [chosen_line(run)]


def test_export_names_the_checkpoint_it_resolved(run, tmp_path, capsys):
    root, _ = run
    argv = ["--checkpoint", str(root), "--out", str(tmp_path / "export"), "--buckets", "16"]
    assert export_cli.main([*argv, "--batch-sizes", "1", "--chunk", "8"]) == 0
    out, named = stderr_lines(capsys)
    assert named == [chosen_line(run)] and out.startswith("exported ")


def test_a_checkpoint_that_recorded_a_non_finite_metric_is_refused_by_every_command(
    trained, tmp_path, capsys
):
    """generate, evaluate, export and serve refuse, before any output or Ray, a checkpoint whose
    history recorded a NaN loss (a run that diverged), naming it, the metric and the step."""
    trial, result = trained
    history = [*result.history[:-1], {**result.history[-1], "loss": float("nan")}]
    folder = checkpoint.save_state(tmp_path / TRIAL_NAME / "checkpoint_x", result.state, trial, history, {})
    refusal = f"{folder} records loss nan at step {STEPS}: its training diverged"
    with pytest.raises(checkpoint.CheckpointError, match="its training diverged"):
        checkpoint.restore(folder)
    commands = {
        generate_cli.main: ["--max-new-tokens", "8"],
        evaluate_cli.main: ["--out", str(tmp_path / "eval")],
        export_cli.main: ["--out", str(tmp_path / "export"), "--buckets", "16"],
    }
    for command, argv in commands.items():
        assert command(["--checkpoint", str(folder), *argv]) == 2
        assert refusal in capsys.readouterr().err
    assert not (tmp_path / "eval").exists() and not (tmp_path / "export").exists()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with pytest.raises(SystemExit) as exit_:
        serve_cli.main(["--checkpoint", str(folder), "--port", str(port)])
    assert exit_.value.code == 2 and refusal in capsys.readouterr().err
