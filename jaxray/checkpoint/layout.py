"""What a checkpoint folder holds, and the check every read of one begins with.

The file names (the module docstring of ``jaxray.checkpoint`` gives the layout), ``open_for_reading``
(every file against the SHA-256 its digest manifest records, before any array is read), ``verify``
(the same for a full train state), and the configs saved beside the params.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from jaxray.checkpoint.digests import check_recorded, sha256_all
from jaxray.checkpoint.failures import CheckpointError, reading
from jaxray.config import ModelConfig, TrialConfig

PARAMS_DIR = "params"
MODEL_CONFIG = "model_config.json"
TRIAL_CONFIG = "trial_config.json"
OPT_STATE_DIR = "opt_state"
HISTORY_FILE = "history.json"
TRAIN_STATE = "train_state.json"
CHECKSUMS = "checksums.json"
MANIFESTS = (TRAIN_STATE, CHECKSUMS)  # the files that hold the others' digests
ARRAY_TREES = {TRAIN_STATE: (PARAMS_DIR, OPT_STATE_DIR), CHECKSUMS: (PARAMS_DIR,)}  # what each records
log = logging.getLogger(__name__)
_warned_unverified: set[str] = set()  # folders already named in the "no checksums" warning


def _manifest_name(directory: Path) -> str | None:
    """The digest manifest ``directory`` holds (``train_state.json``, else ``checksums.json``), or None."""
    return next((n for n in MANIFESTS if (directory / n).is_file()), None)


def _manifest(directory: Path, full_state: bool) -> tuple[str | None, dict[str, Any]]:
    """(the digest manifest's name, its document) of ``directory``; (None, {}) for a params-only
    checkpoint saved before checksums were recorded. CheckpointError when it is incomplete."""
    name = _manifest_name(directory)
    full_state = full_state or any((directory / n).exists() for n in (OPT_STATE_DIR, HISTORY_FILE))
    if full_state and name != TRAIN_STATE:
        raise CheckpointError(
            f"{directory} is incomplete: {TRAIN_STATE} is missing (its save did not finish)"
        )
    if name is None:
        return None, {}
    path = directory / name
    try:
        doc = json.loads(path.read_text())
        if not isinstance(doc["files"], dict):
            raise TypeError(f"its files are a {type(doc['files']).__name__}, not an object")
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None
    check_recorded(path, doc, ARRAY_TREES[name])
    return name, doc


def manifest_sha256(directory: str | Path) -> str | None:
    """The SHA-256 of ``directory``'s digest manifest (``train_state.json``, else ``checksums.json``):
    one value that names every file and array of the checkpoint, as a run's summary row records it
    (``checkpoint_sha256``); None without a manifest."""
    name = _manifest_name(Path(directory))
    return sha256_all([Path(directory) / name])[0] if name else None


def open_for_reading(directory: str | Path, full_state: bool = False, again: bool = False) -> dict[str, Any]:
    """The one way a checkpoint is opened for reading: the SHA-256 of every file its save listed is
    checked against that list (``train_state.json``, or ``checksums.json`` of a params-only
    ``save``) before any array is read. Returns the manifest's document (``{}`` for a params-only
    checkpoint older than checksums: loaded unverified, with a warning once per folder). With
    ``again`` (the check after a read, ``failures.unchanged``) the files of a folder whose arrays'
    SHA-256 the manifest records are left out: ``check_arrays`` compares what was read of them.

    Raises CheckpointError naming the checkpoint and the file when it is no folder, is incomplete
    (opt_state/ or history.json without ``train_state.json``: the save never finished; with
    ``full_state`` any checkpoint without it), its manifest is unreadable, a listed file is missing
    or cannot be read (the OS error in words), or a file's SHA-256 differs (the message gives the
    expected and the found digest).
    """
    directory = Path(directory)
    with reading(directory):
        return _check_digests(directory, full_state, again)


def _require_folder(directory: Path) -> None:
    if not directory.is_dir():
        what = "it is a file" if directory.exists() else "no such folder"
        raise CheckpointError(f"{directory} is not a checkpoint: {what}")


def _check_digests(directory: Path, full_state: bool, again: bool) -> dict[str, Any]:
    """``open_for_reading`` less the translation of OS errors into CheckpointError."""
    _require_folder(directory)
    name, doc = _manifest(directory, full_state)
    if name is None:
        if str(directory) not in _warned_unverified:
            _warned_unverified.add(str(directory))
            log.warning(
                "%s has no checksums.json (saved before jaxray wrote one): loaded unverified", directory
            )
        return doc
    listed = [(rel, directory / rel, digest) for rel, digest in doc["files"].items()]
    if again and isinstance(doc.get("arrays"), dict):  # after a read: the arrays' digests cover theirs
        listed = [entry for entry in listed if entry[0].split("/")[0] not in doc["arrays"]]
    missing = next((rel for rel, f, _ in listed if not f.is_file()), None)
    if missing is not None:
        raise CheckpointError(f"{directory} is damaged: {missing} is missing")
    found = sha256_all([f for _, f, _ in listed])
    for (rel, _, expected), got in zip(listed, found, strict=True):
        if got != expected:
            raise CheckpointError(
                f"{directory} is damaged: {rel} does not match its checksum (truncated or "
                f"overwritten): {name} records SHA-256 {expected}, the file has {got}"
            )
    return doc


def verify(directory: str | Path) -> dict[str, Any]:
    """``train_state.json`` of a complete, undamaged full-state checkpoint (``open_for_reading``
    with ``full_state``). Raises CheckpointError naming the checkpoint and the file when it is
    incomplete (no ``train_state.json``: the save never finished), a listed file is missing, or a
    file's SHA-256 differs (truncated, damaged; both digests given)."""
    return open_for_reading(directory, full_state=True)


def _load_config(directory: str | Path, name: str, cls):
    path = Path(directory) / name
    with reading(Path(directory)):  # a file that cannot be opened: the OS error in words
        if not path.is_file():
            raise CheckpointError(f"{directory} is not a jaxray checkpoint: {name} is missing")
        text = path.read_text()
    try:
        return cls.model_validate_json(text)
    except ValueError as err:
        raise CheckpointError(f"{path} is damaged: {err}") from None


def load_model_config(directory: str | Path) -> ModelConfig:
    """The ModelConfig saved beside the params. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, MODEL_CONFIG, ModelConfig)


def load_trial_config(directory: str | Path) -> TrialConfig:
    """The TrialConfig the params were trained with. Raises CheckpointError if missing or invalid."""
    return _load_config(directory, TRIAL_CONFIG, TrialConfig)


def require_checkpoint(directory: Path) -> None:
    """CheckpointError naming what is missing when ``directory`` is not a jaxray checkpoint."""
    with reading(directory):
        _require_folder(directory)
        for name in (MODEL_CONFIG, PARAMS_DIR):
            if not (directory / name).exists():
                shown = name if name == MODEL_CONFIG else f"{name}/"
                raise CheckpointError(f"{directory} is not a jaxray checkpoint: {shown} is missing")
