"""The Ray hooks of ``jaxray.train.run.train`` (``on_log``, ``save``, ``on_compile``): log rows and
checkpoints through ``ray.train.report``, and the compile report as a file."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import ray.train
from pyarrow.fs import LocalFileSystem
from ray.train import Checkpoint, CheckpointUploadMode

from jaxray import checkpoint
from jaxray.checkpoint import CheckpointSaveError
from jaxray.config import TrainConfig, TrialConfig
from jaxray.raytrain.faults import kill_in_save
from jaxray.raytrain.resume import checkpoint_name
from jaxray.reporting.format import json_safe


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


class CheckpointSaver:
    """``save(step, state, history, row=None)`` on every rank: each process writes its shards of the
    state straight into the run's storage as ``checkpoint_name(step, attempt)``, in the background;
    the save is committed (``train_state.json``) and reported to Ray Train at the next save, at
    ``flush()``, or at once for the final one (``row`` with ``final``). A failed save raises
    CheckpointSaveError naming the step, folder and cause, its partial folder removed (rank 0)."""

    def __init__(self, trial: TrialConfig, rank: int, attempt: int, batches_per_epoch: int | None) -> None:
        self.trial, self.rank, self.attempt, self.batches_per_epoch = trial, rank, attempt, batches_per_epoch
        self._pending: tuple[checkpoint.PendingSave, dict, str] | None = None

    def __call__(self, step: int, state, history: list[dict], row: dict | None = None) -> None:
        self.flush()
        name = checkpoint_name(step, self.attempt)
        folder = storage_folder(name)
        with removing(folder, self.rank):
            pending = checkpoint.start_save_state(
                folder,
                state,
                self.trial,
                history,
                position(step, self.batches_per_epoch),
                kill_in_save(step, self.attempt),
                summary=row if row and row.get("final") else None,
            )
        self._pending = (pending, row or {**(history[-1] if history else {}), "step": step}, name)
        if row and row.get("final"):
            self.flush()

    def flush(self) -> None:
        """Commit the save under way, if any, and report it (every rank calls this equally often)."""
        if self._pending is None:
            return
        pending, row, name = self._pending
        self._pending = None
        with removing(pending.directory, self.rank):
            folder = pending.commit()
        ckpt = Checkpoint(str(folder)) if self.rank == 0 else None
        upload = CheckpointUploadMode.NO_UPLOAD  # written in place: nothing to copy
        ray.train.report(row, checkpoint=ckpt, checkpoint_dir_name=name, checkpoint_upload_mode=upload)


def storage_folder(name: str) -> Path:
    """Checkpoint ``name``'s folder in the run's storage (Ray Train's StorageContext), which every
    worker writes into: a local or mounted shared filesystem. Raises CheckpointSaveError when the
    storage is not on one."""
    storage = ray.train.get_context().get_storage()
    if not isinstance(storage.storage_filesystem, LocalFileSystem):
        raise CheckpointSaveError(
            f"checkpoints are written by every worker into the run's storage, which must be a local "
            f"or mounted shared folder; {storage.storage_filesystem.type_name} storage is not supported"
        )
    return Path(storage.build_checkpoint_path_from_name(name))


def discard_unfinished(attempt: int) -> list[str]:
    """Remove the trial's checkpoint folders that an earlier attempt began and never committed (no
    ``train_state.json``: its workers died while writing them, and no process is left to finish
    them); their names. Rank 0 calls it at the start of an attempt."""
    ours = checkpoint_name(0, attempt)
    gone = []
    for folder in sorted(storage_folder(ours).parent.glob(f"{checkpoint.CHECKPOINT_PREFIX}*")):
        earlier = folder.name.rsplit("_", 1)[-1] != ours.rsplit("_", 1)[-1]  # "attempt<n>"
        if earlier and folder.is_dir() and not (folder / checkpoint.TRAIN_STATE).exists():
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder.name)
    return gone


@contextmanager
def removing(folder: Path, rank: int) -> Iterator[None]:
    """On a CheckpointSaveError inside, rank 0 removes ``folder`` (the partial save) and the error
    says so."""
    try:
        yield
    except CheckpointSaveError as err:
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        raise CheckpointSaveError(
            f"{err} (the partial folder is removed; earlier checkpoints are kept)"
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
