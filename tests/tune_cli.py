"""``python -m jaxray.tune ARGS`` as a user runs it, for the tests of its command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tune_cli(*args, cwd: Path = ROOT, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the command from ``cwd`` (the repository root) with ``env`` added to this environment;
    its output captured as text; at most 120 s."""
    return subprocess.run(
        [sys.executable, "-m", "jaxray.tune", *map(str, args)],
        cwd=cwd,
        env={**os.environ, **env} if env else None,
        capture_output=True,
        text=True,
        timeout=120,
    )


def tune_main(*args) -> subprocess.CompletedProcess:
    """``jaxray.tune.main(args)`` in this process, its stdout and stderr captured as a subprocess's."""
    import contextlib
    import io

    from jaxray.tune import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*map(str, args)])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
