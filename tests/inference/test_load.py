"""``jaxray.inference.load``: one path, a checkpoint or an export artifact, becomes an Engine; what
cannot be served is refused, naming the path or the setting, before any weights are read."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jaxray import checkpoint
from jaxray.inference.artifact import export_checkpoint
from jaxray.inference.batcher import Batcher
from jaxray.inference.engine import Engine, Request
from jaxray.inference.load import check_checkpoint, check_source, is_artifact, load_engine
from jaxray.inference.settings import EngineSettings
from jaxray.reporting.sweep import write_reports

REQUESTS = [
    Request(b"ROMEO:", 40, temperature=0.0),  # past max_seq_len: the window slides
    Request(b"To be, or not", 12, temperature=0.9, top_k=20, seed=3),
]


@pytest.mark.slow  # 11 s; tests/inference/test_artifact.py checks the artifact's programs fast
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
        (EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=8, context_keep=24), "context_keep 24 differs"),
        (
            EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=8, kv_cache_dtype="bfloat16"),
            "kv_cache_dtype bfloat16 differs from the artifact's float32",
        ),
    ],
)
def test_settings_the_artifact_lacks_are_named(artifact, settings, match):
    with pytest.raises(ValueError, match=match):
        check_source(artifact, settings)
    with pytest.raises(ValueError, match=match):
        load_engine(artifact, settings)


def test_an_artifact_serves_and_reports_the_cache_dtype_it_was_exported_with(artifact):
    engine = load_engine(artifact, EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=8))  # auto
    assert engine.settings.kv_cache_dtype == engine.kv_cache_dtype == engine.info()["kv_cache_dtype"]
    assert engine.kv_cache_dtype == "float32"  # exported on this CPU


def test_what_cannot_be_served_is_refused_naming_it(tiny_transformer, mlp_checkpoint, tmp_path):
    with pytest.raises(checkpoint.CheckpointError, match="nowhere does not exist"):
        check_source(tmp_path / "nowhere")
    with pytest.raises(checkpoint.CheckpointError, match="mlp checkpoint, not a transformer one"):
        load_engine(mlp_checkpoint)
    with pytest.raises(checkpoint.CheckpointError, match="not a transformer one: it cannot be exported"):
        check_checkpoint(mlp_checkpoint, purpose="exported")
    with pytest.raises(ValueError, match="context_keep must be in 2..31"):
        check_source(tiny_transformer[2], EngineSettings(context_keep=32))


def transformer_run_folder(root: Path, source: Path) -> Path:
    """A run folder whose one trial's checkpoint is a copy of ``source``, summary.json written by
    the sweep's own writer from the absolute path Tune reports."""
    ck = shutil.copytree(source, root / "train" / "t" / "checkpoint_step_00000001_attempt1")
    row = {"trial": "t", "workload": "transformer", "val_loss": 2.0, "checkpoint": str(ck)}
    write_reports(root, [row], {"t": []})
    return root


def test_a_copied_run_folder_is_served_and_exported_and_a_damaged_checkpoint_refused(
    tiny_transformer, tmp_path
):
    original = transformer_run_folder(tmp_path / "original", tiny_transformer[2])
    copy = Path(shutil.copytree(original, tmp_path / "moved" / "copy"))
    shutil.rmtree(original)
    settings = EngineSettings(buckets=(8,), batch_sizes=(1,), chunk=8)
    assert Path(load_engine(copy, settings).source).is_relative_to(copy)
    manifest = export_checkpoint(copy, tmp_path / "export", settings)
    assert Path(manifest["checkpoint"]).is_relative_to(copy)
    ck = copy / "train" / "t" / "checkpoint_step_00000001_attempt1"
    victim = max((f for f in (ck / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-1] + bytes([victim.read_bytes()[-1] ^ 0xFF]))
    for read in (lambda: load_engine(ck, settings), lambda: export_checkpoint(ck, tmp_path / "e2", settings)):
        with pytest.raises(
            checkpoint.CheckpointError, match=r"does not match its checksum.*SHA-256 [0-9a-f]{64}"
        ):
            read()
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint"):
        load_engine(copy, settings)  # the trial's only checkpoint is damaged
    assert not (tmp_path / "e2").exists()
