"""Tune at cluster scale without a cluster: concurrent trials from the cluster's GPUs, and the ASHA
scheduler the YAML asks for."""

from __future__ import annotations

import pytest
from ray.tune.schedulers import ASHAScheduler

from jaxray.config import ExperimentConfig, SweepConfig
from jaxray.tune import concurrent_trials, early_stopping


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
        ({"num_workers": 2, "devices_per_worker": 2, "use_gpu": True}, 8, 2),  # 4 GPUs per trial
        ({"num_workers": 1, "devices_per_worker": 2, "use_gpu": True}, 7, 3),  # whole trials only
        ({"num_workers": 4, "devices_per_worker": 2, "use_gpu": True}, 2, 1),  # waits for more; never 0
        ({"num_workers": 2, "devices_per_worker": 2, "use_gpu": False}, 8, 1),  # CPU trials one at a time
    ],
)
def test_concurrent_trials_follow_the_clusters_gpus(workers, gpus, expected):
    assert concurrent_trials(experiment(workers), {"GPU": float(gpus), "CPU": 48.0}) == expected


def test_an_explicit_max_concurrent_trials_wins():
    assert concurrent_trials(experiment({"use_gpu": True}, 3), {"GPU": 16.0}) == 3


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
