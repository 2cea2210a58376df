"""``python -m jaxray.bench compile``'s report of one config from shapes alone, and its text."""

from __future__ import annotations

import pytest

from jaxray.bench.compile_step import fits_text, render, report_for
from jaxray.config import parse_trial
from jaxray.parallel.mesh import make_mesh


@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_report_for_a_config_without_data(workload):
    trial = parse_trial(
        {
            "model": {"workload": workload, "width": 32, "num_layers": 1, "max_seq_len": 16},
            "data": {"seq_len": 16},
            "train": {"global_batch": 8},
        }
    )
    rep = report_for(trial, make_mesh())
    mem = rep["memory"]
    assert (
        mem["peak_bytes"]
        == mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
    )
    # The donated state is updated in place: its outputs alias the arguments.
    assert 0 < mem["alias_bytes"] <= mem["output_bytes"] and mem["argument_bytes"] > 0
    assert rep["flops"] > 0 and rep["bytes_accessed"] > 0 and rep["compile_s"] > 0
    assert rep["config"] == {
        "workload": workload,
        "dtype": "float32",
        "width": 32,
        "global_batch": 8,
        "per_device_batch": 8,
        "devices": 1,
        "data": 1,
        "fsdp": 1,
        "tensor": 1,
        **({"seq_len": 16, "num_layers": 1, "num_heads": 4} if workload == "transformer" else {}),
    }
    # A CPU device reports no limit: it is compared with the host's RAM.
    assert rep["memory_source"] == "host RAM" and rep["device_memory_bytes"] > 2**30 and rep["fits"] is True
    assert "(host RAM): fits" in fits_text(rep) and "peak" in render(rep)
    assert rep["ops"]["scatter"] == {} and rep["ops"]["dots"] > 0


def test_fits_compares_peak_with_the_device_memory():
    rep = {
        "memory": {"peak_bytes": 3 * 2**30},
        "device_memory_bytes": 2 * 2**30,
        "fits": False,
        "platform": "gpu",
        "memory_source": "device",
    }
    assert fits_text(rep) == "peak 3.00 GiB per device of 2.00 GiB (device): does NOT fit"
    rep.update(device_memory_bytes=None, fits=None)
    assert fits_text(rep) == "peak 3.00 GiB per device; the gpu device reports no memory to compare with"
