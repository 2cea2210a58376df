"""Why a worker group restarted: ``FailureLog`` (a Ray Train callback in the run's controller) records
how each attempt ended in a JSON file beside the run; ``read_causes`` names the causes for the trial's
summary (``restart_causes``). Also the keys of the workers' reports the driver reads (attempt,
preemption save, checkpoint score)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import ray
from ray.train import UserCallback

from jaxray import storage

# The causes: "preempted": the workers saved on a preemption notice, then their node went; "node
# lost": a node up at the group's last report has died since; "worker died": a worker ended or raised,
# every node still up; "resized": an elastic group restarted with another number of workers; "driver
# lost": Tune restarted the trial after its driver (trial actor, Ray Train controller) died;
# "interrupted": the jaxray.tune run that began the trial ended first and ``--resume`` went on with
# it; "unknown": none of these.
PREEMPTION_KEY = "preemption_save_step"  # in the report of a save made on a preemption notice
ATTEMPT_KEY = "attempt"  # in every report: the worker group's attempt (1, 2, ...)
# The key Ray ranks checkpoints by (``checkpoint_score_attribute``), in every report with one: never
# inf or NaN (``Reports._score``), as Ray saves its record of checkpoints as JSON with those turned to
# null, and a run resumed from that record fails ranking a null.
SCORE_KEY = "checkpoint_score"
WORST_SCORE = sys.float_info.max


def _alive_nodes() -> list[str]:
    return sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])


class FailureLog(UserCallback):
    """Records at ``path`` ({attempt: entry}) how each attempt ended, once (the first entry counts):
    ``{"cause": "preempted"}`` at a report of a save on a preemption notice (Ray restarts the group
    when the node is gone, not always through a worker error), else at its first worker error
    ``{"cause": "worker died", "nodes": [...]}`` with the nodes up at its last report (Ray marks a
    lost node dead only after missed heartbeats, so ``read_causes`` looks again)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        self._attempt: int | None = None  # the attempt that reported last
        self._alive: list[str] = []  # the cluster's nodes up at that report

    def after_report(self, run_context, metrics, checkpoint) -> None:
        self._attempt = metrics[0].get(ATTEMPT_KEY) if metrics else None
        self._alive = _alive_nodes()
        if any(PREEMPTION_KEY in m for m in metrics):
            self._record({"cause": "preempted"})

    def after_exception(self, run_context, worker_exceptions) -> None:
        self._record({"cause": "worker died", "nodes": self._alive})

    def _record(self, entry: dict) -> None:
        if self._attempt is not None:
            _add(self.path, self._attempt, entry)


def record_driver_lost(path: str | Path, attempts_path: str | Path, cause: str = "driver lost") -> None:
    """Records at ``path`` (``FailureLog``'s) that the newest attempt counted in ``attempts_path``
    (``resume.count_attempt``'s) ended with ``cause``, unless one is recorded; nothing before a first."""
    if isinstance(attempt := read_record(attempts_path).get("attempts"), int):
        _add(path, attempt, {"cause": cause})


def _add(path: str | Path, attempt: int, entry: dict) -> None:
    """``entry`` for ``attempt`` in the JSON object at ``path``, unless it has one (the first counts)."""
    entries = read_record(path)
    if str(attempt) in entries:
        return
    with contextlib.suppress(OSError):  # a lost record must not stop the restart
        storage.write_text(path, json.dumps({**entries, str(attempt): entry}))


def read_record(path: str | Path | None) -> dict:
    """The JSON object at ``path``; {} when there is none, or it cannot be read (a lost record)."""
    try:
        return dict(json.loads(storage.read_text(path) or "{}")) if path else {}
    except (OSError, ValueError, TypeError):
        return {}


def read_causes(path: str | Path | None, workers: list[int]) -> list[str]:
    """The causes of the ends of the attempts before the last (``workers``: each attempt's workers)
    that ``FailureLog`` recorded at ``path``, oldest first: "worker died" becomes "node lost" where a
    node up at that attempt's last report is dead now; with none recorded, "resized" where the next
    attempt ran with another number of workers (Ray's elastic resize is no failure), else "unknown"."""
    entries, alive = read_record(path), set(_alive_nodes())
    causes = []
    for n in range(1, len(workers)):
        e = entries.get(str(n))
        if e is None:
            causes.append("resized" if workers[n] != workers[n - 1] else "unknown")
            continue
        lost = e["cause"] == "worker died" and set(e.get("nodes", ())) - alive
        causes.append("node lost" if lost else e["cause"])
    return causes
