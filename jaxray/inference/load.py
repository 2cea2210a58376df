"""Where an engine comes from: ``load_engine("runs/demo")`` (or ``"exports/demo"``). A path holding
``manifest.json`` is an export artifact whose programs run in an ``Engine``; any other is a checkpoint,
run folder or ``runs/<experiment>``. ``check_source`` checks without loading weights."""

from __future__ import annotations

import functools
from pathlib import Path

import jax

from jaxray import checkpoint, runs
from jaxray.config import ModelConfig
from jaxray.inference import kv_decode
from jaxray.inference.artifact_loader import ARTIFACT_MANIFEST, load_artifact, read_artifact_manifest
from jaxray.inference.engine import Engine, Programs, check_keep, compiled_buckets
from jaxray.inference.prefix_cache import check_prefix_block
from jaxray.inference.settings import EngineSettings
from jaxray.reporting import checkpoint_line


def is_artifact(path: str | Path) -> bool:
    """Whether ``path`` is an export artifact directory (it holds the artifact's manifest.json)."""
    return (Path(path) / ARTIFACT_MANIFEST).is_file()


def open_transformer(
    path: str | Path | checkpoint.Verified, purpose: str
) -> tuple[checkpoint.Verified, ModelConfig]:
    """The transformer checkpoint ``path`` resolves to (``runs.open_checkpoint``) and its model config,
    ``purpose`` naming what is refused. Raises CheckpointError as ``require``, ValueError for an
    export artifact: only ``serve`` runs those."""
    if not isinstance(path, checkpoint.Verified) and is_artifact(path):
        raise ValueError(
            f"--checkpoint {path} is an export artifact: python -m jaxray.serve --checkpoint {path} serves "
            f"it (only a checkpoint can be {purpose})"
        )
    opened = runs.open_checkpoint(path, workload="transformer")
    return opened, opened.require("transformer", purpose)


def check_checkpoint(
    path: str | Path | checkpoint.Verified, settings: EngineSettings | None = None, purpose: str = "served"
) -> checkpoint.Verified:
    """The transformer checkpoint ``path`` resolves to, verified once and not restored. Raises
    CheckpointError naming the path (no or non-transformer checkpoint), ValueError for context_keep
    or prefix_block, ValueError for an export artifact (``open_transformer``)."""
    opened, config = open_transformer(path, purpose)
    max_seq_len = config.max_seq_len
    check_keep(settings or EngineSettings(), max_seq_len)
    check_prefix_block(settings or EngineSettings(), max_seq_len)
    return opened


def check_source(path: str | Path, settings: EngineSettings | None = None) -> Path:
    """What ``load_engine`` would serve, checked without loading weights: the artifact directory
    (``settings_for``) or the resolved checkpoint. ArtifactError / CheckpointError / ValueError."""
    if is_artifact(path):
        settings_for(read_artifact_manifest(path), settings)
        return Path(path)
    return check_checkpoint(path, settings).path


def describe_source(path: str | Path) -> str:
    """One line naming ``path``: ``checkpoint_line.describe``, or ``artifact: PATH (exported from ...)``."""
    if not is_artifact(path):
        return checkpoint_line.describe(path)
    return f"artifact: {path} (exported from {read_artifact_manifest(path)['checkpoint']})"


def load_engine(path: str | Path | checkpoint.Verified, settings: EngineSettings | None = None) -> Engine:
    """The engine for a checkpoint, run folder, ``runs/<experiment>`` or export artifact. Raises as
    ``check_source``, ArtifactError / CheckpointError for damaged weights."""
    if not isinstance(path, checkpoint.Verified) and is_artifact(path):
        return engine_from_artifact(path, settings)
    opened = check_checkpoint(path, settings)
    model, params = checkpoint.restore(opened)
    return Engine.for_model(model, params, settings, source=checkpoint.source(opened.path))


def settings_for(manifest: dict, settings: EngineSettings | None) -> EngineSettings:
    """``settings`` (None: the artifact's own) checked against an artifact's manifest: buckets and batch
    sizes exported, chunk, context_keep and kv_cache_dtype (auto: the artifact's) equal, no prefix
    cache. ValueError naming the setting."""
    size, keep = manifest["max_seq_len"], manifest["context_keep"]
    dtype = manifest["kv_cache_dtype"]
    if settings is None:
        return EngineSettings(
            buckets=tuple(manifest["buckets"]),
            batch_sizes=tuple(manifest["batch_sizes"]),
            chunk=manifest["chunk"],
            context_keep=keep,
            kv_cache_dtype=dtype,
        )
    given = [name for name in ("prefix_cache_mib", "prefill_chunk") if getattr(settings, name)]
    if given:  # before the buckets: no choice gives them
        raise ValueError(f"{', '.join(given)}: an export artifact has no prefix-cache programs; set 0")
    buckets = set(compiled_buckets(settings, size))
    for name, wanted in (("buckets", buckets), ("batch_sizes", set(settings.batch_sizes))):
        missing = sorted(wanted - set(manifest[name]))
        if missing:
            raise ValueError(f"{name} {missing} were not exported: the artifact has {manifest[name]}")
    if settings.chunk != manifest["chunk"]:
        raise ValueError(f"chunk {settings.chunk} differs from the artifact's {manifest['chunk']}")
    if check_keep(settings, size) != keep:
        raise ValueError(f"context_keep {check_keep(settings, size)} differs from the artifact's {keep}")
    if settings.kv_cache_dtype not in ("auto", dtype):
        raise ValueError(f"kv_cache_dtype {settings.kv_cache_dtype} differs from the artifact's {dtype}")
    return settings.model_copy(update={"kv_cache_dtype": dtype})


def _start(exported: dict, state_tree, params, tokens, *args):
    """``Programs.start`` over the artifact's ``start_b{bucket}_n{batch}`` for tokens [batch, bucket]."""
    batch, bucket = tokens.shape
    leaves, first = exported[("start", bucket, batch)].call(params, tokens, *args)
    return jax.tree.unflatten(state_tree, leaves), first


def _decode_chunk(exported: dict, state_tree, params, state, max_steps):
    """``Programs.decode_chunk`` over the artifact's ``decode_n{batch}``, the state flattened for it."""
    leaves = tuple(jax.tree.leaves(state))
    leaves, tokens, counts = exported[("decode", None, leaves[0].shape[0])].call(params, leaves, max_steps)
    return jax.tree.unflatten(state_tree, leaves), tokens, counts


def engine_from_artifact(path: str | Path, settings: EngineSettings | None = None) -> Engine:
    """An ``Engine`` calling an artifact's exported functions, its params the flat weights. Raises
    ArtifactError for a damaged artifact, ValueError as ``settings_for``."""
    artifact = load_artifact(path)
    config = ModelConfig.model_validate(artifact.manifest["model"])
    settings = settings_for(artifact.manifest, settings)
    layers = tuple(None for _ in range(config.num_layers))  # KVCache: one kv array a layer
    state_tree = jax.tree.structure(kv_decode.DecodeState(layers, *[None] * 8), is_leaf=lambda x: x is None)
    programs = Programs(
        functools.partial(_start, artifact.exported, state_tree),
        functools.partial(_decode_chunk, artifact.exported, state_tree),
    )
    return Engine(config, artifact.weights, settings, programs, source=str(path))
