"""What a Ray Train worker hands back: log rows and full-state checkpoints through
``ray.train.report`` (Ray Train passes them on to Tune), and the step's compile report as a file.

These are the hooks of ``jaxray.train.run.train`` (``on_log``, ``save``, ``on_compile``); the loop
itself knows nothing of Ray.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import ray.train
from ray.train import Checkpoint

from jaxray import checkpoint
from jaxray.config import TrainConfig, TrialConfig
from jaxray.raytrain.faults import kill_in_save
from jaxray.raytrain.resume import checkpoint_name
from jaxray.reporting.format import json_safe

# save(step, state, history, row=None): checkpoint_saver's function.
SaveFn = Callable[..., None]


def log_reporter(train: TrainConfig) -> Callable[[dict[str, float]], None]:
    """``on_log`` for ``train``: ``ray.train.report(row)`` every ``train.report_interval`` steps,
    except the last step's row, which goes out with the final checkpoint and the summary."""

    def report(row: dict[str, float]) -> None:
        if row["step"] % train.report_interval == 0 and row["step"] != train.steps:
            ray.train.report(row)

    return report


def position(step: int, batches_per_epoch: int | None) -> dict[str, int]:
    """The data position after ``step`` batches: epoch and batch index within it (when known)."""
    if not batches_per_epoch:
        return {}
    return {"epoch": step // batches_per_epoch, "batch_in_epoch": step % batches_per_epoch}


def checkpoint_saver(trial: TrialConfig, rank: int, attempt: int, batches_per_epoch: int | None) -> SaveFn:
    """``save(step, state, history, row=None)`` for ``train`` and for the final checkpoint: rank 0
    writes the full state with Orbax into a local folder and every rank reports it to Ray Train (a
    barrier) with ``row`` (default: the last log row), which copies it to the run's storage as
    ``checkpoint_name(step, attempt)`` and keeps ``train.keep_checkpoints`` of them. The copy is
    synchronous (``ASYNC`` upload was tried once and lost a checkpoint on a kill, before
    ``faults.die``'s pause existed)."""

    def save(step: int, state, history: list[dict], row: dict | None = None) -> None:
        ckpt = None
        if rank == 0:
            folder = checkpoint.save_state(
                tempfile.mkdtemp(prefix="jaxray-ckpt-"),
                state,
                trial,
                history,
                position(step, batches_per_epoch),
                kill_in_save(trial, step, attempt),
            )
            ckpt = Checkpoint.from_directory(folder)
        if row is None:
            row = {**(history[-1] if history else {}), "step": step}
        ray.train.report(
            row,
            checkpoint=ckpt,
            checkpoint_dir_name=checkpoint_name(step, attempt),
            delete_local_checkpoint_after_upload=True,
        )

    return save


def compile_writer(path: str | None) -> Callable[[dict], None] | None:
    """``on_compile`` for ``train``: the report as JSON at ``path`` (temp file, then rename), or None."""
    if not path:
        return None

    def write(report: dict) -> None:
        file = Path(path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(json_safe(report), indent=2))
        tmp.replace(file)

    return write
