"""Ctrl-C (SIGINT) in the driver of ``python -m jaxray.tune``, before Tune handles it itself.

Python raises KeyboardInterrupt where the main thread happens to be; between an ``--overwrite``'s
set-aside and the start of Tune's fit that can be library code that swallows it (a fresh user saw
it there: the run went on to its end and the earlier results were deleted). So the request is
recorded as well (``recording``) and checked just before each sweep's fit (``stop_if_interrupted``,
``jaxray.raytrain.sweep``). Once Tune's fit runs, its own handler takes Ctrl-C and stops the sweep
with its state saved.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

_interrupted = threading.Event()


def _on_sigint(signum: int, frame: Any) -> None:
    _interrupted.set()
    raise KeyboardInterrupt


# In the driver, from before JAX is imported: a Ctrl-C during the imports can land in JAX's garbage
# collection callback, where Python only prints "Exception ignored" and goes on (a fresh user saw an
# --overwrite run on to its end so). jaxray.tune imports this module before anything that imports
# JAX; in other processes (tests, Ray's workers) nothing is installed on import.
if getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) == "jaxray.tune":
    signal.signal(signal.SIGINT, _on_sigint)


def interrupted() -> bool:
    """True once Ctrl-C was pressed while ``recording``."""
    return _interrupted.is_set()


def stop_if_interrupted() -> None:
    """Raise KeyboardInterrupt when Ctrl-C was pressed, even if the exception it raised then was lost."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """While inside, a Ctrl-C is recorded as well as raised (in the main thread only, where Python
    runs signal handlers; elsewhere this does nothing); the earlier handler comes back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    earlier = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, earlier)
