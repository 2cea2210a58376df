"""What an engine compiles and accepts (``EngineSettings``), and the same settings as command-line
options for serve, export and bench serve. Imports neither JAX nor Ray (fast ``--help``)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from jaxray.argtypes import (
    FieldOptions,
    add_field_options,
    context_keep,
    given_options,
    int_list,
    non_negative_int,
    positive_int,
)

KVCacheDtype = Literal["auto", "float32", "bfloat16"]


def kv_cache_dtype(text: str) -> str:
    """``--kv-cache-dtype``: one of ``KVCacheDtype``'s names."""
    if text not in get_args(KVCacheDtype):
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(get_args(KVCacheDtype))}, got {text!r}")
    return text


class EngineSettings(BaseModel):
    """What a replica compiles and accepts; the fields are described in ``OPTIONS``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    buckets: tuple[int, ...] = (32, 128, 256)
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    chunk: int = Field(32, gt=0, le=100_000, strict=True)
    max_new_tokens: int = Field(1024, gt=0, le=100_000, strict=True)
    max_prompt_bytes: int = Field(65536, gt=0, strict=True)
    context_keep: int | None = Field(None, ge=2, strict=True)
    prefix_cache_mib: int | None = Field(None, ge=0, le=1 << 20, strict=True)  # None: sized by the engine
    prefix_block: int = Field(32, gt=0, le=100_000, strict=True)
    prefill_chunk: int = Field(0, ge=0, le=100_000, strict=True)
    kv_cache_dtype: KVCacheDtype = "auto"  # auto: bfloat16 on an accelerator, the compute dtype on a CPU

    @field_validator("buckets", "batch_sizes")
    @classmethod
    def _positive_sorted(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(isinstance(v, bool) or v < 1 for v in value):
            raise ValueError("must be a non-empty list of positive integers")
        return tuple(sorted(set(value)))

    @model_validator(mode="after")
    def _chunks_in_the_cache(self) -> EngineSettings:
        if self.prefill_chunk and self.prefix_cache_mib == 0:
            raise ValueError(
                "prefill_chunk needs the prefix cache (prefix_cache_mib not 0), which holds its chunks"
            )
        if self.prefill_chunk % self.prefix_block:
            raise ValueError(f"prefill_chunk must be a multiple of prefix_block {self.prefix_block}")
        return self


# EngineSettings' fields as command-line options (jaxray.argtypes.add_field_options).
OPTIONS: FieldOptions = {
    "buckets": (int_list, "prompt lengths compiled; max_seq_len is always added, longer ones dropped", ""),
    "batch_sizes": (int_list, "batch sizes compiled; a batch pads to the next one", ""),
    "chunk": (positive_int, "new tokens per decode call", ""),
    "max_new_tokens": (positive_int, "cap on new tokens per request", ""),
    "max_prompt_bytes": (positive_int, "longest prompt, UTF-8 bytes", ""),
    "context_keep": (
        context_keep,
        "bytes kept when a row's window is full (2..max_seq_len - 1)",
        "max_seq_len // 2",
    ),
    "prefix_cache_mib": (
        non_negative_int,
        "MiB of device memory keeping prompt prefixes' KV for reuse (0: no prefix caching)",
        "10 %% of the accelerator's free memory, 64 MiB on a CPU",
    ),
    "prefix_block": (
        positive_int,
        "tokens per prefix-cache block (a prefix is reused whole blocks at a time)",
        "",
    ),
    "prefill_chunk": (
        non_negative_int,
        "prefill longer prompts this many tokens per decode step (a multiple of --prefix-block; 0: at once)",
        "",
    ),
    "kv_cache_dtype": (
        kv_cache_dtype,
        "the KV cache's dtype: auto is bfloat16 on an accelerator (half the bytes a decode step reads), "
        "the model's compute dtype on a CPU; float32, bfloat16",
        "",
    ),
}


def add_engine_options(
    parser: argparse.ArgumentParser, names: Iterable[str] = OPTIONS, note: str = ""
) -> None:
    """Add the ``OPTIONS`` in ``names`` to ``parser``, each defaulting to None (EngineSettings'
    default applies)."""
    add_field_options(parser, EngineSettings, OPTIONS, names, note)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """{EngineSettings field: value} for the engine options given on the command line."""
    return given_options(args, OPTIONS)


def engine_settings(args: argparse.Namespace) -> EngineSettings:
    """``EngineSettings`` of the engine options given (``engine_overrides``). Raises ValueError naming
    the option of a refused value ("--buckets: ..."), or a check across fields in its own words."""
    try:
        return EngineSettings(**engine_overrides(args))
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if not first["loc"]:  # a model validator's check across fields
            raise ValueError(str(first.get("ctx", {}).get("error", first["msg"]))) from None
        raise ValueError(f"--{str(first['loc'][0]).replace('_', '-')}: {first['msg']}") from None
