"""The best checkpoint is the model: a trial's folder ranks its checkpoints by the ``val_loss`` each
recorded at its own step; ``--checkpoint <folder>`` loads the best, the local runner keeps the best
and the newest; a trial stops itself after ``train.patience`` evaluations without improvement."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.checkpoint import checkpoint_name, remote, save_state
from jaxray.config import DataConfig, ModelConfig, TrainConfig, TrialConfig
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.local_run import keep_best_and_newest
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh
from jaxray.runs import open_checkpoint
from jaxray.train.run import Plateau, train
from jaxray.train.step import TrainState, init_state, optimizer_for

TRIAL = TrialConfig(
    model=ModelConfig(workload="transformer", width=32, num_layers=1, num_heads=2, max_seq_len=32),
    train=TrainConfig(steps=12, global_batch=8, log_every=3, eval_every=3, checkpoint_every=3),
    data=DataConfig(seq_len=32),
)


def saved_curve(folder, losses: dict[int, float | None]) -> None:
    """Real checkpoints at each step of ``losses``, each history recording its val_loss at its step
    (params differing per step, so the one loaded can be told apart)."""
    model = build(TRIAL.model)
    tx, _ = optimizer_for(TRIAL)
    history = []
    for step, loss in losses.items():
        history.append({"step": step, "loss": 3.0, **({} if loss is None else {"val_loss": loss})})
        state = init_state(model.init(jax.random.key(step)), tx)
        state = TrainState(state.params, state.opt_state, jnp.int32(step))
        save_state(folder / checkpoint_name(step, 1), state, TRIAL, list(history), {})


def test_the_lowest_val_loss_is_loaded_and_kept_with_the_newest(tmp_path):
    saved_curve(tmp_path, {3: 2.0, 6: 1.5, 9: 1.7, 12: 1.9})  # a curve rising after step 6
    ranked = remote.ranked_checkpoints(str(tmp_path))
    assert [int(Path(c).name.split("_")[2]) for c in ranked] == [6, 12, 9, 3]  # the best, then newest first
    assert remote.saved_val_loss(ranked[0]) == 1.5
    loaded = open_checkpoint(tmp_path)
    assert loaded.path.name == checkpoint_name(6, 1)
    assert sorted(keep_best_and_newest(tmp_path)) == [checkpoint_name(3, 1), checkpoint_name(9, 1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint_name(6, 1), checkpoint_name(12, 1)]


def test_a_folder_without_val_loss_loads_its_newest(tmp_path):
    saved_curve(tmp_path, {3: None, 6: None})
    assert open_checkpoint(tmp_path).path.name == checkpoint_name(6, 1)


@pytest.mark.parametrize(
    "losses, patience, min_delta, stalled",
    [
        ([2.0, 1.9, 1.95, 1.96], 2, 0.0, True),  # two evaluations above the best before them
        ([2.0, 1.9, 1.95, 1.89], 2, 0.0, False),  # the last improved
        ([2.0, 1.9, 1.95, 1.89], 2, 0.05, True),  # ... by less than min_delta
        ([2.0, 1.9], 2, 0.0, False),  # too few evaluations yet
    ],
)
def test_plateau(losses, patience, min_delta, stalled):
    history = [{"step": i, "val_loss": v} for i, v in enumerate(losses)]
    assert Plateau(patience, min_delta, history).stalled() is stalled


def test_patience_stops_a_run_and_it_ends_with_its_best(real_dir):
    # min_delta 10: no evaluation after the first can improve enough, so patience 1 stops at the second.
    trial = TRIAL.model_copy(
        update={
            "train": TRIAL.train.model_copy(update={"patience": 1, "min_delta": 10.0}),
            "data": TRIAL.data.model_copy(update={"data_dir": str(real_dir)}),
        }
    )
    source, held_out = load_arrays(trial)
    held_out = {k: v[:64] for k, v in held_out.items()}
    result = train(trial, train_batches(source, 8, trial.train.seed), held_out, make_mesh(jax.devices()[:1]))
    s = result.summary
    assert s["stopped_early"] and s["last_step"] == 6 and result.history[-1]["step"] == 6
    assert s["final_val_loss"] == result.history[-1]["val_loss"]  # one measure: logged = summary's
    evaluated = {r["step"]: r["val_loss"] for r in result.history if "val_loss" in r}
    assert s["best_step"] in evaluated and s["val_loss"] == min(evaluated.values())
    assert np.isclose(s["val_perplexity"], np.exp(s["val_loss"]))
