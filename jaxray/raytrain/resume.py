"""Which checkpoint a (restarted) worker group continues from: rank 0 walks back from the newest
complete one to the newest undamaged one (``checkpoint.verify``) and broadcasts its choice, so every
rank restores the same one."""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import NamedTuple

import ray.train
from ray.train.collective import broadcast_from_rank_zero

from jaxray import checkpoint, storage
from jaxray.raytrain.seams import BEFORE_RESUME


class ResumePoint(NamedTuple):
    """Where a worker group starts: ``checkpoint`` (None: step 0), newer ones ``skipped`` as damaged,
    rank 0's ``attempt`` number (1 for the first start) and the ``workers`` of each attempt so far."""

    checkpoint: checkpoint.Verified | None
    skipped: list[str]
    attempt: int
    workers: list[int]


def count_attempt(path: str | None, workers: int = 1) -> tuple[int, list[int]]:
    """(this worker group's attempt number, the workers of every attempt so far, this one's last),
    counted in the JSON file ``path`` ((1, [workers]) without one). Raises OSError when the count
    cannot be read or written."""
    if not path:
        return 1, [workers]
    try:  # a local file, or on the run's object storage (its checkpoints' names must never repeat)
        doc = json.loads(storage.read_text(path) or '{"attempts": 0}')
        attempt, sizes = doc["attempts"] + 1, [*doc.get("workers", []), workers]
        storage.write_text(path, json.dumps({"attempts": attempt, "workers": sizes}))
    except OSError as err:
        raise OSError(
            f"cannot count this worker group's attempt in {path} ({err}), so its checkpoints could "
            f"not be named apart from an earlier attempt's; make it writable (free space, reach the "
            f"storage), then resume the run"
        ) from None
    return attempt, sizes


def choose(candidates: list) -> tuple[checkpoint.Verified | None, list[str]]:
    """(the first undamaged of ``candidates`` (folders, or URIs: its fetched copy), verified once, the
    names of those before it); (None, every name) if none."""

    def usable(c: Path | str) -> checkpoint.Verified:
        try:  # a URI's fetch checks the digests as they arrive
            return checkpoint.open(c, full_state=True)
        except checkpoint.StorageError as err:  # unreachable is not damaged: the attempt fails, Ray retries
            raise OSError(str(err)) from err

    names = [PurePosixPath(str(c)).name for c in candidates]
    try:
        local, chosen = checkpoint.restore_latest(candidates, usable)
    except checkpoint.CheckpointError as err:
        checkpoint.log.warning("%s; starting again from step 0", err)
        return None, names
    return local, names[: candidates.index(chosen)]


def candidates(trial: Path | str, reported: Path | str | None) -> list:
    """The checkpoints to resume from, newest first: Ray Train's newest reported one and every complete
    one in ``trial``, the trial's storage folder (Paths) or URI (URIs). After an ungraceful node loss
    Ray's record can lack the newest (a report the controller had not collected yet); storage has it."""
    found = set(checkpoint.checkpoints(trial if storage.is_uri(str(trial)) else Path(trial)))
    found |= {reported} if reported is not None else set()
    return sorted(found, key=checkpoint.checkpoint_order, reverse=True)


def resume_point(
    rank: int, attempt: tuple[int, list[int]], trial_dir: Path, trial_uri: str | None = None
) -> ResumePoint:
    """Where this worker group starts, decided by rank 0 from ``candidates`` of ``trial_dir`` (with
    object storage, of ``trial_uri``, fetched into this node's cache) and broadcast with ``attempt``
    (``count_attempt``'s). With object storage, CheckpointSaveError on workers not on rank 0's node."""
    attempt, workers = attempt
    world = ray.train.get_context().get_world_size()
    chosen, skipped = None, []
    if trial_uri is not None:  # called by every worker
        here = ray.get_runtime_context().get_node_id()
        first = broadcast_from_rank_zero(here) if world > 1 else here
        if here != first:
            raise checkpoint.CheckpointSaveError(
                f"worker {rank} runs on node {here}, worker 0 on {first}: with object storage (storage:), "
                f"a trial's workers stage each checkpoint in one folder, so they must all run on one node "
                f"(use fewer, larger workers, or a folder every node mounts as storage)"
            )
    if rank == 0:
        latest = ray.train.get_checkpoint()
        reported = None if latest is None else Path(latest.path)
        if trial_uri is not None and reported is not None:  # Ray's path in the bucket, as a URI
            reported = storage.join(trial_uri, reported.name)
        found = candidates(trial_uri or trial_dir, reported)
        if found and found[0] != reported:
            print(
                f"jaxray: resuming from storage: {PurePosixPath(str(found[0])).name} is newer than Ray's "
                f"newest reported checkpoint ({PurePosixPath(str(reported)).name if reported else 'none'})",
                flush=True,
            )
        for call in BEFORE_RESUME if trial_uri is None else []:
            call(found, attempt)
        chosen, skipped = choose(found) if found else (None, [])
    if world > 1:  # rank 0 verified it: the others take its word
        chosen, skipped, attempt, workers = broadcast_from_rank_zero((chosen, skipped, attempt, workers))
    return ResumePoint(chosen, skipped, attempt, workers)
