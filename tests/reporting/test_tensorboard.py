"""TensorBoard events survive a process that never closes its writer (ASHA stopping a trial ends its
worker): each logged row is on disk when the logger returns."""

import struct
import subprocess
import sys

from tensorboardX.proto import event_pb2

from jaxray.reporting.tensorboard import TensorBoardLogger

WRITE_AND_DIE = """
import os, sys
from jaxray.reporting.tensorboard import TensorBoardLogger
tb = TensorBoardLogger(sys.argv[1])
for step in (10, 20):
    tb({"step": step, "loss": 2.5 - step / 100, "val_loss": 2.6})
os._exit(9)  # as a killed worker: no close, no atexit
"""


def scalars(folder) -> dict[str, list[int]]:
    """{tag: [steps]} read from the TFRecord-framed event files in ``folder``."""
    found: dict[str, list[int]] = {}
    for path in folder.glob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                found.setdefault(value.tag, []).append(event.step)
    return found


def test_rows_logged_before_the_process_is_killed_are_kept(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", WRITE_AND_DIE, str(tmp_path)], capture_output=True, text=True
    )
    assert proc.returncode == 9, proc.stderr
    assert scalars(tmp_path) == {"train/loss": [10, 20], "val/loss": [10, 20]}


def test_a_resumed_run_marks_its_restart_for_tensorboard(tmp_path):
    """A resumed run's logger writes TensorBoard's restart marker (a SessionLog START, as
    ``SummaryWriter(purge_step=...)``) at its first step, before its rows: TensorBoard drops the
    earlier run's events from there, so a step logged twice shows once."""
    with TensorBoardLogger(tmp_path) as tb:
        for step in (10, 20):
            tb({"step": step, "loss": 1.0})
    with TensorBoardLogger(tmp_path, purge_step=11) as tb:
        tb({"step": 20, "loss": 0.9})
    later = max(tmp_path.glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime_ns)
    events = read_events(later)
    marks = [("start", e.step) if e.session_log.status == event_pb2.SessionLog.START else ("row", e.step)
             for e in events if e.session_log.status or e.summary.value]  # fmt: skip
    assert marks == [("start", 11), ("row", 20)]


def read_events(path) -> list:
    data, at, events = path.read_bytes(), 0, []
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at : at + 8])
        events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + length]))
        at += 12 + length + 4
    return events
