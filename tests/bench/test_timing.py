"""The benchmark clock: warm-up calls first, then `repeats` windows of `calls`, median reported."""

import jax.numpy as jnp
import pytest

from jaxray.bench.timing import environment, time_calls


def test_time_calls_runs_warmup_then_each_window():
    seen = []

    def call(i):
        seen.append(i)
        return jnp.ones(3) * i

    timing = time_calls(call, calls=4, repeats=3, warmup=2)
    assert seen == [0, 1] + [0, 1, 2, 3] * 3
    assert len(timing.repeats_s) == 3 and timing.median_s == sorted(timing.repeats_s)[1]


@pytest.mark.parametrize("calls, repeats, warmup", [(0, 1, 1), (1, 0, 1), (1, 1, -1)])
def test_time_calls_rejects_empty_windows(calls, repeats, warmup):
    with pytest.raises(ValueError, match="calls and repeats"):
        time_calls(lambda i: None, calls, repeats, warmup)


def test_environment_names_device_and_versions():
    env = environment(1)
    assert env["platform"] == "cpu" and env["devices"] == 1 and env["jax"] and env["jaxlib"]
