"""A stale `ray start` address file must not make `python -m jaxray.tune` wait for a dead cluster."""

from __future__ import annotations

import socket

from jaxray.tune import running_local_cluster


def test_stale_address_file_is_ignored(tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{dead}")
    assert running_local_cluster() is None


def test_live_address_is_returned(monkeypatch):
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))  # Ray rewrites 127.0.0.1 to the node's own address
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        assert running_local_cluster().endswith(f":{port}")
