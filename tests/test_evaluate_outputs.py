"""Where ``python -m jaxray.evaluate`` writes, and that it never loses an earlier evaluation: one
default folder per checkpoint, an --out holding another checkpoint's evaluation is refused unless
--overwrite, a failed evaluation creates no folder, and a full disk (a real tmpfs) leaves the
earlier results as they were. Real Orbax checkpoints of an untrained MLP, the real test set."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import pytest
from checkpoint_copies import flip_a_byte, largest_params_file
from full_disk import fill, small_tmpfs
from saved import save_params

from jaxray.checkpoint import checkpoint_name
from jaxray.config import parse_trial
from jaxray.evaluate import default_out, main
from jaxray.folders import exclusive
from jaxray.models import build

TRIAL_NAME = parse_trial({"model": {"workload": "mlp", "width": 8}}).name()  # as a sweep names it
RESULTS = ["confusion_matrix.png", "predictions_grid.png", "summary.json"]


@pytest.fixture(scope="module")
def trial_checkpoints(real_dir, tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of one trial as a sweep leaves them: runs/demo/train/<trial>/checkpoint_step_*
    (untrained MLP params; different seeds, so their evaluations differ)."""
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}, "data": {"data_dir": str(real_dir)}})
    folder = tmp_path_factory.mktemp("runs") / "demo" / "train" / TRIAL_NAME
    model = build(trial.model)
    return tuple(
        save_params(folder / checkpoint_name(step, 1), model.init(jax.random.key(step)), trial)
        for step in (10, 20)
    )


