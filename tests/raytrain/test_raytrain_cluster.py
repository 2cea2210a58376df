"""Finding a `ray start` cluster on this machine: a stale address file must not make
`python -m jaxray.tune` wait for a dead cluster; a live one is joined. The worker's log line."""

from __future__ import annotations

import socket

import pytest

from jaxray.raytrain.cluster import describe_worker, ray_address_file, running_local_cluster


def dead_port() -> int:
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_stale_address_file_is_ignored(tmp_path):
    file = tmp_path / "ray_current_cluster"
    file.write_text(f"127.0.0.1:{dead_port()}\n")
    assert running_local_cluster(file) is None


def test_live_address_is_returned(tmp_path):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        (tmp_path / "ray_current_cluster").write_text(address + "\n")
        assert running_local_cluster(tmp_path / "ray_current_cluster") == address


@pytest.mark.parametrize("text", [None, "", "no-port", "host:notaport", ":6379"])
def test_missing_or_unreadable_address_file_means_no_cluster(tmp_path, text):
    file = tmp_path / "ray_current_cluster"
    if text is not None:
        file.write_text(text)
    assert running_local_cluster(file) is None


def test_address_file_follows_rays_temp_folder(tmp_path, monkeypatch):
    """Where `ray start` writes it: ray/ray_current_cluster under RAY_TMPDIR, else TMPDIR, else /tmp."""
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    monkeypatch.delenv("TMPDIR", raising=False)
    assert str(ray_address_file()) == "/tmp/ray/ray_current_cluster"
    monkeypatch.setenv("TMPDIR", str(tmp_path / "t"))
    assert ray_address_file() == tmp_path / "t" / "ray" / "ray_current_cluster"
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "r"))
    assert ray_address_file() == tmp_path / "r" / "ray" / "ray_current_cluster"
    with socket.socket() as server:  # the default file is the one probed
        server.bind(("127.0.0.1", 0))
        server.listen()
        ray_address_file().parent.mkdir(parents=True)
        ray_address_file().write_text(f"127.0.0.1:{server.getsockname()[1]}")
        assert running_local_cluster() == ray_address_file().read_text()


def test_the_worker_line_names_the_process_and_devices():
    line = describe_worker(0)
    assert line.startswith("jaxray worker rank 0: JAX process 0 of 1, local devices [CpuDevice(id=0)")
