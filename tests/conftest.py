"""Shared fixtures. The real data files come from JAXRAY_DATA_DIR (CI and `make test` set it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_dir() -> Path:
    """The folder holding tinyshakespeare.txt and fashion-mnist/; fails (never skips) when unset."""
    value = os.environ.get("JAXRAY_DATA_DIR")
    if not value:
        pytest.fail("JAXRAY_DATA_DIR is not set. These tests need the real data files: set it to the folder "
                    "holding tinyshakespeare.txt and fashion-mnist/ (e.g. JAXRAY_DATA_DIR=../shared/data).")
    path = Path(value).resolve()
    if not (path / "tinyshakespeare.txt").is_file():
        pytest.fail(f"JAXRAY_DATA_DIR={value} does not hold tinyshakespeare.txt")
    return path
