"""Which checkpoint a (restarted) worker group continues from, and how its checkpoints are named.

Rank 0 walks back from the newest complete checkpoint (Ray Train's newest reported one, or a newer
one in the trial's storage that Ray's record lost with a node) to the newest undamaged one
(``checkpoint.verify``) and broadcasts its choice, so every rank restores the same one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import ray.train
from ray.train.collective import broadcast_from_rank_zero

from jaxray import checkpoint
from jaxray.raytrain.faults import damage, damages_latest
from jaxray.runs import written_whole


class ResumePoint(NamedTuple):
    """Where a worker group starts: ``checkpoint`` (None: step 0), newer ones ``skipped`` as damaged,
    rank 0's ``attempt`` number (1 for the first start) and the ``workers`` of each attempt so far."""

    checkpoint: Path | None
    skipped: list[str]
    attempt: int
    workers: list[int]


def checkpoint_name(step: int, attempt: int) -> str:
    """Folder name of the checkpoint at ``step`` saved by ``attempt``; sorts by step, then attempt.
    The attempt keeps names unique across restarts (Ray Train's rotation must never see one twice)."""
    return f"checkpoint_step_{step:08d}_attempt{attempt}"


def count_attempt(path: str | None, workers: int = 1) -> tuple[int, list[int]]:
    """(this worker group's attempt number, the workers of every attempt so far, this one's last),
    counted in the JSON file ``path`` ((1, [workers]) without one). Raises OSError in words when
    the count cannot be read or written."""
    if not path:
        return 1, [workers]
    file = Path(path)
    try:
        doc = json.loads(file.read_text()) if file.is_file() else {"attempts": 0}
        attempt, sizes = doc["attempts"] + 1, [*doc.get("workers", []), workers]
        file.parent.mkdir(parents=True, exist_ok=True)
        with written_whole(file) as tmp:
            tmp.write_text(json.dumps({"attempts": attempt, "workers": sizes}))
    except OSError as err:
        raise OSError(
            f"cannot count this worker group's attempt in {file} ({err}), so its checkpoints could "
            f"not be named apart from an earlier attempt's; free space there, then resume the run"
        ) from None
    return attempt, sizes


def choose(candidates: list[Path]) -> tuple[Path | None, list[str]]:
    """(the first undamaged of ``candidates``, the names of those before it); (None, every name) if none."""
    try:
        _, path = checkpoint.restore_latest(candidates, lambda c: checkpoint.verify(c, full_state=True))
    except checkpoint.CheckpointError as err:
        checkpoint.log.warning("%s; starting again from step 0", err)
        return None, [c.name for c in candidates]
    return path, [c.name for c in candidates[: candidates.index(path)]]


def candidates(trial_dir: Path, reported: Path | None) -> list[Path]:
    """The checkpoints to resume from, newest first (by name: step, then attempt): Ray Train's newest
    reported one and every complete one (``train_state.json`` written) in ``trial_dir``, the trial's
    storage folder. After an ungraceful node loss Ray's record can lack the newest (FACTS: a report
    the controller had not collected yet); the storage still has it."""
    found = {
        c
        for c in trial_dir.glob(f"{checkpoint.CHECKPOINT_PREFIX}*")
        if (c / checkpoint.TRAIN_STATE).is_file()
    }
    found |= {reported} if reported is not None else set()
    return sorted(found, key=lambda c: c.name, reverse=True)


def resume_point(rank: int, attempt: tuple[int, list[int]], trial_dir: Path) -> ResumePoint:
    """The checkpoint this worker group continues from (None on a fresh start), decided by rank 0
    from ``candidates(trial_dir, ...)`` and broadcast with its ``attempt`` (``count_attempt``'s)."""
    attempt, workers = attempt
    chosen, skipped = None, []
    if rank == 0:
        latest = ray.train.get_checkpoint()
        reported = Path(latest.path) if latest is not None else None
        found = candidates(trial_dir, reported)
        if found and found[0] != reported:
            print(
                f"jaxray: resuming from storage: {found[0].name} is newer than Ray's newest reported "
                f"checkpoint ({reported.name if reported else 'none'})",
                flush=True,
            )
        if found and damages_latest(attempt):
            print(f"jaxray fault injection: damaged {damage(found[0])}", flush=True)
        path, skipped = choose(found) if found else (None, [])
        chosen = str(path) if path else None
    if ray.train.get_context().get_world_size() > 1:
        chosen, skipped, attempt, workers = broadcast_from_rank_zero((chosen, skipped, attempt, workers))
    return ResumePoint(Path(chosen) if chosen else None, skipped, attempt, workers)
