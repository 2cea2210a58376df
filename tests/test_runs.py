"""jaxray.runs: the best trial is ranked by the metric the sweep saved, the same for the report and
for ``--checkpoint runs/<experiment>``; hand-written summary rows (the ranking is shape logic)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import jax
import pytest
from saved import save_params

from jaxray import checkpoint, folders, runs
from jaxray.config import parse_trial
from jaxray.config.experiment import ExperimentConfig
from jaxray.inference.load import check_checkpoint
from jaxray.models import build
from jaxray.reporting.sweep import markdown_summary
from jaxray.tune import main as tune_main
from jaxray.tune import save_experiment


def mlp(trial, accuracy, loss, **extra):
    return {
        "trial": trial,
        "workload": "mlp",
        "test_accuracy": accuracy,
        "test_loss": loss,
        "checkpoint": f"train/{trial}/checkpoint_step_00000020_attempt1",  # relative, as written
        **extra,
    }


# Highest accuracy (the default metric) is "sharp"; lowest test loss is "calm": they disagree.
ROWS = [mlp("sharp", 0.90, 0.45), mlp("calm", 0.88, 0.31), mlp("bad", 0.70, 0.80)]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> Path:
    """A real checkpoint of a width-8 MLP (an Orbax save), copied to each row's checkpoint."""
    trial = parse_trial({"model": {"workload": "mlp", "width": 8}})
    params = build(trial.model).init(jax.random.key(0))
    return save_params(tmp_path_factory.mktemp("stored") / "ck", params, trial)


def populate(folder: Path, rows: list[dict], stored: Path) -> Path:
    """A copy of ``stored`` at each row's checkpoint under ``folder``, so resolve finds real ones."""
    for row in rows:
        shutil.copytree(stored, folder / row["checkpoint"])
    return folder


def sweep_folder(tmp_path: Path, rows: list[dict], metric: str | None = "test_loss", mode=None) -> Path:
    """A run folder as python -m jaxray.tune leaves it: experiment.yaml (by tune's own writer) and
    summary.json."""
    sweep = {"workload": "mlp", **({"metric": metric} if metric else {}), **({"mode": mode} if mode else {})}
    save_experiment(tmp_path, ExperimentConfig.model_validate({"experiment": "x", "sweeps": [sweep]}))
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps(rows))
    return tmp_path


def best_named_in_summary_md(rows, ranking) -> str:
    best = markdown_summary(rows, ranking).split("## Best per workload")[1]
    return best.split("`")[1]


def test_the_default_and_the_saved_metric_disagree_and_the_saved_one_wins(tmp_path, stored):
    assert runs.best_trial(ROWS, "mlp")["trial"] == "sharp"  # DEFAULT_METRIC: highest test_accuracy
    folder = populate(sweep_folder(tmp_path, ROWS), ROWS, stored)
    ranking = runs.saved_ranking(folder)
    assert ranking == {"mlp": ("test_loss", "min")}  # mode follows the metric when not given
    assert runs.best_trial(ROWS, "mlp", ranking)["trial"] == "calm"
    assert runs.open_checkpoint(folder).path == folder / ROWS[1]["checkpoint"]
    assert runs.open_checkpoint(folder).path == folder / ROWS[1]["checkpoint"]
    assert best_named_in_summary_md(ROWS, ranking) == "calm"


def test_an_explicit_mode_is_honoured(tmp_path, stored):
    folder = populate(sweep_folder(tmp_path, ROWS, metric="test_loss", mode="max"), ROWS, stored)
    assert runs.saved_ranking(folder) == {"mlp": ("test_loss", "max")}
    assert runs.open_checkpoint(folder).path.parent.name == "bad"
    assert best_named_in_summary_md(ROWS, runs.saved_ranking(folder)) == "bad"


def test_a_sweep_on_the_default_metric_ranks_as_before(tmp_path, stored):
    folder = populate(sweep_folder(tmp_path, ROWS, metric=None), ROWS, stored)
    assert runs.saved_ranking(folder) == {"mlp": ("test_accuracy", "max")}
    assert runs.open_checkpoint(folder).path.parent.name == "sharp"


