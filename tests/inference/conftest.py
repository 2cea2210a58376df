"""Fixtures of the inference tests: a tiny transformer checkpoint (fresh weights) and its export.

Params come from init: the artifact tests check that the export reproduces the live model, not
what training taught it.
"""

from __future__ import annotations

import jax
import pytest
from saved import save_params

from jaxray.config import parse_trial
from jaxray.inference.artifact import export_checkpoint
from jaxray.inference.settings import EngineSettings
from jaxray.models import build


def tiny_trial(workload: str, **model):
    """A TrialConfig of a width-32 ``workload`` model over 32-byte sequences."""
    return parse_trial({"model": {"workload": workload, "width": 32, **model}, "data": {"seq_len": 32}})


@pytest.fixture(scope="session")
def tiny_transformer(tmp_path_factory):
    """(model, params, checkpoint path) of a 1-layer, 2-head transformer, max_seq_len 32."""
    trial = tiny_trial("transformer", num_layers=1, num_heads=2, max_seq_len=32)
    model = build(trial.model)
    params = model.init(jax.random.key(7))
    path = save_params(tmp_path_factory.mktemp("ck") / "transformer", params, trial)
    return model, params, path


@pytest.fixture(scope="session")
def mlp_checkpoint(tmp_path_factory):
    """A checkpoint of a width-32 MLP (fresh weights): what no inference command accepts."""
    trial = tiny_trial("mlp")
    params = build(trial.model).init(jax.random.key(0))
    return save_params(tmp_path_factory.mktemp("ck") / "mlp", params, trial)


@pytest.fixture(scope="session")
def artifact(tiny_transformer, tmp_path_factory):
    """``tiny_transformer`` exported (``jaxray.inference.artifact``) for buckets 8 and 32, batch
    sizes 1 and 2, chunks of 8 tokens; the default context_keep, 16."""
    out = tmp_path_factory.mktemp("export") / "artifact"
    settings = EngineSettings(buckets=(8, 32), batch_sizes=(1, 2), chunk=8)
    export_checkpoint(tiny_transformer[2], out, settings)
    return out
