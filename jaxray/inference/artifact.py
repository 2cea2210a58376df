"""The export artifact writer (``python -m jaxray.export``): a trained transformer's ``logits``,
``start`` per (bucket, batch size) and ``decode_n{B}`` as serialized StableHLO, float32 weights and
``manifest.json`` (layout: ``artifact_loader``). Params are a flat-list argument, never baked in.
Always XLA attention (cuDNN custom calls would tie it to NVIDIA); lowered for this platform, CPU, CUDA."""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxray import checkpoint
from jaxray.config import ModelConfig
from jaxray.inference.artifact_loader import ARTIFACT_MANIFEST, FORMAT, FORMAT_VERSION
from jaxray.inference.engine import Engine, check_keep
from jaxray.inference.load import check_checkpoint
from jaxray.inference.settings import EngineSettings
from jaxray.models import build
from jaxray.storage import file_sha256

WEIGHTS = "weights.npz"
PORTABLE_PLATFORMS = ("cpu", "cuda")
ATTENTION_NOTE = (
    "exported with the XLA attention implementation: cuDNN attention lowers to custom "
    "calls that are not portable across platforms and cuDNN versions"
)


class ExportError(ValueError):
    """An export that cannot be written; the message names the option at fault."""


def check_out(out: Path) -> None:
    """ExportError naming --out when it exists and is not an empty directory (never overwritten)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(
            f"--out {out} exists and is not an empty directory; an export never overwrites, "
            f"choose a new folder"
        )


def named_weights(params: Any) -> dict[str, np.ndarray]:
    """The params' leaves on the host, in flattening order, named by key path ("blocks/0/ln1/scale/value").
    ExportError if a leaf is not float32."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    out = {jax.tree_util.keystr(path, simple=True, separator="/"): np.asarray(leaf) for path, leaf in flat}
    odd = [name for name, leaf in out.items() if leaf.dtype != np.float32]
    if odd:
        raise ExportError(f"params must be float32; {odd[0]} is {out[odd[0]].dtype}")
    return out


def export_programs(model, params, engine: Engine, targets: tuple[str, ...]) -> dict[str, tuple[dict, Any]]:
    """``{file stem: (manifest entry, jax.export.Exported)}`` for ``logits`` (batch symbolic, T = S),
    every ``start_b{bucket}_n{batch}`` and ``decode_n{batch}``."""
    weights = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
    unflatten = functools.partial(jax.tree.unflatten, jax.tree.structure(params))
    state_tree = jax.tree.structure(engine.decode_chunk_args(engine.settings.batch_sizes[0])[0])

    def logits(leaves, tokens):
        return model.apply(unflatten(leaves), tokens)

    def start(leaves, *args):
        state, first = engine.programs.start(unflatten(leaves), *args)
        return tuple(jax.tree.leaves(state)), first

    def decode_chunk(leaves, state, max_steps):
        state = jax.tree.unflatten(state_tree, state)
        state, tokens, counts = engine.programs.decode_chunk(unflatten(leaves), state, max_steps)
        return tuple(jax.tree.leaves(state)), tokens, counts

    def export(fn, *args):
        return jax.export.export(jax.jit(fn), platforms=targets)(weights, *args)

    (batch,) = jax.export.symbolic_shape("b")
    tokens = jax.ShapeDtypeStruct((batch, model.config.max_seq_len), jnp.int32)
    out = {"logits": ({"kind": "logits"}, export(logits, tokens))}
    for size in engine.settings.batch_sizes:
        for bucket in engine.buckets:
            entry = {"kind": "start", "bucket": bucket, "batch": size}
            out[f"start_b{bucket}_n{size}"] = (entry, export(start, *engine.start_args(bucket, size)))
        state, max_steps = engine.decode_chunk_args(size)
        decode = export(decode_chunk, tuple(jax.tree.leaves(state)), max_steps)
        out[f"decode_n{size}"] = ({"kind": "decode", "batch": size}, decode)  # "decode": the format's name
    return out


