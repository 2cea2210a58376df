"""One run per run folder (``jaxray.runs.exclusive``): a second ``python -m jaxray.tune`` into a
folder another run is writing is refused before it reads or moves anything."""

from __future__ import annotations

import pytest
from tune_cli import tune_cli

from jaxray.runs import RunFolderError, exclusive


def test_a_held_folder_is_refused_in_another_process_and_left_as_it_was(tmp_path):
    out = tmp_path / "run"
    with exclusive(out):
        (out / "experiment.yaml").write_text("experiment: first\n")  # the first run's files
        before = {p.name: p.read_bytes() for p in out.iterdir()}
        proc = tune_cli(
            "--config", "tune_configs/smoke.yaml", "--out", out, "--overwrite", env={"RAY_ADDRESS": "local"}
        )
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert f"another python -m jaxray.tune is writing into {out}" in proc.stderr
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
