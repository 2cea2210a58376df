"""The compile report: HLO op counts, XLA's cost and memory analysis, and what training records."""

from __future__ import annotations

import itertools

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
