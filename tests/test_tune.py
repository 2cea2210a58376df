"""`python -m jaxray.tune`: bad input ends with a clear error and exit code 2 before Ray starts,
every run writes a new folder, `--resume` finds the run it finishes, the saved experiment.yaml
round-trips. (The sweeps themselves: tests/integration/.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ray
from full_disk import fill, small_tmpfs
from tune_cli import tune_cli as tune

from jaxray.config import ConfigError
from jaxray.config.experiment import load_experiment
from jaxray.folders import TRAIN_DIR
from jaxray.raytrain.sweep import with_run_storage
from jaxray.runs import EXPERIMENT_FILE, RunFolderError, finished, new_run
from jaxray.tune import (
    full_disk,
    load_resume,
    main,
    next_steps,
    parse_args,
    report,
    save_experiment,
)

ROOT = Path(__file__).resolve().parents[1]


def test_one_subprocess_run_of_the_entry_point_refuses_a_missing_folder(tmp_path):
    proc = tune("--resume", str(tmp_path / "nope"))
    assert proc.returncode == 2, proc.stderr
    assert f"error: --resume {tmp_path / 'nope'}: no such folder" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "nope").exists()


def test_resume_of_a_folder_without_a_run_or_with_a_damaged_config(tmp_path, capsys):
    (tmp_path / "summary.json").write_text("[]")
    assert main(["--resume", str(tmp_path)]) == 2
    assert "no run of python -m jaxray.tune there" in capsys.readouterr().err
    run = tmp_path / "20261203-000000"
    run.mkdir()
    (run / EXPERIMENT_FILE).write_text("experiment: x\nsweeps: [{workload: nope}]\n")
    assert main(["--resume", str(tmp_path)]) == 2
    assert "was edited after the run started" in capsys.readouterr().err
    assert (run / EXPERIMENT_FILE).read_text().startswith("experiment: x")


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--config", "tune_configs/smoke.yaml", "--resume", "runs/smoke"],
            "argument --resume: not allowed with argument --config",
        ),
        (
            ["--resume", "runs/smoke", "--out", "runs/other"],
            "argument --out: not allowed with argument --resume",
        ),
        ([], "one of the arguments --config --resume is required"),
    ],
)
def test_conflicting_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_saved_config_round_trips_and_resume_takes_the_newest_run(tmp_path, monkeypatch):
    """What a run saves is what --resume reads: the same experiment, data folders made absolute; an
    experiment folder means its newest run."""
    monkeypatch.chdir(ROOT)
    exp = load_experiment("tune_configs/demo.yaml", {"data.data_dir": "tests"})
    older, newer = tmp_path / "20261201-120000", tmp_path / "20261202-120000"
    for run in (older, newer):
        save_experiment(run, exp)
    resumed, run = load_resume(tmp_path)
    assert run == newer and load_resume(older)[1] == older
    assert resumed.data.data_dir == str(ROOT / "tests")
    assert resumed.model_copy(update={"data": exp.data}) == exp
    assert load_resume(newer, {"data.data_dir": str(ROOT)})[0].data.data_dir == str(ROOT)


def test_every_run_gets_a_new_folder_and_never_one_inside_a_run(tmp_path):
    first, second = new_run(tmp_path / "demo"), new_run(tmp_path / "demo")
    assert first != second and first.parent == second.parent == tmp_path / "demo"
    assert sorted(p.name for p in (tmp_path / "demo").iterdir()) == sorted([first.name, second.name])
    save_experiment(first, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    with pytest.raises(RunFolderError, match="is the folder of one run; pass its experiment folder"):
        new_run(first)


def test_runs_started_the_same_second_never_share_a_storage_folder(tmp_path):
    # Two --out folders (or machines), one experiment and storage, one second: each run's storage
    # folder is its own, so neither resumes from the other's checkpoints.
    exp = load_experiment(ROOT / "tune_configs/smoke.yaml").model_copy(
        update={"storage": f"file://{tmp_path}/s"}
    )
    first, second = new_run(tmp_path / "a"), new_run(tmp_path / "b")
    uris = [with_run_storage(exp, run).storage for run in (first, second)]
    assert uris[0] != uris[1]
    for run, uri in zip((first, second), uris, strict=True):
        assert re.fullmatch(rf"file://{tmp_path}/s/smoke/{run.name}-[0-9a-f]{{8}}", uri), uri
    assert with_run_storage(exp.model_copy(update={"storage": None}), first).storage is None


def test_bad_input_is_refused_before_a_run_folder_is_made(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(
        (ROOT / "tune_configs/smoke.yaml").read_text().replace("workload: mlp", "workload: nope")
    )
    assert main(["--config", str(config), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "workload" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_sweep_stopped_on_a_full_disk_is_told_from_the_disk(tmp_path):
    err = EOFError("Ran out of input")  # what Ray Tune 2.60 raises reading an empty error.pkl
    assert full_disk(tmp_path, err) is None  # room left: the error is not the disk's
    with small_tmpfs(tmp_path / "disk", 4) as disk:
        fill(disk)
        message = full_disk(disk, err)
    assert message and f"the disk holding {disk} full (0 bytes free)" in message, message
    assert "EOFError: Ran out of input" in message and f"kept in {disk / TRAIN_DIR}" in message


def test_the_saved_config_is_whole_or_absent_on_a_full_disk(tmp_path):
    exp = load_experiment(ROOT / "tune_configs/smoke.yaml")
    with small_tmpfs(tmp_path / "disk", 1) as disk:
        fill(disk)
        with pytest.raises(OSError, match="No space left on device"):
            save_experiment(disk / "run", exp)
        assert not any((disk / "run").iterdir())  # no truncated experiment.yaml for --resume to misread


def test_resume_refuses_an_experiment_yaml_edited_after_the_run_started(tmp_path):
    saved = save_experiment(tmp_path, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    assert load_resume(tmp_path)[0].experiment == "smoke"  # as written: accepted
    text = saved.read_text()
    saved.write_text(text.replace("steps: 20", "steps: 40"))
    with pytest.raises(ConfigError, match="was edited after the run started") as err:
        load_resume(tmp_path)
    assert str(saved) in str(err.value) and "undo the edit, or start a new run" in str(err.value)


def test_resume_names_every_unfinished_run_and_finishes_the_newest(tmp_path, capsys):
    exp = load_experiment(ROOT / "tune_configs/smoke.yaml")
    older, newer, finished = (tmp_path / n for n in ("20261201-120000", "20261202-120000", "20261203-120000"))
    for run in (older, newer, finished):
        save_experiment(run, exp)
    (finished / "summary.json").write_text(
        json.dumps([{"trial": "t", "workload": "mlp", "test_accuracy": 0.9}])
    )
    assert load_resume(tmp_path)[1] == newer
    assert (
        f"--resume {tmp_path}: resuming the unfinished run {newer.name}; 1 older unfinished run(s) stay "
        f"as they are: {older.name} (finish one with --resume {tmp_path}/<run>)"
    ) in capsys.readouterr().err


def test_resume_of_a_finished_run_says_there_is_nothing_to_do_before_ray_starts(tmp_path, capsys):
    """A run that wrote its summary is finished, a diverged trial included (it would diverge again);
    a trial that failed otherwise (a crash) is work for --resume."""
    run = tmp_path / "20261201-120000"
    save_experiment(run, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    done = {"trial": "a", "workload": "mlp", "test_accuracy": 0.9}
    diverged = {"trial": "b", "workload": "mlp", "error": "diverged at step 2: loss nan", "diverged_step": 2}
    (run / "summary.json").write_text(json.dumps([done, diverged]))
    assert finished(run)
    assert main(["--resume", str(run)]) == 0
    assert (
        f"--resume {run}: the run finished ({run / 'summary.md'}), nothing to resume"
        in capsys.readouterr().err
    )
    assert main(["--resume", str(tmp_path)]) == 0
    assert "its 1 run(s) all finished (newest 20261201-120000), nothing to resume" in capsys.readouterr().err
    assert not ray.is_initialized()
    (run / "summary.json").write_text(
        json.dumps([done, {"trial": "c", "workload": "mlp", "error": "killed"}])
    )
    assert not finished(run)


def test_the_next_commands_are_the_installs_and_none_when_every_trial_failed(tmp_path, capsys):
    rows = [
        {"trial": "t", "workload": "transformer", "val_loss": 1.6, "checkpoint": "train/t/c"},
        {"trial": "m", "workload": "mlp", "checkpoint": "train/m/c"},
    ]
    hints = next_steps(tmp_path, rows)
    assert "python -m jaxray.generate" in hints and "python -m jaxray.serve" in hints
    assert all(line.split()[0] in ("next:", "python") for line in hints.splitlines())  # no tensorboard
    failed = [{**r, "error": "diverged at step 2: loss nan (not finite)"} for r in rows]
    assert next_steps(tmp_path, failed) == ""
    assert report(tmp_path, load_experiment(ROOT / "tune_configs/smoke.yaml"), [(r, []) for r in failed]) == 1
    captured = capsys.readouterr()
    assert "next:" not in captured.out and "2 trial(s) failed" in captured.err
    assert f"to run them again from their newest checkpoints: python -m jaxray.tune --resume {tmp_path}" in (
        captured.err
    )
    diverged = [{**r, "diverged_step": 2} for r in failed]  # would diverge again: no such hint
    smoke = load_experiment(ROOT / "tune_configs/smoke.yaml")
    assert report(tmp_path, smoke, [(r, []) for r in diverged]) == 1
    assert "--resume" not in capsys.readouterr().err
