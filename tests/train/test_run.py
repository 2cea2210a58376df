"""jaxray.train.run: what one training run records in its summary row, and where a diverged one stops."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from jaxray.config import ModelConfig, parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import Diverged, _attention, train

CPU_NOTE = "auto: cuDNN attention needs an NVIDIA GPU, this device is cpu"


@pytest.mark.slow  # a whole run: compile, loop, evaluation (~15-25 s on a busy CPU)
@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the note of a CPU")
def test_a_tiny_transformer_run_says_which_attention_and_why():
    trial = parse_trial(
        {
            "model": {
                "workload": "transformer",
                "width": 16,
                "num_layers": 1,
                "num_heads": 2,
                "max_seq_len": 8,
            },
            "data": {"seq_len": 8},
            "train": {"steps": 1, "global_batch": 2, "log_every": 1, "eval_batch": 2},
        }
    )
    tokens = {"tokens": np.arange(32, dtype=np.int32).reshape(4, 8)}
    row = train(trial, train_batches(tokens, 2), tokens, make_mesh()).summary
    assert (row["attention"], row["attention_note"]) == ("xla", CPU_NOTE), row


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the note of a CPU")
def test_the_summary_fields_of_each_request():
    def fields(workload, **model):
        return _attention(build(ModelConfig(workload=workload, width=16, num_heads=2, **model)))

    assert fields("transformer") == {"attention": "xla", "attention_note": CPU_NOTE}
    assert fields("transformer", attention="xla") == {
        "attention": "xla",
        "attention_note": "requested in model.attention",
    }
    assert fields("mlp") == {}  # the MLPs have no attention


@pytest.mark.parametrize("log_every", [2, 4])
def test_a_diverged_run_stops_at_its_first_non_finite_step_and_saves_nothing_of_it(real_dir, log_every):
    """A peak learning rate of 1e30 blows the params up after step 1: step 2's loss is not finite.
    The run stops there, by the log hook (log_every 2) or the checkpoint hook (checkpoint_every 1),
    and only step 1's state was saved."""
    trial = parse_trial(
        {
            "model": {"workload": "mlp", "width": 16},
            "data": {"data_dir": str(real_dir)},
            "train": {
                **{"steps": 8, "global_batch": 32, "learning_rate": 1e30, "log_every": log_every},
                "checkpoint_every": 1,
            },
        }
    )
    train_arrays, held_out = load_arrays(trial)
    saved = []
    with pytest.raises(Diverged) as err:
        train(
            trial,
            train_batches(train_arrays, 32, trial.train.seed),
            held_out,
            make_mesh(),
            save=lambda step, state, history: saved.append(step),
        )
    assert (err.value.step, err.value.metric) == (2, "loss") and not math.isfinite(err.value.value)
    assert saved == [1]
    assert err.value.row() == {
        "diverged_step": 2,
        "diverged_metric": "loss",
        "diverged_value": str(err.value.value),
    }
    assert str(err.value) == f"diverged at step 2: loss {err.value.value}"


def test_params_broken_by_the_last_update_are_a_divergence(real_dir):
    """One step at a peak learning rate of 1e30: its logged loss (before the update) is finite, the
    held-out loss of the params it leaves is not."""
    trial = parse_trial(
        {
            "model": {"workload": "mlp", "width": 16},
            "data": {"data_dir": str(real_dir)},
            "train": {"steps": 1, "global_batch": 32, "learning_rate": 1e30, "log_every": 1},
        }
    )
    train_arrays, held_out = load_arrays(trial)
    with pytest.raises(Diverged) as err:
        train(trial, train_batches(train_arrays, 32, trial.train.seed), held_out, make_mesh())
    assert (err.value.step, err.value.metric) == (1, "test_loss") and not math.isfinite(err.value.value)
