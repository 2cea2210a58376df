"""The reading commands on a run folder that was copied elsewhere, the original deleted: generate,
evaluate and export read the copy's own checkpoint; a damaged one is refused by each, naming the
file and both digests. Serve on a copied run folder:
tests/integration/test_serve_faults.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_copies import COPIED_TRIAL, damaged_copy

from jaxray import evaluate, export, generate

CHECKPOINT = Path("train", COPIED_TRIAL, "checkpoint_step_00000060_attempt1")


@pytest.fixture(scope="module")
def copied(copied_run_folder) -> Path:
    return copied_run_folder


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


@pytest.mark.slow  # every command once, on a copied folder (13 s); CI runs it
def test_every_reading_command_works_on_a_copied_run_folder(copied, tmp_path, capsys):
    for name, run in commands(copied, tmp_path).items():
        assert run() == 0, (name, capsys.readouterr().err)
        assert str(copied / CHECKPOINT) in capsys.readouterr().out or name == "generate"


def test_every_reading_command_refuses_a_damaged_checkpoint(copied, tmp_path, capsys):
    damaged, rel = damaged_copy(copied / CHECKPOINT, tmp_path)
    for name, run in commands(damaged, tmp_path).items():
        assert run() == 2, name
        err = capsys.readouterr().err
        assert rel in err and "does not match its checksum" in err and err.count("SHA-256") == 1, (name, err)
    assert not (tmp_path / "export").exists() and not (tmp_path / "eval" / "summary.json").exists()
