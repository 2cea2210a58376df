"""Argument types shared by the command lines (argparse turns their errors into exit code 2 with
the option's name). Nothing here imports JAX: parsing happens before XLA_FLAGS is final."""
from __future__ import annotations

import argparse
from pathlib import Path

MAX_CPU_DEVICES = 256  # forced host devices; thousands make XLA's start-up hang


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def cpu_device_count(text: str) -> int:
    """A forced CPU device count, 1..MAX_CPU_DEVICES."""
    value = positive_int(text)
    if value > MAX_CPU_DEVICES:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_CPU_DEVICES} forced CPU devices, got {value}")
    return value


def folder(text: str) -> str:
    """An existing directory."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text
