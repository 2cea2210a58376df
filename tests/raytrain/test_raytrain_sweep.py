"""The Tune driver without a cluster: concurrent trials from the cluster's GPUs, the ASHA scheduler
the YAML asks for, trial names, and a trial's summary row read from its Tune result (what the
workers reported, none of Tune's own fields)."""

from __future__ import annotations

import json

import pytest
from ray import tune
from ray.tune.schedulers import ASHAScheduler

from jaxray.config.experiment import ExperimentConfig, SweepConfig
from jaxray.folders import COMPILE_FILE, TRAIN_DIR
from jaxray.raytrain import sweep as sweep_module
from jaxray.raytrain.sweep import concurrent_trials, early_stopping, trial_rows
from jaxray.raytrain.trainable import trial_name


def experiment(workers: dict, max_concurrent_trials=None) -> ExperimentConfig:
    return ExperimentConfig.model_validate(
        {
            "experiment": "x",
            "workers": workers,
            "sweeps": [{"workload": "mlp"}],
            "max_concurrent_trials": max_concurrent_trials,
        }
    )


@pytest.mark.parametrize(
    "workers,gpus,expected",
    [
        ({"num_workers": 2, "devices_per_worker": 2, "accelerator": "gpu"}, 8, 2),  # 4 GPUs per trial
        ({"num_workers": 1, "devices_per_worker": 2, "accelerator": "gpu"}, 7, 3),  # whole trials only
        ({"num_workers": 4, "devices_per_worker": 2, "accelerator": "gpu"}, 2, 1),  # waits for more; never 0
        ({"num_workers": 2, "devices_per_worker": 2, "accelerator": "cpu"}, 8, 1),  # CPU trials one at a time
    ],
)
def test_concurrent_trials_follow_the_clusters_gpus(workers, gpus, expected):
    assert concurrent_trials(experiment(workers), {"GPU": float(gpus), "CPU": 48.0}) == expected


def test_an_explicit_max_concurrent_trials_wins():
    assert concurrent_trials(experiment({"accelerator": "gpu"}, 3), {"GPU": 16.0}) == 3


def test_asha_from_the_yaml():
    assert early_stopping(SweepConfig.model_validate({"workload": "mlp"})) is None
    sweep = SweepConfig.model_validate(
        {
            "workload": "transformer",
            "train": {"steps": 1000},
            "early_stopping": {"grace_period": 100, "reduction_factor": 4},
        }
    )
    asha = early_stopping(sweep)
    assert isinstance(asha, ASHAScheduler)
    assert (asha.metric, asha._mode, asha._time_attr, asha._max_t, asha._reduction_factor) == (
        "loss",
        "min",
        "step",
        1000,
        4,
    )
    assert asha._brackets[0]._rungs[-1][0] == 100  # the first rung: the grace period
    by_accuracy = SweepConfig.model_validate({"workload": "mlp", "early_stopping": {"metric": "accuracy"}})
    assert by_accuracy.early_stopping.mode == "max"
    short = early_stopping(
        SweepConfig.model_validate(
            {"workload": "mlp", "train": {"steps": 20}, "early_stopping": {"grace_period": 100}}
        )
    )
    assert short._brackets[0]._rungs[-1][0] == 20  # never past the last step


# The final Tune result of an MLP trial as Ray 2.60 returns it: the workers' final report (the last
# log row, the summary, ``final``), the checkpoint path TuneReportCallback adds, and Tune's fields.
GRID_POINT = {"global_batch": 128, "dtype": "float32", "width": 64, "learning_rate": 0.003}
LOG_ROW = {"step": 20, "examples": 2560, "loss": 0.61, "accuracy": 0.79, "grad_norm": 0.9}
SUMMARY = {"workload": "mlp", **GRID_POINT, "steps": 20, "devices": 1, "test_accuracy": 0.77, "restarts": 0}
TUNE_FIELDS = {
    "timestamp": 1764580000,
    "checkpoint_dir_name": None,
    "done": True,
    "training_iteration": 3,
    "trial_id": "a1b2c3d4",
    "date": "2026-12-01_09-26-17",
    "time_this_iter_s": 0.5,
    "time_total_s": 7.5,
    "pid": 4242,
    "hostname": "host",
    "node_ip": "10.0.0.1",
    "config": GRID_POINT,
    "time_since_restore": 7.5,
    "iterations_since_restore": 3,
    "experiment_tag": "0_global_batch=128",
    **{f"config/{k}": v for k, v in GRID_POINT.items()},
}


