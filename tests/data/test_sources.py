"""Search order, checksum verification and error messages of jaxray.data.sources."""

from __future__ import annotations

import gzip
import hashlib
import shutil
import urllib.error
from pathlib import Path

import pytest

from jaxray.data import sources
from jaxray.data.sources import REGISTRY, DataFileError, read_verified

SHAKESPEARE = "tinyshakespeare.txt"
LABELS = "fashion-mnist/t10k-labels-idx1-ubyte.gz"  # smallest real file (5 KB)


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """No test may see the user's cache, a system install, or the network."""
    monkeypatch.setenv("JAXRAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(sources, "SYSTEM_DIR", tmp_path / "system")

    def offline(url, dest):
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(sources, "_download", offline)


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _corrupted_labels_gz(real_dir: Path) -> bytes:
    payload = bytearray(gzip.decompress((real_dir / LABELS).read_bytes()))
    payload[8] = (payload[8] + 1) % 10  # still a valid label, different digest
    return gzip.compress(bytes(payload))


def test_real_files_match_registry(real_dir):
    for name in (SHAKESPEARE, LABELS, "fashion-mnist/train-labels-idx1-ubyte.gz"):
        content = read_verified(name, data_dir=real_dir)
        assert hashlib.sha256(content).hexdigest() == REGISTRY[name].sha256


def test_unknown_name_is_value_error():
    with pytest.raises(ValueError, match="unknown data file"):
        read_verified("mnist.txt")


def test_checksum_mismatch_names_file_and_both_digests(real_dir, tmp_path):
    data = bytearray((real_dir / SHAKESPEARE).read_bytes())
    data[1000] ^= 0x20
    bad = _write(tmp_path / "bad" / SHAKESPEARE, bytes(data))
    with pytest.raises(DataFileError) as exc:
        read_verified(SHAKESPEARE, data_dir=tmp_path / "bad")
    msg = str(exc.value)
    assert str(bad) in msg
    assert REGISTRY[SHAKESPEARE].sha256 in msg
    assert hashlib.sha256(bytes(data)).hexdigest() in msg
    assert "JAXRAY_DATA_DIR" in msg and "Delete" in msg


def test_checksum_is_of_decompressed_content(real_dir, tmp_path):
    corrupted = _corrupted_labels_gz(real_dir)
    bad = _write(tmp_path / LABELS, corrupted)
    with pytest.raises(DataFileError) as exc:
        read_verified(LABELS, data_dir=tmp_path)
    actual = hashlib.sha256(gzip.decompress(corrupted)).hexdigest()
    assert str(bad) in str(exc.value) and actual in str(exc.value)


def test_truncated_gz_is_reported(real_dir, tmp_path):
    data = (real_dir / LABELS).read_bytes()
    bad = _write(tmp_path / LABELS, data[: len(data) // 2])
    with pytest.raises(DataFileError, match="truncated or corrupt") as exc:
        read_verified(LABELS, data_dir=tmp_path)
    assert str(bad) in str(exc.value)


def test_uncompressed_copy_is_accepted(real_dir, tmp_path):
    payload = gzip.decompress((real_dir / LABELS).read_bytes())
    _write(tmp_path / "t10k-labels-idx1-ubyte", payload)
    assert read_verified(LABELS, data_dir=tmp_path) == payload


def test_explicit_dir_beats_env_var(real_dir, tmp_path, monkeypatch):
    _write(tmp_path / "env" / SHAKESPEARE, b"not shakespeare")
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(tmp_path / "env"))
    assert read_verified(SHAKESPEARE, data_dir=real_dir) == (real_dir / SHAKESPEARE).read_bytes()


def test_bad_first_copy_is_an_error_not_skipped(real_dir, tmp_path, monkeypatch):
    bad = _write(tmp_path / "explicit" / SHAKESPEARE, b"not shakespeare")
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(real_dir))
    with pytest.raises(DataFileError) as exc:
        read_verified(SHAKESPEARE, data_dir=tmp_path / "explicit")
    assert str(bad) in str(exc.value)


def test_env_var_dir_with_basename_layout(real_dir, tmp_path, monkeypatch):
    flat = tmp_path / "flat"
    flat.mkdir()
    shutil.copy(real_dir / LABELS, flat / "t10k-labels-idx1-ubyte.gz")
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(flat))
    content = read_verified(LABELS)
    assert hashlib.sha256(content).hexdigest() == REGISTRY[LABELS].sha256


