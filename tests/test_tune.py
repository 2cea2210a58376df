"""`python -m jaxray.tune`, the CLI and its folder policy: `--resume DIR` on bad input ends with a
clear error and exit code 2 before Ray starts, nothing in DIR touched; conflicting arguments; the
saved experiment.yaml round-trips. (The resume itself: tests/integration/test_tune_resume.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest
from earlier_runs import earlier_run, files, results
from full_disk import fill, small_tmpfs
from tune_cli import tune_cli as tune

from jaxray import checkpoint
from jaxray.config import ConfigError, parse_trial
from jaxray.config.experiment import load_experiment
from jaxray.models import build
from jaxray.overwrite import ASIDE_DIR, check_out, full_disk, set_aside, settle_aside
from jaxray.runs import EXPERIMENT_FILE, SUMMARY_JSON, TRAIN_DIR, RunFolderError
from jaxray.tune import load_resume, main, parse_args, save_experiment

ROOT = Path(__file__).resolve().parents[1]


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
        check_out(tmp_path, overwrite=False)
    assert check_out(tmp_path, overwrite=True) == [tmp_path / EXPERIMENT_FILE]
    assert (tmp_path / EXPERIMENT_FILE).is_file()  # checking moves nothing


def test_overwrite_keeps_the_earlier_run_aside_until_a_new_trial_finishes(tmp_path):
    before = earlier_run(tmp_path)
    aside = set_aside(tmp_path, check_out(tmp_path, overwrite=True))
    assert (
        aside == tmp_path / ASIDE_DIR
        and (aside / TRAIN_DIR / "trial_0" / "weights").read_bytes() == b"earlier"
    )
    assert (tmp_path / "notes.txt").is_file() and not (tmp_path / SUMMARY_JSON).exists()
    with pytest.raises(
        ConfigError, match=re.escape(f"{aside} holds the results of a run that an interrupted")
    ):
        check_out(tmp_path, overwrite=True)  # a second overwrite never touches set-aside results
    (tmp_path / SUMMARY_JSON).write_text('{"rows": ["new"]}')
    settle_aside(tmp_path, aside, [({"trial": "t0", "test_accuracy": 0.8}, [])], complete=True)
    assert not aside.exists() and not (tmp_path / f"{ASIDE_DIR}.deleting").exists()
    assert (tmp_path / SUMMARY_JSON).read_text() == '{"rows": ["new"]}'
    assert "notes.txt" in files(tmp_path) and len(before) == 4


def test_a_new_run_that_did_not_finish_every_trial_keeps_both(tmp_path, capsys):
    # One trial finished, then one failed or the run was interrupted (a fresh user lost an earlier,
    # better run so: the new run's first finished trial was enough to delete it).
    before = earlier_run(tmp_path)
    aside = set_aside(tmp_path, check_out(tmp_path, overwrite=True))
    (tmp_path / SUMMARY_JSON).write_text('{"rows": ["new"]}')
    rows = [({"trial": "t0", "test_accuracy": 0.8}, []), ({"trial": "t1", "error": "RuntimeError: boom"}, [])]
    settle_aside(tmp_path, aside, rows, complete=False)
    assert files(aside) == {k: v for k, v in before.items() if k != "notes.txt"}
    assert (tmp_path / SUMMARY_JSON).read_text() == '{"rows": ["new"]}'
    assert (
        f"did not finish every trial, so the earlier run's results are kept in {aside}"
        in capsys.readouterr().err
    )


def test_a_new_run_with_no_finished_trial_puts_the_earlier_results_back(tmp_path, capsys):
    before = earlier_run(tmp_path)
    aside = set_aside(tmp_path, check_out(tmp_path, overwrite=True))
    save_experiment(tmp_path, load_experiment(ROOT / "tune_configs/demo.yaml"))  # the new run's files
    (tmp_path / TRAIN_DIR).mkdir()
    settle_aside(tmp_path, aside, [({"trial": "t0", "error": "RuntimeError: boom"}, [])], complete=False)
    assert files(tmp_path) == before and not aside.exists()
    assert f"the earlier run's results are back in {tmp_path}" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.slow
def test_an_overwrite_refused_by_the_cluster_leaves_the_earlier_run_in_place(tmp_path, monkeypatch, capfd):
    """use_gpu on a private Ray without GPUs fails once Ray is up (the last check before training):
    before, --overwrite had already deleted the earlier results by then."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    before = earlier_run(tmp_path / "out")
    config = tmp_path / "gpu.yaml"
    smoke = (ROOT / "tune_configs/smoke.yaml").read_text()
    config.write_text(smoke.replace("devices_per_worker: 1}", "devices_per_worker: 1, use_gpu: true}"))
    assert "use_gpu: true" in config.read_text()
    assert main(["--config", str(config), "--out", str(tmp_path / "out"), "--overwrite"]) == 2
    assert "workers.use_gpu is true" in capfd.readouterr().err  # the terminal's descriptor
    after = files(tmp_path / "out")
    [log] = [name for name in after if name.startswith("logs/tune-")]  # the new run's log, beside
    assert {k: v for k, v in after.items() if k != log} == before
    assert b"error: workers.use_gpu is true" in after[log]  # jaxray's lines too: the whole record


