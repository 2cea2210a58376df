"""The clock every benchmark uses, and the environment every result row records.

Recipe (the learning path's "honest throughput"): run ``warmup`` calls first (compilation and
first-touch costs land there), then time ``repeats`` windows of ``calls`` calls each, calling
``jax.block_until_ready`` on the last output before reading the clock (JAX dispatch is
asynchronous: without it the clock measures dispatch, not compute), and report the median window.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jaxlib


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median over repeats and every repeat's value."""

    median_s: float
    repeats_s: tuple[float, ...]


def time_calls(call: Callable[[int], Any], calls: int, repeats: int, warmup: int = 1) -> Timing:
    """Time ``call(i)`` (the i-th call of a window; returns arrays to wait on).

    Runs ``warmup`` calls, then ``repeats`` windows of ``calls`` calls. Raises ValueError if any
    count is below 1 (warm-up may be 0).
    """
    if calls < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"calls and repeats must be >= 1 and warmup >= 0, got {calls}, {repeats}, {warmup}")
    for i in range(warmup):
        jax.block_until_ready(call(i))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for i in range(calls):
            out = call(i)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) / calls)
    return Timing(statistics.median(per_call), tuple(per_call))


def environment(devices: int) -> dict[str, Any]:
    """What a result depends on: platform, device kind, devices used, jax and jaxlib versions."""
    device = jax.devices()[0]
    return {
        "platform": device.platform,
        "device_kind": device.device_kind,
        "devices": devices,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
    }
