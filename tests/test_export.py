"""``python -m jaxray.export``: it writes an artifact and says what it wrote, and refuses bad
checkpoints, options and output folders by name without writing anything.

The artifact itself (its manifest, logits and tokens against the live model) is tested in
tests/inference/test_artifact.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from saved import save_params

from jaxray import export as export_cli
from jaxray.config import parse_trial
from jaxray.inference.artifact_loader import ARTIFACT_MANIFEST
from jaxray.models import build

ROOT = Path(__file__).resolve().parents[1]
OPTIONS = ["--buckets", "8", "--batch-sizes", "1", "--chunk", "8"]


def export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxray.export", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
    )


def test_the_cli_writes_the_artifact_and_says_so(trained_transformer, tmp_path):
    out = tmp_path / "artifact"
    proc = export("--checkpoint", str(trained_transformer), "--out", str(out), *OPTIONS)
    assert proc.returncode == 0, proc.stderr
    assert (
        "exported 4 programs of" in proc.stdout and "buckets [8, 64], batch sizes [1], chunk 8" in proc.stdout
    )
    assert "attention: xla" in proc.stdout and "not portable" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["functions"]) == ["decode_n1", "logits", "start_b64_n1", "start_b8_n1"]


def test_bad_checkpoints_are_refused_before_writing(trained_transformer, tmp_path, capsys):
    out = tmp_path / "out"
    assert export_cli.main(["--checkpoint", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err
    mlp = parse_trial({"model": {"workload": "mlp", "width": 32}, "data": {"seq_len": 32}})
    save_params(tmp_path / "mlp", build(mlp.model).init(jax.random.key(0)), mlp)
    assert export_cli.main(["--checkpoint", str(tmp_path / "mlp"), "--out", str(out)]) == 2
    assert "holds a mlp checkpoint, not a transformer one: it cannot be exported" in capsys.readouterr().err
    keep = ["--context-keep", "64"]
    assert export_cli.main(["--checkpoint", str(trained_transformer), "--out", str(out), *keep]) == 2
    assert "context_keep must be in 2..63" in capsys.readouterr().err
    artifact = tmp_path / "artifact"  # an export given to export: said so, as generate says it
    artifact.mkdir()
    (artifact / ARTIFACT_MANIFEST).write_text("{}")
    assert export_cli.main(["--checkpoint", str(artifact), "--out", str(out)]) == 2
    assert (
        f"is an export artifact: python -m jaxray.serve --checkpoint {artifact} serves"
        in capsys.readouterr().err
    )
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["artifact", "mlp"]


def test_a_non_empty_out_is_never_overwritten(trained_transformer, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = export("--checkpoint", str(trained_transformer), "--out", str(out))
    assert proc.returncode == 2 and f"--out {out} exists and is not an empty directory" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"


def test_bad_option_values_name_the_option(trained_transformer, tmp_path, capsys):
    base = ["--checkpoint", str(trained_transformer), "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        export_cli.main([*base, "--buckets", "8,x"])
    assert exit_info.value.code == 2 and "--buckets" in capsys.readouterr().err
    assert export_cli.main([*base, "--chunk", "10000000"]) == 2
    assert "--chunk:" in capsys.readouterr().err and not (tmp_path / "o").exists()
