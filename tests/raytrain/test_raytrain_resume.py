"""Which checkpoint a restarted worker group resumes from, on real full-state checkpoints of a small
MLP: the newest usable one, walking back past damaged and incomplete ones, also one newer than Ray
Train's latest that Ray's record lost (complete in storage); none usable means step 0. Checkpoint
names sort by step, then attempt, and the attempt counter counts starts."""

from __future__ import annotations

import jax
import pytest
from faults import damage

from jaxray.checkpoint import (
    TRAIN_STATE,
    checkpoint_name,
    checkpoint_order,
    checkpoints,
    remove_unfinished,
    save_state,
    trial_checkpoints,
)
from jaxray.config import ModelConfig, TrainConfig, TrialConfig
from jaxray.models import build
from jaxray.raytrain.resume import candidates, choose, count_attempt
from jaxray.train.step import init_state, make_optimizer

TRIAL = TrialConfig(model=ModelConfig(workload="mlp", width=8), train=TrainConfig(steps=12))


@pytest.fixture(scope="module")
def state():
    model = build(TRIAL.model)
    return init_state(model.init(jax.random.key(0)), make_optimizer(1e-3, 0.0))


def saved(root, state, *steps_attempts):
    """Real checkpoints under ``root``, named as the worker names them; their paths, oldest first."""
    return [
        save_state(root / checkpoint_name(step, attempt), state, TRIAL, [{"step": step}], {})
        for step, attempt in steps_attempts
    ]


def test_names_sort_by_step_then_attempt():
    names = [checkpoint_name(s, a) for s, a in [(12, 1), (8, 10), (8, 2), (100, 1), (8, 9)]]
    want = [checkpoint_name(s, a) for s, a in [(8, 2), (8, 9), (8, 10), (12, 1), (100, 1)]]
    assert sorted(names, key=checkpoint_order) == want  # attempt 10 after 9, as a name's text would not
    assert checkpoint_order(f"s3://bucket/run/trial/{checkpoint_name(8, 10)}/") == (8, 10)
    assert checkpoint_name(8, 2) == "checkpoint_step_00000008_attempt2"


def test_a_tenth_attempt_is_newer_than_the_ninth(tmp_path, state):
    ninth, tenth = saved(tmp_path, state, (8, 9), (8, 10))
    assert candidates(tmp_path, None) == [tenth, ninth]
    assert list(trial_checkpoints(tenth)) == [tenth, ninth] and list(trial_checkpoints(ninth)) == [ninth]


def test_attempts_are_counted_per_start(tmp_path):
    file = tmp_path / "run" / "trial.attempts.json"
    assert [count_attempt(str(file), n) for n in (2, 1, 2)] == [(1, [2]), (2, [2, 1]), (3, [2, 1, 2])]
    assert count_attempt(None, 2) == (1, [2]) and not (tmp_path / "None").exists()


def test_the_order_is_newest_first_from_storage_and_rays_record(tmp_path, state):
    old4, old8, latest, newer = saved(tmp_path, state, (4, 1), (8, 1), (8, 2), (12, 1))
    (tmp_path / checkpoint_name(16, 1)).mkdir()  # begun, never committed: not a candidate
    # Ray's record ends at step 8 of attempt 2; storage holds a complete step 12 it lost.
    assert candidates(tmp_path, latest) == [newer, latest, old8, old4]
    assert candidates(tmp_path, None) == [newer, latest, old8, old4]
    assert candidates(tmp_path / "none", None) == []
    (tmp_path / "trial.attempts.json").write_text("{}")  # beside the trials' folders: no checkpoints
    assert checkpoints(tmp_path / "trial.attempts.json", None) == [] == remove_unfinished(tmp_path / "x")
    assert checkpoints(str(tmp_path), False) == [str(tmp_path / checkpoint_name(16, 1))]
    # run folders (runs/<experiment>) still fall back from the one named, never past it
    assert list(trial_checkpoints(latest)) == [latest, old8, old4]


def test_the_newest_usable_checkpoint_is_chosen(tmp_path, state):
    c4, c8, c12 = saved(tmp_path, state, (4, 1), (8, 1), (12, 1))
    assert choose(list(trial_checkpoints(c12)))[0].path == c12.absolute()  # verified once: restored as it is
    damage(c12)
    (c8 / TRAIN_STATE).unlink()  # a save that never finished: not listed
    chosen, skipped = choose(list(trial_checkpoints(c12)))
    assert chosen.path == c4.absolute() and skipped == [c12.name]


def test_none_usable_starts_again_from_step_zero(tmp_path, state, caplog):
    (c4,) = saved(tmp_path, state, (4, 1))
    damage(c4)
    assert choose(list(trial_checkpoints(c4))) == (None, [c4.name])
    assert "starting again from step 0" in caplog.text
