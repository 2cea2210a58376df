"""Checkpoints read by URI from a real S3-compatible server (moto's, started here): fetched into the
cache with every file checked against its digest, read from the cache while unchanged, refused by
name when damaged or absent; ``generate`` and the Serve app take the URI."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import filelock
import jax
import numpy as np
import pyarrow.fs as pafs
import pytest
from checkpoint_copies import largest_params_file
from s3_server import s3_server
from saved import save_params

from jaxray import checkpoint, runs, storage
from jaxray.checkpoint import remote
from jaxray.data.manifest import ManifestError, read_manifest
from jaxray.generate import main as generate
from jaxray.serve.app import app_builder

BUCKET = "jaxray"


@pytest.fixture(scope="module")
def s3() -> pafs.S3FileSystem:
    with s3_server(BUCKET) as fs:
        yield fs


def upload(s3: pafs.S3FileSystem, folder: Path, key: str) -> str:
    """``folder`` copied to ``s3://jaxray/<key>``; its URI."""
    pafs.copy_files(str(folder), f"{BUCKET}/{key}", pafs.LocalFileSystem(), s3)
    return f"s3://{BUCKET}/{key}"


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(storage.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache" / "checkpoints"


def test_a_checkpoint_read_by_uri_is_the_one_uploaded_and_fetched_once(s3, trained_transformer, cache):
    uri = upload(s3, trained_transformer, "runs/a/checkpoint_step_00000060")
    local = runs.open_checkpoint(uri).path
    assert local.parent == cache and checkpoint.verify(local) == checkpoint.verify(trained_transformer)
    fetched, uploaded = (jax.tree.leaves(checkpoint.restore(p)[1]) for p in (local, trained_transformer))
    for a, b in zip(fetched, uploaded, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stamps = {f: f.stat().st_mtime_ns for f in local.rglob("*")}
    assert runs.open_checkpoint(uri).path == local
    assert {f: f.stat().st_mtime_ns for f in local.rglob("*")} == stamps
    # A damaged cached copy is fetched again, whole.
    flipped = largest_params_file(local)
    flipped.write_bytes(b"\0" * flipped.stat().st_size)
    assert runs.open_checkpoint(uri).path == local
    checkpoint.verify(local)


def test_generate_reads_a_uri_as_it_reads_the_folder(s3, trained_transformer, capsys):
    uri = upload(s3, trained_transformer, "generate/checkpoint")
    argv = ["--prompt", "ROMEO:", "--max-new-tokens", "24", "--temperature", "0"]
    assert generate(["--checkpoint", str(trained_transformer), *argv]) == 0
    local_text = capsys.readouterr().out
    assert generate(["--checkpoint", uri, *argv]) == 0
    out, err = capsys.readouterr()
    assert out == local_text
    assert f"checkpoint: {uri} (trial " in err  # named by its URI, not by the cached copy


def test_a_damaged_or_absent_remote_checkpoint_is_refused_by_name(s3, trained_transformer, cache, tmp_path):
    copy = Path(shutil.copytree(trained_transformer, tmp_path / "copy"))
    victim = largest_params_file(copy)
    uri = upload(s3, copy, "damaged")
    rel = victim.relative_to(copy).as_posix()
    with s3.open_output_stream(f"{BUCKET}/damaged/{rel}") as out:
        out.write(b"\0" * victim.stat().st_size)
    refused = checkpoint.CheckpointError
    with pytest.raises(refused, match=f"{uri} is damaged: {rel} does not match its checksum"):
        runs.open_checkpoint(uri)
    assert [p.suffix for p in cache.iterdir()] == [".lock"]  # nothing half-fetched is kept
    s3.delete_file(f"{BUCKET}/damaged/{rel}")
    with pytest.raises(refused, match=f"{uri} is damaged: {rel} is missing"):
        runs.open_checkpoint(uri)
    s3.delete_file(f"{BUCKET}/damaged/{checkpoint.TRAIN_STATE}")
    with pytest.raises(refused, match=f"{uri} is incomplete: its save never finished"):
        runs.open_checkpoint(uri)
    s3.create_dir(f"{BUCKET}/other")
    with s3.open_output_stream(f"{BUCKET}/other/notes.txt") as out:
        out.write(b"not a checkpoint")
    with pytest.raises(refused, match="s3://jaxray/other is not a jaxray checkpoint folder"):
        runs.open_checkpoint("s3://jaxray/other")


def test_the_serve_app_checks_a_uri_and_hands_it_to_its_replicas(s3, trained_transformer, cache, capsys):
    uri = upload(s3, trained_transformer, "serve/checkpoint")
    application = app_builder({"checkpoint": uri})
    args, _, pinned = application._bound_deployment.init_args
    assert args.checkpoint == uri  # each replica fetches it into its own node's cache, this one:
    assert pinned == hashlib.sha256((trained_transformer / checkpoint.TRAIN_STATE).read_bytes()).hexdigest()
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1  # fetched and checked here, first


def replace_remote(s3: pafs.S3FileSystem, key: str, folder: Path) -> None:
    s3.delete_dir(f"{BUCKET}/{key}")
    upload(s3, folder, key)


@pytest.fixture(scope="module")
def retrained(trained_transformer, tmp_path_factory) -> Path:
    """Another checkpoint of the same model: ``trained_transformer``'s params plus 0.01."""
    _, params = checkpoint.restore(trained_transformer)
    params = jax.tree.map(lambda x: x + 0.01, params)
    trial = checkpoint.load_trial_config(trained_transformer)
    return save_params(tmp_path_factory.mktemp("retrained") / "transformer", params, trial)


def test_a_checkpoint_replaced_at_its_uri_is_fetched_anew_and_a_checked_one_is_pinned(
    s3, trained_transformer, retrained, cache
):
    uri = upload(s3, trained_transformer, "replaced")
    first = runs.open_checkpoint(uri).path
    pinned = remote.manifest_sha256(first)
    other = runs.open_checkpoint(upload(s3, trained_transformer, "other")).path  # another URI's copy stays
    replace_remote(s3, "replaced", retrained)
    second = runs.open_checkpoint(uri).path
    assert second != first and checkpoint.verify(second) == checkpoint.verify(retrained)
    assert remote.source(second) == uri and not first.exists()  # one copy per URI: the older removed
    assert other.is_dir() and sorted(p for p in cache.iterdir() if p.is_dir()) == sorted([other, second])
    # Serve's replicas fetch with the digest build_app checked: a replaced checkpoint is refused.
    with pytest.raises(checkpoint.CheckpointError, match=f"{uri} changed since it was checked"):
        remote.fetch(uri, pinned)
    assert remote.fetch(uri + "/", remote.manifest_sha256(second)) == second  # a trailing slash: the same
    # A copy another process is fetching (its lock held) is left, and removed by a later fetch.
    replace_remote(s3, "replaced", trained_transformer)
    with filelock.FileLock(f"{second}.lock"):
        third = runs.open_checkpoint(uri).path
        assert third == first and second.is_dir()
    assert runs.open_checkpoint(uri).path == third and not second.exists() and other.is_dir()


def test_names_that_leave_the_folder_a_run_folder_and_a_wrong_bucket_are_refused(
    s3, trained_transformer, copied_run_folder, tmp_path
):
    copy = Path(shutil.copytree(trained_transformer, tmp_path / "copy"))
    outside = tmp_path / "outside.txt"
    doc = checkpoint.verify(copy)
    for name in (str(outside), "../outside.txt", "params//x"):
        (copy / checkpoint.TRAIN_STATE).write_text(json.dumps({**doc, "files": {name: "0" * 64}}))
        uri = upload(s3, copy, "escape")
        with pytest.raises(checkpoint.CheckpointError, match=f"it lists '{re.escape(name)}', not a file in"):
            runs.open_checkpoint(uri)
    assert not outside.exists()
    run = upload(s3, copied_run_folder, "run")
    with pytest.raises(checkpoint.CheckpointError, match=f"{run} is a run or trial folder: only checkpoint"):
        runs.open_checkpoint(run)
    with pytest.raises(checkpoint.CheckpointError, match="s3://nobucket/x does not exist"):
        runs.open_checkpoint("s3://nobucket/x")


def test_an_unwritable_cache_is_named(s3, trained_transformer, monkeypatch):
    uri = upload(s3, trained_transformer, "unwritable")
    monkeypatch.setenv(storage.CACHE_ENV, "/proc/nope")
    with pytest.raises(
        checkpoint.CheckpointError, match="the checkpoint cache /proc/nope/checkpoints cannot be"
    ):
        runs.open_checkpoint(uri)


def test_an_evaluation_of_a_uri_records_the_uri(s3, trained_transformer, tmp_path):
    from jaxray.config import ConfigError
    from jaxray.reporting.eval_results import default_out, results_folder

    uri = upload(s3, trained_transformer, "evaluated/train/trial_a/checkpoint_step_00000060_attempt1")
    local = runs.open_checkpoint(uri).path
    assert default_out(remote.source(local)).parts[-3:] == ("evaluated", "trial_a", local_name(uri))
    out = tmp_path / "eval"
    out.mkdir()
    (out / "summary.json").write_text(json.dumps({"checkpoint": uri, "written_by": "jaxray.evaluate"}))
    assert results_folder(out, local, overwrite=False) == out  # the same URI: its evaluation again
    (out / "summary.json").write_text(json.dumps({"checkpoint": uri + "x", "written_by": "jaxray.evaluate"}))
    with pytest.raises(ConfigError, match=f"holds the evaluation of {uri}x"):
        results_folder(out, local, overwrite=False)
    # The same URI, other weights (the checkpoint replaced there): refused unless --overwrite.
    earlier = {"checkpoint": uri, "written_by": "jaxray.evaluate", "checkpoint_sha256": "0" * 64}
    (out / "summary.json").write_text(json.dumps(earlier))
    with pytest.raises(ConfigError, match=f"holds the evaluation of {uri} before its weights changed"):
        results_folder(out, local, overwrite=False)
    assert results_folder(out, local, overwrite=True) == out
    same = {**earlier, "checkpoint_sha256": remote.manifest_sha256(local)}
    (out / "summary.json").write_text(json.dumps(same))
    assert results_folder(out, local, overwrite=False) == out


def local_name(uri: str) -> str:
    return uri.rsplit("/", 1)[-1]


@pytest.mark.slow  # waits out the cloud client's own timeouts: make test-all
def test_a_gs_uri_without_credentials_fails_in_seconds(tmp_path):
    """Issue 49's bar: a URI that cannot be reached is refused within 15 s (pyarrow's own retries: many
    minutes), as --checkpoint, as storage and as data."""
    start = time.monotonic()
    with pytest.raises(checkpoint.CheckpointError, match="gs://jaxray-none/x cannot be read"):
        runs.open_checkpoint("gs://jaxray-none/x")
    with pytest.raises(OSError, match="gs://jaxray-none/s cannot be written"):
        storage.check_writable("gs://jaxray-none/s")
    with pytest.raises(ManifestError, match="gs://jaxray-none/d cannot be reached"):
        read_manifest("gs://jaxray-none/d")
    assert time.monotonic() - start < 3 * 15


def test_concurrent_fetches_share_one_copy_and_a_diverged_model_is_refused(s3, trained_transformer, tmp_path):
    uri = upload(s3, trained_transformer, "shared")
    with ThreadPoolExecutor(4) as pool:
        entries = set(pool.map(lambda _: remote.fetch(uri), range(4)))
    assert len(entries) == 1 and checkpoint.verify(entries.pop())
    copy = Path(shutil.copytree(trained_transformer, tmp_path / "diverged"))
    doc = checkpoint.verify(copy)
    (copy / checkpoint.TRAIN_STATE).write_text(json.dumps({**doc, "summary": {"loss": float("nan")}}))
    diverged = upload(s3, copy, "diverged")
    with pytest.raises(checkpoint.CheckpointError, match=f"{diverged}: .* records loss nan"):
        runs.open_checkpoint(diverged)


def test_credentials_and_query_in_a_uri_are_never_shown_or_recorded(s3, trained_transformer):
    assert storage.display("s3://KEY:secret@bucket/a/b?region=x") == "s3://bucket/a/b"
    upload(s3, trained_transformer, "keyed")
    local = runs.open_checkpoint("s3://test:test@jaxray/keyed").path
    assert remote.source(local) == "s3://jaxray/keyed"


def test_training_storage_is_checked_listed_and_measured(s3, trained_transformer):
    with pytest.raises(OSError, match="s3://no-such-bucket/runs cannot be written"):
        storage.check_writable("s3://no-such-bucket/runs")
    storage.check_writable(f"s3://{BUCKET}/storage/run")  # leaves nothing behind
    assert checkpoint.checkpoints(f"s3://{BUCKET}/storage/run") == []
    trial = f"s3://{BUCKET}/storage/run/trial"
    for name in ("checkpoint_step_00000004_attempt1", "checkpoint_step_00000008_attempt1"):
        upload(s3, trained_transformer, f"storage/run/trial/{name}")
    s3.delete_file(f"{BUCKET}/storage/run/trial/checkpoint_step_00000004_attempt1/{checkpoint.TRAIN_STATE}")
    assert checkpoint.checkpoints(trial) == [f"{trial}/checkpoint_step_00000008_attempt1"]
    size = sum(f.stat().st_size for f in trained_transformer.rglob("*") if f.is_file())
    count, mib = remote.disk_use(trial)
    assert count == 2 and 2 * size / 2**20 - 0.01 < mib + 0.01 < 2 * size / 2**20 + 0.02
    state = storage.read_text(f"{trial}/checkpoint_step_00000008_attempt1/{checkpoint.TRAIN_STATE}")
    assert json.loads(state) == checkpoint.verify(trained_transformer)
    assert storage.read_text(f"{trial}/absent.json") is None


def test_a_run_folder_on_storage_falls_back_to_the_trials_older_checkpoint(s3, trained_transformer, tmp_path):
    from jaxray.reporting.sweep import write_reports

    trial = f"s3://{BUCKET}/fallback/run/transformer_t"
    for step in (4, 8):
        upload(s3, trained_transformer, f"fallback/run/transformer_t/checkpoint_step_0000000{step}_attempt1")
    newest = f"{BUCKET}/fallback/run/transformer_t/checkpoint_step_00000008_attempt1"
    params = largest_params_file(trained_transformer).relative_to(trained_transformer).as_posix()
    with s3.open_output_stream(f"{newest}/{params}") as f:  # damaged in the bucket
        f.write(b"\0")
    named = f"{trial}/checkpoint_step_00000008_attempt1"
    row = {"trial": "transformer_t", "workload": "transformer", "val_loss": 2.0, "checkpoint": named}
    write_reports(tmp_path / "run", [row], {})
    assert json.loads((tmp_path / "run" / "summary.json").read_text())[0]["checkpoint"] == named
    local = runs.open_checkpoint(tmp_path / "run").path
    assert remote.source(local) == f"{trial}/checkpoint_step_00000004_attempt1"
