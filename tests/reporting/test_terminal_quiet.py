"""``jaxray.reporting.terminal.quiet``: jaxray's lines on the terminal, everything else in the log,
in a real process (descriptors 1 and 2, a child process, the logging module)."""

from __future__ import annotations

import subprocess
import sys

DRIVER = """
import logging, os, subprocess, sys
from pathlib import Path
from jaxray.reporting import terminal

print("before")
with terminal.quiet(Path(sys.argv[1])) as log:
    print("a library's line")
    os.write(2, b"a C library's line\\n") if sys.argv[1] != "/dev/full" else None
    # A child writes to the log itself: on a full disk its own print fails (its affair).
    subprocess.run([sys.executable, "-c", "print('a child process line')"], check=sys.argv[1] != "/dev/full")
    print("jaxray's result", file=terminal.out())
    print(f"jaxray's header, log {terminal.log_file()}", file=terminal.err())
    for _ in range(2):
        logging.getLogger("jaxray.checkpoint").warning("said twice")
    sys.stdout.flush()
print("after", terminal.is_quiet(), terminal.log_file())
"""


def run(log: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", DRIVER, log], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_terminal_gets_jaxrays_lines_and_the_log_the_rest(tmp_path):
    log = tmp_path / "logs" / "tune.log"
    done = run(str(log))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before\njaxray's result\nafter False None\n"
    assert done.stderr == f"jaxray's header, log {log}\nwarning: said twice\n"  # a warning once
    text = log.read_text()
    for line in ("a library's line", "a C library's line", "a child process line"):
        assert line in text
    assert text.count("warning: said twice") == 2  # the log has every one
    assert "jaxray's result" in text and "jaxray's header" in text  # the whole record


def test_a_log_that_cannot_be_written_fails_no_one(tmp_path):
    done = run("/dev/full")  # every write: ENOSPC, as on a full disk
    assert done.returncode == 0, done.stderr
    assert done.stdout == "before\njaxray's result\nafter False None\n"
    assert done.stderr.startswith("jaxray's header, log /dev/full\nwarning: said twice\n"), done.stderr
