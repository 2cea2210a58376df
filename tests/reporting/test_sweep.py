"""jaxray.reporting.sweep: file formats of the sweep report, from hand-written rows (no training)."""

from __future__ import annotations

import json
import math

import pytest
from full_disk import fill, small_tmpfs

from jaxray.reporting.sweep import KEY_ORDER, markdown_table, write_reports

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FILES = ("summary.json", "summary.md", "throughput_vs_batch.png", "loss_curves.png")


def mlp_row(trial, batch, dtype="float32", width=256, acc=0.85, **extra):
    return {
        "trial": trial,
        "workload": "mlp",
        "global_batch": batch,
        "dtype": dtype,
        "width": width,
        "steps": 200,
        "devices": 1,
        "examples_per_sec": 123456.789,
        "ms_per_step": 2.3456,
        "compile_s": 1.234,
        "final_train_loss": 0.41234,
        "test_accuracy": acc,
        "checkpoint": f"/runs/exp/{trial}/checkpoint_000000",
        **extra,
    }


def transformer_row(trial, batch, val_loss=1.75, **extra):
    return {
        "trial": trial,
        "workload": "transformer",
        "global_batch": batch,
        "dtype": "bfloat16",
        "width": 128,
        "steps": 300,
        "devices": 1,
        "tokens_per_sec": 2345678.0,
        "ms_per_step": 11.5,
        "compile_s": 4.56,
        "final_train_loss": 1.6,
        "val_loss": val_loss,
        "val_perplexity": math.exp(val_loss),
        "checkpoint": None,
        **extra,
    }


def history(n=5, tokens=False):
    rows = [{"step": s, "examples": 64 * s, "loss": 2.0 / (s + 1)} for s in range(n)]
    for r in rows:
        if tokens:
            r |= {"tokens": 64 * 128 * r["step"], "perplexity": math.exp(r["loss"])}
    return rows


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5_000  # an actual figure, not an empty canvas


@pytest.fixture
def mixed(tmp_path):
    rows = [
        mlp_row("mlp_a", 256, width=512, per_device_batch=256, params=1000),
        mlp_row("mlp_b", 1024, acc=0.91),
        mlp_row("mlp_c", 256, acc=0.80),
        {
            "trial": "sb_fail",
            "workload": "shared_block_mlp",
            "global_batch": 512,
            "dtype": "float16",
            "width": 256,
            "error": "RuntimeError: out of memory | bad\ntraceback",
        },
        mlp_row("sb_ok", 512, dtype="bfloat16", acc=float("nan")) | {"workload": "shared_block_mlp"},
        transformer_row("tf_a", 32, val_loss=1.9, val_accuracy=0.4),
        transformer_row("tf_b", 64, val_loss=1.7),
    ]
    histories = {
        "mlp_a": history(),
        "mlp_b": history(),
        "tf_a": history(tokens=True),
        "tf_b": history(tokens=True),
        "sb_fail": [],
    }
    return rows, histories, write_reports(tmp_path / "out", rows, histories)


def test_all_files_written(mixed):
    _, _, paths = mixed
    assert set(paths) == set(FILES)
    for p in paths.values():
        assert p.is_file()
    assert_png(paths["throughput_vs_batch.png"])
    assert_png(paths["loss_curves.png"])


def test_summary_json_key_order_and_round_trip(mixed):
    rows, _, paths = mixed
    loaded = json.loads(paths["summary.json"].read_text())
    assert [r["trial"] for r in loaded] == [r["trial"] for r in rows]
    first = loaded[0]
    listed = [k for k in KEY_ORDER if k in first]
    assert list(first)[: len(listed)] == listed
    assert list(first)[len(listed) :] == ["per_device_batch", "params"]
    assert first["examples_per_sec"] == pytest.approx(123456.789)
    tf = loaded[5]
    assert list(tf)[-1] == "val_accuracy"
    assert list(tf).index("tokens_per_sec") < list(tf).index("val_loss") < list(tf).index("checkpoint")
    assert "  {" in paths["summary.json"].read_text()  # indent 2


def test_nan_and_inf_become_null(tmp_path):
    row = mlp_row("div", 128, acc=float("nan")) | {
        "final_train_loss": float("inf"),
        "extra": [float("-inf"), 1.0],
    }
    paths = write_reports(tmp_path, [row], {"div": history()})
    text = paths["summary.json"].read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text)[0]
    assert loaded["test_accuracy"] is None and loaded["final_train_loss"] is None
    assert loaded["extra"] == [None, 1.0]
    assert_png(paths["throughput_vs_batch.png"])


def test_failed_row_in_table(mixed):
    rows, _, paths = mixed
    table = markdown_table(rows)
    line = next(ln for ln in table.splitlines() if "sb_fail" in ln)
    assert "RuntimeError: out of memory" in line
    assert "traceback" not in line  # only the first line of the error
    assert line.count(" | ") == table.splitlines()[0].count(" | ")  # "|" in the error is escaped
    assert "error" in table.splitlines()[0]


def test_no_error_column_when_all_succeed():
    assert "error" not in markdown_table([mlp_row("a", 64)]).splitlines()[0]


def test_summary_md_units_rounding_and_best(mixed):
    _, _, paths = mixed
    md = paths["summary.md"].read_text()
    assert md.startswith("# ")
    assert "123,457 ex/s" in md and "2,345,678 tok/s" in md
    assert "| 2.35 |" in md and "| 1.2 |" in md and "| 0.4123 |" in md
    assert "mlp_a/checkpoint_000000" in md and "/runs/exp" not in md
    best = md.split("## Best per workload")[1]
    assert "**mlp**: `mlp_b`, test accuracy 0.9100" in best
    assert "**transformer**: `tf_b`, val loss 1.7000" in best
    assert "**shared_block_mlp**: no trial finished" in best