@pytest.mark.ray
@pytest.mark.slow
def test_an_overwrite_stopped_by_a_full_disk_puts_the_earlier_run_back(tmp_path, monkeypatch, capfd):
    """The disk fills once every check has passed and the earlier results are set aside: the new
    run cannot write its experiment.yaml. A full disk is a failure, not a crash: the new run's files
    are removed and the earlier ones put back (before, they stayed in .overwritten/ and the next
    --overwrite was refused)."""
    monkeypatch.setenv("RAY_ADDRESS", "local")
    with small_tmpfs(tmp_path / "disk", 1) as disk:
        out = disk / "run"
        before = earlier_run(out)
        fill(disk)
        assert (
            main(["--config", str(ROOT / "tune_configs/smoke.yaml"), "--out", str(out), "--overwrite"]) == 1
        )
        err = capfd.readouterr().err
        assert f"with the disk holding {out} full (" in err and "No space left on device" in err, err
        assert f"the earlier run's results are back in {out}" in err and "kept in" not in err, err
        assert results(out) == before  # and the new run's log, if the full disk let it start one
        assert not (out / ASIDE_DIR).exists()


def test_a_sweep_stopped_on_a_full_disk_is_told_from_the_disk(tmp_path):
    err = EOFError("Ran out of input")  # what Ray Tune 2.60 raises reading an empty error.pkl
    assert full_disk(tmp_path, err) is None  # room left: the error is not the disk's
    with small_tmpfs(tmp_path / "disk", 4) as disk:
        fill(disk)
        message = full_disk(disk, err)
        put_back = full_disk(disk, err, keeps_new=False)  # an --overwrite's: its files are removed
    assert message and f"the disk holding {disk} full (0 bytes free)" in message, message
    assert "EOFError: Ran out of input" in message and f"kept in {disk / TRAIN_DIR}" in message
    assert put_back and "kept in" not in put_back and "Free space, then run the sweep again" in put_back


def test_folders_named_like_a_runs_without_its_files_are_never_replaced(tmp_path):
    # A project folder of the user's that happens to hold train/ and tensorboard/: not a run folder.
    (tmp_path / TRAIN_DIR).mkdir()
    (tmp_path / TRAIN_DIR / "train_model.py").write_text("the user's code")
    (tmp_path / "tensorboard").mkdir()
    before = files(tmp_path)
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match="is not a run folder of python -m jaxray.tune") as err:
            check_out(tmp_path, overwrite=overwrite)
        assert "train, tensorboard" in str(err.value) and "nothing in it is replaced" in str(err.value)
    assert files(tmp_path) == before


def test_the_saved_config_is_whole_or_absent_on_a_full_disk(tmp_path):
    exp = load_experiment(ROOT / "tune_configs/smoke.yaml")
    with small_tmpfs(tmp_path / "disk", 1) as disk:
        fill(disk)
        with pytest.raises(OSError, match="No space left on device"):
            save_experiment(disk / "run", exp)
        assert not any((disk / "run").iterdir())  # no truncated experiment.yaml for --resume to misread


