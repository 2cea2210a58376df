"""Each checkpoint file is hashed once per use (issue 49): ``generate`` and ``evaluate`` of a run
folder, a worker's resume (``resume.choose`` then training from what it chose), and serving a run
folder (``build_app``'s check, then a replica taking the checkpoint by its ``train_state.json``
digest). ``storage.file_sha256``, the one file hash, is wrapped to count its calls; it still
hashes."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from jaxray import checkpoint, evaluate, generate, storage
from jaxray.checkpoint import remote
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.inference.load import check_source, load_engine
from jaxray.parallel.mesh import make_mesh
from jaxray.raytrain.resume import choose
from jaxray.train.run import train


@pytest.fixture
def hashed(monkeypatch) -> Counter:
    """{file: times its SHA-256 was computed} from now on."""
    counts: Counter = Counter()
    real = storage.file_sha256

    def counting(path: Path, fs=None) -> str:
        counts[Path(path).absolute()] += 1
        return real(path, fs)

    monkeypatch.setattr(storage, "file_sha256", counting)
    return counts


def listed(folder: Path) -> set[Path]:
    """The files ``train_state.json`` of ``folder`` lists (what verify hashes)."""
    files = json.loads((folder / checkpoint.TRAIN_STATE).read_text())["files"]
    return {(folder / rel).absolute() for rel in files}


def the_checkpoint(run: Path) -> Path:
    return next(run.glob("train/*/checkpoint_*")).absolute()


def test_generate_and_evaluate_hash_each_file_once(copied_run_folder, hashed, tmp_path, capsys):
    ck = the_checkpoint(copied_run_folder)
    args = ["--checkpoint", str(copied_run_folder), "--prompt", "RO", "--max-new-tokens", "4"]
    assert generate.main(args) == 0
    assert dict(hashed) == dict.fromkeys(listed(ck), 1)
    hashed.clear()
    assert evaluate.main([*args, "--out", str(tmp_path / "eval")]) == 0
    assert dict(hashed) == dict.fromkeys(listed(ck), 1)


def test_serving_a_run_folder_hashes_each_file_once(copied_run_folder, hashed):
    source = check_source(copied_run_folder)  # build_app, in the driver
    pinned = remote.manifest_sha256(source)
    engine = load_engine(checkpoint.open(source, pinned=pinned))  # each replica
    assert engine.source == str(source)
    assert dict(hashed) == dict.fromkeys(listed(source), 1)


def test_a_resume_hashes_each_file_once(trained_transformer, hashed):
    chosen, skipped = choose([trained_transformer])  # rank 0, from the trial's candidates
    assert skipped == [] and chosen.path == trained_transformer.absolute()
    trial = checkpoint.load_trial_config(trained_transformer)
    trial = trial.model_copy(update={"train": trial.train.model_copy(update={"steps": 2, "log_every": 1})})
    arrays, held_out = load_arrays(trial)
    batches = train_batches(arrays, trial.train.global_batch)
    result = train(trial, batches, held_out, make_mesh(), resume=chosen)
    assert result.summary["resumed_from_step"] == 0 and len(result.history) == 2
    assert dict(hashed) == dict.fromkeys(listed(trained_transformer), 1)
