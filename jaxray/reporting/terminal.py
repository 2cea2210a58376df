"""The main job's terminal: jaxray's own lines there, everything else in a log file.

``quiet(log_file)`` points file descriptors 1 and 2 at ``log_file`` (Ray, Tune, Orbax, warnings,
child processes); jaxray writes through ``out()``/``err()`` (terminal and log) and a live display
through ``display()`` (terminal only). Descriptors, not Python streams, are redirected because Ray
writes worker lines to whatever ``sys.stderr`` is. ``QUIET_ENV``: what every Ray process is started
with to keep Ray Data's progress bars out of the logs."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

# Ray Data's per-dataset progress bars would flood the log of every trial: off in every Ray process.
QUIET_ENV = {"RAY_DATA_DISABLE_PROGRESS_BARS": "1"}

_terminal: tuple[TextIO, TextIO] | None = None  # (stdout, stderr) of the terminal while quiet
_lines: tuple[TextIO, TextIO] | None = None  # the same, each also written to the log
_log_file: Path | None = None  # where everything else goes meanwhile


def out() -> TextIO:
    """jaxray's results: the terminal's stdout and the log (``sys.stdout`` when not quiet)."""
    return _lines[0] if _lines else sys.stdout


def err() -> TextIO:
    """jaxray's header, warnings and errors: the terminal's stderr and the log."""
    return _lines[1] if _lines else sys.stderr


def display() -> TextIO:
    """The terminal's stderr alone, for a live display (its redraws would litter the log)."""
    return _terminal[1] if _terminal else sys.stderr


def is_quiet() -> bool:
    """True inside ``quiet``."""
    return _terminal is not None


def log_file() -> Path | None:
    """The log file of ``quiet`` while inside it, else None."""
    return _log_file


def log_hint() -> str:
    """``; all output: LOG`` for an error line while quiet (where the rest of the story is), else ''."""
    return f"; all output: {_log_file}" if _log_file else ""


class _Forgiving:
    """A text stream whose failed writes are dropped (a full disk must not fail whoever prints)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError:
            return len(text)

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class _Tee:
    """A text stream that writes to the terminal and to the log."""

    def __init__(self, terminal: TextIO, log: TextIO) -> None:
        self.terminal, self.log = terminal, log

    def write(self, text: str) -> int:
        self.log.write(text)
        return self.terminal.write(text)

    def flush(self) -> None:
        self.log.flush()
        self.terminal.flush()

    def isatty(self) -> bool:
        return self.terminal.isatty()


class _Lowercase(logging.Formatter):
    """``warning: message``, as jaxray's own lines read."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {record.getMessage()}"


class _Once(logging.Filter):
    """Lets each distinct message through once (a warning repeated by every read says nothing new)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


@contextlib.contextmanager
def quiet(log_file: Path) -> Iterator[Path]:
    """Descriptors 1 and 2 to ``log_file`` (created, appended to) inside; ``jaxray`` logger warnings
    reach ``err()`` once each. Yields ``log_file``. Raises OSError when the log file cannot be
    created (before anything is redirected)."""
    global _terminal, _lines, _log_file
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = os.dup(1), os.dup(2)
    terminal = tuple(os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8") for fd in saved)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    # Python's writers get the log as their own stream (pytest may have replaced sys.stderr).
    log = _Forgiving(os.fdopen(log_fd, "w", buffering=1, encoding="utf-8", errors="replace"))
    streams = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = log
    _terminal, _log_file = terminal, log_file
    _lines = _Tee(terminal[0], sys.stdout), _Tee(terminal[1], sys.stderr)
    handlers = [logging.StreamHandler(terminal[1]), logging.StreamHandler(sys.stderr)]  # the log's
    handlers[0].addFilter(_Once())
    jaxray_log = logging.getLogger("jaxray")
    for handler in handlers:
        handler.setLevel(logging.WARNING)
        handler.setFormatter(_Lowercase())
        jaxray_log.addHandler(handler)
    try:
        yield log_file
    finally:
        for handler in handlers:
            jaxray_log.removeHandler(handler)
        for stream in (sys.stdout, sys.stderr, *terminal):
            stream.flush()
        sys.stdout, sys.stderr = streams
        with contextlib.suppress(OSError):
            log.stream.close()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        for stream in terminal:
            stream.close()
        _terminal = _lines = _log_file = None