def _aval(aval) -> str:
    """ "int32[b,128]": dtype and shape (symbolic dims by name)."""
    return f"{aval.dtype}[{','.join(str(d) for d in aval.shape)}]"


def base_manifest(
    cfg: ModelConfig, engine: Engine, source: Path, weights: dict[str, np.ndarray], targets: tuple[str, ...]
) -> dict:
    """manifest.json less the files' sha256s and the functions (``write_artifact`` adds them)."""
    state, _ = engine.decode_chunk_args(engine.settings.batch_sizes[0])
    state_names = [
        jax.tree_util.keystr(p, simple=True, separator="/")
        for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "checkpoint": checkpoint.source(source),
        "model": cfg.model_dump(),
        "attention": "xla",
        "attention_note": ATTENTION_NOTE,
        "platforms": list(targets),
        "max_seq_len": cfg.max_seq_len,
        "vocab_size": cfg.vocab_size,
        "buckets": list(engine.buckets),
        "batch_sizes": list(engine.settings.batch_sizes),
        "chunk": engine.settings.chunk,
        "context_keep": check_keep(engine.settings, cfg.max_seq_len),
        "kv_cache_dtype": engine.kv_cache_dtype,  # settings' auto: decided on the exporting machine
        "calling_convention": "every function takes weights.leaves (in order) first; the decode "
        "state is a flat tuple in state_leaves order",
        "weights": {
            "file": WEIGHTS,
            "leaves": [
                {"name": name, "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
                for name, leaf in weights.items()
            ],
        },
        "state_leaves": state_names,
        "functions": {},
    }


def write_artifact(out: Path, manifest: dict, weights: dict[str, np.ndarray], programs: dict) -> None:
    """Write the artifact into a temporary sibling renamed to ``out`` (absent or empty) at the end, so a
    failed export leaves nothing behind."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        np.savez(tmp / WEIGHTS, **weights)
        manifest["weights"]["sha256"] = file_sha256(tmp / WEIGHTS)
        for stem, (entry, exported) in programs.items():
            file = f"{stem}.exported"
            (tmp / file).write_bytes(exported.serialize())
            manifest["functions"][stem] = {
                **entry,
                "file": file,
                "sha256": file_sha256(tmp / file),
                "inputs": [_aval(a) for a in exported.in_avals[len(weights) :]],
                "outputs": [_aval(a) for a in exported.out_avals],
            }
        (tmp / ARTIFACT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.rename(tmp, out)  # POSIX: replaces an empty directory, fails on a non-empty one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_checkpoint(
    path: str | Path | checkpoint.Verified, out: str | Path, settings: EngineSettings | None = None
) -> dict:
    """Export the transformer at ``path`` (checkpoint, run folder or experiment) to the new directory
    ``out``; returns the manifest. Raises, before writing anything, ExportError (``out`` not empty),
    CheckpointError (no transformer checkpoint) or ValueError (a setting)."""
    out, settings = Path(out), settings or EngineSettings()
    check_out(out)
    opened = check_checkpoint(path, settings, purpose="exported")
    _, params = checkpoint.restore(opened)
    source = opened.path
    cfg = checkpoint.load_model_config(source).model_copy(update={"attention": "xla"})
    model = build(cfg, attention="xla")
    plain = settings.model_copy(update={"prefix_cache_mib": 0})  # an artifact exports no prefix programs
    engine = Engine.for_model(model, params, plain, source=str(source))
    # This machine's lowering platform, then CPU and CUDA (XLA attention has no custom calls).
    targets = tuple(dict.fromkeys((jax.export.default_export_platform(),) + PORTABLE_PLATFORMS))
    weights = named_weights(params)
    manifest = base_manifest(cfg, engine, source, weights, targets)
    write_artifact(out, manifest, weights, export_programs(model, params, engine, targets))
    return manifest