def tune_result(tmp_path, metrics=None, error=None) -> tune.Result:
    return tune.Result(metrics=metrics, checkpoint=None, error=error, path=str(tmp_path / "trial_folder"))


def test_trial_names_come_from_the_grid_point():
    assert trial_name("mlp", GRID_POINT) == "mlp_b128_float32_w64_lr0.003"


def test_the_row_holds_what_the_workers_reported_and_none_of_tunes_fields(tmp_path):
    history = [{"step": 10, "loss": 0.7}, LOG_ROW]
    ckpt = tmp_path / "train" / "mlp_b128_float32_w64_lr0.003" / "checkpoint_step_00000020_attempt1"
    ckpt.mkdir(parents=True)
    (ckpt / "history.json").write_text(json.dumps(history))
    metrics = {**LOG_ROW, **SUMMARY, "final": True, "checkpoint_path": str(ckpt), **TUNE_FIELDS}
    # The trial's kept checkpoints, counted and measured once Ray's retention is done.
    (ckpt.parent / "checkpoint_step_00000010_attempt1").mkdir()
    (ckpt.parent / "checkpoint_step_00000010_attempt1" / "a").write_bytes(b"x" * 2**20)
    row, rows = trial_rows("mlp", tune_result(tmp_path, metrics), tmp_path)
    disk = {"checkpoints_kept": 2, "checkpoints_mib": round(1 + len(json.dumps(history)) / 2**20, 2)}
    assert row == {"trial": "mlp_b128_float32_w64_lr0.003", **SUMMARY, "checkpoint": str(ckpt), **disk}
    assert rows == history


def test_a_checkpoint_reported_before_the_run_folder_moved_is_read_inside_it(tmp_path):
    # A trial that finished, then the folder was moved and the run resumed there: Tune still holds
    # the path the trial reported in the old place.
    history = [LOG_ROW]
    ckpt = tmp_path / "train" / "mlp_b128_float32_w64_lr0.003" / "checkpoint_step_00000020_attempt1"
    ckpt.mkdir(parents=True)
    (ckpt / "history.json").write_text(json.dumps(history))
    old = "/gone/runs/demo/train/mlp_b128_float32_w64_lr0.003/checkpoint_step_00000020_attempt1"
    metrics = {**LOG_ROW, **SUMMARY, "final": True, "checkpoint_path": old, **TUNE_FIELDS}
    row, rows = trial_rows("mlp", tune_result(tmp_path, metrics), tmp_path)
    assert row["checkpoint"] == str(ckpt) and rows == history


def test_a_trial_without_its_final_report_or_with_an_error_is_a_failed_row(tmp_path):
    row, rows = trial_rows("mlp", tune_result(tmp_path, {**LOG_ROW, **TUNE_FIELDS}), tmp_path)
    assert row == {
        "trial": "mlp_b128_float32_w64_lr0.003",
        "workload": "mlp",
        **GRID_POINT,
        "error": row["error"],
    }
    assert row["error"] == "trial ended without its final report" and rows == []
    # An errored trial may come back without its config (Result.config is metrics["config"]): the
    # row is named after its folder.
    row, rows = trial_rows("mlp", tune_result(tmp_path, error=RuntimeError("\x1b[31mboom\x1b[0m")), tmp_path)
    assert row == {"trial": "trial_folder", "workload": "mlp", "error": "RuntimeError: boom"} and rows == []


def test_the_drivers_xla_flags_travel_to_the_trials(monkeypatch, tmp_path):
    # The trial builds its trainer in a Tune actor, whose environment is the cluster's: the
    # driver's XLA_FLAGS go along with the trainable (trainer.worker_env keeps them).
    class Stop(Exception):
        pass

    def with_parameters(trainable, **kwargs):
        raise Stop(kwargs)

    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    monkeypatch.setattr(sweep_module.tune, "with_parameters", with_parameters)
    exp = experiment({})
    with pytest.raises(Stop) as stopped:
        sweep_module.run_sweep(exp, 0, {}, None, tmp_path)
    assert stopped.value.args[0]["xla_flags"] == "--xla_dump_to=/tmp/d"


