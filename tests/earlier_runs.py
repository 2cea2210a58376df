"""A finished run's results in a run folder, for the tests of ``--overwrite``: the smoke
experiment's experiment.yaml (as a real run writes it), a summary.json, a checkpoint file and a
file of the user's, and what every file held, to compare byte for byte once the overwrite ended."""

from __future__ import annotations

from pathlib import Path

from jaxray.config.experiment import load_experiment
from jaxray.tune import save_experiment

ROOT = Path(__file__).resolve().parents[1]


def earlier_run(out: Path) -> dict[str, bytes]:
    """Write the earlier run into ``out``; {path relative to ``out``: bytes} of its files."""
    save_experiment(out, load_experiment(ROOT / "tune_configs/smoke.yaml"))
    (out / "summary.json").write_text('{"rows": []}')
    (out / "train" / "trial_0").mkdir(parents=True)
    (out / "train" / "trial_0" / "weights").write_bytes(b"earlier")
    (out / "notes.txt").write_text("the user's own file")  # not a run's: --overwrite never moves it
    return files(out)


def files(out: Path) -> dict[str, bytes]:
    """{path relative to ``out``: bytes} of every file under ``out``."""
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def results(out: Path) -> dict[str, bytes]:
    """``files(out)`` less the runs' logs (``logs/tune-<time>.log``: each run started there adds
    one, beside the results, whatever becomes of them)."""
    return {k: v for k, v in files(out).items() if not k.startswith("logs/")}
