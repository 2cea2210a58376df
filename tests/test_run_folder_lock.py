"""One run per run folder (``jaxray.folders.exclusive``): a second ``python -m jaxray.tune`` into a
run folder another is writing (a ``--resume``) is refused before it reads or moves anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from jaxray.config.experiment import load_experiment
from jaxray.folders import RunFolderError, exclusive
from jaxray.tune import main, save_experiment

ROOT = Path(__file__).resolve().parents[1]


def test_a_resume_of_a_held_run_is_refused_and_leaves_it_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    with exclusive(out):
        save_experiment(out, load_experiment(ROOT / "tune_configs/smoke.yaml"))  # the first run's files
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        assert main(["--resume", str(out)]) == 2
        assert f"another python -m jaxray.tune is writing into {out}" in capsys.readouterr().err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # Released when the holder is done: the next run may take it.
    with exclusive(out):
        pass


def test_in_one_process_a_second_hold_is_refused_too(tmp_path):
    with exclusive(tmp_path / "run"), pytest.raises(RunFolderError, match="another python -m jaxray.tune"):
        with exclusive(tmp_path / "run"):
            pass


def test_a_folder_created_for_a_run_whose_checks_failed_is_removed(tmp_path):
    with pytest.raises(ValueError, match="config"), exclusive(tmp_path / "new"):
        raise ValueError("a config check failed")
    assert not (tmp_path / "new").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with exclusive(kept):
        pass
    assert kept.is_dir() and not any(kept.iterdir())  # as it was: the lock file is gone too


def test_a_file_is_not_a_run_folder(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunFolderError, match="is a file, not a folder"), exclusive(tmp_path / "file"):
        pass