def test_without_experiment_yaml_the_default_metric_ranks(tmp_path, stored):
    (populate(tmp_path, ROWS, stored) / runs.SUMMARY_JSON).write_text(json.dumps(ROWS))
    assert runs.saved_ranking(tmp_path) == {}
    assert runs.open_checkpoint(tmp_path).path.parent.name == "sharp"


def test_a_damaged_experiment_yaml_is_named(tmp_path):
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps(ROWS))
    (tmp_path / runs.EXPERIMENT_FILE).write_text(
        "experiment: x\nsweeps: [{workload: mlp, metric: val_loss}]\n"
    )
    with pytest.raises(runs.RunFolderError, match="experiment.yaml is damaged"):
        runs.saved_ranking(tmp_path)
    with pytest.raises(checkpoint.CheckpointError, match="experiment.yaml is damaged"):
        runs.open_checkpoint(tmp_path)


def test_missing_and_non_finite_values_rank_last_and_ties_go_to_the_first():
    rows = [
        mlp("nan", float("nan"), float("nan")),
        mlp("none", None, None),
        mlp("text", "0.99", "0.01"),
        mlp("first", 0.8, 0.5),
        mlp("second", 0.8, 0.5),
    ]
    assert runs.best_trial(rows, "mlp")["trial"] == "first"
    assert runs.best_trial(rows, "mlp", {"mlp": ("test_loss", "min")})["trial"] == "first"
    assert runs.best_trial(rows[:3], "mlp") is None
    assert runs.metric_value({"m": math.inf}, "m") is None and runs.metric_value({"m": True}, "m") is None


def test_a_run_whose_trials_all_diverged_is_never_resolved_and_hides_no_earlier_run(tmp_path, stored):
    """Rows without a finite ranking metric (diverged, NaN recorded as null): no best trial, so the
    run folder itself is refused naming the metric, and its experiment resolves to the earlier run."""
    experiment = tmp_path / "demo"
    good = populate(sweep_folder(experiment / "20261201-100000", ROWS), ROWS, stored)
    rows = [mlp("a", float("nan"), float("nan")), mlp("b", None, None)]
    diverged = populate(sweep_folder(experiment / "20261202-100000", rows), rows, stored)
    with pytest.raises(
        checkpoint.CheckpointError, match="no trial of workload 'mlp' finished with a finite test_loss"
    ):
        runs.open_checkpoint(diverged)
    assert "no trial finished with a finite test loss" in markdown_summary(rows, runs.saved_ranking(diverged))
    assert runs.finished(diverged) and runs.latest_run(experiment) == good
    assert runs.open_checkpoint(experiment).path.is_relative_to(good)


def test_other_workloads_keep_their_own_ranking():
    rows = [
        {"trial": "t1", "workload": "transformer", "val_loss": 2.0, "val_perplexity": 7.0},
        {"trial": "t2", "workload": "transformer", "val_loss": 1.9, "val_perplexity": 7.5},
        {"trial": "?1", "test_accuracy": 0.2},
        {"trial": "?2", "test_accuracy": 0.3},
    ]
    ranking = {"mlp": ("test_loss", "min")}  # only the mlp sweep chose another metric
    assert runs.best_trial(rows, "transformer", ranking)["trial"] == "t2"
    assert runs.best_trial(rows, "?", ranking)["trial"] == "?2"  # FALLBACK_METRIC
    assert runs.ranking_metric("transformer") == ("val_loss", "min")


def test_the_default_workload_is_the_transformer_then_the_first_by_name(tmp_path):
    rows = [*ROWS, {"trial": "t", "workload": "transformer", "val_loss": 2.0, "checkpoint": "train/t/c"}]
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps(rows))
    assert runs.checkpoint_of(tmp_path, runs.best_row(tmp_path)) == tmp_path / "train/t/c"
    with pytest.raises(runs.RunFolderError, match="has no shared_block_mlp trial"):
        runs.best_row(tmp_path, "shared_block_mlp")
    failed = [*rows, {"trial": "s", "workload": "shared_block_mlp", "error": "boom"}]
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps(failed))
    with pytest.raises(runs.RunFolderError, match="no finished trial with a checkpoint of workload 'shared_"):
        runs.best_row(tmp_path, "shared_block_mlp")
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps(ROWS))
    assert runs.best_row(tmp_path)["trial"] == "sharp"


