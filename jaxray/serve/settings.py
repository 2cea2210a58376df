"""The Serve app's settings (``AppArgs``: ``serve/config.yaml``'s ``args``) and the replica's
command-line options. Imports neither JAX nor Ray, so ``--help`` stays fast."""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.types import NonNegativeFloat, PositiveFloat, PositiveInt, StrictFloat, StrictInt

from jaxray import argtypes
from jaxray.argtypes import json_object, non_negative_float, positive_int
from jaxray.inference.settings import EngineSettings

# Serve config files do not expand environment variables: ``with_checkpoint`` reads this.
CHECKPOINT_ENV = "JAXRAY_CHECKPOINT"
DEFAULT_CHECKPOINT = "runs/demo"


class AppArgs(BaseModel):
    """The ``args`` of ``serve/config.yaml`` and ``python -m jaxray.serve`` (``OPTIONS``: replica fields)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    # A checkpoint dir, runs/<experiment>, or export artifact; relative paths are read from the
    # directory Serve was started in.
    checkpoint: str
    max_batch_size: PositiveInt | None = None
    batch_wait_ms: NonNegativeFloat = 2.0  # 10 cost one client 41 % of its TTFT (docs/benchmarks.md)
    max_ongoing_requests: PositiveInt = 256  # past it, requests queue in Serve's proxy, not ahead of /healthz
    max_queued_requests: PositiveInt = 1024
    compute_cpus: PositiveInt | None = None
    # Ray's num_gpus (0: none reserved, but Ray 2.60 shows the replica every GPU). Strict: YAML true != 1.
    num_gpus: Annotated[StrictInt | StrictFloat, Field(ge=0, allow_inf_nan=False)] = 0
    num_replicas: PositiveInt = 1
    autoscaling_config: dict[str, Any] | None = None
    served_model_name: str = Field("jaxray", min_length=1)
    # Seconds from a request's arrival at the replica to its end, else a 504 "timeout" error (an error
    # event on a stream). python -m jaxray.serve sets it to 3/4 of http_options.request_timeout_s,
    # where Serve's proxy would cut a stream with no event. None: no limit.
    generation_timeout_s: PositiveFloat | None = None
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @model_validator(mode="after")
    def _one_replica_policy(self) -> AppArgs:
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        return self


def with_checkpoint(args: dict[str, Any]) -> dict[str, Any]:
    """``args`` with ``checkpoint`` from ``$JAXRAY_CHECKPOINT``, else ``runs/demo``, where they name none."""
    if "checkpoint" in args:
        return dict(args)
    return {**args, "checkpoint": os.environ.get(CHECKPOINT_ENV) or DEFAULT_CHECKPOINT}


# AppArgs' replica fields as command-line options (argtypes.add_field_options, given_options).
OPTIONS: argtypes.FieldOptions = {
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
    "num_replicas": (positive_int, "replicas, each with its own compiled engine", ""),
    "autoscaling_config": (
        json_object,
        'Ray Serve\'s autoscaling_config as JSON, e.g. \'{"min_replicas": 1, "max_replicas": 2}\' '
        "(instead of --num-replicas)",
        "none",
    ),
    "served_model_name": (str, "the model's id in GET /v1/models and in OpenAI requests' model", ""),
}


def args_error(err: ValidationError, option: bool = False) -> str:
    """The first AppArgs validation error as "<dotted field path>: <message>", or with ``option`` as
    "--<its last field as an option>: <message>"."""
    first = err.errors(include_url=False)[0]
    path = [str(p) for p in first["loc"]] or ["args"]
    return f"{'--' + path[-1].replace('_', '-') if option else '.'.join(path)}: {first['msg']}"