def evaluate(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr less the line naming the checkpoint resolved: tests/checkpoint/test_describe.py)."""
    code = main([*map(str, args)])
    err = capsys.readouterr().err.splitlines(keepends=True)
    return code, "".join(line for line in err if not line.startswith("checkpoint: "))


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_the_default_folder_is_one_per_checkpoint(trial_checkpoints, tmp_path, monkeypatch, capsys):
    first, second = trial_checkpoints
    assert default_out(first) == Path("runs/eval/demo") / TRIAL_NAME / first.name
    assert default_out(second) == Path("runs/eval/demo") / TRIAL_NAME / second.name
    loose = tmp_path / "elsewhere" / TRIAL_NAME / "checkpoint_2026-01-01_00-00-00"  # no run folder
    assert default_out(loose) == Path("runs/eval") / TRIAL_NAME / loose.name
    assert default_out(tmp_path / "mlp_ck") == Path("runs/eval/mlp_ck")
    # In a run of python -m jaxray.tune: runs/<experiment>/<YYYYmmdd-HHMMSS>/train/<trial>/checkpoint_*
    run = tmp_path / "runs" / "demo" / "20261203-101010"
    in_run = run / "train" / TRIAL_NAME / first.name
    assert default_out(in_run) == Path("runs/eval/demo/20261203-101010") / TRIAL_NAME / first.name
    monkeypatch.chdir(tmp_path)
    for ck in (first, second):
        assert evaluate(capsys, "--checkpoint", ck) == (0, "")
    for ck in (first, second):  # both evaluations kept, each recording its own checkpoint
        saved = json.loads((tmp_path / default_out(ck) / "summary.json").read_text())
        assert saved["checkpoint"] == str(ck) and sorted(contents(tmp_path / default_out(ck))) == RESULTS


@pytest.mark.slow  # two evaluations (11 s); CI runs it
def test_another_checkpoints_evaluation_is_replaced_only_with_overwrite(trial_checkpoints, tmp_path, capsys):
    first, second = trial_checkpoints
    out = tmp_path / "eval"
    assert evaluate(capsys, "--checkpoint", first, "--out", out) == (0, "")
    before = contents(out)
    assert evaluate(capsys, "--checkpoint", first, "--out", out)[0] == 0  # the same checkpoint again
    code, err = evaluate(capsys, "--checkpoint", second, "--out", out)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"--out {out} holds the evaluation of {first}; pass --overwrite or another --out" in err
    assert contents(out) == before
    assert evaluate(capsys, "--checkpoint", second, "--out", out, "--overwrite") == (0, "")
    assert json.loads((out / "summary.json").read_text())["checkpoint"] == str(second)
    assert sorted(contents(out)) == RESULTS


def test_an_out_another_evaluation_is_writing_is_refused(trial_checkpoints, tmp_path, capsys):
    out = tmp_path / "eval"
    with exclusive(out, "python -m jaxray.evaluate"):
        code, err = evaluate(capsys, "--checkpoint", trial_checkpoints[0], "--out", out)
        assert code == 2 and f"another python -m jaxray.evaluate is writing into {out}" in err, err
        assert [p.name for p in out.iterdir()] == [".jaxray.lock"]
    assert not out.exists()  # nothing of either was left


def test_a_failed_evaluation_creates_no_folder(trial_checkpoints, real_dir, tmp_path, monkeypatch, capsys):
    damaged = Path(shutil.copytree(trial_checkpoints[0], tmp_path / TRIAL_NAME / trial_checkpoints[0].name))
    flip_a_byte(largest_params_file(damaged))
    monkeypatch.chdir(tmp_path)
    code, err = evaluate(capsys, "--checkpoint", damaged)  # the default --out
    assert code == 2 and "does not match its checksum" in err
    bad_data = tmp_path / "data" / "fashion-mnist"  # the real files, the test labels damaged
    bad_data.mkdir(parents=True)
    for real in (real_dir / "fashion-mnist").iterdir():
        (bad_data / real.name).symlink_to(real)
    (bad_data / "t10k-labels-idx1-ubyte.gz").unlink()
    (bad_data / "t10k-labels-idx1-ubyte.gz").write_bytes(b"not gzip")
    code, err = evaluate(capsys, "--checkpoint", trial_checkpoints[0], "--data-dir", bad_data.parent)
    assert code == 2 and "t10k-labels-idx1-ubyte.gz" in err
    nested = tmp_path / "new" / "eval"
    assert evaluate(capsys, "--checkpoint", damaged, "--out", nested)[0] == 2
    assert not (tmp_path / "runs").exists() and not (tmp_path / "new").exists()


def test_an_out_that_cannot_be_created_is_refused_before_the_work(trial_checkpoints, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    code, err = evaluate(capsys, "--checkpoint", trial_checkpoints[0], "--out", tmp_path / "a_file" / "eval")
    assert code == 2 and f"{tmp_path / 'a_file'} is not a directory" in err
    assert (tmp_path / "a_file").read_text() == "x"


@pytest.mark.slow  # an evaluation onto a full tmpfs (8 s); CI runs it
def test_a_full_disk_leaves_the_earlier_evaluation_as_it_was(trial_checkpoints, tmp_path, capsys):
    first, second = trial_checkpoints
    with small_tmpfs(tmp_path / "disk", 4) as disk:
        out = disk / "eval"
        assert evaluate(capsys, "--checkpoint", first, "--out", out) == (0, "")
        before = contents(out)
        fill(disk)
        for given in (out, disk / "new" / "eval"):
            code, err = evaluate(capsys, "--checkpoint", second, "--out", given, "--overwrite")
            assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
            assert f"the evaluation could not be written to {given}" in err
            assert "No space left on device" in err and "nothing there was changed" in err
        assert contents(out) == before  # no partial files either
        assert sorted(p.name for p in disk.iterdir()) == ["eval", "filler"]


def test_figures_of_the_users_own_in_out_are_never_replaced(trial_checkpoints, tmp_path, capsys):
    # A user's own confusion_matrix.png: never overwritten (an MLP's evaluation) or deleted (a
    # transformer's, which writes no figures).
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "confusion_matrix.png").write_text("my own figure")
    code, err = evaluate(
        capsys, "--checkpoint", trial_checkpoints[0], "--out", tmp_path / "mine", "--overwrite"
    )
    assert code == 2 and "holds confusion_matrix.png but no evaluation (no summary.json)" in err, err
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["confusion_matrix.png"]
    assert (tmp_path / "mine" / "confusion_matrix.png").read_text() == "my own figure"