def test_read_summary_refuses_what_is_not_a_sweep_summary(tmp_path):
    (tmp_path / runs.SUMMARY_JSON).write_text('{"written_by": "jaxray.evaluate"}')
    with pytest.raises(runs.RunFolderError, match="is not a sweep summary"):
        runs.read_summary(tmp_path)
    (tmp_path / runs.SUMMARY_JSON).write_text("[{")
    with pytest.raises(runs.RunFolderError, match="summary.json is damaged"):
        runs.read_summary(tmp_path)


def test_check_overwrite_lets_only_the_same_writer_replace_a_summary(tmp_path):
    folders.check_overwrite(tmp_path, "jaxray.evaluate")  # nothing there yet
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps({"written_by": "jaxray.evaluate"}))
    folders.check_overwrite(tmp_path, "jaxray.evaluate")
    with pytest.raises(ValueError, match="was not written by jaxray.bench dispatch"):
        folders.check_overwrite(tmp_path, "jaxray.bench dispatch")
    (tmp_path / runs.SUMMARY_JSON).write_text(json.dumps(ROWS))  # a sweep's summary: a list, no owner
    with pytest.raises(ValueError, match="choose another --out"):
        folders.check_overwrite(tmp_path, "jaxray.evaluate")
    (tmp_path / folders.COMPILE_FILE).write_text("{}")
    with pytest.raises(ValueError, match="compile.json exists"):
        folders.check_overwrite(tmp_path, "jaxray.bench compile", folders.COMPILE_FILE)


def test_the_layout_names():
    assert runs.FILES == ("summary.json", "summary.md", "throughput_vs_batch.png", "loss_curves.png")
    assert (folders.TRAIN_DIR, folders.TUNE_DIR, folders.TENSORBOARD_DIR) == ("train", "tune", "tensorboard")
    assert runs.EXPERIMENT_FILE == "experiment.yaml"


def test_an_experiment_folder_resolves_to_its_newest_complete_run(tmp_path, stored):
    """A newer run that failed, or was interrupted before its summary, never hides a complete one;
    a run folder itself is read as it is."""
    experiment = tmp_path / "demo"
    complete = populate(sweep_folder(experiment / "20261201-100000", ROWS), ROWS, stored)
    failed_rows = [mlp("sharp", 0.95, 0.1), {"trial": "x", "workload": "mlp", "error": "boom"}]
    failed = populate(sweep_folder(experiment / "20261202-100000", failed_rows), failed_rows[:1], stored)
    interrupted = experiment / "20261203-100000"
    save_experiment(
        interrupted, ExperimentConfig.model_validate({"experiment": "x", "sweeps": [{"workload": "mlp"}]})
    )
    assert runs.run_folders(experiment) == [interrupted, failed, complete]
    assert runs.latest_run(experiment) == complete
    assert runs.open_checkpoint(experiment).path.is_relative_to(complete)
    assert runs.open_checkpoint(failed).path.is_relative_to(failed)  # named itself: used
    with pytest.raises(checkpoint.CheckpointError, match="empty does not exist"):
        runs.open_checkpoint(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="neither a checkpoint"):
        runs.open_checkpoint(tmp_path / "empty")
    shutil.rmtree(complete)
    with pytest.raises(
        checkpoint.CheckpointError, match="has no finished run with a model: of its 2 run"
    ) as err:
        runs.open_checkpoint(experiment)
    assert "the newest, 20261203-100000, has no summary.json (interrupted" in str(err.value)
    assert f"--resume {interrupted}" in str(err.value)
    # The interrupted run named itself: the error says what to do with it, not that it is no run.
    with pytest.raises(checkpoint.CheckpointError, match="has not finished") as err:
        runs.open_checkpoint(interrupted)
    assert f"--resume {interrupted}" in str(err.value) and str(interrupted / "train") in str(err.value)


def test_a_recorded_path_outside_the_run_folder_is_refused(tmp_path):
    for recorded in ("/elsewhere/ck", "../other/ck", 5):
        with pytest.raises(runs.RunFolderError, match="not a path inside the run folder"):
            runs.checkpoint_of(tmp_path, {"trial": "t", "checkpoint": recorded})


