"""What a checkpoint save or read that fails says: the folder, what was being done, and the cause in
words. An OS error reads as Python words it (``[Errno 28] No space left on device: <file>``), whether
it came as an ``OSError`` or inside a TensorStore message (``[os_error_code='28']``); any other cause
is the innermost message of the exception chain, first line, without TensorStore's spec or any
object's repr (``<bound method ...>``).

  with saving(folder, "the checkpoint of step 40"):   # CheckpointSaveError naming folder and cause
      ...
  with reading(folder):                               # CheckpointError naming folder and cause
      ...
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")  # how TensorStore reports an OS error
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')  # the first absolute path a TensorStore message quotes
_STATUS = re.compile(r"^[A-Z][A-Z_]+: ")  # an absl status code: "RESOURCE_EXHAUSTED: ..."
# Where a message turns into a repr or TensorStore's spec: everything from there on is dropped.
_REPR = re.compile(r"\s*(See full TensorStore details|<bound method|<[\w.]+ object at 0x|TensorStore\(\{).*")
MAX_CAUSE_CHARS = 300


class CheckpointError(ValueError):
    """A path that is not a usable checkpoint; the message says what was expected."""


class CheckpointSaveError(OSError):
    """A save that could not finish; the message names the folder, what was saved and the cause."""


def _chain(err: BaseException) -> list[BaseException]:
    """``err`` and the exceptions it was raised from or during, outermost first."""
    found: list[BaseException] = []
    while err is not None and err not in found and len(found) < 16:
        found.append(err)
        err = err.__cause__ or err.__context__
    return found


def _os_words(code: int, filename: object = None) -> str:
    text = f"[Errno {code}] {os.strerror(code)}"
    return f"{text}: {filename}" if filename else text


def os_error(err: BaseException) -> str | None:
    """The innermost OS error in ``err``'s chain in words (``[Errno 13] Permission denied: FILE``),
    from an OSError or a TensorStore message (whose last quoted path is the file); None if none."""
    chain = _chain(err)
    for e in reversed(chain):
        if isinstance(e, OSError) and e.errno:
            return _os_words(e.errno, e.filename)
    for e in reversed(chain):
        code = _OS_ERROR_CODE.search(str(e))
        if code:
            paths = _QUOTED_PATH.findall(str(e))
            return _os_words(int(code.group(1)), paths[-1].removesuffix(".__lock") if paths else None)
    return None


def cause(err: BaseException) -> str:
    """The cause of ``err`` in words (see the module docstring), at most ``MAX_CAUSE_CHARS``."""
    words = os_error(err)
    if words:
        return words
    for e in reversed(_chain(err)):
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        first = _REPR.sub("", _STATUS.sub("", first)).rstrip(" :.")
        if first:
            return first[:MAX_CAUSE_CHARS]
    return type(err).__name__


@contextmanager
def saving(folder: Path, what: str) -> Iterator[None]:
    """Turn a failure of the save inside into CheckpointSaveError: "could not save ``what`` in
    ``folder``: <cause>". Orbax and TensorStore raise ValueErrors or bare Exceptions for a failed
    write (a full disk among them), so any Exception counts."""
    try:
        yield
    except CheckpointSaveError:
        raise
    except Exception as err:  # noqa: BLE001 - see the docstring
        raise CheckpointSaveError(f"could not save {what} in {folder}: {cause(err)}") from None


@contextmanager
def reading(folder: Path) -> Iterator[None]:
    """Turn an OS error inside (a file or folder that cannot be opened: permissions, an I/O error)
    into CheckpointError: "<folder> cannot be read: [Errno 13] Permission denied: <file>"."""
    try:
        yield
    except OSError as err:
        raise CheckpointError(f"{folder} cannot be read: {cause(err)}") from None


def _snapshot(directory: Path) -> dict[str, tuple[int, ...]] | None:
    """(device, inode, size, mtime, ctime) of every file under ``directory``; None when it cannot be
    read."""
    found: dict[str, tuple[int, ...]] = {}
    try:
        for root, _, names in os.walk(directory, onerror=_raise):  # os.walk: a few ms less than rglob
            for name in names:
                s = os.stat(os.path.join(root, name))
                # ctime too: a rewrite in place whose mtime was set back (cp -p, touch -r) changes it
                found[os.path.join(root, name)] = (
                    s.st_dev,
                    s.st_ino,
                    s.st_size,
                    s.st_mtime_ns,
                    s.st_ctime_ns,
                )
    except OSError:
        return None
    return found


def _raise(err: OSError) -> None:  # os.walk's errors are ignored unless a handler raises them
    raise err


@contextmanager
def unchanged(directory: Path, verify_again: Callable[[], object]) -> Iterator[None]:
    """Raise CheckpointError when a file of ``directory`` changed while the block read it: the
    digests are checked first and the arrays read after, from the same paths, so a checkpoint
    copied over another between the two would be used unverified (a fresh user had evaluate report
    one checkpoint's digest for another's params so). Two checks after the block: every file's
    (device, inode, size, mtime, ctime) as before it (replaced, added, removed), and
    ``verify_again`` (the digest check, raising CheckpointError on a mismatch) for bytes changed
    where they are through a shared memory map, which updates neither time. A change undone before
    ``verify_again`` hashes the file again is not seen."""
    before = _snapshot(directory)
    yield
    try:
        verify_again()
        same = _snapshot(directory) == before
    except CheckpointError:
        same = False
    if not same:
        raise CheckpointError(
            f"{directory} changed while it was read (a file was replaced, added, removed or "
            f"rewritten), so what was read is not what was verified; read it again once nothing "
            f"writes to it"
        )