def test_the_grid_is_parsed_twice_and_the_trials_travel_parsed(monkeypatch, tmp_path):
    """Loading checks every grid point; the plan parses each once more, and the pre-flight checks,
    the data set-up and the Tune trainable share it: the trainable receives those TrialConfig
    objects by name (Tune's actor and the workers parse nothing)."""
    from jaxray import tune as tune_cli
    from jaxray.config import experiment as experiment_module
    from jaxray.parallel.checks import plan_experiment

    parsed = []
    real = experiment_module.parse_trial
    monkeypatch.setattr(
        experiment_module, "parse_trial", lambda *a, **k: parsed.append(real(*a, **k)) or parsed[-1]
    )
    path = tmp_path / "x.yaml"
    path.write_text(
        "experiment: x\nsweeps:\n- workload: mlp\n  search_space: {global_batch: [32, 64], width: [16, 32]}\n"
    )
    exp = experiment_module.load_experiment(path)
    plans = plan_experiment(exp, str(path))
    assert tune_cli.first_trials(plans)["mlp"] is plans[0].trial
    assert len(parsed) == 8  # 4 grid points, twice

    class Stop(Exception):
        pass

    def with_parameters(trainable, **kwargs):
        raise Stop(kwargs)

    monkeypatch.setattr(sweep_module.tune, "with_parameters", with_parameters)
    with pytest.raises(Stop) as stopped:
        sweep_module.run_sweep(exp, 0, {plan.name: plan.trial for plan in plans}, None, tmp_path)
    trials = stopped.value.args[0]["trials"]
    assert len(parsed) == 8 and all(a is b.trial for a, b in zip(trials.values(), plans, strict=True))
    # run_trial finds its trial by the name of Tune's config, the grid point
    assert list(trials) == [trial_name("mlp", point) for point in exp.sweeps[0].points()]


def test_a_trial_asha_stopped_keeps_its_last_rows_figures(tmp_path):
    """No final report: the row keeps where it stopped and its last log row's loss, step time and the
    throughput they make (16 sequences of 63 predicted bytes a step in 76.54 ms: make demo's lr0.002)."""
    grid = {"global_batch": 16, "dtype": "float32", "width": 128, "learning_rate": 0.002}
    last = {"step": 250, "examples": 4000, "tokens": 252_000, "loss": 2.3555, "val_loss": 2.3624}
    metrics = {**last, "ms_per_step": 76.54, **TUNE_FIELDS, "config": grid}
    row, rows = trial_rows("transformer", tune_result(tmp_path, metrics), tmp_path, early_stopping="val_loss")
    assert (row["stopped_at_step"], row["stopped_metric"], row["stopped_value"]) == (250, "val_loss", 2.3624)
    assert row["final_train_loss"] == 2.3555 and row["ms_per_step"] == 76.54
    assert row["examples_per_sec"] == 16 / 76.54 * 1e3 and round(row["tokens_per_sec"]) == 13_170
    assert row["checkpoint"] is None and rows == []  # stopped before its first save


def test_a_trial_asha_stopped_keeps_its_mesh_and_the_curve_it_reported(tmp_path):
    """Its devices, mesh and per-device batch from its compile report (compile.json, in the run folder
    also when checkpoints go to ``storage``), and its loss curve from the rows it reported to Tune
    (stopped before its first save: no checkpoint history), a restart's rows replacing those from
    the step it resumed at."""
    import pandas as pd

    grid = {"global_batch": 16, "dtype": "float32", "width": 128, "learning_rate": 0.002}
    folder = tmp_path / TRAIN_DIR / trial_name("transformer", grid)
    folder.mkdir(parents=True)
    config = {"devices": 4, "data": 2, "fsdp": 1, "tensor": 2, "per_device_batch": 8}
    report = {"config": config, "compile_s": 3.0, "memory": {"peak_bytes": 2**20}}
    (folder / COMPILE_FILE).write_text(json.dumps(report))
    reports = [
        {"step": s, "examples": 16 * s, "tokens": 1008 * s, "loss": loss, "val_loss": 2.5}
        for s, loss in ((125, 2.61), (250, 2.42), (250, 2.41), (375, 2.3555))  # attempt 2 from 125
    ]
    frame = pd.DataFrame([{**r, **TUNE_FIELDS} for r in reports])
    metrics = {**reports[-1], "ms_per_step": 76.54, **TUNE_FIELDS, "config": grid}
    result = tune.Result(metrics, None, None, path=str(folder), metrics_dataframe=frame)
    uri = (tmp_path / "bucket").as_uri()
    row, rows = trial_rows("transformer", result, tmp_path, early_stopping="val_loss", storage_uri=uri)
    assert (row["devices"], row["mesh"], row["per_device_batch"]) == (4, "data=2,tensor=2", 8)
    assert (row["compile_s"], row["peak_bytes_per_device"], row["checkpoint"]) == (3.0, 2**20, None)
    kept = [reports[i] for i in (0, 2, 3)]
    assert rows == [{k: r[k] for k in ("step", "examples", "tokens", "loss")} for r in kept]
