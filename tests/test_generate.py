"""``python -m jaxray.generate``: both samplers print the same greedy text from a checkpoint trained
on the real TinyShakespeare bytes, and bad options are refused by name before anything is restored."""

from __future__ import annotations

import subprocess
import sys

import jax
import pytest
from saved import save_params

from jaxray.config import parse_trial
from jaxray.generate import main
from jaxray.inference.artifact_loader import ARTIFACT_MANIFEST
from jaxray.models import build


def generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxray.generate", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # two CLI runs that each restore and compile (25 s); CI runs it
def test_cli_samplers_agree(trained_transformer):
    greedy = ["--checkpoint", str(trained_transformer), "--prompt", "ROMEO:", "--max-new-tokens", "40"]
    kv, full = (
        generate(*greedy, "--temperature", "0"),
        generate(*greedy, "--temperature", "0", "--sampler", "full"),
    )
    assert kv.returncode == 0 and full.returncode == 0, (kv.stderr[-2000:], full.stderr[-2000:])
    assert kv.stdout == full.stdout and kv.stdout.startswith("ROMEO:")


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--sampler", "full", "--context-keep", "8"], "--context-keep applies to --sampler kv only"),
        (["--prompt", ""], "prompt is empty"),
        (["--max-new-tokens", "0"], "max_new_tokens must be in 1..10000"),
        (["--top-k", "0"], "top_k must be in 1..256"),
    ],
)
def test_bad_options_are_refused_by_name(trained_transformer, extra, match, capsys):
    assert main(["--checkpoint", str(trained_transformer), *extra]) == 2
    assert match in capsys.readouterr().err


def test_only_a_transformer_checkpoint_is_sampled(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "nowhere")]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err
    mlp = parse_trial({"model": {"workload": "mlp", "width": 32}, "data": {"seq_len": 32}})
    save_params(tmp_path / "mlp", build(mlp.model).init(jax.random.key(0)), mlp)
    assert main(["--checkpoint", str(tmp_path / "mlp")]) == 2
    assert "holds a mlp checkpoint, not a transformer one: it cannot be sampled" in capsys.readouterr().err


def test_an_export_artifact_is_pointed_to_serve(tmp_path, capsys):
    """An export folder (its manifest) is not sampled here: the message names serve, which reads it."""
    (tmp_path / ARTIFACT_MANIFEST).write_text("{}")
    assert main(["--checkpoint", str(tmp_path)]) == 2
    assert (
        f"is an export artifact: python -m jaxray.serve --checkpoint {tmp_path} serves it"
        in capsys.readouterr().err
    )
