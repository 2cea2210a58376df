"""JAX's persistent compilation cache, on by default: every trial of a run, and later runs, reuse the
compiled step from one folder. ``enable`` before the first compile; ``watch`` tells whether a compile
was served from the cache (JAX's ``/jax/compilation_cache/cache_hits`` monitoring event). The cache
holds executable code: keep it per user or cluster, never writable by anyone you do not trust."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import jax

from jaxray.config.scaling import COMPILE_CACHE_ENV

ENV = COMPILE_CACHE_ENV  # wins over the default, not over the YAML
HIT_EVENT = "/jax/compilation_cache/cache_hits"
_hits = 0
_lock = threading.Lock()


def default_folder() -> Path:
    """``$XDG_CACHE_HOME/jaxray/jax-compilation-cache`` (``~/.cache`` without XDG_CACHE_HOME)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxray" / "jax-compilation-cache"


def folder_for(setting: str | None) -> str | None:
    """The cache folder for ``workers.compile_cache`` / ``--compile-cache``: the setting, else
    ``$JAX_COMPILATION_CACHE_DIR``, else ``default_folder()``; None for "" (off)."""
    if setting == "":
        return None
    return setting or os.environ.get(ENV) or str(default_folder())


def enable(setting: str | None = None) -> str | None:
    """Point JAX's persistent cache at ``folder_for(setting)`` (created if missing) or turn it off;
    returns the folder (None: off). Call before this process compiles anything."""
    folder = folder_for(setting)
    if folder is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    if "://" not in folder:  # JAX opens a gs:// cache itself
        Path(folder).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", folder)
    return folder


def _count(event: str, **_) -> None:
    global _hits
    if event == HIT_EVENT:
        with _lock:
            _hits += 1


jax.monitoring.register_event_listener(_count)


@dataclass
class Watch:
    """Cache hits seen inside ``watch()`` (``hits``) and the folder then in use (None: off)."""

    folder: str | None
    hits: int = 0

    def fields(self) -> dict[str, object]:
        return {"compile_from_cache": self.hits > 0, "compile_cache_dir": self.folder}


@contextlib.contextmanager
def watch() -> Iterator[Watch]:
    """Count the persistent-cache hits of the compiles run inside (this process, any thread)."""
    enabled = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    seen = Watch(jax.config.jax_compilation_cache_dir if enabled else None)
    before = _hits
    try:
        yield seen
    finally:
        seen.hits = _hits - before
