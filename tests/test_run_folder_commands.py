"""The reading commands on a run folder that was copied elsewhere, the original deleted: generate,
evaluate and export read the copy's own checkpoint; a damaged one is refused by each, naming the
file and both digests (issue 15, points 2 and 3). Serve loads through the same
``jaxray.inference.load.load_engine`` (tests/inference/test_load.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jaxray import evaluate, export, generate
from jaxray.reporting.sweep import write_reports

TRIAL = "transformer_b16_float32_w64"
CHECKPOINT = Path("train", TRIAL, "checkpoint_step_00000060_attempt1")


@pytest.fixture(scope="module")
def copied(trained_transformer, tmp_path_factory) -> Path:
    """A run folder holding the trained transformer as its one trial's checkpoint (summary.json by
    the sweep's writer, from the absolute path Tune reports), copied elsewhere, the original gone."""
    root = tmp_path_factory.mktemp("cluster") / "runs" / "demo"
    ck = shutil.copytree(trained_transformer, root / CHECKPOINT)
    write_reports(
        root, [{"trial": TRIAL, "workload": "transformer", "val_loss": 2.0, "checkpoint": str(ck)}], {}
    )
    copy = Path(shutil.copytree(root, tmp_path_factory.mktemp("laptop") / "demo"))
    shutil.rmtree(root)
    return copy


def commands(folder: Path, out: Path) -> dict:
    return {
        "generate": lambda: generate.main(["--checkpoint", str(folder), "--max-new-tokens", "8"]),
        "evaluate": lambda: evaluate.main(
            ["--checkpoint", str(folder), "--out", str(out / "eval"), "--max-new-tokens", "8"]
        ),
        "export": lambda: export.main(
            [
                "--checkpoint",
                str(folder),
                "--out",
                str(out / "export"),
                "--buckets",
                "8",
                "--batch-sizes",
                "1",
            ]
        ),
    }


def test_every_reading_command_works_on_a_copied_run_folder(copied, tmp_path, capsys):
    for name, run in commands(copied, tmp_path).items():
        assert run() == 0, (name, capsys.readouterr().err)
        assert str(copied / CHECKPOINT) in capsys.readouterr().out or name == "generate"


def test_every_reading_command_refuses_a_damaged_checkpoint(copied, tmp_path, capsys):
    damaged = Path(shutil.copytree(copied / CHECKPOINT, tmp_path / "damaged"))
    victim = max((f for f in (damaged / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    rel = victim.relative_to(damaged).as_posix()
    for name, run in commands(damaged, tmp_path).items():
        assert run() == 2, name
        err = capsys.readouterr().err
        assert rel in err and "does not match its checksum" in err and err.count("SHA-256") == 1, (name, err)
    assert not (tmp_path / "export").exists() and not (tmp_path / "eval" / "summary.json").exists()
