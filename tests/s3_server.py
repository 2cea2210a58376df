"""moto's S3-compatible server for the tests that read or write checkpoints on object storage."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pyarrow.fs as pafs
import pytest
from private_ray import free_port


@contextmanager
def s3_server(bucket: str) -> Iterator[pafs.S3FileSystem]:
    """moto's S3 server on a free port, the AWS_* variables pointing pyarrow (and the Ray workers
    started after them) at it, ``bucket`` made; its filesystem."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and server.poll() is None, "moto's server did not start"
            time.sleep(0.2)
    env = pytest.MonkeyPatch()
    url = f"http://127.0.0.1:{port}"
    try:
        for key, value in {
            "AWS_ENDPOINT_URL": url,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            env.setenv(key, value)
        fs = pafs.S3FileSystem(endpoint_override=url, region="us-east-1", allow_bucket_creation=True)
        fs.create_dir(bucket)
        yield fs
    finally:
        env.undo()
        server.terminate()
        server.wait(timeout=30)
