"""python -m jaxray.export: the artifact's logits and sampled tokens equal the live model's, the loader
needs no jaxray model code, Flax or Orbax, and bad inputs are refused without touching anything.

Params come from init: this is a parity test of the export, not of training.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxray import checkpoint
from jaxray import export as export_cli
from jaxray.config import parse_trial
from jaxray.inference.artifact import load_engine
from jaxray.inference.artifact_loader import ArtifactError, load_artifact, sha256
from jaxray.inference.batcher import Batcher
from jaxray.inference.engine import Engine, EngineSettings, Request
from jaxray.models import build

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = EngineSettings(buckets=(8, 32), batch_sizes=(1, 2), chunk=8)
OPTIONS = ["--buckets", "8,32", "--batch-sizes", "1,2", "--chunk", "8"]
TOKENS = np.random.default_rng(0).integers(0, 256, (3, 32)).astype(np.int32)

# Runs in a fresh interpreter: the loader's logits, and which jaxray / Flax / Orbax modules it imported.
LOADER = """
import json, sys
import numpy as np
from jaxray.inference.artifact_loader import load_artifact
art = load_artifact(sys.argv[1])
tokens = np.load(sys.argv[2])
np.save(sys.argv[3], art.logits(tokens))
np.save(sys.argv[4], art.logits(tokens[:2, :20]))
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("jaxray", "flax", "orbax"))))
"""


def _trial(workload: str, **model):
    return parse_trial({"model": {"workload": workload, "width": 32, **model}, "data": {"seq_len": 32}})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    trial = _trial("transformer", num_layers=1, num_heads=2, max_seq_len=32)
    model = build(trial.model)
    params = model.init(jax.random.key(7))
    path = checkpoint.save(tmp_path_factory.mktemp("ck") / "transformer", params, trial)
    return model, params, path


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "artifact"
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.export", "--checkpoint", str(tiny[2]), "--out", str(out), *OPTIONS],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "attention: xla" in proc.stdout and "not portable" in proc.stdout
    return out


def test_manifest_describes_the_artifact(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["attention"] == "xla" and manifest["model"]["attention"] == "xla"
    assert {"cpu", "cuda"} <= set(manifest["platforms"]) and manifest["jax"] == jax.__version__
    assert (manifest["buckets"], manifest["batch_sizes"], manifest["chunk"]) == ([8, 32], [1, 2], 8)
    assert manifest["context_keep"] == 16 and manifest["vocab_size"] == 256
    assert sorted(manifest["functions"]) == [
        "decode_n1",
        "decode_n2",
        "logits",
        "start_b32_n1",
        "start_b32_n2",
        "start_b8_n1",
        "start_b8_n2",
    ]
    assert manifest["functions"]["logits"]["outputs"] == ["float32[b,32,256]"]
    for entry in [manifest["weights"], *manifest["functions"].values()]:
        assert sha256(artifact / entry["file"]) == entry["sha256"]


def test_loader_logits_equal_the_live_model_without_jaxray_models(tiny, artifact, tmp_path):
    model, params, _ = tiny
    np.save(tmp_path / "tokens.npy", TOKENS)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            LOADER,
            str(artifact),
            str(tmp_path / "tokens.npy"),
            str(tmp_path / "full.npy"),
            str(tmp_path / "short.npy"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == ["jaxray", "jaxray.inference", "jaxray.inference.artifact_loader"]
    for file, tokens in (("full.npy", TOKENS), ("short.npy", TOKENS[:2, :20])):
        exported = np.load(tmp_path / file)
        live = np.asarray(model.apply(params, tokens))
        assert exported.shape == live.shape and exported.dtype == np.float32
        assert float(np.max(np.abs(exported - live))) < 1e-5


def test_artifact_engine_samples_like_the_live_engine(tiny, artifact):
    model, params, _ = tiny
    requests = [
        Request(b"ROMEO:", 40, temperature=0.0),  # past max_seq_len: the window slides
        Request(b"To be, or not", 12, temperature=0.9, top_k=20, seed=3),
    ]
    live = Engine.for_model(model, params, SETTINGS).generate(requests)
    served = Engine.load(artifact)  # detects the artifact; settings default to the exported ones
    assert served.settings.context_keep == 16 and served.buckets == (8, 32)
    assert [c.tokens for c in served.generate(requests)] == [c.tokens for c in live]
    batcher = Batcher(served)  # continuous batching runs on the artifact's programs too
    got = {u.ticket: u.tokens for u in batcher.admit(requests[:1], [0])}
    got.update({u.ticket: u.tokens for u in batcher.admit(requests[1:], [1])})
    while batcher.live:
        for update in batcher.decode():
            got[update.ticket] = got.get(update.ticket, []) + update.tokens
    assert [got[0], got[1]] == [c.tokens for c in live]
    art = load_artifact(artifact)  # the loader's own start/decode, greedy
    tokens = np.zeros((1, 8), np.int32)
    tokens[0, :6] = np.frombuffer(b"ROMEO:", np.uint8)
    state, first = art.start(
        tokens,
        np.array([6], np.int32),
        np.zeros(1, np.uint32),
        np.zeros(1, np.float32),
        np.array([256], np.int32),
        np.array([9], np.int32),
    )
    _, new, counts = art.decode(state, np.int32(8))
    assert [int(first[0])] + np.asarray(new)[0, : int(counts[0])].tolist() == live[0].tokens[:9]


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
        load_engine(artifact, settings)


def test_damaged_or_incomplete_artifacts_are_named(artifact, tmp_path):
    copy = shutil.copytree(artifact, tmp_path / "copy")
    blob = bytearray((copy / "start_b8_n1.exported").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (copy / "start_b8_n1.exported").write_bytes(blob)
    with pytest.raises(ArtifactError, match="start_b8_n1.exported is damaged"):
        load_artifact(copy)
    (copy / "weights.npz").unlink()
    with pytest.raises(ArtifactError, match="weights.npz is missing"):
        load_artifact(copy)
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_artifact(tmp_path)


def test_bad_checkpoints_are_refused_before_writing(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_cli.main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "nowhere is neither a checkpoint" in capsys.readouterr().err
    mlp = _trial("mlp")
    checkpoint.save(tmp_path / "mlp", build(mlp.model).init(jax.random.key(0)), mlp)
    assert export_cli.main(["--checkpoint", str(tmp_path / "mlp"), "--out", str(out)]) == 2
    assert (
        "holds an MLP checkpoint, not a transformer: only a transformer can be exported"
        in capsys.readouterr().err
    )
    assert export_cli.main(["--checkpoint", str(tiny[2]), "--out", str(out), "--context-keep", "33"]) == 2
    assert "context_keep must be in 2..32" in capsys.readouterr().err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mlp"]


def test_a_non_empty_out_is_never_overwritten(tiny, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxray.export", "--checkpoint", str(tiny[2]), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2 and f"--out {out} exists and is not an empty directory" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


def test_bad_option_values_name_the_option(tiny, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        export_cli.main(["--checkpoint", str(tiny[2]), "--out", str(tmp_path / "o"), "--buckets", "8,x"])
    assert exit_info.value.code == 2 and "--buckets" in capsys.readouterr().err
    assert (
        export_cli.main(["--checkpoint", str(tiny[2]), "--out", str(tmp_path / "o"), "--chunk", "10000000"])
        == 2
    )
    assert "--chunk:" in capsys.readouterr().err and not (tmp_path / "o").exists()
