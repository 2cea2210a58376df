"""Fault injection (tests/faults.py, the fault-tolerance tests' own) fires where it says and only
there: the kill hook on rank 0 of the first attempt, off checkpoint steps (there the save itself dies),
the damage on the first restart; it reaches the workers through Ray's setup hook and the product's
seams, never through the product's own environment. Nothing here is called that would end the test
process."""

from __future__ import annotations

import json

import pytest
from faults import (
    FAULT_ENV,
    FAULT_FILE_ENV,
    SETUP_HOOK,
    Fault,
    damage,
    damage_latest,
    fault_hooks,
    injected,
    install,
    kill_in_save,
    pause_lengths,
    runtime_env,
    set_fault,
)

from jaxray.config import ModelConfig, TrainConfig, TrialConfig, WorkersConfig
from jaxray.raytrain import seams
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


def test_the_kill_in_a_save_is_at_its_step_on_the_first_attempt(fault, monkeypatch):
    died = []
    monkeypatch.setattr("faults.die", died.append)
    kill_in_save(8, 1)
    fault(kill_at_step=8)
    kill_in_save(4, 1), kill_in_save(8, 2)
    assert died == []
    kill_in_save(8, 1)
    assert died == [8]


def test_the_newest_checkpoint_is_damaged_on_the_first_restart_only(fault, tmp_path):
    newest, older = tmp_path / "b", tmp_path / "a"
    for folder in (newest, older):
        folder.mkdir()
        (folder / "params").write_bytes(b"x" * 100)
    damage_latest([newest, older], 2)
    fault(kill_at_step=6, corrupt_latest_checkpoint=True)
    for attempt in (1, 3, 2):
        damage_latest([newest, older], attempt)
    assert (newest / "params").stat().st_size == 50 and (older / "params").stat().st_size == 100


def test_the_fault_reaches_the_workers_by_rays_setup_hook_not_the_products_environment(fault, tmp_path):
    fault(kill_at_step=6)
    assert FAULT_ENV not in worker_env(WorkersConfig())
    env = runtime_env(tmp_path / "f.json", {"env_vars": {"A": "1"}})
    assert env["worker_process_setup_hook"] == SETUP_HOOK
    assert env["env_vars"]["A"] == "1" and env["env_vars"][FAULT_FILE_ENV] == str(tmp_path / "f.json")


def test_a_fault_file_is_read_at_each_trial_start(monkeypatch, tmp_path):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.setenv(FAULT_FILE_ENV, str(tmp_path / "f.json"))
    assert injected() == Fault()
    set_fault(tmp_path / "f.json", {"pause_at_steps": [3]})
    assert injected().pause_at_steps == [3]
    set_fault(tmp_path / "f.json", None)
    assert injected() == Fault()


def test_install_fills_the_products_seams(monkeypatch):
    for name in ("TRAIN_HOOKS", "BEFORE_MANIFEST", "BEFORE_RESUME"):
        monkeypatch.setattr(seams, name, [])
    install()
    assert seams.TRAIN_HOOKS == [fault_hooks] and seams.BEFORE_MANIFEST == [kill_in_save]
    assert seams.BEFORE_RESUME == [damage_latest]


def test_damage_halves_the_largest_file(tmp_path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "big").write_bytes(b"x" * 1000)
    (tmp_path / "small").write_bytes(b"y" * 10)
    assert damage(tmp_path) == tmp_path / "params" / "big"
    assert (tmp_path / "params" / "big").stat().st_size == 500 and (tmp_path / "small").stat().st_size == 10