def test_env_var_beats_cache(real_dir, tmp_path, monkeypatch):
    _write(tmp_path / "cache" / SHAKESPEARE, b"stale cache")
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(real_dir))
    assert len(read_verified(SHAKESPEARE)) == 1_115_394


def test_cache_and_system_dir_are_searched(real_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("JAXRAY_DATA_DIR", raising=False)
    shutil.copytree(real_dir / "fashion-mnist", tmp_path / "system")
    assert len(read_verified(LABELS)) == 8 + 10_000
    (tmp_path / "cache").mkdir(exist_ok=True)
    shutil.copy(real_dir / SHAKESPEARE, tmp_path / "cache" / SHAKESPEARE)
    assert len(read_verified(SHAKESPEARE)) == 1_115_394


def test_offline_and_nowhere_lists_every_place(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(tmp_path / "env"))
    with pytest.raises(DataFileError) as exc:
        read_verified(LABELS, data_dir=tmp_path / "explicit")
    msg = str(exc.value)
    for place in (
        tmp_path / "explicit" / LABELS,
        tmp_path / "explicit" / "t10k-labels-idx1-ubyte.gz",
        tmp_path / "explicit" / "t10k-labels-idx1-ubyte",
        tmp_path / "env" / LABELS,
        tmp_path / "env" / "t10k-labels-idx1-ubyte.gz",
        tmp_path / "cache" / LABELS,
        tmp_path / "system" / "t10k-labels-idx1-ubyte.gz",
    ):
        assert f"  {place}\n" in msg, f"{place} missing from:\n{msg}"
    assert REGISTRY[LABELS].url in msg
    assert "network disabled in tests" in msg
    for hint in ("--data-dir", "JAXRAY_DATA_DIR", "apt-get install dataset-fashion-mnist"):
        assert hint in msg
    assert not (tmp_path / "cache" / LABELS).exists()


def test_download_goes_through_cache(real_dir, tmp_path, monkeypatch):
    # A file:// URL exercises the real urllib download path without a network.
    monkeypatch.setattr(sources, "_download", _real_download)
    monkeypatch.delenv("JAXRAY_DATA_DIR")
    url = (real_dir / LABELS).absolute().as_uri()
    monkeypatch.setitem(REGISTRY, LABELS, REGISTRY[LABELS]._replace(url=url))
    content = read_verified(LABELS)
    assert hashlib.sha256(content).hexdigest() == REGISTRY[LABELS].sha256
    cached = tmp_path / "cache" / LABELS
    assert cached.read_bytes() == (real_dir / LABELS).read_bytes()
    assert list(cached.parent.iterdir()) == [cached]  # no temp file left behind


def test_bad_download_is_discarded(real_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "_download", _real_download)
    monkeypatch.delenv("JAXRAY_DATA_DIR")
    bad = _write(tmp_path / "served" / "labels.gz", _corrupted_labels_gz(real_dir))
    monkeypatch.setitem(REGISTRY, LABELS, REGISTRY[LABELS]._replace(url=bad.as_uri()))
    with pytest.raises(DataFileError, match="discarded"):
        read_verified(LABELS)
    assert list((tmp_path / "cache" / "fashion-mnist").iterdir()) == []


_real_download = sources._download


def test_a_data_folder_given_without_the_file_is_said_when_another_place_has_it(
    real_dir, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(real_dir))
    (tmp_path / "given").mkdir()
    with caplog.at_level("WARNING", logger="jaxray.data.sources"):
        assert len(read_verified(SHAKESPEARE, data_dir=tmp_path / "given")) == 1_115_394
    assert f"is not in the data folder given, {tmp_path / 'given'}: read from {real_dir}" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="jaxray.data.sources"):
        read_verified(SHAKESPEARE, data_dir=real_dir)
    assert caplog.text == ""
