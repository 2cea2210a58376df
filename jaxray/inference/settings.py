"""What an engine compiles and accepts (``EngineSettings``), and the same settings as command-line
options, declared once for every command that builds an engine: ``python -m jaxray.serve``,
``python -m jaxray.export`` and ``python -m jaxray.bench serve`` (which passes them on to serve).

Imports neither JAX nor Ray, so a command's ``--help`` and option errors stay fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from jaxray.argtypes import (
    FieldOptions,
    add_field_options,
    context_keep,
    given_options,
    int_list,
    positive_int,
)


class EngineSettings(BaseModel):
    """What a replica compiles and accepts.

    buckets: prompt lengths compiled (max_seq_len is always added; longer ones are dropped);
    batch_sizes: batch sizes compiled, a batch pads to the next one; chunk: new tokens per decode
    call (the streaming granularity); max_new_tokens: the per-request cap; max_prompt_bytes: longer
    prompts are refused (only the last max_seq_len bytes are read anyway); context_keep: tokens kept
    when a row's window is full (``jaxray.inference.kv_decode``; default max_seq_len // 2, max_seq_len makes
    long outputs equal the full-recompute sampler's).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    buckets: tuple[int, ...] = (32, 128, 256)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    chunk: int = Field(32, gt=0, le=100_000, strict=True)
    max_new_tokens: int = Field(1024, gt=0, le=100_000, strict=True)
    max_prompt_bytes: int = Field(65536, gt=0, strict=True)
    context_keep: int | None = Field(None, ge=2, strict=True)

    @field_validator("buckets", "batch_sizes")
    @classmethod
    def _positive_sorted(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(isinstance(v, bool) or v < 1 for v in value):
            raise ValueError("must be a non-empty list of positive integers")
        return tuple(sorted(set(value)))


# EngineSettings' fields as command-line options (jaxray.argtypes.add_field_options).
OPTIONS: FieldOptions = {
    "buckets": (int_list, "prompt lengths compiled; max_seq_len is always added, longer ones dropped", ""),
    "batch_sizes": (int_list, "batch sizes compiled; a batch pads to the next one", ""),
    "chunk": (positive_int, "new tokens per decode call", ""),
    "max_new_tokens": (positive_int, "cap on new tokens per request", ""),
    "max_prompt_bytes": (positive_int, "longest prompt, UTF-8 bytes", ""),
    "context_keep": (context_keep, "bytes kept when a row's window is full", "max_seq_len // 2"),
}


def add_engine_options(
    parser: argparse.ArgumentParser, names: Iterable[str] = OPTIONS, note: str = ""
) -> None:
    """Add ``--buckets``, ``--batch-sizes``, ... (the ``OPTIONS`` in ``names``) to ``parser``; each
    defaults to None, and EngineSettings' default (shown in the help) then applies."""
    add_field_options(parser, EngineSettings, OPTIONS, names, note)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """{EngineSettings field: value} for the engine options given on the command line."""
    return given_options(args, OPTIONS)
