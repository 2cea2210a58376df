"""The Ray hooks of ``jaxray.train.run.train`` (``on_log``, ``save``, ``on_compile``): log rows and
checkpoints through ``ray.train.report``, and the compile report as a file."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath

import jax
import ray.train
from pyarrow.fs import LocalFileSystem
from ray.train import Checkpoint, CheckpointUploadMode

from jaxray import checkpoint, storage
from jaxray.checkpoint import CheckpointSaveError, checkpoint_name
from jaxray.config import TrialConfig
from jaxray.raytrain.failures import ATTEMPT_KEY, PREEMPTION_KEY, SCORE_KEY, WORST_SCORE
from jaxray.raytrain.seams import BEFORE_MANIFEST
from jaxray.reporting.format import json_safe
from jaxray.train.loop import Hook


class Reports:
    """A worker's reports to Ray Train, log rows and checkpoints in one stream in step order: the
    ``jaxray.runner.Host`` of a Ray Train worker.

    ``log`` (``train``'s ``on_log``): a report every ``train.report_interval`` steps but the last,
    with the latest ``val_*`` metrics, so the metric ASHA reads is in every report after the first
    evaluation. ``save`` (``train``'s ``save``, every rank): each process writes its shards into
    ``storage_folder(checkpoint_name(step, attempt))`` in the background; it is committed with the
    next report (at once with a ``final`` ``row``). A failed save raises CheckpointSaveError naming
    the step, folder and cause, its partial folder removed (rank 0)."""

    def __init__(self, trial: TrialConfig, rank: int, attempt: int, batches_per_epoch: int | None) -> None:
        self.trial, self.rank, self.attempt, self.batches_per_epoch = trial, rank, attempt, batches_per_epoch
        self._held: dict[str, float] = {}
        self._pending: tuple[checkpoint.PendingSave, str] | None = None
        self._history: list[dict] = []  # the rows logged so far
        self._noticed = False  # a preemption notice was acted on

    def log(self, row: dict[str, float]) -> None:
        self._history.append(row)
        self._held.update({k: v for k, v in row.items() if k.startswith("val_")})
        train = self.trial.train
        if row["step"] % train.report_interval == 0 and row["step"] != train.steps:
            self._report({**row, **self._held})

    def save(self, step: int, state, history: list[dict], row: dict | None = None) -> None:
        if self._pending is not None:  # not reported since it started: now, with the latest row
            # but never one of the last step before the final report: ASHA stops a trial at max_t.
            rows = [r for r in history if r["step"] < self.trial.train.steps]
            self._report({**(rows[-1] if rows else {}), **self._held})
        name = checkpoint_name(step, self.attempt)
        folder = storage_folder(name)
        calls = BEFORE_MANIFEST if self.rank == 0 else []

        def before_manifest() -> None:
            check_shared(folder)
            for call in calls:
                call(step, self.attempt)

        per_epoch = self.batches_per_epoch  # the data position after ``step`` batches, when known
        position = {"epoch": step // per_epoch, "batch_in_epoch": step % per_epoch} if per_epoch else {}
        with removing(folder, self.rank):
            pending = checkpoint.start_save_state(
                folder,
                state,
                self.trial,
                history,
                position,
                before_manifest,
                summary=row if row and row.get("final") else None,
            )
        self._pending = (pending, name)
        if row and row.get("final"):
            self._report(row)

    def say(self, line: str) -> None:
        """A line of the trial's log, printed by rank 0."""
        if self.rank == 0:
            print(f"jaxray: {line}", flush=True)

    def finish(self, step: int, state, history: list[dict], row: dict) -> None:
        """The final checkpoint, reported at once with the final ``row``."""
        self.save(step, state, history, row=row)

    def _score(self, step: int) -> float:
        """``train.score``'s metric for the checkpoint of ``step``: its newest logged value at or before
        that step; a held-out metric (the whole split) only from that step itself, so that only the
        params it measured carry it; else (none, or not finite) the worst finite value for its order."""
        metric, order = self.trial.train.score
        held_out = metric.startswith("val_")
        rows = [r for r in reversed(self._history) if r["step"] <= step and metric in r]
        rows = [r for r in rows if r["step"] == step] if held_out else rows
        value = float(rows[0][metric]) if rows else math.nan
        return value if math.isfinite(value) else (WORST_SCORE if order == "min" else -WORST_SCORE)

    def preemption_hook(self) -> Hook:
        """Every ``train.log_every`` steps on every rank (``get_preemption_info`` is a collective): at
        the first preemption notice, this step's state is saved and reported at once, so the restart
        loses no steps."""
        train = self.trial.train

        def check(step: int, state, metrics) -> None:
            notice = ray.train.get_preemption_info()
            if notice is None or self._noticed or step == train.steps:  # the final save follows
                return
            self._noticed = True
            left = (notice.deadline_ms / 1e3 - time.time()) if notice.deadline_ms else float("nan")
            if self.rank == 0:
                print(
                    f"jaxray: preemption notice for node(s) {', '.join(notice.preempted_node_ids)} "
                    f"({left:.0f} s left): saving step {step} now",
                    flush=True,
                )
            if step % train.checkpoint_interval:  # else the checkpoint hook has just started it
                self.save(step, state, list(self._history))
            self._report({**self._history[-1], **self._held, PREEMPTION_KEY: step})

        return Hook(train.log_every, check)

    def abandon(self) -> None:
        """Let the save under way finish writing, then remove it unreported (a diverged run: the
        params it holds may already be broken)."""
        if self._pending is not None:
            pending, self._pending = self._pending[0], None
            with contextlib.suppress(CheckpointSaveError):
                pending.commit(manifest=False)
            if self.rank == 0:
                shutil.rmtree(pending.directory, ignore_errors=True)

    def _report(self, metrics: dict) -> None:
        """``ray.train.report(metrics)`` on every rank, with the save under way committed and attached."""
        ckpt, name, staging = None, None, False
        if self._pending is not None:
            (pending, name), self._pending = self._pending, None
            with removing(pending.directory, self.rank):
                folder = pending.commit()
            ckpt = Checkpoint(str(folder)) if self.rank == 0 else None
            metrics = {**metrics, SCORE_KEY: self._score(pending.step)}
            staging = staged()
        # Written in place: nothing to copy; staged on this node: uploaded (then deleted here) before
        # report returns.
        upload = CheckpointUploadMode.SYNC if staging else CheckpointUploadMode.NO_UPLOAD
        metrics = {**metrics, ATTEMPT_KEY: self.attempt}
        ray.train.report(
            metrics,
            checkpoint=ckpt,
            checkpoint_dir_name=name,
            checkpoint_upload_mode=upload,
            delete_local_checkpoint_after_upload=staging,
        )


def staged() -> bool:
    """Whether the run's storage is object storage: each checkpoint is then written on this node
    (``storage_folder``) and uploaded by Ray at its report."""
    return not isinstance(ray.train.get_context().get_storage().storage_filesystem, LocalFileSystem)


def storage_folder(name: str) -> Path:
    """The folder every worker writes checkpoint ``name`` into: its folder in the run's (local or
    mounted) storage, or with object storage one in this node's ``$JAXRAY_CACHE_DIR/staging``."""
    path = ray.train.get_context().get_storage().build_checkpoint_path_from_name(name)
    if not staged():
        return Path(path)
    trial = hashlib.sha256(str(PurePosixPath(path).parent).encode()).hexdigest()[:16]
    return storage.cache_dir("staging") / trial / name


def trial_folder() -> Path:
    """The folder this trial's checkpoints are written in (``storage_folder``'s parent)."""
    return storage_folder(checkpoint_name(0, 1)).parent


def discard_unfinished(attempt: int) -> list[str]:
    """``remove_unfinished`` in this trial's storage folder for the earlier attempts (rank 0, at the
    start of an attempt); with object storage, every checkpoint they left staged on this node."""
    if not staged():
        return checkpoint.remove_unfinished(trial_folder(), but_attempt=attempt)
    left = checkpoint.checkpoints(trial_folder(), complete=None)
    for folder in left:
        shutil.rmtree(folder, ignore_errors=True)
    return [folder.name for folder in left]


def check_shared(folder: Path) -> None:
    """Before a checkpoint's manifest: raises CheckpointSaveError unless process 0 sees every
    process's shards (``ocdbt.process_<i>``), i.e. ``folder`` is one that all workers share."""
    if jax.process_index() != 0 or jax.process_count() == 1:
        return
    for item in (checkpoint.PARAMS_DIR, checkpoint.OPT_STATE_DIR):
        seen = len(list((folder / item).glob("ocdbt.process_*")))
        if seen != jax.process_count():
            need = (
                "with object storage (storage:), a trial's workers must all run on one node"
                if staged()
                else "the run's storage must be one folder every worker node mounts"
            )
            raise CheckpointSaveError(
                f"process 0 sees the shards of {seen} of the {jax.process_count()} processes in "
                f"{folder / item}: {need}"
            )


@contextmanager
def removing(folder: Path, rank: int) -> Iterator[None]:
    """On a CheckpointSaveError inside, rank 0 removes ``folder`` (the partial save); the error says so."""
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
        try:  # a local path: written whole
            storage.write_text(path, json.dumps(json_safe(report), indent=2))
        except OSError as err:
            print(f"jaxray: warning: the compile report was not written to {path}: {err}", flush=True)

    return write