def test_resume_refuses_an_experiment_yaml_edited_after_the_run_started(tmp_path):
    saved = save_experiment(tmp_path, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    assert load_resume(tmp_path).experiment == "smoke"  # as written: accepted
    text = saved.read_text()
    saved.write_text(text.replace("steps: 20", "steps: 40"))
    with pytest.raises(ConfigError, match="was edited after the run started") as err:
        load_resume(tmp_path)
    assert str(saved) in str(err.value) and "undo the edit, or start a new run" in str(err.value)
    # A folder written before the digest line existed: its config is taken as it is.
    saved.write_text("\n".join(line for line in text.splitlines() if "SHA-256" not in line))
    assert load_resume(tmp_path).experiment == "smoke"


def test_a_run_folder_inside_another_run_is_refused(tmp_path):
    # A fresh user ran a sweep with --out in another run's checkpoint folder: evaluate on that
    # checkpoint took no notice of it, and the outer run's next --overwrite deleted it.
    outer = tmp_path / "outer"
    earlier_run(outer)
    inner = outer / TRAIN_DIR / "trial_0" / "checkpoint_step_00000004_attempt1" / "run"
    with pytest.raises(RunFolderError, match=re.escape(f"--out {inner} lies in the run folder {outer}")):
        check_out(inner, overwrite=False)
    # An experiment.yaml of the user's own (a config, not a run's) is no run folder.
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / EXPERIMENT_FILE).write_text("experiment: mine\n")
    assert check_out(tmp_path / "project" / "runs" / "x", overwrite=False) == []


def test_a_run_folder_inside_a_checkpoint_folder_is_refused(tmp_path):
    # A fresh user ran a sweep into a checkpoint copied out of a run (evaluate and export refused it).
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}})
    ckpt = checkpoint.save(tmp_path / "ck", build(trial.model).init(jax.random.key(0)), trial)
    with pytest.raises(
        ConfigError, match=re.escape(f"--out {ckpt / 'run'} lies in the checkpoint folder {ckpt}")
    ):
        check_out(ckpt / "run", overwrite=False)


def test_an_overwrite_that_would_delete_a_run_inside_the_earlier_one_is_refused(tmp_path):
    before = earlier_run(tmp_path / "outer")
    nested = tmp_path / "outer" / TRAIN_DIR / "trial_0" / "run"
    save_experiment(nested, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    with pytest.raises(RunFolderError, match=re.escape(f"{nested} is another run's folder inside")):
        check_out(tmp_path / "outer", overwrite=True)
    assert set(before) <= set(files(tmp_path / "outer")) and not (tmp_path / "outer" / ASIDE_DIR).exists()


def test_an_out_reached_through_a_symlink_into_another_run_is_refused(tmp_path):
    earlier_run(tmp_path / "outer")
    (tmp_path / "link").symlink_to(tmp_path / "outer" / TRAIN_DIR)
    with pytest.raises(RunFolderError, match=re.escape(f"lies in the run folder {tmp_path / 'outer'}")):
        check_out(tmp_path / "link" / "run", overwrite=False)


def test_a_run_folder_moved_during_the_run_leaves_the_earlier_results_where_it_went(tmp_path):
    earlier_run(tmp_path / "run")
    aside = set_aside(tmp_path / "run", check_out(tmp_path / "run", overwrite=True))
    (tmp_path / "run").rename(tmp_path / "moved")  # the .overwritten/ went with it
    settle_aside(tmp_path / "run", aside, [({"trial": "t0", "test_accuracy": 0.8}, [])], complete=True)
    assert (tmp_path / "moved" / ASIDE_DIR / "summary.json").is_file()  # untouched where it went
    # (_run says so and exits 1: "DIR was moved while the run wrote into it, so it holds part ...")


def test_a_deletion_a_killed_run_left_does_not_stop_the_next_one(tmp_path):
    # A SIGKILL during the deletion of the earlier results leaves .overwritten.deleting/; the next
    # complete --overwrite failed renaming onto it ("Directory not empty") and exited 1.
    earlier_run(tmp_path)
    aside = set_aside(tmp_path, check_out(tmp_path, overwrite=True))
    (tmp_path / f"{ASIDE_DIR}.deleting" / "train").mkdir(parents=True)
    (tmp_path / f"{ASIDE_DIR}.deleting" / "experiment.yaml").write_text("a half-deleted run")
    settle_aside(tmp_path, aside, [({"trial": "t0", "test_accuracy": 0.8}, [])], complete=True)
    assert not aside.exists() and not (tmp_path / f"{ASIDE_DIR}.deleting").exists()
