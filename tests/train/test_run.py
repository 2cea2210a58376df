"""jaxray.train.run: what one training run records in its summary row."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxray.config import ModelConfig, parse_trial
from jaxray.data.batching import train_batches
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import _attention, train

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
