"""Ctrl-C (SIGINT) in the driver of ``python -m jaxray.tune``, around Tune's own handling of it.

Python raises KeyboardInterrupt where the main thread happens to be; between an ``--overwrite``'s
set-aside and the start of Tune's fit that can be library code that swallows it (a fresh user saw
it there: the run went on to its end and the earlier results were deleted). So the request is
recorded as well (``recording``) and checked just before each sweep's fit (``stop_if_interrupted``,
``jaxray.raytrain.sweep``). While Tune's fit runs, its own handler takes Ctrl-C and stops the sweep
with its state saved; ``around_fit`` records that too, and takes Ctrl-C back after the fit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

_interrupted = threading.Event()


def _record(signum: int, frame: Any) -> None:
    _interrupted.set()


def _on_sigint(signum: int, frame: Any) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


# In the driver, from before JAX is imported, a Ctrl-C is only recorded: raised during the imports
# it either ends the command with a traceback or lands in JAX's garbage-collection callback, where
# Python only prints "Exception ignored" and goes on (a fresh user saw an --overwrite run on to its
# end so). jaxray.tune imports this module before anything that imports JAX and checks the record
# first thing; the same handler is back when main returns (Ray's exit hooks run then). In other
# processes (tests, Ray's workers) nothing is installed on import.
if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) == "jaxray.tune":
    signal.signal(signal.SIGINT, _record)


def interrupted() -> bool:
    """True once Ctrl-C was pressed while ``recording`` (or Tune's fit took one: ``around_fit``)."""
    return _interrupted.is_set()


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt when Ctrl-C was pressed, even if the exception it raised then was lost."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def _main_thread() -> bool:  # the only thread where Python runs signal handlers (and may set them)
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def _handled_by(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """``handler`` takes SIGINT while inside (in the main thread only, where Python runs signal
    handlers; elsewhere this does nothing); the earlier handler comes back after."""
    if not _main_thread():
        yield
        return
    earlier = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, earlier)


def recording() -> contextlib.AbstractContextManager[None]:
    """While inside, a Ctrl-C is recorded as well as raised (main thread only)."""
    return _handled_by(_on_sigint)


def shielded() -> contextlib.AbstractContextManager[None]:
    """While inside, a Ctrl-C is only recorded (main thread only): for a step that must not stop
    half-way and ends the command anyway (putting an earlier run's results back)."""
    return _handled_by(_record)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """``shielded``, then KeyboardInterrupt on leaving when Ctrl-C was pressed: for a step that must
    not stop half-way, before others that must not start (setting an earlier run's results aside)."""
    with shielded():
        yield
    stop_if_interrupted()


@contextlib.contextmanager
def around_fit() -> Iterator[None]:
    """Around one Tune fit. Tune 2.60 installs its own SIGINT handler for the fit (a graceful stop:
    state saved, trials stopped); when it fires it puts the earlier handler back, otherwise it stays
    installed after the fit, where a Ctrl-C reaches only a finished fit (a fresh user saw one
    between two sweeps lost: the next sweep ran to its end, exit 0). After a fit that returns, a
    Ctrl-C Tune took is recorded (its handler had put ours back); the earlier handler is restored
    after any fit. (Should a later Tune put its handler back after every fit, each run would stop
    as interrupted after its first sweep: the two-sweep smoke test would fail.)"""
    earlier = signal.getsignal(signal.SIGINT)
    tune_handles = _main_thread() and not int(os.environ.get("TUNE_DISABLE_SIGINT_HANDLER", "0"))
    try:
        yield
        if tune_handles and signal.getsignal(signal.SIGINT) is earlier:
            _interrupted.set()
    finally:
        if tune_handles:
            signal.signal(signal.SIGINT, earlier)