def test_only_timestamped_folders_are_runs_and_an_evaluation_beside_them_hides_none(tmp_path, stored):
    experiment = tmp_path / "demo"
    older = populate(sweep_folder(experiment / "20261201-100000", ROWS), ROWS, stored)
    newer = populate(sweep_folder(experiment / "20261201-100000-2", ROWS), ROWS, stored)
    shutil.copytree(older, experiment / "baseline")  # a copy kept beside the runs: not a run
    (experiment / runs.SUMMARY_JSON).write_text('{"written_by": "jaxray.evaluate"}')  # evaluate --out here
    assert runs.run_folders(experiment) == [newer, older]
    assert runs.latest_run(experiment) == newer
    assert runs.open_checkpoint(experiment).path.is_relative_to(newer)


def test_a_run_is_never_made_inside_a_checkpoint(tmp_path, stored):
    with pytest.raises(runs.RunFolderError, match="lies in the checkpoint folder"):
        runs.new_run(stored / "params" / "out")


def test_a_newer_run_of_another_workload_hides_no_transformer(tmp_path, stored):
    """runs/<experiment> for a workload is the newest complete run that trained it."""
    experiment = tmp_path / "demo"
    lm = [{"trial": "lm", "workload": "transformer", "val_loss": 1.7, "checkpoint": "train/lm/ck"}]
    older = sweep_folder(experiment / "20261201-100000", [*ROWS, *lm])
    newer = populate(sweep_folder(experiment / "20261202-100000", ROWS), ROWS, stored)
    assert runs.latest_run(experiment) == newer and runs.latest_run(experiment, "mlp") == newer
    assert runs.latest_run(experiment, "transformer") == older
    with pytest.raises(runs.RunFolderError, match="has no transformer trial"):
        runs.best_row(newer, "transformer")


def test_a_run_with_a_diverged_mlp_still_serves_its_best_transformer(tmp_path, stored, capsys):
    """One meaning of finished (runs.finished): a diverged trial is finished without a model, each
    workload ranked among its own trials with one. --resume has nothing to do; --checkpoint of the
    experiment, the generate/serve check and evaluate use the new run's best transformer, and the
    MLP still comes from the earlier run; the diverged trial's empty folder says what it is."""
    model = {"workload": "transformer", "width": 16, "num_layers": 1, "num_heads": 2, "max_seq_len": 16}
    trial = parse_trial({"model": model, "data": {"seq_len": 16}})
    lm = save_params(tmp_path / "lm", build(trial.model).init(jax.random.key(0)), trial)
    experiment = tmp_path / "demo"
    older = populate(sweep_folder(experiment / "20261201-100000", ROWS), ROWS, stored)
    diverged = {
        "trial": "mlp_bad", "workload": "mlp", "error": "diverged at step 2: loss nan (not finite)",
        "diverged_step": 2, "diverged_metric": "loss", "diverged_value": "nan",
    }  # fmt: skip
    lms = [
        {"trial": t, "workload": "transformer", "val_loss": v, "checkpoint": f"train/{t}/checkpoint_step_20"}
        for t, v in (("t1", 2.0), ("t2", 1.8))
    ]
    mixed = populate(sweep_folder(experiment / "20261202-100000", [diverged, *lms], metric=None), lms, lm)
    (mixed / folders.TRAIN_DIR / "mlp_bad").mkdir()
    assert runs.finished(mixed) and runs.run_folders(experiment)[0] == mixed
    assert tune_main(["--resume", str(experiment)]) == 0
    assert "all finished" in capsys.readouterr().err
    assert runs.latest_run(experiment) == mixed == runs.latest_run(experiment, "transformer")
    assert runs.open_checkpoint(experiment).path.is_relative_to(mixed / folders.TRAIN_DIR / "t2")
    check_checkpoint(str(experiment))  # what generate and serve run first: passes
    assert runs.open_checkpoint(experiment, "mlp").path.is_relative_to(older)
    with pytest.raises(checkpoint.CheckpointError, match="diverged at step 2, before its first save"):
        runs.open_checkpoint(mixed / folders.TRAIN_DIR / "mlp_bad")
