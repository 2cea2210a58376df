"""The Ray hooks of ``jaxray.train.run.train`` (``on_log``, ``save``, ``on_compile``): log rows and
checkpoints through ``ray.train.report``, and the compile report as a file."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray.train
from pyarrow.fs import FileType
from ray.train import Checkpoint

from jaxray import checkpoint
from jaxray.checkpoint import CheckpointSaveError
from jaxray.config import TrainConfig, TrialConfig
from jaxray.raytrain.faults import kill_in_save
from jaxray.raytrain.resume import checkpoint_name
from jaxray.reporting.format import json_safe

# save(step, state, history, row=None): checkpoint_saver's function.
SaveFn = Callable[..., None]


def log_reporter(train: TrainConfig) -> Callable[[dict[str, float]], None]:
    """``on_log``: ``ray.train.report(row)`` every ``train.report_interval`` steps but the last, with
    the latest held-out metrics (``val_*``, measured every ``train.eval_every`` steps) added: the
    metric an ASHA scheduler reads is then in every report after the first evaluation."""
    held: dict[str, float] = {}

    def report(row: dict[str, float]) -> None:
        held.update({k: v for k, v in row.items() if k.startswith("val_")})
        if row["step"] % train.report_interval == 0 and row["step"] != train.steps:
            ray.train.report({**row, **held})

    return report


def position(step: int, batches_per_epoch: int | None) -> dict[str, int]:
    """The data position after ``step`` batches: epoch and batch index within it (when known)."""
    if not batches_per_epoch:
        return {}
    return {"epoch": step // batches_per_epoch, "batch_in_epoch": step % batches_per_epoch}


def checkpoint_saver(trial: TrialConfig, rank: int, attempt: int, batches_per_epoch: int | None) -> SaveFn:
    """``save(step, state, history, row=None)``: rank 0 writes the state locally, every rank reports
    it to Ray Train, which copies it as ``checkpoint_name(step, attempt)``. Raises
    CheckpointSaveError naming the step, folder and OS error, having removed what it wrote."""

    def save(step: int, state, history: list[dict], row: dict | None = None) -> None:
        ckpt = None
        if rank == 0:
            where = position(step, batches_per_epoch)
            folder = save_locally(
                step,
                lambda local: checkpoint.save_state(
                    local,
                    state,
                    trial,
                    history,
                    where,
                    kill_in_save(step, attempt),
                    summary=row if row and row.get("final") else None,
                ),
            )
            ckpt = Checkpoint.from_directory(folder)
        if row is None:
            row = {**(history[-1] if history else {}), "step": step}
        name = checkpoint_name(step, attempt)
        with copying(step, name, ckpt):
            ray.train.report(
                row, checkpoint=ckpt, checkpoint_dir_name=name, delete_local_checkpoint_after_upload=True
            )

    return save


def save_locally(step: int, write: Callable[[Path], Path]) -> Path:
    """``write(folder)`` into a new local temp folder; its result. Raises CheckpointSaveError."""
    try:
        folder = Path(tempfile.mkdtemp(prefix="jaxray-ckpt-"))
    except OSError as err:
        raise CheckpointSaveError(
            f"could not save the checkpoint of step {step}: no local folder for it in "
            f"{tempfile.gettempdir()}: {err}"
        ) from err
    try:
        return write(folder)
    except BaseException as err:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(err, CheckpointSaveError):
            raise CheckpointSaveError(
                f"{err} (the partial folder is removed; earlier checkpoints are kept)"
            ) from err
        raise


def _storage_folder(name: str) -> tuple[Any, str, bool] | None:
    """(pyarrow filesystem, path, whether it is still absent) of checkpoint ``name`` in the run's
    storage; None where Ray Train's context does not give its storage (a DeveloperAPI)."""
    try:
        storage = ray.train.get_context().get_storage()
        fs, path = storage.storage_filesystem, storage.build_checkpoint_path_from_name(name)
        return fs, path, fs.get_file_info(path).type == FileType.NotFound
    except (AttributeError, NotImplementedError, RuntimeError, OSError):
        return None


@contextmanager
def copying(step: int, name: str, ckpt: Checkpoint | None) -> Iterator[None]:
    """Around the ``ray.train.report`` that copies ``ckpt`` to storage as ``name``: on failure removes
    the local folder and partial copy; an OSError becomes CheckpointSaveError."""
    if ckpt is None:
        yield
        return
    target = _storage_folder(name)
    try:
        yield
    except BaseException as err:
        shutil.rmtree(ckpt.path, ignore_errors=True)  # Ray Train removes it after a successful copy only
        if target is not None and target[2]:
            with contextlib.suppress(OSError):
                target[0].delete_dir(target[1])
        if not isinstance(err, OSError):
            raise
        where = target[1] if target else f"{name} of the run's storage"
        raise CheckpointSaveError(
            f"could not copy the checkpoint of step {step} into the run's storage {where}: "
            f"{err} (the partial copy is removed; earlier checkpoints are kept)"
        ) from err


def compile_writer(path: str | None) -> Callable[[dict], None] | None:
    """``on_compile``: the report as JSON at ``path``, or None; a failed write only warns."""
    if not path:
        return None

    def write(report: dict) -> None:
        file = Path(path)
        tmp = file.with_suffix(".json.tmp")
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(json_safe(report), indent=2))
            tmp.replace(file)
        except OSError as err:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            print(f"jaxray: warning: the compile report was not written to {file}: {err}", flush=True)

    return write
