"""Fault injection fires where the trial config says and only there: the kill hook on rank 0 of the
first attempt, off checkpoint steps (there the save itself dies), the damage on the first
restart. Nothing here is called that would end the test process."""

from __future__ import annotations

import pytest

from jaxray.config import FaultConfig, ModelConfig, TrainConfig, TrialConfig, WorkersConfig
from jaxray.raytrain.faults import damage, damages_latest, fault_hooks, kill_in_save


def trial(checkpoint_every: int | None = 4, **fault) -> TrialConfig:
    return TrialConfig(
        model=ModelConfig(workload="mlp", width=8),
        train=TrainConfig(steps=12, checkpoint_every=checkpoint_every),
        workers=WorkersConfig(max_failures=1),
        fault=FaultConfig(**fault),
    )


@pytest.mark.parametrize(
    "cfg,rank,attempt,hooks",
    [
        (trial(kill_at_step=6), 0, 1, 1),
        (trial(kill_at_step=6), 1, 1, 0),  # rank 0 only
        (trial(kill_at_step=6), 0, 2, 0),  # the restarted group runs undisturbed
        (trial(kill_at_step=8), 0, 1, 0),  # a checkpoint step: the save dies instead
        (trial(checkpoint_every=None, kill_at_step=8), 0, 1, 1),  # no checkpoints: the hook
        (trial(), 0, 1, 0),
    ],
)
def test_the_kill_hook(cfg, rank, attempt, hooks):
    found = fault_hooks(cfg, rank, attempt)
    assert len(found) == hooks
    assert all(h.every == cfg.fault.kill_at_step for h in found)


def test_the_kill_in_a_save_is_at_its_step_on_the_first_attempt():
    cfg = trial(kill_at_step=8)
    assert callable(kill_in_save(cfg, 8, 1))
    assert kill_in_save(cfg, 4, 1) is None and kill_in_save(cfg, 8, 2) is None
    assert kill_in_save(trial(), 8, 1) is None


def test_the_newest_checkpoint_is_damaged_on_the_first_restart_only():
    cfg = trial(kill_at_step=6, corrupt_latest_checkpoint=True)
    assert [damages_latest(cfg, a) for a in (1, 2, 3)] == [False, True, False]
    assert not damages_latest(trial(), 2)


def test_damage_halves_the_largest_file(tmp_path):
    (tmp_path / "params").mkdir()
    (tmp_path / "params" / "big").write_bytes(b"x" * 1000)
    (tmp_path / "small").write_bytes(b"y" * 10)
    assert damage(tmp_path) == tmp_path / "params" / "big"
    assert (tmp_path / "params" / "big").stat().st_size == 500 and (tmp_path / "small").stat().st_size == 10
