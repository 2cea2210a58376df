"""What the files of a full disk and a trial folder do to the small writers and listings around
checkpoints , on real saves and a real tmpfs: "no usable checkpoint"
lists only the trial's checkpoint folders, each with why it was refused (not Ray Train's
``checkpoint_manager_snapshot.json``); the attempt counter on a full disk raises an error in words
and keeps its earlier count; the compile report on a full disk is a warning, not a failed trial."""

from __future__ import annotations

import json

import jax
import pytest
from checkpoint_copies import flip_a_byte, largest_params_file
from full_disk import fill, small_tmpfs
from saved import save_params

from jaxray import checkpoint, runs
from jaxray.checkpoint import checkpoint_name
from jaxray.config import parse_trial
from jaxray.models import build
from jaxray.raytrain.reports import compile_writer
from jaxray.raytrain.resume import count_attempt
from jaxray.reporting.sweep import write_reports

TRIAL = parse_trial({"model": {"workload": "mlp", "width": 8}})
TRIAL_NAME = TRIAL.name()  # its folder, as a sweep names it
SNAPSHOT = "checkpoint_manager_snapshot.json"


def test_no_usable_checkpoint_lists_only_the_checkpoint_folders(tmp_path):
    trial_dir = tmp_path / "run" / "train" / TRIAL_NAME
    params = build(TRIAL.model).init(jax.random.key(0))
    saved = [save_params(trial_dir / checkpoint_name(s, 1), params, TRIAL) for s in (10, 20)]
    (trial_dir / SNAPSHOT).write_text(json.dumps({"checkpoint_results": []}))  # as Ray Train leaves it
    row = {"trial": TRIAL_NAME, "workload": "mlp", "test_accuracy": 0.9, "checkpoint": str(saved[-1])}
    write_reports(tmp_path / "run", [row], {TRIAL_NAME: []})
    for ck in saved:
        flip_a_byte(largest_params_file(ck))
    with pytest.raises(checkpoint.CheckpointError) as err:
        runs.open_checkpoint(tmp_path / "run")
    message = str(err.value)
    assert message.startswith("no usable checkpoint of the 2 tried, newest first: ")
    assert SNAPSHOT not in message and message.count("does not match its checksum") == 2
    assert message.index(str(saved[1])) < message.index(str(saved[0]))


@pytest.mark.parametrize("as_uri", [False, True])  # a run folder's, or storage: a shared folder's
def test_the_attempt_count_on_a_full_disk_is_an_error_in_words(tmp_path, as_uri):
    with small_tmpfs(tmp_path / "disk", 1) as disk:
        file = disk / "trial" / "attempts.json"
        name = file.as_uri() if as_uri else str(file)
        assert count_attempt(name) == (1, [1])
        fill(disk)
        with pytest.raises(OSError) as err:
            count_attempt(name)
        assert f"cannot count this worker group's attempt in {name}" in str(err.value)
        assert "No space left on device" in str(err.value)
        assert json.loads(file.read_text()) == {"attempts": 1, "workers": [1]}  # never left empty
        assert sorted(p.name for p in file.parent.iterdir()) == ["attempts.json"]


def test_a_compile_report_on_a_full_disk_is_a_warning(tmp_path, capsys):
    with small_tmpfs(tmp_path / "disk", 1) as disk:
        file = disk / "trial" / "compile_report.json"
        compile_writer(str(file))({"compile_s": 1.0})
        fill(disk)
        compile_writer(str(file))({"compile_s": 2.0, "text": "x" * 100_000})
        assert f"jaxray: warning: the compile report was not written to {file}" in capsys.readouterr().out
        assert json.loads(file.read_text()) == {"compile_s": 1.0}
        assert sorted(p.name for p in file.parent.iterdir()) == ["compile_report.json"]
