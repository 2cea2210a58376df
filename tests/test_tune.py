"""`python -m jaxray.tune`, the CLI and its folder policy: `--resume DIR` on bad input ends with a
clear error and exit code 2 before Ray starts, nothing in DIR touched; conflicting arguments; the
saved experiment.yaml round-trips. (The resume itself: tests/integration/test_tune_resume.py.)"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxray.config import ConfigError
from jaxray.config.experiment import load_experiment
from jaxray.runs import EXPERIMENT_FILE
from jaxray.tune import load_resume, main, parse_args, prepare_out, save_experiment

ROOT = Path(__file__).resolve().parents[1]


def tune(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxray.tune", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_resume_of_a_missing_folder(tmp_path):
    proc = tune("--resume", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert f"error: --resume {tmp_path / 'nope'}: no such folder" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "nope").exists()


def test_resume_of_a_folder_without_the_saved_config(tmp_path):
    (tmp_path / "summary.json").write_text("[]")
    proc = tune("--resume", str(tmp_path))
    assert proc.returncode == 2
    assert f"{tmp_path / EXPERIMENT_FILE} is missing" in proc.stderr
    assert "not the output folder of a python -m jaxray.tune run" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_resume_of_a_file_or_a_damaged_config(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert main(["--resume", str(tmp_path / "file")]) == 2
    assert f"--resume {tmp_path / 'file'} is a file, not a folder" in capsys.readouterr().err
    (tmp_path / EXPERIMENT_FILE).write_text("experiment: x\nsweeps: [{workload: nope}]\n")
    assert main(["--resume", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"invalid config {tmp_path / EXPERIMENT_FILE}" in err and "sweeps.0.workload" in err
    assert (tmp_path / EXPERIMENT_FILE).read_text().startswith("experiment: x")


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
        (
            ["--resume", "runs/smoke", "--overwrite"],
            "argument --overwrite: not allowed with argument --resume",
        ),
        ([], "one of the arguments --config --resume is required"),
    ],
)
def test_conflicting_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_saved_config_round_trips(tmp_path, monkeypatch):
    """What a run saves is what --resume reads: the same experiment, data folders made absolute."""
    monkeypatch.chdir(ROOT)
    exp = load_experiment("tune_configs/demo.yaml", {"data.data_dir": "tests"})
    save_experiment(tmp_path / "out", exp)
    resumed = load_resume(tmp_path / "out")
    assert resumed.data.data_dir == str(ROOT / "tests")
    assert resumed.model_copy(update={"data": exp.data}) == exp
    assert load_resume(tmp_path / "out", {"data.data_dir": str(ROOT)}).data.data_dir == str(ROOT)


def test_a_new_run_into_a_resumable_folder_points_to_resume(tmp_path):
    save_experiment(tmp_path, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    with pytest.raises(
        ConfigError,
        match=re.escape(
            f"(experiment.yaml); pass --overwrite to replace them, --resume {tmp_path} to finish that run"
        ),
    ):
        prepare_out(tmp_path, overwrite=False)
    prepare_out(tmp_path, overwrite=True)
    assert not (tmp_path / EXPERIMENT_FILE).exists()
