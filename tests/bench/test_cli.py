"""``python -m jaxray.bench``: commands run in process through ``main(argv)`` at tiny sizes on real
data, their errors for bad input, and one fresh process (``all``, 4 forced CPU devices). Nothing here
asserts a speed: rows, columns and files only."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxray.bench import check, mfu
from jaxray.bench.__main__ import build_parser, main
from jaxray.bench.runner import throughput_size
from jaxray.bench.throughput import make_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _env(real_dir, monkeypatch):
    monkeypatch.setenv("JAXRAY_DATA_DIR", str(real_dir))
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() may set it: undone after


@pytest.fixture(scope="module")
def reference_dir(real_dir) -> Path:
    for folder in (real_dir.parent / "bench", ROOT.parent / "shared" / "bench"):
        if (folder / "reference_mlp.py").is_file():
            return folder
    pytest.fail(f"no reference scripts in {real_dir.parent / 'bench'} or {ROOT.parent / 'shared' / 'bench'}")


def rows(folder: Path) -> dict[str, dict]:
    assert (folder / "summary.md").read_text().startswith("# ")
    return {
        r.get("case", r.get("feed")): r for r in json.loads((folder / "summary.json").read_text())["rows"]
    }


def run(*args) -> int:
    return main([str(a) for a in args])


@pytest.mark.slow  # `bench all` at tiny sizes in a fresh process (4 forced devices): ~2 min on 2 cores
def test_all_in_a_fresh_process_writes_every_suite(real_dir, tmp_path):
    out = tmp_path / "all"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    cmd = [
        sys.executable,
        "-m",
        "jaxray.bench",
        "all",
        "--preset",
        "tiny",
        "--cpu-devices",
        "4",
        "--out",
        out,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    charts = {"dispatch": ["dispatch.png"], "precision": ["precision.png"], "shard-map": ["shard_map.png"],
              "devices": ["devices_throughput.png", "devices_transformer_loss.png"],
              "batch-sweep": ["throughput_vs_batch.png"], "attention": ["attention.png"],
              "throughput": ["loss_per_step.png"]}  # fmt: skip
    for suite, pngs in charts.items():
        for name in ["summary.json", "summary.md", *pngs]:
            assert (out / suite / name).stat().st_size > 0, f"{suite}/{name}"
    d = rows(out / "dispatch")
    assert d["eager"]["step"] == "eager" and d["jit"]["examples_per_sec"] > 0
    p = rows(out / "precision")
    assert 0 <= p["mlp bfloat16"]["test_accuracy"] <= 1 and p["transformer float32"]["val_loss"] > 0
    dev = rows(out / "devices")
    assert (dev["mlp x1"]["per_device_batch"], dev["mlp x4"]["global_batch"], dev["mlp x4"]["devices"]) == (
        16,
        64,
        4,
    )
    sm = rows(out / "shard-map")
    for workload, bound in (("mlp", 3e-3 / 30), ("transformer", 1e-5)):  # float32 sums in another order
        row = sm[f"{workload} shard_map"]
        assert row["max_param_abs_diff"] < bound and row["max_loss_abs_diff"] < 1e-5
        assert row["max_key_bias_abs_diff"] < 2 * 3e-4 * 9  # zero-gradient key bias: ~lr per step
        assert math.isclose(row["final_loss"], sm[f"{workload} jit"]["final_loss"], rel_tol=1e-5)
    sweep = rows(out / "batch-sweep")
    assert "not divisible by 4" in sweep["batch 6"]["skipped"]
    assert (
        "more than the 60000" in sweep["batch 120000"]["error"] and sweep["batch 64"]["examples_per_sec"] > 0
    )
    att = rows(out / "attention")
    assert "needs an NVIDIA GPU" in att["cudnn"]["skipped"] and att["auto"]["attention"] == "xla"
    assert "| tokens/s |" in (out / "attention" / "summary.md").read_text()
    assert (out / "all.md").is_file()


@pytest.mark.slow  # a timed benchmark run (12 s); CI runs it
def test_throughput_writes_the_report_and_prints_one_json_line(tmp_path, capsys):
    out = tmp_path / "tp"
    assert run("throughput", "--workload", "transformer", "--width", 32, "--seq-len", 32, "--batch", 4,
               "--steps", 2, "--repeats", 2, "--out", out) == 0  # fmt: skip
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["tokens_per_sec"] == pytest.approx(row["examples_per_sec"] * 31) and math.isfinite(
        row["final_loss"]
    )
    saved = rows(out)["transformer"]
    assert saved["seq_len"] == 32 and saved["attention"] == "xla"
    assert len(saved["ms_per_step_repeats"]) == 2 and saved["device_kind"] and saved["jaxlib"]
    assert (out / "loss_per_step.png").stat().st_size > 0
    assert json.loads((out / "summary.json").read_text())["written_by"] == "jaxray.bench throughput"


@pytest.mark.parametrize(
    "args, message",
    [
        (["decode", "--new-tokens", "0"], "expected a positive integer"),
        (["decode", "--temperature", "-1"], "expected a finite number >= 0"),
        (["decode", "--checkpoint", "/nonexistent"], "is not a directory"),
        (["decode", "--batch-sizes", "1,1"], "listed twice"),
        (["throughput", "--steps", "0"], "expected a positive integer"),
        (["throughput", "--dtype", "float64"], "invalid choice"),
        (["throughput", "--model-preset", "gpt3"], "invalid choice: 'gpt3'"),
        (["throughput", "--data-dir", "/nonexistent"], "is not a directory"),
        (["batch-sweep", "--batches", "256,abc"], "expected a positive integer"),
        (["checkpoint", "--every", "0"], "expected a positive integer"),
        (["ingest", "--steps", "0"], "expected a positive integer"),
        (["serve", "--url", "localhost:8000"], "expected http://HOST:PORT"),
        (["serve", "--clients", "4,4"], "listed twice"),
        (["serve", "--prompt", ""], "the prompt is empty"),
    ],
)
def test_bad_options_exit_2_naming_them(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--out", ""])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "args, message",
    [
        (["decode", "--reference", "/nonexistent/reference_generate.py"], "not a file"),
        (["decode", "--prompt", ""], "prompt is empty"),
        (["throughput", "--workload", "mlp", "--batch", "6", "--devices", "2"], "more than the 1 available"),
        (
            ["throughput", "--workload", "mlp", "--steps", "5", "--steps-per-call", "2"],
            "multiple of steps_per_call",
        ),
        (["throughput", "--workload", "mlp", "--attention", "xla"], "applies to --workload transformer only"),
        (["throughput", "--workload", "mlp", "--batch", "100000", "--steps", "2"], "more than the 60000"),
        (["compare", "--reference", "/nonexistent/reference.py"], "not a file"),
        (["compare", "--reference", "README.md"], "cannot tell the workload"),
        (
            ["compare", "--reference", "{bench}/reference_transformer.py", "--dtype", "bfloat16"],
            "float32 only",
        ),
        (
            ["compile", "--workload", "mlp", "--seq-len", "8"],
            "--seq-len applies to --workload transformer only",
        ),
        (
            ["compile", "--workload", "mlp", "--batch", str(10**12), "--width", str(10**9)],
            "more than XLA can index",
        ),
        (
            ["throughput", "--workload", "mlp", "--mesh", "fsdp=3", "--batch", "4", "--devices", "4"],
            "parallel.fsdp 3 x parallel.tensor 1 cannot make a mesh of the trial's 4 devices",
        ),
        (
            [
                "throughput",
                "--workload",
                "mlp",
                "--step",
                "shard_map",
                "--mesh",
                "fsdp=2",
                "--batch",
                "2",
                "--devices",
                "2",
            ],
            "step shard_map keeps the params whole: it needs fsdp 1 and tensor 1, got fsdp 2, tensor 1",
        ),
        (["ingest", "--workload", "mlp", "--seq-len", "64"], "--seq-len applies to the transformer only"),
        (["serve", "--url", "http://127.0.0.1:9"], "GET /healthz did not answer"),
    ],
)
def test_bad_input_is_a_clear_error(reference_dir, args, message, capsys):
    assert run(*[a.format(bench=reference_dir) for a in args], "--out", "") == 2
    assert message in capsys.readouterr().err


def test_model_preset_gpt2_small_sizes_the_step_and_its_flops():
    """D 768, F 3072, L 12, V 256, T 1024: 12 * (4*589824 + 2*768*3072) + 768*256 = 85131264 weights
    -> x 6 = 510787584; causal attention 6 * 12 * 1024 * 768 = 56623104 -> 567410688 a token."""
    args = build_parser().parse_args(["throughput", "--model-preset", "gpt2_small", "--dtype", "bfloat16"])
    trial = make_spec(**throughput_size(args)).trial
    m = trial.model
    assert (m.width, m.num_layers, m.num_heads, m.max_seq_len, trial.data.seq_len) == (
        768,
        12,
        12,
        1024,
        1024,
    )
    assert mfu.flops_per_token(m, trial.data.seq_len) == 567410688
    args = build_parser().parse_args(["throughput", "--model-preset", "gpt2_small", "--seq-len", "256"])
    shorter = make_spec(**throughput_size(args)).trial
    assert (shorter.data.seq_len, shorter.model.max_seq_len) == (256, 1024)


def test_out_never_replaces_another_tools_summary_or_a_failed_run(tmp_path, capsys):
    sweep = tmp_path / "runs" / "demo"
    sweep.mkdir(parents=True)
    (sweep / "summary.json").write_text('[{"trial": "mlp_b256"}]')
    tiny = ["--workload", "mlp", "--width", 32, "--batch", 32, "--steps", 2, "--repeats", 1]
    assert run("throughput", *tiny, "--out", sweep) == 2
    assert "was not written by jaxray.bench" in capsys.readouterr().err
    assert (sweep / "summary.json").read_text() == '[{"trial": "mlp_b256"}]'
    out = tmp_path / "tp"
    assert run("throughput", *tiny, "--out", out) == 0
    saved = (out / "summary.json").read_text()
    assert run("throughput", "--workload", "mlp", "--batch", 100000, "--steps", 2, "--out", out) == 2
    assert run("dispatch", "--preset", "tiny", "--out", out) == 2
    assert "was not written by jaxray.bench dispatch" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == saved
    (tmp_path / "afile").write_text("x")
    assert run("throughput", *tiny, "--out", tmp_path / "afile") == 2
    assert "cannot be a results folder" in capsys.readouterr().err


def test_compile_prints_and_writes_the_report_and_keeps_a_trials_own(tmp_path, capsys):
    trial = tmp_path / "train" / "mlp_b128"  # a sweep trial's own record
    trial.mkdir(parents=True)
    (trial / "compile.json").write_text('{"config": {"global_batch": 128}}')
    small = ["--workload", "mlp", "--batch", 8, "--width", 16]
    assert run("compile", *small, "--out", trial) == 2
    assert (trial / "compile.json").read_text() == '{"config": {"global_batch": 128}}'
    capsys.readouterr()
    assert run("compile", *small, "--json", "--out", tmp_path / "own") == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["config"]["workload"] == "mlp"
    report = json.loads((tmp_path / "own" / "compile.json").read_text())
    assert report["written_by"] == "jaxray.bench compile" and report["memory"]["peak_bytes"] > 0


@pytest.mark.slow  # a real checkpoint cost run (~20 s)
def test_checkpoint_sizes_and_cost_rows(tmp_path):
    out = tmp_path / "ckpt"
    assert (
        run("checkpoint", "--workload", "mlp", "--every", 2, "--steps", 5, "--repeats", 1, "--out", out) == 0
    )
    doc = json.loads((out / "summary.json").read_text())
    mlp_size, lm_size, none, sync, background = doc["rows"]
    assert mlp_size["params"] == 235_146 and lm_size["params"] == 3_356_160
    assert 0.75 * 12 * lm_size["params"] / 1e6 <= lm_size["size_mb"] <= 1.2 * 12 * lm_size["params"] / 1e6
    assert all(r["save_s"] > 0 and r["restore_s"] > 0 for r in (mlp_size, lm_size))
    assert (none["every"], none["mode"], none["vs_none"], none["blocked_ms"]) == ("none", "none", 1.0, None)
    for row, mode in ((sync, "sync"), (background, "async")):
        assert (row["every"], row["mode"]) == (2, mode) and row["blocked_ms"] > 0
        ratio = row["ms_per_step"] / none["ms_per_step"]
        assert doc["summary"][f"mlp_every_2_{mode}"] == pytest.approx(ratio)


@pytest.mark.slow
@pytest.mark.ray  # starts a local Ray for Ray Data
def test_ingest_streamed_and_prestaged_agree(tmp_path):
    out = tmp_path / "ingest"  # global batch 8192: 7 batches an epoch, so steps 1..8 cross one boundary
    args = ["--workload", "mlp", "--batch", 8192, "--warmup", 1, "--steps", 8, "--repeats", 1, "--out", out]
    assert run("ingest", *args) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert [r["feed"] for r in doc["rows"]] == [
        "pre-staged",
        "in memory",
        "ray data, arrays",
        "ray data",
    ]
    for row in doc["rows"]:
        assert row["epoch_boundaries"] == 1 and row["final_losses"] == doc["rows"][0]["final_losses"]
    assert doc["summary"]["mlp_ratio"] == pytest.approx(doc["rows"][3]["vs_prestaged"])
    verdict = "met" if doc["rows"][3]["vs_prestaged"] <= doc["summary"]["target"] else "missed"
    assert any(n.startswith("mlp, ray data: ") and n.endswith(f"target {verdict}") for n in doc["notes"])


@pytest.mark.slow  # the learning path's own scripts run beside jaxray
def test_compare_and_decode_against_the_reference_scripts(reference_dir, trained_transformer, tmp_path):
    out = tmp_path / "compare"
    script = reference_dir / "reference_mlp.py"
    assert run("compare", "--reference", script, "--batch", 64, "--steps", 5, "--pairs", 1, "--out", out) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert doc["summary"]["max_final_loss_rel_diff"] <= 1e-4 and (out / "compare.png").stat().st_size > 0
    assert {r["impl"] for r in doc["rows"]} == {"reference", "jaxray"} and doc["rows"][1][
        "ratio_vs_reference"
    ] > 0
    out = tmp_path / "decode"
    args = ["--checkpoint", trained_transformer, "--new-tokens", 70, "--batch-sizes", "1,2", "--repeats", 1]
    assert run("decode", *args, "--reference", reference_dir / "reference_generate.py", "--out", out) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert [(r["sampler"], r["batch"]) for r in doc["rows"]] == [
        ("kv-cache, context_keep 32", 1), ("kv-cache, context_keep 32", 2), ("kv-cache, context_keep 63", 1),
        ("full recompute (jaxray.inference.sampling.sample)", 1), ("notebook (reference_generate.py)", 1),
    ]  # fmt: skip
    assert all(r["new_tokens"] == 70 and r["vs_full"] > 0 and r["vs_notebook"] > 0 for r in doc["rows"])
    assert "the window fills after 57 new tokens" in (out / "summary.md").read_text()


@pytest.mark.slow  # two decode programs compiled, timed and traced (~25 s)
def test_decode_profile_names_the_decode_programs_ops_and_device_time(trained_transformer, tmp_path):
    """``bench decode --profile``: per KV batch size, the decode program's HLO op counts and its device
    time per step from a jax.profiler trace, in the summary and the notes."""
    out = tmp_path / "decode"
    args = ["--checkpoint", trained_transformer, "--new-tokens", 12, "--batch-sizes", "1,2", "--repeats", 1]
    assert run("decode", *args, "--profile", "--out", out) == 0
    profiles = json.loads((out / "summary.json").read_text())["summary"]["profile"]
    assert sorted(profiles) == ["1", "2"]
    for trace in profiles.values():
        assert trace["hlo_ops"]["while"] >= 1 and trace["op_us_per_step"] > 0
        assert trace["top_ops"] and all(o["us"] > 0 for o in trace["top_ops"])
        assert abs(sum(trace["groups"].values()) - 1) < 0.01
    assert "Profile of the context_keep 32 row, batch 2:" in (out / "summary.md").read_text()


def test_check_without_an_accelerator_says_so_first(tmp_path, capsys):
    """``bench check`` on a CPU says first that the figures would be the CPU's (only the sweep, and no
    sweep: nothing measured, exit 2, no report); a part no preset names, or a preset without check
    cases, is refused before anything runs."""
    out = tmp_path / "check"
    assert main(["check", "--preset", "tiny", "--only", "sweep", "--sweep", "", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.lstrip().startswith("no accelerator here: JAX runs on the CPU"), err[:300]
    assert "no case of check could be measured" in err and not (out / "summary.json").exists()
    assert main(["check", "--preset", "tiny", "--only", "attention,tiny_f23", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--only tiny_f23: not a part of --preset tiny's check (one of attention, sweep," in err, err
    assert main(["check", "--out", str(out)]) == 2  # the default preset, cpu, has no check cases
    assert "--preset cpu has no check cases: --preset gpu (or tiny on a CPU)" in capsys.readouterr().err
    assert not out.exists()  # the folder the first made for its report went again


def test_check_without_ray_notes_the_sweep_and_runs_the_steps(tmp_path, monkeypatch):
    """Where Ray is not installed (the lent TPU host) ``bench check`` says its sweep was not run and
    measures the in-process cases; a sweep config that does not exist is an error row (exit 1)."""
    found = importlib.util.find_spec
    out, second, missing = tmp_path / "check", tmp_path / "c2", str(tmp_path / "no_such.yaml")
    with monkeypatch.context() as patch:
        patch.setattr(check.importlib.util, "find_spec", lambda n, *a: None if n == "ray" else found(n, *a))
        assert main(["check", "--preset", "tiny", "--only", "sweep,tiny_f32", "--out", str(out)]) == 0
    doc = json.loads((out / "summary.json").read_text())
    assert [r["case"] for r in doc["rows"]] == ["tiny_f32"]
    assert any("not run: Ray is not installed here" in n for n in doc["notes"]), doc["notes"]
    # A --sweep given runs though --only leaves "sweep" out.
    assert (
        main(["check", "--preset", "tiny", "--only", "tiny_f32", "--sweep", missing, "--out", str(second)])
        == 1
    )
    row, step = json.loads((second / "summary.json").read_text())["rows"]
    assert row["case"] == f"sweep {missing}" and row["error"] == f"no such experiment config: {missing}"
    assert step["case"] == "tiny_f32" and "error" not in step
