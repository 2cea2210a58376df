"""Which checkpoint a (restarted) worker group continues from, and how its checkpoints are named.

Rank 0 walks back from Ray Train's newest checkpoint to the newest undamaged one
(``checkpoint.verify``) and broadcasts its choice, so every rank restores the same one."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import NamedTuple

import ray.train
from ray.train.collective import broadcast_from_rank_zero

from jaxray import checkpoint
from jaxray.raytrain.faults import damage, damages_latest


class ResumePoint(NamedTuple):
    """Where a worker group starts: ``checkpoint`` (None: step 0), newer ones ``skipped`` as damaged,
    and rank 0's ``attempt`` number (1 for the first start)."""

    checkpoint: Path | None
    skipped: list[str]
    attempt: int


def checkpoint_name(step: int, attempt: int) -> str:
    """Folder name of the checkpoint at ``step`` saved by ``attempt``; sorts by step, then attempt.
    The attempt keeps names unique across restarts (Ray Train's rotation must never see one twice)."""
    return f"checkpoint_step_{step:08d}_attempt{attempt}"


def count_attempt(path: str | None) -> int:
    """This worker group's attempt number, counted in the JSON file ``path`` (1 without one).
    Raises OSError in words when the count cannot be read or written."""
    if not path:
        return 1
    file = Path(path)
    tmp = file.with_name(file.name + ".tmp")
    try:
        attempt = (json.loads(file.read_text())["attempts"] if file.is_file() else 0) + 1
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"attempts": attempt}))
        tmp.replace(file)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OSError(
            f"cannot count this worker group's attempt in {file} ({err}), so its checkpoints could "
            f"not be named apart from an earlier attempt's; free space there, then resume the run"
        ) from None
    return attempt


def choose(candidates: list[Path]) -> tuple[Path | None, list[str]]:
    """(the first undamaged of ``candidates``, the names of those before it); (None, every name) if none."""
    try:
        _, path = checkpoint.restore_latest(candidates, lambda c: checkpoint.verify(c, full_state=True))
    except checkpoint.CheckpointError as err:
        checkpoint.log.warning("%s; starting again from step 0", err)
        return None, [c.name for c in candidates]
    return path, [c.name for c in candidates[: candidates.index(path)]]


def resume_point(rank: int, attempt: int) -> ResumePoint:
    """The checkpoint this worker group continues from (None on a fresh start), decided by rank 0
    and broadcast with its ``attempt``."""
    chosen, skipped = None, []
    latest = ray.train.get_checkpoint()
    if rank == 0 and latest is not None:
        newest = Path(latest.path)
        if damages_latest(attempt):
            print(f"jaxray fault injection: damaged {damage(newest)}", flush=True)
        path, skipped = choose(checkpoint.trial_checkpoints(newest))
        chosen = str(path) if path else None
    if ray.train.get_context().get_world_size() > 1:
        chosen, skipped, attempt = broadcast_from_rank_zero((chosen, skipped, attempt))
    return ResumePoint(Path(chosen) if chosen else None, skipped, attempt)
