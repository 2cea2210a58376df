"""TensorBoard event files for a training run, written synchronously (tensorboardX's ``EventsWriter``
and ``summary.scalar``): ``SummaryWriter`` queues events for a background thread, which a process
ended without ``close()`` (ASHA stopping a trial, a lost node) never lets write them."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from tensorboardX.event_file_writer import EventsWriter
from tensorboardX.proto.event_pb2 import Event, SessionLog
from tensorboardX.summary import scalar

log = logging.getLogger(__name__)


class TensorBoardLogger:
    """Writes each logged row as scalars ``train/<name>`` (held-out ones ``val/<name>``) at its
    ``step``, on disk when the call returns. Use as a context manager."""

    def __init__(self, logdir: str | Path, purge_step: int | None = None):
        """``purge_step``: the run's first step (1, or a resumed run's checkpoint step + 1); TensorBoard
        drops an earlier run's events in ``logdir`` from that step on (the restart marker
        ``SummaryWriter(purge_step=...)`` writes), so a step logged before a crash and again after
        the restart shows once."""
        self._logdir = Path(logdir)
        self._logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(self._logdir / "events"))
        if purge_step is not None:
            start = Event(
                wall_time=time.time(), step=purge_step, session_log=SessionLog(status=SessionLog.START)
            )
            self._writer.write_event(start)

    def _write(self, scalars: dict[str, float], step: int) -> None:
        """Raises OSError (a full disk) naming the event folder."""
        try:
            for tag, value in scalars.items():
                self._writer.write_event(Event(wall_time=time.time(), step=step, summary=scalar(tag, value)))
            self._writer.flush()
        except OSError as err:
            raise self._failed(err) from None

    def _failed(self, err: OSError) -> OSError:
        return OSError(f"could not write the TensorBoard events in {self._logdir}: {err}")

    def __call__(self, row: dict[str, float]) -> None:
        tags = {(f"val/{k[4:]}" if k.startswith("val_") else f"train/{k}"): v for k, v in row.items()}
        self._write({tag: v for tag, v in tags.items() if tag != "train/step"}, int(row["step"]))

    def add_final(self, summary: dict, step: int) -> None:
        finals = {f"final/{k}": v for k, v in summary.items() if not isinstance(v, bool)}
        self._write({k: v for k, v in finals.items() if isinstance(v, (int, float))}, step)

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, kind, *exc) -> None:
        """Flush and close; an OSError (a full disk) names the event folder, and is only logged when
        an exception is already on its way out (a failing close must not replace it)."""
        try:
            self._writer.close()
        except OSError as err:
            if kind is None:
                raise self._failed(err) from None
            log.warning("%s", self._failed(err))
