"""A Ctrl-C in the driver of ``python -m jaxray.tune`` is only recorded from before JAX is imported
(raised there, it ended the command with a traceback, or JAX's garbage-collection callback
swallowed it with "Exception ignored"), and main raises it first thing; inside ``deferred`` it is
raised on leaving, once the step is whole (``jaxray.raytrain.interrupts``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import importlib.util, os, signal, sys, time
sys.modules["__main__"].__spec__ = importlib.util.find_spec("jaxray.tune")  # as python -m sets it
import jaxray.raytrain.interrupts as interrupts
assert signal.getsignal(signal.SIGINT) is interrupts._record
os.kill(os.getpid(), signal.SIGINT)  # during the imports: nothing raised that code could swallow
time.sleep(0.5)
print("recorded" if interrupts.interrupted() else "lost")
try:
    with interrupts.recording():  # main: recorded and raised
        interrupts.stop_if_interrupted()
except KeyboardInterrupt:
    print("raised")
"""

OTHER = """
import signal
import jaxray.raytrain.interrupts
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_the_drivers_ctrl_c_is_recorded_even_when_its_exception_is_swallowed():
    assert run(DRIVER).split() == ["recorded", "raised"]


def test_other_processes_keep_pythons_own_handler():
    assert run(OTHER) == "True"  # tests, Ray's workers: nothing installed on import


DEFERRED = """
import os, signal
from jaxray.raytrain import interrupts
done = []
try:
    with interrupts.recording():
        with interrupts.deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the step went on")
except KeyboardInterrupt:
    print(*done, "then raised", sep=", ")
"""


def test_a_deferred_ctrl_c_is_raised_once_the_step_is_whole():
    assert run(DEFERRED) == "the step went on, then raised"


SHIELDED = """
import os, signal
from jaxray.raytrain import interrupts
with interrupts.recording():
    with interrupts.shielded():
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C during the put-back
    print("the put-back went on to its end;", "recorded" if interrupts.interrupted() else "lost")
"""


def test_a_shielded_ctrl_c_is_recorded_and_never_raised():
    assert run(SHIELDED) == "the put-back went on to its end; recorded"
