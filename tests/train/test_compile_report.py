"""The compile report: HLO op counts, XLA's cost and memory analysis, and what training records."""

from __future__ import annotations

import itertools

import pytest

from jaxray.bench.compile_step import fits_text, render, report_for
from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.parallel.mesh import make_mesh
from jaxray.train.compile_report import hlo_ops
from jaxray.train.run import train

# Lines in the shape XLA prints them (optimised HLO of a GPU step), for the parser's shape logic.
HLO = """
HloModule jit_step
%fused_computation (p: bf16[256,64]) -> bf16[256,64] {
  %scatter.3 = bf16[256,64]{1,0} scatter(bf16[256,64]{1,0} %p, s32[512,1]{1,0} %i, bf16[512,64]{1,0} %u), to_apply=%add
}
ENTRY %main {
  %gather.1 = f32[512,64]{1,0} gather(f32[256,64]{1,0} %t, s32[512,1]{1,0} %i), offset_dims={1}
  %all-reduce-start = (f32[64]{0}, f32[8]{0}) all-reduce-start(f32[64]{0} %g, f32[8]{0} %h), to_apply=%add
  %all-reduce-done = (f32[64]{0}, f32[8]{0}) all-reduce-done(%all-reduce-start)
  %all-gather.2 = f32[128]{0} all-gather(f32[64]{0} %g), dimensions={0}
  %custom-call.7 = (bf16[4,256,4,64]{3,2,1,0}, u8[0]{0}) custom-call(bf16[4,256,4,64]{3,2,1,0} %q), custom_call_target="__cudnn$fmhaSoftmax"
  %fusion.4 = bf16[256,64]{1,0} fusion(bf16[256,64]{1,0} %p), kind=kLoop, calls=%fused_computation
  %fusion.5 = f32[64]{0} fusion(f32[64]{0} %g), kind=kInput, calls=%other
  ROOT %dot.9 = f32[64,64]{1,0} dot(f32[64,8]{1,0} %a, f32[8,64]{1,0} %b), lhs_contracting_dims={1}
}
"""  # noqa: E501 - XLA's own line lengths: the parser must read them unbroken


def test_hlo_ops_counts_what_explains_speed():
    ops = hlo_ops(HLO)
    assert ops == {
        "scatter": {"bf16": 1},
        "gather": {"f32": 1},
        "collectives": {"all-reduce": 1, "all-gather": 1},
        "custom_calls": {"__cudnn$fmhaSoftmax": 1},
        "fusions": {"kLoop": 1, "kInput": 1},
        "dots": 1,
    }


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


def test_training_reports_the_compile_before_the_first_step(real_dir):
    trial = parse_trial(
        {
            "model": {"workload": "mlp", "width": 16},
            "data": {"data_dir": str(real_dir)},
            "train": {"steps": 3, "global_batch": 8, "log_every": 1},
        }
    )
    arrays, held_out = load_arrays(trial)
    events = []
    result = train(
        trial,
        train_batches(arrays, 8),
        {k: v[:64] for k, v in held_out.items()},
        make_mesh(),
        on_log=[lambda row: events.append("log")],
        on_compile=lambda rep: events.append(rep),
    )
    assert isinstance(events[0], dict) and events[1:] == ["log"] * 3
    assert result.compile_report is events[0]
    assert result.summary["peak_bytes_per_device"] == events[0]["memory"]["peak_bytes"] > 0
    assert list(itertools.islice(result.compile_report["config"].items(), 2)) == [
        ("workload", "mlp"),
        ("dtype", "float32"),
    ]