def test_single_trial_sweep(tmp_path):
    paths = write_reports(tmp_path, [transformer_row("only", 16)], {"only": history(tokens=True)})
    loaded = json.loads(paths["summary.json"].read_text())
    assert len(loaded) == 1 and loaded[0]["checkpoint"] is None
    assert "**transformer**: `only`" in paths["summary.md"].read_text()
    assert_png(paths["throughput_vs_batch.png"])
    assert_png(paths["loss_curves.png"])


def test_no_histories_and_all_failed(tmp_path):
    rows = [
        {"trial": "x", "workload": "mlp", "global_batch": 64, "dtype": "float32", "width": 8, "error": "boom"}
    ]
    paths = write_reports(tmp_path, rows, {})
    assert "boom" in paths["summary.md"].read_text()
    assert paths["throughput_vs_batch.png"].read_bytes()[:8] == PNG_SIGNATURE
    assert paths["loss_curves.png"].read_bytes()[:8] == PNG_SIGNATURE


def test_the_attention_and_why_are_in_the_summary(tmp_path):
    note = "auto: cuDNN attention needs an NVIDIA GPU, this device is cpu"
    rows = [transformer_row("tf", 16, attention="xla", attention_note=note), mlp_row("m", 64)]
    paths = write_reports(tmp_path, rows, {})
    first = json.loads(paths["summary.json"].read_text())[0]
    assert list(first)[5:7] == ["attention", "attention_note"] and first["attention_note"] == note
    table = paths["summary.md"].read_text().splitlines()
    header = [c.strip() for c in next(ln for ln in table if ln.startswith("| trial")).split("|")]
    tf = [c.strip() for c in next(ln for ln in table if ln.startswith("| tf ")).split("|")]
    mlp = [c.strip() for c in next(ln for ln in table if ln.startswith("| m ")).split("|")]
    column = header.index("attention")
    assert tf[column] == f"xla ({note})" and mlp[column] == ""


def test_a_full_disk_leaves_no_part_written_report(tmp_path):
    # A fresh user saw a 0-byte throughput_vs_batch.png left by a run whose disk filled at the end.
    rows = [mlp_row("mlp_a", 128), mlp_row("mlp_b", 256)]
    with small_tmpfs(tmp_path / "disk", 1) as disk:
        filler = fill(disk, leave=8 << 10)  # room for summary.json and summary.md, not for a figure
        with pytest.raises(OSError, match="No space left on device"):
            write_reports(disk / "out", rows, {"mlp_a": history(), "mlp_b": history()})
        left = sorted(p.name for p in (disk / "out").iterdir())
        assert left == ["summary.json", "summary.md"], left  # each whole; no partial file, no empty PNG
        assert len(json.loads((disk / "out" / "summary.json").read_text())) == 2
        filler.unlink()


def test_summary_md_shows_the_effect_of_each_swept_axis(mixed):
    """One row per value of each axis a workload swept (two or more values): the trials run at it,
    the best of them by the ranking metric, their median throughput; an unswept axis has no row."""
    _, _, paths = mixed
    effects = paths["summary.md"].read_text().split("## Effect of each axis")[1]
    assert "(mlp: test accuracy, shared_block_mlp: test accuracy, transformer: val loss)" in effects
    for line in (
        "| mlp | global batch | 256 | 2 | 0.8500 (mlp_a) | 123,457 ex/s |",
        "| mlp | global batch | 1024 | 1 | 0.9100 (mlp_b) | 123,457 ex/s |",
        "| mlp | width | 256 | 2 | 0.9100 (mlp_b) | 123,457 ex/s |",
        "| mlp | width | 512 | 1 | 0.8500 (mlp_a) | 123,457 ex/s |",
        "| shared_block_mlp | dtype | bfloat16 | 1 | none finite | 123,457 ex/s |",
        "| shared_block_mlp | dtype | float16 | 1 | none finite |  |",
        "| transformer | global batch | 32 | 1 | 1.9000 (tf_a) | 2,345,678 tok/s |",
    ):
        assert line in effects, (line, effects)
    assert "| mlp | dtype |" not in effects and "| transformer | width |" not in effects
    single = write_reports(paths["summary.md"].parent / "one", [mlp_row("a", 256)], {})
    assert "Effect of each axis" not in single["summary.md"].read_text()


def test_a_trial_stopped_early_is_counted_and_shown_as_such(tmp_path):
    stopped = {
        **{"trial": "tf_lr3", "workload": "transformer", "global_batch": 16, "learning_rate": 0.003},
        **{"stopped_at_step": 500, "stopped_metric": "val_loss", "stopped_value": 2.0586},
        **{
            "ms_per_step": 12.5,
            "compile_s": 3.25,
            "final_train_loss": 2.1,
            "checkpoint": "train/tf_lr3/ck_500",
        },
    }
    paths = write_reports(
        tmp_path, [transformer_row("tf_lr2", 16, val_loss=1.66, learning_rate=0.002), stopped], {}
    )
    md = paths["summary.md"].read_text()
    assert "2 trial(s), 0 failed, 1 stopped early by ASHA (tf_lr3 at step 500: val_loss 2.0586)." in md
    assert "| 500 (stopped early) |" in md and "**transformer**: `tf_lr2`, val loss 1.6600" in md
    [line] = [ln for ln in md.splitlines() if "| 500 (stopped early) |" in ln]
    assert all(f"| {c} |" in line for c in ("12.50", "3.2", "2.1000", "2.0586", "tf_lr3/ck_500")), line
    assert "| 2.0586 | 7.83 |" in line  # its perplexity, exp(2.0586) = 7.834, as evaluation gives it
    assert "| transformer | peak lr | 0.003 | 1 | stopped early (step 500) |  |" in md
