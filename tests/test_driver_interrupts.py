"""A Ctrl-C in the driver of ``python -m jaxray.tune`` is recorded from before JAX is imported,
so one whose KeyboardInterrupt is swallowed (JAX's garbage-collection callback only prints
"Exception ignored") still stops the run before Tune's fit (``jaxray.raytrain.interrupts``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """
import importlib.util, os, signal, sys, time
sys.modules["__main__"].__spec__ = importlib.util.find_spec("jaxray.tune")  # as python -m sets it
import jaxray.raytrain.interrupts as interrupts
assert signal.getsignal(signal.SIGINT) is interrupts._on_sigint
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    pass  # swallowed, as an "Exception ignored" callback does
print("recorded" if interrupts.interrupted() else "lost")
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
    assert run(DRIVER) == "recorded"


def test_other_processes_keep_pythons_own_handler():
    assert run(OTHER) == "True"  # tests, Ray's workers: nothing installed on import
