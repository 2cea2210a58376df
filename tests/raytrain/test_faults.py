"""Fault injection (``JAXRAY_FAULT``, set by the fault-tolerance tests only) fires where it says and
only there: the kill hook on rank 0 of the first attempt, off checkpoint steps (there the save itself
dies), the damage on the first restart. Nothing here is called that would end the test process."""

from __future__ import annotations

import json

import pytest

from jaxray.config import ModelConfig, TrainConfig, TrialConfig, WorkersConfig
from jaxray.raytrain.faults import (
    FAULT_ENV,
    Fault,
    damage,
    damages_latest,
    fault_hooks,
    kill_in_save,
    pause_lengths,
)
from jaxray.raytrain.trainer import worker_env


def trial(checkpoint_every: int | None = 4) -> TrialConfig:
    return TrialConfig(
        model=ModelConfig(workload="mlp", width=8),
        train=TrainConfig(steps=12, checkpoint_every=checkpoint_every),
        workers=WorkersConfig(max_failures=1),
    )


@pytest.fixture
def fault(monkeypatch):
    def inject(**fault) -> None:
        monkeypatch.setenv(FAULT_ENV, json.dumps(fault))

    monkeypatch.delenv(FAULT_ENV, raising=False)
    return inject


@pytest.mark.parametrize(
    "every,kill,rank,attempt,hooks",
    [
        (4, 6, 0, 1, 1),
        (4, 6, 1, 1, 0),  # rank 0 only
        (4, 6, 0, 2, 0),  # the restarted group runs undisturbed
        (4, 8, 0, 1, 0),  # a checkpoint step: the save dies instead
        (None, 8, 0, 1, 1),  # by default (a tenth of 12 steps, up to log_every 25): only the final one
        (4, None, 0, 1, 0),
    ],
)
def test_the_kill_hook(fault, every, kill, rank, attempt, hooks):
    if kill is not None:
        fault(kill_at_step=kill)
    found = fault_hooks(trial(every), rank, attempt)
    assert len(found) == hooks
    assert all(h.every == kill for h in found)


def test_pauses_take_one_length_or_one_per_step():
    assert pause_lengths(Fault(pause_at_steps=(21, 26), pause_s=10)) == {21: 10.0, 26: 10.0}
    assert pause_lengths(Fault(pause_at_steps=(21, 26), pause_s=[20, 60])) == {21: 20.0, 26: 60.0}
    with pytest.raises(ValueError, match="pause_s has 1 lengths for 2 pause_at_steps"):
        pause_lengths(Fault(pause_at_steps=(21, 26), pause_s=[20]))


def test_the_kill_in_a_save_is_at_its_step_on_the_first_attempt(fault):
    assert kill_in_save(8, 1) is None
    fault(kill_at_step=8)
    assert callable(kill_in_save(8, 1))
    assert kill_in_save(4, 1) is None and kill_in_save(8, 2) is None


def test_the_newest_checkpoint_is_damaged_on_the_first_restart_only(fault):
    assert not damages_latest(2)
    fault(kill_at_step=6, corrupt_latest_checkpoint=True)
    assert [damages_latest(a) for a in (1, 2, 3)] == [False, True, False]


def test_the_fault_travels_to_the_workers_and_nothing_else_does(fault):
    assert FAULT_ENV not in worker_env(WorkersConfig())
    fault(kill_at_step=6)
    assert json.loads(worker_env(WorkersConfig())[FAULT_ENV]) == {"kill_at_step": 6}


def test_damage_halves_the_largest_file(tmp_path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "big").write_bytes(b"x" * 1000)
    (tmp_path / "small").write_bytes(b"y" * 10)
    assert damage(tmp_path) == tmp_path / "params" / "big"
    assert (tmp_path / "params" / "big").stat().st_size == 500 and (tmp_path / "small").stat().st_size == 10
