"""``python -m jaxray.bench compile``: one config's train step compiled from shapes alone (no data, no
training) and its compile report (``jaxray.train.compile_report``) with the train state's bytes, as
JSON or a few lines of text."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxray.config import ConfigError
from jaxray.parallel.checks import check_trial
from jaxray.parallel.mesh import batch_sharding
from jaxray.train.compile_report import describe, report
from jaxray.train.layout import trial_layout
from jaxray.train.loop import compile_train_step
from jaxray.train.step import dropout_keys


def _size(n: float | None) -> str:
    """Bytes as MiB below 1 GiB, else GiB ("?" when unknown)."""
    if n is None:
        return "?"
    return f"{n / 2**20:.1f} MiB" if n < 2**30 else f"{n / 2**30:.2f} GiB"


def fits_text(rep: dict[str, Any]) -> str:
    """One line on whether the program's peak memory fits in the device's."""
    peak = rep["memory"].get("peak_bytes")
    if peak is None:
        return "peak memory unknown (no memory analysis on this backend)"
    text = f"peak {_size(peak)} per device"
    limit = rep["device_memory_bytes"]
    if limit is None:
        return f"{text}; the {rep['platform']} device reports no memory to compare with"
    verdict = "fits" if rep["fits"] else "does NOT fit"
    return f"{text} of {_size(limit)} ({rep.get('memory_source') or 'device'}): {verdict}"


def render(rep: dict[str, Any]) -> str:
    """The report as a few lines of text for a terminal."""
    cfg, mem, ops = rep.get("config", {}), rep["memory"], rep["ops"]
    head = ", ".join(f"{k} {v}" for k, v in cfg.items())
    flops = rep.get("flops")
    lines = [
        f"compile report ({head})" if head else "compile report",
        f"  compile {rep['compile_s']:.2f} s on {rep['device_kind']} ({rep['platform']}); per device and "
        f"step: {'?' if flops is None else f'{flops / 1e12:.4g} TFLOP'}, "
        f"{_size(rep.get('bytes_accessed'))} accessed",
        f"  memory per device: arguments {_size(mem.get('argument_bytes'))}, "
        f"outputs {_size(mem.get('output_bytes'))} (aliased to donated arguments "
        f"{_size(mem.get('alias_bytes'))}), temporaries {_size(mem.get('temp_bytes'))}",
        f"  train state {_size(rep.get('state_bytes'))}, "
        f"{_size(rep.get('state_bytes_per_device'))} per device",
        f"  {fits_text(rep)}",
        f"  ops: scatter {ops['scatter'] or 'none'}; gather {ops['gather'] or 'none'}; collectives "
        f"{ops['collectives'] or 'none'}; custom calls {ops['custom_calls'] or 'none'}; fusions "
        f"{sum(ops['fusions'].values())} {ops['fusions'] or ''}; dots {ops['dots']}",
    ]
    return "\n".join(lines)


def abstract_batch(trial, mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes of one global batch of ``trial``: ``tokens`` [B, T] int32, or ``image`` [B, 784]
    float32 and ``label`` [B] int32, split over the devices as training splits them."""
    b, sharding = trial.train.global_batch, batch_sharding(mesh)
    if trial.model.workload == "transformer":
        shapes = {"tokens": ((b, trial.data.seq_len), jnp.int32)}
    else:
        shapes = {"image": ((b, 784), jnp.float32), "label": ((b,), jnp.int32)}
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for k, (shape, dtype) in shapes.items()}


# XLA aborts the process (not an exception) when an array's element count overflows int64.
MAX_ELEMENTS = 2**62


def check_extents(trial) -> None:
    """ConfigError when the largest array of ``trial``'s step has more elements than XLA can index."""
    m, b = trial.model, trial.train.global_batch
    rows = b * (trial.data.seq_len if m.workload == "transformer" else 1)
    largest = max(rows * max(4 * m.width, m.vocab_size, 784), 4 * m.width * m.width)
    if largest > MAX_ELEMENTS:
        raise ConfigError(
            f"global_batch {b} and width {m.width} make arrays of ~{largest:.2e} elements, more than "
            f"XLA can index (2**62); choose smaller sizes"
        )


def report_for(trial, mesh) -> dict[str, Any]:
    """Compile ``trial``'s train step for ``mesh`` from shapes alone and return its compile report
    with the config under ``config``. Raises ConfigError for a batch that does not divide, arrays
    too big for XLA, or cuDNN attention that cannot run."""
    check_trial(trial, mesh.shape)
    check_extents(trial)
    layout = trial_layout(trial, mesh)
    compiled, compile_s = compile_train_step(
        layout.model,
        layout.tx,
        mesh,
        layout.state,
        abstract_batch(trial, mesh),
        dropout=dropout_keys(trial),
        shardings=layout.shardings,
    )
    return {
        "config": describe(trial, mesh),
        **report(compiled, compile_s, mesh.local_devices[0]),
        **state_bytes(layout.state),
    }


def state_bytes(state) -> dict[str, int]:
    """``state_bytes``: the train state's bytes; ``state_bytes_per_device``: one device's share as
    training lays it out, from shapes alone (``state``: ``Layout.state``, leaves carrying shardings)."""
    leaves = jax.tree.leaves(state)
    per_device = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in leaves)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    return {"state_bytes": total, "state_bytes_per_device": per_device}
