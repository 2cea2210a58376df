"""The Serve app's settings (``AppArgs``: ``serve/config.yaml``'s ``args``), and the replica's as
command-line options, declared once for ``python -m jaxray.serve`` and ``python -m jaxray.bench serve``
(which passes them on). Imports neither JAX nor Ray, so ``--help`` and option errors stay fast.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveInt,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from jaxray.argtypes import FieldOptions, add_field_options, given_options, non_negative_float, positive_int
from jaxray.inference.settings import EngineSettings

# Serve config files do not expand environment variables: args that name no checkpoint
# (serve/config.yaml's) get it from here, else DEFAULT_CHECKPOINT (``with_checkpoint``).
CHECKPOINT_ENV = "JAXRAY_CHECKPOINT"
DEFAULT_CHECKPOINT = "runs/demo"


class AppArgs(BaseModel):
    """The ``args`` of ``serve/config.yaml`` (and of ``python -m jaxray.serve``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    checkpoint: str = Field(
        description="checkpoint dir, runs/<experiment>, or export artifact; relative "
        "paths are read from the directory Serve was started in"
    )
    max_batch_size: PositiveInt | None = Field(None, description="default: max(engine.batch_sizes)")
    batch_wait_ms: NonNegativeFloat = Field(10.0, description="how long a batch waits to fill, ms")
    # Requests the replica holds at once (queued for a batch or decoding). More wait in Serve's proxy,
    # where they would queue ahead of /healthz; waiting in the replica costs only a coroutine.
    max_ongoing_requests: PositiveInt = 256
    # Requests Serve's proxy holds for the replica once it holds max_ongoing_requests (or while no
    # replica is up, e.g. one being replaced); past that a request gets 503 with Retry-After at once.
    max_queued_requests: PositiveInt = 1024
    compute_cpus: PositiveInt | None = Field(
        None, description="CPUs for JAX's compute threads in the replica (default: all but one, at least one)"
    )
    # Ray's ray_actor_options num_gpus: the replica is placed on a node with that many free GPUs and
    # sees only them (CUDA_VISIBLE_DEVICES). 0 reserves none; Ray 2.60 then leaves the replica every
    # GPU of its node, which suits one replica on a one-GPU machine but nothing shared.
    # Strict numbers: YAML's true would otherwise pass as 1.
    num_gpus: Annotated[StrictInt | StrictFloat, Field(ge=0, allow_inf_nan=False)] = Field(
        0, description="GPUs reserved per replica (0: none)"
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)


def with_checkpoint(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` (a Serve config's application args), with ``checkpoint`` from the environment
    variable ``JAXRAY_CHECKPOINT``, else ``runs/demo``, where they name none. Read in the process
    that builds the app: under ``serve run`` a worker of the Ray it started, which inherits the
    shell's environment (of ``ray start``'s shell, on a cluster started that way)."""
    if "checkpoint" in args:
        return dict(args)
    return {**args, "checkpoint": os.environ.get(CHECKPOINT_ENV) or DEFAULT_CHECKPOINT}


# AppArgs' replica fields as command-line options (jaxray.argtypes.add_field_options).
OPTIONS: FieldOptions = {
    "max_batch_size": (positive_int, "requests decoded together", "the largest of --batch-sizes"),
    "batch_wait_ms": (non_negative_float, "how long a batch waits to fill, ms", ""),
    "max_ongoing_requests": (
        positive_int,
        "requests the replica holds at once (batch queue and decoding); more wait in Serve's proxy",
        "",
    ),
    "max_queued_requests": (
        positive_int,
        "requests Serve's proxy queues past --max-ongoing-requests; more get 503 with Retry-After",
        "",
    ),
    "compute_cpus": (
        positive_int,
        "CPUs for JAX's compute threads in the replica",
        "all but one, at least one",
    ),
    "num_gpus": (non_negative_float, "GPUs Ray reserves for the replica (0: none; see docs/serving.md)", ""),
}


def add_replica_options(
    parser: argparse.ArgumentParser, names: Iterable[str] = OPTIONS, note: str = ""
) -> None:
    """Add ``--max-batch-size``, ``--batch-wait-ms``, ... (the ``OPTIONS`` in ``names``) to ``parser``;
    each defaults to None, and AppArgs' default (shown in the help) then applies."""
    add_field_options(parser, AppArgs, OPTIONS, names, note)


def replica_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """{AppArgs field: value} for the replica options given on the command line."""
    return given_options(args, OPTIONS)


def args_error(err: ValidationError) -> str:
    """The first error of validating AppArgs from a config's ``args``: "<field path>: <message>"
    (the path dotted, e.g. ``engine.chunk``; ``args`` for the whole mapping)."""
    first = err.errors(include_url=False)[0]
    return f"{'.'.join(str(p) for p in first['loc']) or 'args'}: {first['msg']}"
