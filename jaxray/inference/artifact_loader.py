"""Run a ``python -m jaxray.export`` artifact with JAX alone (stdlib, NumPy, JAX: copyable).

An artifact directory holds ``manifest.json`` (format, versions, config, buckets, batch sizes, weight
order, each file's sha256), ``weights.npz`` (float32 params by key path), ``logits.exported`` (tokens
[b, S] int32 -> logits [b, S, V] float32) and ``start_b{P}_n{B}``/``decode_n{B}.exported``
(``kv_decode``). Every function takes the flat weights first; the decode state is a flat tuple."""

from __future__ import annotations

import hashlib
import io
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

FORMAT = "jaxray-export"
FORMAT_VERSION = 4  # 2: start takes top_p; 3: decode slides at max_seq_len - 1; 4: one kv array a layer
ARTIFACT_MANIFEST = "manifest.json"  # not jaxray.data.manifest's: that one describes a Parquet dataset


class ArtifactError(ValueError):
    """An artifact that cannot be run here; the message names the file or field at fault."""


@dataclass
class Artifact:
    """A loaded, verified artifact: ``weights`` device arrays in manifest order, ``exported`` keyed
    ``("logits", None, None)``, ``("start", bucket, batch)``, ``("decode", None, batch)``."""

    path: Path
    manifest: dict
    weights: list
    exported: dict
    _jitted: dict = field(default_factory=dict, repr=False)

    def program(self, key: tuple) -> Callable[..., Any]:
        """The jitted function for ``key`` with the weights bound. KeyError names the available keys."""
        if key not in self.exported:
            raise KeyError(f"the artifact has no program {key}; it has {sorted(self.exported, key=str)}")
        if key not in self._jitted:
            self._jitted[key] = jax.jit(self.exported[key].call)
        fn = self._jitted[key]
        return lambda *args: fn(self.weights, *args)

    def logits(self, tokens) -> np.ndarray:
        """tokens [B, T] integers in 0..V-1, 1 <= T <= S -> logits [B, T, V] float32 (rows
        zero-padded to S). Raises ValueError naming ``tokens`` for a bad shape or value."""
        tokens = np.asarray(tokens)
        size, vocab = self.manifest["max_seq_len"], self.manifest["vocab_size"]
        if tokens.ndim != 2 or not 1 <= tokens.shape[1] <= size or tokens.shape[0] < 1:
            raise ValueError(
                f"tokens must be [B, T] with B >= 1 and 1 <= T <= {size}, got shape {tokens.shape}"
            )
        if not np.issubdtype(tokens.dtype, np.integer) or tokens.min() < 0 or tokens.max() >= vocab:
            raise ValueError(f"tokens must be integers in 0..{vocab - 1}")
        padded = np.zeros((tokens.shape[0], size), np.int32)
        padded[:, : tokens.shape[1]] = tokens
        return np.asarray(self.program(("logits", None, None))(padded))[:, : tokens.shape[1]]

    def start(self, tokens, lengths, seeds, temperature, top_k, top_p, max_new_tokens):
        """``kv_decode.start`` for tokens [B, P] int32 (P a bucket, B a batch size); lengths, top_k,
        max_new_tokens [B] int32; seeds [B] uint32; temperature, top_p [B] float32. Returns (state:
        tuple of arrays, first [B] int32)."""
        batch, bucket = np.shape(tokens)
        program = self.program(("start", bucket, batch))
        return program(tokens, lengths, seeds, temperature, top_k, top_p, max_new_tokens)

    def decode_chunk(self, state, max_steps):
        """``kv_decode.decode_chunk``: max_steps () int32 -> (state, tokens [B, chunk], counts [B])."""
        return self.program(("decode", None, np.shape(state[0])[0]))(state, max_steps)


def read_artifact_manifest(directory: str | Path) -> dict:
    """manifest.json of an artifact. Raises ArtifactError if missing, damaged or of another format."""
    path = Path(directory) / ARTIFACT_MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory} is not an export artifact: {ARTIFACT_MANIFEST} is missing")
    try:
        manifest = json.loads(path.read_bytes())
    except ValueError as err:
        raise ArtifactError(f"{path} is damaged: {err}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format_version {manifest.get('format_version')!r}; "
            f"this loader reads {FORMAT_VERSION}"
        )
    return manifest


def read_verified(directory: Path, manifest: dict) -> dict[str, bytes]:
    """{file name: bytes} of every file the manifest lists, read once (what is used is what was
    hashed). ArtifactError naming the first file missing or mismatching its sha256, or an entry
    without a file or digest."""
    files = [manifest["weights"]] + list(manifest["functions"].values())
    read = {}
    for entry in files:
        if not isinstance(entry, dict) or not entry.get("file") or not entry.get("sha256"):
            raise ArtifactError(f"{directory / ARTIFACT_MANIFEST} lists a file without its name or sha256")
        path = directory / entry["file"]
        if not path.is_file():
            raise ArtifactError(f"{path} is missing")
        data = path.read_bytes()
        found = hashlib.sha256(data).hexdigest()
        if found != entry["sha256"]:
            raise ArtifactError(
                f"{path} is damaged: {ARTIFACT_MANIFEST} records sha256 {entry['sha256']}, "
                f"the file has {found}"
            )
        read[entry["file"]] = data
    return read


def load_weights(path: Path, leaves: list[dict], data: bytes) -> list:
    """The weights in manifest order as device arrays, from the verified bytes ``data`` of ``path``.
    ArtifactError naming a leaf missing or of the wrong shape or dtype."""
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        out = []
        for leaf in leaves:
            if leaf["name"] not in npz.files:
                raise ArtifactError(f"{path} has no array {leaf['name']!r}")
            array = npz[leaf["name"]]
            if list(array.shape) != leaf["shape"] or str(array.dtype) != leaf["dtype"]:
                raise ArtifactError(
                    f"{path}: {leaf['name']} is {array.dtype}{list(array.shape)}, "
                    f"the manifest says {leaf['dtype']}{leaf['shape']}"
                )
            out.append(jax.device_put(array))
    return out


def load_artifact(directory: str | Path) -> Artifact:
    """Read, verify and deserialize an artifact directory. ArtifactError for a bad manifest, file or
    weights, or another platform; warns on another JAX minor version."""
    directory = Path(directory)
    manifest = read_artifact_manifest(directory)
    files = read_verified(directory, manifest)
    if str(manifest.get("jax", "")).split(".")[:2] != jax.__version__.split(".")[:2]:
        warnings.warn(
            f"artifact exported with jax {manifest.get('jax')}; running jax {jax.__version__}", stacklevel=2
        )
    platform = jax.export.default_export_platform()
    if platform not in manifest["platforms"]:
        raise ArtifactError(
            f"{directory} was exported for {', '.join(manifest['platforms'])}; this machine runs {platform}"
        )
    exported = {}
    for entry in manifest["functions"].values():
        try:
            key = (entry["kind"], entry.get("bucket"), entry.get("batch"))
            exported[key] = jax.export.deserialize(bytearray(files[entry["file"]]))
        except Exception as err:  # noqa: BLE001 - deserialize raises assorted errors for unreadable blobs
            raise ArtifactError(f"{directory / entry['file']} could not be deserialized: {err}") from None
    name = manifest["weights"]["file"]
    weights = load_weights(directory / name, manifest["weights"]["leaves"], files[name])
    return Artifact(directory, manifest, weights, exported)
