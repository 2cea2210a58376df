"""What a Ray Train worker hands back: log rows and full-state checkpoints through
``ray.train.report`` (Ray Train passes them on to Tune), and the step's compile report as a file.

These are the hooks of ``jaxray.train.run.train`` (``on_log``, ``save``, ``on_compile``); the loop
itself knows nothing of Ray. A checkpoint save that cannot finish (a full disk, locally or in the
run's storage) fails the worker with a CheckpointSaveError in words, having removed what it wrote.
"""

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
    ``faults.die``'s pause existed).

    A save that cannot finish (a full disk) raises CheckpointSaveError naming the step, the folder
    (the local one, or the checkpoint's folder in the run's storage) and the OS error; what it had
    written is removed, every earlier checkpoint is left as it was, and the worker's failure ends the
    trial (or Ray Train's ``workers.max_failures`` restarts, which resume from the newest one)."""

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
    """``write(folder)`` (a ``checkpoint.save_state``) into a new local temp folder; its result. When
    it fails, the folder is removed and CheckpointSaveError names it, the step and the cause."""
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
    """Around the ``ray.train.report`` that copies ``ckpt`` (rank 0's local checkpoint, else None)
    into the run's storage as ``name``. When the copy fails: the local folder and the partial copy
    (a folder this copy made: never one Ray Train registered) are removed, and an OSError becomes
    CheckpointSaveError naming the step, the storage folder and the OS error."""
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
    """``on_compile`` for ``train``: the report as JSON at ``path`` (temp file, then rename), or None.
    A report that cannot be written (a full disk) is a printed warning, not a failed trial."""
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
