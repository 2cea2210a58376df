"""``jaxray.inference.load``: one path, a checkpoint or an export artifact, becomes an Engine; what
cannot be served is refused, naming the path or the setting, before any weights are read."""

from __future__ import annotations

import pytest

from jaxray import checkpoint
from jaxray.inference.batcher import Batcher
from jaxray.inference.engine import Engine, Request
from jaxray.inference.load import check_checkpoint, check_source, is_artifact, load_engine
from jaxray.inference.settings import EngineSettings

REQUESTS = [
    Request(b"ROMEO:", 40, temperature=0.0),  # past max_seq_len: the window slides
    Request(b"To be, or not", 12, temperature=0.9, top_k=20, seed=3),
]


def test_an_artifact_is_served_like_the_live_model(tiny_transformer, artifact):
    model, params, _ = tiny_transformer
    served = load_engine(artifact)  # detects the artifact; settings default to the exported ones
    assert is_artifact(artifact) and served.source == str(artifact)
    assert served.settings.context_keep == 16 and served.buckets == (8, 32)
    live = Engine.for_model(model, params, served.settings).generate(REQUESTS)
    assert [c.tokens for c in served.generate(REQUESTS)] == [c.tokens for c in live]
    batcher = Batcher(served)  # continuous batching runs on the artifact's programs too
    got = {u.ticket: u.tokens for u in batcher.admit(REQUESTS[:1], [0])}
    got.update({u.ticket: u.tokens for u in batcher.admit(REQUESTS[1:], [1])})
    while batcher.live:
        for update in batcher.step():
            got[update.ticket] = got.get(update.ticket, []) + update.tokens
    assert [got[0], got[1]] == [c.tokens for c in live]


def test_a_checkpoint_is_served_as_restored(tiny_transformer):
    model, params, path = tiny_transformer
    settings = EngineSettings(buckets=(8,), batch_sizes=(2,), chunk=8)
    served = load_engine(path, settings)
    assert not is_artifact(path) and served.source == str(path) == str(check_source(path, settings))
    live = Engine.for_model(model, params, settings)
    assert [c.tokens for c in served.generate(REQUESTS)] == [c.tokens for c in live.generate(REQUESTS)]


@pytest.mark.parametrize(
    "settings,match",
    [
        (EngineSettings(buckets=(8, 32), batch_sizes=(4,), chunk=8), r"batch_sizes \[4\] were not exported"),
        (EngineSettings(buckets=(16,), batch_sizes=(1,), chunk=8), r"buckets \[16\] were not exported"),
        (EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=16), "chunk 16 differs"),
        (EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=8, context_keep=32), "context_keep 32 differs"),
    ],
)
def test_settings_the_artifact_lacks_are_named(artifact, settings, match):
    with pytest.raises(ValueError, match=match):
        check_source(artifact, settings)
    with pytest.raises(ValueError, match=match):
        load_engine(artifact, settings)


def test_what_cannot_be_served_is_refused_naming_it(tiny_transformer, mlp_checkpoint, tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="nowhere is neither a checkpoint"):
        check_source(tmp_path / "nowhere")
    with pytest.raises(checkpoint.CheckpointError, match="MLP checkpoint, not a transformer: only a trans"):
        load_engine(mlp_checkpoint)
    with pytest.raises(checkpoint.CheckpointError, match="only a transformer can be exported"):
        check_checkpoint(mlp_checkpoint, purpose="exported")
    with pytest.raises(ValueError, match="context_keep must be in 2..32"):
        check_source(tiny_transformer[2], EngineSettings(context_keep=33))
