"""The export artifact: its manifest, its logits and sampled tokens equal to the live model's, the
loader needing no jaxray model code, Flax or Orbax, and damaged artifacts named.

The command line (``python -m jaxray.export``) is tested in tests/test_export.py, serving an
artifact through the engine in tests/inference/test_load.py.
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
from conftest import child_env

from jaxray.inference.artifact_loader import ARTIFACT_MANIFEST, ArtifactError, load_artifact
from jaxray.inference.engine import Engine, Request
from jaxray.inference.settings import EngineSettings
from jaxray.storage import file_sha256

ROOT = Path(__file__).resolve().parents[2]
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


def test_manifest_describes_the_artifact(artifact):
    manifest = json.loads((artifact / ARTIFACT_MANIFEST).read_text())
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
        assert file_sha256(artifact / entry["file"]) == entry["sha256"]


@pytest.mark.slow  # a fresh process that imports no model code (10 s); CI runs it
def test_loader_logits_equal_the_live_model_without_jaxray_models(tiny_transformer, artifact, tmp_path):
    model, params, _ = tiny_transformer
    np.save(tmp_path / "tokens.npy", TOKENS)
    files = [tmp_path / name for name in ("tokens.npy", "full.npy", "short.npy")]
    proc = subprocess.run(
        [sys.executable, "-c", LOADER, str(artifact), *map(str, files)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    assert loaded == ["jaxray", "jaxray.inference", "jaxray.inference.artifact_loader"]
    # Where this process holds a TPU the loader runs on the CPU (child_env): float32 across two
    # platforms agrees to ~1e-4 (4.5e-5 seen: exp and the sums round differently), not 1e-5.
    tol = 1e-4 if jax.default_backend() == "tpu" else 1e-5
    for file, tokens in (("full.npy", TOKENS), ("short.npy", TOKENS[:2, :20])):
        exported = np.load(tmp_path / file)
        live = np.asarray(model.apply(params, tokens))
        assert exported.shape == live.shape and exported.dtype == np.float32
        assert float(np.max(np.abs(exported - live))) < tol


def test_loader_start_and_decode_chunk_sample_like_the_live_engine(tiny_transformer, artifact):
    """The loader's own programs, greedy: the first token and one chunk equal the live engine's."""
    model, params, _ = tiny_transformer
    settings = EngineSettings(buckets=(8, 32), batch_sizes=(1, 2), chunk=8)
    [live] = Engine.for_model(model, params, settings).generate([Request(b"ROMEO:", 40, temperature=0.0)])
    art = load_artifact(artifact)
    tokens = np.zeros((1, 8), np.int32)
    tokens[0, :6] = np.frombuffer(b"ROMEO:", np.uint8)
    state, first = art.start(
        tokens,
        np.array([6], np.int32),
        np.zeros(1, np.uint32),
        np.zeros(1, np.float32),
        np.array([256], np.int32),
        np.ones(1, np.float32),
        np.array([9], np.int32),
    )
    _, new, counts = art.decode_chunk(state, np.int32(8))
    assert [int(first[0])] + np.asarray(new)[0, : int(counts[0])].tolist() == live.tokens[:9]


def test_damaged_or_incomplete_artifacts_are_named(artifact, tmp_path):
    copy = shutil.copytree(artifact, tmp_path / "copy")
    blob = bytearray((copy / "start_b8_n1.exported").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (copy / "start_b8_n1.exported").write_bytes(blob)
    with pytest.raises(
        ArtifactError,
        match=r"start_b8_n1.exported is damaged: manifest.json records sha256 [0-9a-f]{64}, the file has",
    ):
        load_artifact(copy)
    (copy / "weights.npz").unlink()
    with pytest.raises(ArtifactError, match="weights.npz is missing"):
        load_artifact(copy)
    with pytest.raises(ArtifactError, match="manifest.json is missing"):
        load_artifact(tmp_path)


def test_weights_replaced_after_the_check_are_not_loaded(artifact, tmp_path, monkeypatch):
    # A fresh user renamed other weights (same names, shapes and size) over weights.npz between the
    # sha256 check and the read: the engine held them. Each file is now read once, and what is
    # hashed is what is used. The swap is real; the wrapper only times it.
    import jaxray.inference.artifact_loader as loader  # the module whose read_verified is wrapped

    copy = shutil.copytree(artifact, tmp_path / "copy")
    with np.load(copy / "weights.npz") as npz:
        original = {k: npz[k] for k in npz.files}
    np.savez(
        tmp_path / "halved.npz", **{k: v * 0.5 if v.dtype.kind == "f" else v for k, v in original.items()}
    )
    read = loader.read_verified

    def read_then_swapped(directory, manifest):
        files = read(directory, manifest)
        (tmp_path / "halved.npz").rename(copy / "weights.npz")
        return files

    monkeypatch.setattr(loader, "read_verified", read_then_swapped)
    loaded = load_artifact(copy)
    names = [leaf["name"] for leaf in loaded.manifest["weights"]["leaves"]]
    with np.load(copy / "weights.npz") as swapped:  # the file on disk is the other one now
        assert any(not np.array_equal(swapped[name], original[name]) for name in names)
    for name, weight in zip(names, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(weight), original[name])
