"""python -m jaxray.evaluate on real checkpoints trained here for a few steps: every test image is
counted once, the confusion matrix agrees with the accuracy, the language-model units agree, and
bad input is a one-line error with exit code 2."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from saved import save_params

from jaxray.config import ModelConfig, parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.fashion_mnist import CLASS_NAMES
from jaxray.data.shakespeare import load_shakespeare
from jaxray.data.workloads import load_arrays
from jaxray.evaluate import confusion_matrix, default_out, jit_predict_step, main, predict, run
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh
from jaxray.train.run import train


def _train_and_save(directory: Path, trial_dict: dict, held_out_rows=None):
    """Train ``trial_dict`` briefly on real data, save its params to ``directory``; the TrainResult.
    ``held_out_rows`` trims the held-out set train() evaluates on (only to save time)."""
    trial = parse_trial(trial_dict)
    train_arrays, held_out = load_arrays(trial)
    if held_out_rows:
        held_out = {k: v[:held_out_rows] for k, v in held_out.items()}
    result = train(
        trial, train_batches(train_arrays, trial.train.global_batch, trial.train.seed), held_out, make_mesh()
    )
    save_params(directory, result.state.params, trial)
    return result


@pytest.fixture(scope="module")
def mlp_checkpoint(real_dir, tmp_path_factory):
    """(checkpoint dir, TrainResult): 100 steps of the MLP at global batch 256; the result's
    test_accuracy comes from jaxray.train.held_out.evaluate over all 10,000 test images."""
    directory = tmp_path_factory.mktemp("mlp") / "mlp_ck"
    result = _train_and_save(
        directory,
        {
            "model": {"workload": "mlp", "width": 128},
            "data": {"data_dir": str(real_dir)},
            "train": {"steps": 100, "global_batch": 256, "log_every": 50},
        },
    )
    return directory, result


@pytest.fixture(scope="module")
def transformer_checkpoint(real_dir, tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm") / "checkpoint_2026-01-01_00-00-00"
    _train_and_save(
        directory,
        {
            "model": {
                "workload": "transformer",
                "width": 32,
                "num_layers": 1,
                "num_heads": 2,
                "max_seq_len": 32,
            },
            "data": {"data_dir": str(real_dir), "seq_len": 32},
            "train": {"steps": 20, "global_batch": 16, "log_every": 10, "eval_batch": 512},
        },
        held_out_rows=16,
    )
    return directory


def test_mlp_confusion_matrix_counts_every_test_image(mlp_checkpoint, tmp_path):
    directory, trained = mlp_checkpoint
    summary = run(directory, out=tmp_path / "eval")
    matrix = np.asarray(summary["confusion_matrix"])
    assert matrix.shape == (10, 10) and matrix.dtype == np.int64
    assert matrix.sum() == summary["count"] == 10_000 and summary["dropped"] == 0
    # Exact: both are integer counts over 10,000; the second is evaluate() on the params before saving.
    assert np.trace(matrix) / 10_000 == summary["accuracy"] == trained.summary["test_accuracy"]
    for key in ("confusion_matrix_png", "predictions_grid_png"):
        assert Path(summary[key]).stat().st_size > 0
    saved = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert saved["confusion_matrix"] == matrix.tolist() and saved["class_names"] == list(CLASS_NAMES)
    assert saved["accuracy"] == summary["accuracy"] and saved["dropped"] == 0


def test_cli_prints_the_count_and_writes_files(mlp_checkpoint, tmp_path, capsys):
    directory, trained = mlp_checkpoint
    assert main(["--checkpoint", str(directory), "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "10000 evaluated of 10000 (none dropped)" in printed
    assert f"{trained.summary['test_accuracy']:.4f}" in printed
    assert {"summary.json", "confusion_matrix.png", "predictions_grid.png"} <= {
        p.name for p in tmp_path.iterdir()
    }


def test_transformer_units_agree(transformer_checkpoint, real_dir, tmp_path):
    summary = run(transformer_checkpoint, out=tmp_path)
    assert summary["bits_per_byte"] == pytest.approx(summary["loss"] / math.log(2), rel=1e-12)
    assert summary["perplexity"] == pytest.approx(math.exp(summary["loss"]), rel=1e-12)
    assert summary["count"] == len(load_shakespeare(seq_len=32, data_dir=real_dir).validation)
    assert isinstance(summary["sample"], str) and summary["sample"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["sample"] == summary["sample"] and saved["count"] == summary["count"]


def test_default_out_names_the_trial_for_a_ray_checkpoint(transformer_checkpoint, tmp_path):
    trial = transformer_checkpoint.parent.name  # one folder per checkpoint, under its trial's name
    assert default_out(transformer_checkpoint) == Path("runs/eval") / trial / transformer_checkpoint.name
    assert default_out(tmp_path / "mlp_ck") == Path("runs/eval/mlp_ck")


def test_predict_keeps_row_order_and_drops_only_padding():
    model = build(ModelConfig(workload="mlp", width=8))
    params = model.init(jax.random.key(0))
    arrays = {
        "image": np.random.default_rng(0).random((7, 784), dtype=np.float32),
        "label": np.zeros(7, np.int32),
    }
    mesh = make_mesh(jax.devices()[:1])
    got = predict(jit_predict_step(model, mesh), params, arrays, 4, mesh)  # batches of 4: one padded row
    np.testing.assert_array_equal(got, np.argmax(model.apply(params, arrays["image"]), -1))


def test_confusion_matrix_rows_are_true_classes():
    matrix = confusion_matrix(np.array([0, 0, 1, 2]), np.array([0, 1, 1, 1]), num_classes=3)
    assert matrix.tolist() == [[1, 1, 0], [0, 1, 0], [0, 1, 0]]
    with pytest.raises(ValueError, match="3 labels but 2 predictions"):
        confusion_matrix(np.array([0, 1, 2]), np.array([0, 1]), num_classes=3)


@pytest.mark.parametrize(
    "extra,message",
    [
        ([], "not_a_checkpoint does not exist"),
        (["--max-new-tokens", "0"], "max_new_tokens must be in 1..10000"),
        (["--prompt", ""], "prompt is empty"),
        (
            ["--data-dir", "/nonexistent/jaxray-data"],
            "--data-dir /nonexistent/jaxray-data is not a directory",
        ),
    ],
)
def test_bad_input_is_one_error_line(tmp_path, capsys, extra, message):
    missing = tmp_path / "not_a_checkpoint"
    assert main(["--checkpoint", str(missing), *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err
    if not extra:
        assert str(missing) in err


def test_workload_mismatch_is_an_error(mlp_checkpoint, capsys):
    assert main(["--checkpoint", str(mlp_checkpoint[0]), "--workload", "transformer"]) == 2
    assert "holds a mlp checkpoint, not a transformer one" in capsys.readouterr().err


def test_out_never_replaces_a_sweeps_summary(mlp_checkpoint, tmp_path, capsys):
    sweep_summary = tmp_path / "summary.json"
    sweep_summary.write_text('[{"trial": "mlp_b256"}]')
    assert main(["--checkpoint", str(mlp_checkpoint[0]), "--out", str(tmp_path)]) == 2
    assert "was not written by jaxray.evaluate" in capsys.readouterr().err
    assert sweep_summary.read_text() == '[{"trial": "mlp_b256"}]'
    assert not (tmp_path / "confusion_matrix.png").exists()
