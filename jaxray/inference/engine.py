"""The serving engine: KV-cache sampling compiled ahead of time for fixed prompt buckets and batch sizes.

Requests are padded to the smallest compiled batch size and prompt bucket that hold them, so no
request compiles: ``compile()`` builds every ``start`` and ``decode_chunk`` program up front.
``jaxray.inference.load`` builds an engine from a checkpoint, run folder or export artifact."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxray.config import ModelConfig
from jaxray.data.shakespeare import bytes_to_text
from jaxray.inference import kv_decode, prefix_cache
from jaxray.inference.kv_decode import DecodeState
from jaxray.inference.prefix_cache import PrefixCache, auto_mib, new_pool, plan_prefill, store_plan
from jaxray.inference.sampling import Sampling, check_sampling, context_len, encode_prompt, prompt_window
from jaxray.inference.settings import EngineSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """One generation request: prompt bytes (non-empty; the last max_seq_len - 1 are used), a token
    budget, temperature (0 is greedy), top_k (None: all), a 32-bit seed and top_p (1: all)."""

    prompt: bytes
    max_new_tokens: int
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0
    top_p: float = 1.0


@dataclass
class Completion:
    """New token ids (bytes 0..255) and the prompt bytes actually read (<= max_seq_len - 1)."""

    tokens: list[int]
    prompt_tokens: int

    @property
    def text(self) -> str:  # invalid UTF-8 becomes U+FFFD
        return bytes_to_text(np.asarray(self.tokens, np.int32))


@dataclass
class Programs:
    """Uncompiled programs: ``kv_decode``'s with the model bound, params first."""

    start: Callable[..., tuple]
    decode_chunk: Callable[..., tuple]
    start_cached: Callable[..., tuple] | None = None  # kv_decode.start_cached; None: no prefix caching


def _cache_dtype(settings: EngineSettings, config: ModelConfig) -> str:
    return kv_decode.cache_dtype(settings.kv_cache_dtype, config.dtype, jax.default_backend())


TRAINING_ONLY = {"block_repeats", "remat", "scan_layers", "dropout", "init"}  # model keys /info leaves out


@dataclass
class Engine:
    """Compiled KV-cache sampling for one model."""

    config: ModelConfig
    params: Any
    settings: EngineSettings
    programs: Programs
    source: str = ""
    compiled: dict = field(default_factory=dict)
    compile_s: float = 0.0
    prefix: PrefixCache | None = field(default=None, init=False)
    pool: Any = field(default=None, init=False, repr=False)  # [slots, F]: the prefix blocks (new_pool)

    def __post_init__(self):
        """The prefix cache and its pool: ``settings.prefix_cache_mib`` MiB, or by default (None)
        ``prefix_cache.auto_mib`` of the device's memory where the programs have one (not an export
        artifact) and a block is shorter than the window. ValueError as ``new_pool``, when an export
        artifact is given a size, or for ``prefill_chunk`` without a cache."""
        mib, settings = self.settings.prefix_cache_mib, self.settings
        if mib is None and (
            self.programs.start_cached is None or settings.prefix_block >= self.config.max_seq_len
        ):
            mib = 0  # the default where no cache can be: none
        if mib == 0:
            if settings.prefill_chunk:
                raise ValueError(
                    "prefill_chunk needs the prefix cache, which this engine cannot have (an export "
                    "artifact, or prefix_block not below max_seq_len): set prefill_chunk 0"
                )
            return
        if self.programs.start_cached is None:
            raise ValueError("prefix_cache_mib: an export artifact has no prefix-cache programs; set 0")
        if mib is not None:
            self.prefix, self.pool = new_pool(self.config, settings, mib, self.kv_cache_dtype)
            return
        try:  # the default size: a device too full for it, or for one block, serves without
            mib = auto_mib(jax.devices()[0])
            self.prefix, self.pool = new_pool(self.config, settings, mib, self.kv_cache_dtype)
        except ValueError as err:
            if settings.prefill_chunk:  # its chunks live in the cache
                raise
            log.warning("no prefix cache: %s", err)

    @classmethod
    def for_model(cls, model, params, settings: EngineSettings | None = None, source: str = "") -> Engine:
        """The engine of a live transformer ``model`` and its params; ``source`` names their origin.
        Raises ValueError for a context_keep outside 2..max_seq_len - 1."""
        settings = settings or EngineSettings()
        keep, size = check_keep(settings, model.config.max_seq_len), model.config.max_seq_len
        prefill = kv_decode.cast_prefill(model.prefill, _cache_dtype(settings, model.config))
        programs = Programs(
            functools.partial(kv_decode.start, prefill, max_seq_len=size),
            functools.partial(
                kv_decode.decode_chunk, prefill, model.decode_step, chunk=settings.chunk, keep=keep
            ),
            functools.partial(
                kv_decode.start_cached,
                model.extend,
                block_shape=prefix_cache.block_shape(model.config, settings.prefix_block),
            ),
        )
        return cls(model.config, params, settings, programs, source)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's dtype in force: ``settings.kv_cache_dtype`` decided for this backend (an
        artifact's settings carry the dtype it was exported with: ``load.settings_for``)."""
        return _cache_dtype(self.settings, self.config)

    @property
    def context_len(self) -> int:
        """Prompt and context bytes the model reads (``sampling.context_len``: max_seq_len - 1)."""
        return context_len(self.config.max_seq_len)

    @property
    def buckets(self) -> tuple[int, ...]:
        return compiled_buckets(self.settings, self.config.max_seq_len)

    @property
    def max_batch_size(self) -> int:
        return self.settings.batch_sizes[-1]

    def compile(self) -> dict:
        """Compile and run once every ``start``, ``decode_chunk`` and ``gather`` program; compile the
        prefix cache's (not run: the warm-up bypasses the cache). Idempotent. Returns {"compile_s",
        "programs"}."""
        if not self.compiled:
            begin = time.perf_counter()
            states, prefix, self.prefix = {}, self.prefix, None
            for batch in self.settings.batch_sizes:
                for bucket in self.buckets:  # a prompt of the bucket's length compiles and runs its programs
                    for _ in self._stream([Request(b"a" * bucket, 2, 0.5, 1)] * batch):
                        pass
                states[batch], _ = self.start([Request(b"a", 2, 0.5, 1)] * batch)
            for sizes, target in gather_shapes(self.settings.batch_sizes):
                self.gather([states[b] for b in sizes], np.zeros(target, np.int32), np.zeros(target, bool))
            self.prefix = prefix
            for batch in self.settings.batch_sizes if prefix else ():
                self._program("store", None, batch)
                for bucket in self.buckets:
                    self._program("start_cached", bucket, batch)
            self.compile_s = time.perf_counter() - begin
            sizes = (len(self.compiled), self.compile_s, self.buckets, self.settings.batch_sizes)
            log.info("compiled %d programs in %.1f s (buckets %s, batch sizes %s)", *sizes)
        return {"compile_s": self.compile_s, "programs": len(self.compiled)}

    def batch_for(self, rows: int) -> int:
        """The smallest compiled batch size that holds ``rows`` (1..max_batch_size)."""
        return next(b for b in self.settings.batch_sizes if b >= rows)

    def count_prefix(self, request: Request) -> int:
        """Prompt tokens of ``request`` the prefix cache holds now (whole blocks, at least one left to
        compute), its lookup counted in the cache's figures."""
        window, n = prompt_window(request.prompt, self.context_len)
        return self.prefix.count_prompt(window[:n])

    def prefill_blocks(self, request: Request, tokens: int) -> None:
        """Prefill the first ``tokens`` (a multiple of prefix_block) of ``request``'s prompt window into
        the prefix cache, reusing what it holds (chunked prefill; the token sampled is dropped)."""
        window, _ = prompt_window(request.prompt, self.context_len)
        self.start([Request(window[:tokens].astype(np.uint8).tobytes(), 1, 0.0, None, 0)], [False])

    def start(
        self, requests: list[Request], counted: list[bool] | None = None
    ) -> tuple[DecodeState, np.ndarray]:
        """Prefill checked ``requests`` at the smallest batch size and bucket that hold them:
        (DecodeState, padding rows finished; first new token per request [len(requests)] int32).
        With a prefix cache, only what follows each prompt's longest cached prefix is prefilled, and
        its new whole blocks kept (``counted``: whether each lookup counts in the cache's figures)."""
        batch, keys, cached = self.batch_for(len(requests)), None, None
        if self.prefix is None:
            bucket = next(b for b in self.buckets if b >= max(map(self.prompt_tokens, requests)))
            tokens, lengths, *sampling = self._inputs(requests, bucket, batch)
        else:  # whole windows
            tokens, lengths, *sampling = self._inputs(requests, self.config.max_seq_len, batch)
            counted = [True] * len(requests) if counted is None else counted
            keys, bucket, cached = plan_prefill(self.prefix, tokens, lengths, counted, self.buckets)
        if cached is not None:
            program = self._program("start_cached", bucket, batch)
            state, first = program(self.params, self.pool, *cached, tokens, *sampling)
        else:
            program = self._program("start", bucket, batch)
            state, first = program(self.params, tokens[:, :bucket], lengths, *sampling)
        if keys is not None:
            plan = store_plan(self.prefix, keys, batch * (self.config.max_seq_len // self.prefix.block))
            if plan is not None:
                self.pool = self._program("store", None, batch)(self.pool, state.cache, *plan)
        return state, np.asarray(first)[: len(requests)]

    def decode_chunk(self, state: DecodeState) -> tuple[DecodeState, np.ndarray, np.ndarray]:
        """Up to ``chunk`` more tokens for every unfinished row, as ``kv_decode.decode_chunk``. ``state``
        is donated (its arrays are deleted): use the one returned."""
        program = self._program("decode_chunk", None, state.pending.shape[0])
        state, out, counts = program(self.params, state, np.int32(self.settings.chunk))
        return state, np.asarray(out), np.asarray(counts)

    def gather(self, states: list[DecodeState], index: np.ndarray, valid: np.ndarray) -> DecodeState:
        """``kv_decode.gather_rows`` compiled: index, valid [B'] with B' a compiled batch size."""
        sizes = tuple(s.pending.shape[0] for s in states)
        return self._program("gather", sizes, len(index))(tuple(states), index, valid)

    def _program(self, kind: str, shape, batch: int):
        """The compiled program ``kind`` for ``batch`` rows: start and start_cached (shape: the bucket),
        decode_chunk (state donated), store (``store_blocks``, pool donated), gather (shape: the joined
        states' batch sizes)."""
        key = (kind, shape, batch)
        if key in self.compiled:
            return self.compiled[key]
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
        if kind == "start":
            fn, args, donate = self.programs.start, (self.params, *self.start_args(shape, batch)), ()
        elif kind == "decode_chunk":  # the state's cache is updated in place
            fn, args, donate = self.programs.decode_chunk, (self.params, *self.decode_chunk_args(batch)), 1
        elif kind == "gather":
            states = tuple(self.decode_chunk_args(b)[0] for b in shape)
            fn, args, donate = kv_decode.gather_rows, (states, i32(batch), i32(batch).update(dtype=bool)), ()
        else:
            pool = jax.ShapeDtypeStruct(self.pool.shape, self.pool.dtype)
            nb = self.config.max_seq_len // self.prefix.block
            if kind == "store":
                rows, cache = i32(batch * nb), self.decode_chunk_args(batch)[0].cache
                store = functools.partial(kv_decode.store_blocks, block=self.prefix.block)
                fn, args, donate = store, (pool, cache, rows, rows, rows), 0
            else:
                _, lengths, *sampling = self.start_args(shape, batch)
                windows = i32(batch, self.config.max_seq_len)
                args = (pool, i32(batch, nb), i32(batch), i32(batch, shape), lengths, windows, *sampling)
                fn, args, donate = self.programs.start_cached, (self.params, *args), ()
        self.compiled[key] = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
        return self.compiled[key]

    def start_args(self, bucket: int, batch: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Abstract arguments after params of ``start``: tokens [batch, bucket] int32, then per row
        lengths int32, seeds uint32, temperature float32, top_k int32, top_p float32, max_new int32."""
        per_row = [jnp.int32, jnp.uint32, jnp.float32, jnp.int32, jnp.float32, jnp.int32]
        tokens = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
        return (tokens, *(jax.ShapeDtypeStruct((batch,), dtype) for dtype in per_row))

    def decode_chunk_args(self, batch: int) -> tuple[DecodeState, jax.ShapeDtypeStruct]:
        """Abstract arguments after params of ``decode_chunk``: (DecodeState, max_steps () int32)."""
        state, _ = jax.eval_shape(self.programs.start, self.params, *self.start_args(self.buckets[0], batch))
        return state, jax.ShapeDtypeStruct((), jnp.int32)

    def check(self, request: Request) -> None:
        """ValueError naming the field when ``request`` cannot be served."""
        r, limit, cap = request, self.settings.max_prompt_bytes, self.settings.max_new_tokens
        if not r.prompt:
            raise ValueError("prompt is empty: give at least one character")
        if len(r.prompt) > limit:
            raise ValueError(f"prompt is {len(r.prompt)} bytes; the limit is {limit}")
        check_sampling(r.max_new_tokens, r.temperature, r.top_k, self.config.vocab_size, r.seed, cap, r.top_p)

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Every request's new tokens. Raises ValueError as ``stream``."""
        done = [Completion([], self.prompt_tokens(r)) for r in requests]
        for chunk in self.stream(requests):
            for completion, tokens in zip(done, chunk):
                completion.tokens += tokens
        return done

    def prompt_tokens(self, request: Request) -> int:
        """Prompt bytes the model reads: the last ``context_len`` (max_seq_len - 1)."""
        return min(len(request.prompt), self.context_len)

    def stream(self, requests: list[Request]) -> Iterator[list[list[int]]]:
        """Yields, chunk by chunk, each request's new tokens ([] once finished) until all are done.
        Raises ValueError as ``check``, or for more than ``max_batch_size`` requests."""
        if not 1 <= len(requests) <= self.max_batch_size:
            raise ValueError(f"a batch holds 1..{self.max_batch_size} requests, got {len(requests)}")
        for request in requests:
            self.check(request)
        return self._stream(requests)

    def _stream(self, requests: list[Request]) -> Iterator[list[list[int]]]:
        state, first = self.start(requests)
        yield [[int(token)] for token in first]
        left = [r.max_new_tokens - 1 for r in requests]
        while max(left) > 0:
            state, out, counts = self.decode_chunk(state)
            yield [out[i, : counts[i]].tolist() for i in range(len(requests))]
            left = [n - int(c) for n, c in zip(left, counts)]

    def _inputs(self, requests: list[Request], bucket: int, batch: int) -> tuple[np.ndarray, ...]:
        """Host arrays for ``start`` (as ``start_args``); padding rows: a one-byte prompt, no new tokens."""
        tokens = np.zeros((batch, bucket), np.int32)
        lengths, seeds = np.ones(batch, np.int32), np.zeros(batch, np.uint32)
        temperature, top_k = np.zeros(batch, np.float32), np.full(batch, self.config.vocab_size, np.int32)
        top_p, max_new = np.ones(batch, np.float32), np.zeros(batch, np.int32)
        for i, r in enumerate(requests):
            window, lengths[i] = prompt_window(r.prompt, self.context_len, self.config.max_seq_len)
            tokens[i] = window[:bucket]  # the bucket holds the prompt: only padding zeros are cut
            seeds[i], temperature[i], max_new[i] = r.seed, r.temperature, r.max_new_tokens
            top_k[i], top_p[i] = r.top_k or self.config.vocab_size, r.top_p
        return tokens, lengths, seeds, temperature, top_k, top_p, max_new

    def info(self) -> dict:
        """JSON-able description: model config (less fields a transformer does not read), source,
        settings, devices and compile time."""
        return {
            "model": self.config.model_dump(exclude=TRAINING_ONLY),
            "checkpoint": self.source,
            "settings": self.settings.model_dump(),
            "buckets": list(self.buckets),
            "context_keep": check_keep(self.settings, self.config.max_seq_len),
            "kv_cache_dtype": self.kv_cache_dtype,
            "devices": [str(d) for d in jax.devices()],
            "backend": jax.default_backend(),
            "jax": jax.__version__,
            "compile_s": self.compile_s,
            "programs": len(self.compiled),
            "prefix_cache": self.prefix.info() | {"mib": self.pool.nbytes / 2**20} if self.prefix else None,
        }


def check_keep(settings: EngineSettings, max_seq_len: int) -> int:
    """The context_keep in force: settings' or max_seq_len // 2. ValueError outside 2..max_seq_len - 1."""
    keep, context = settings.context_keep or max(2, max_seq_len // 2), context_len(max_seq_len)
    if not 2 <= keep <= context:
        raise ValueError(f"context_keep must be in 2..{context} (max_seq_len - 1), got {keep}")
    return keep


def gather_shapes(batch_sizes: tuple[int, ...]) -> list[tuple[tuple[int, ...], int]]:
    """(joined batch sizes, target batch size) of every ``gather`` program: a running batch B joined
    with a fresh batch b into any B' >= b, or a running batch shrunk to any smaller B'."""
    joins = [((r, f), t) for r in batch_sizes for f in batch_sizes for t in batch_sizes if t >= f]
    return joins + [((r,), t) for r in batch_sizes for t in batch_sizes if t < r]


def compiled_buckets(settings: EngineSettings, max_seq_len: int) -> tuple[int, ...]:
    """The prompt buckets compiled: settings' below max_seq_len, and max_seq_len itself."""
    return tuple(sorted({b for b in settings.buckets if b < max_seq_len} | {max_seq_len}))


def kv_generate(model, params, prompt: str, sampling: Sampling, context_keep: int | None = None) -> str:
    """``sampling.generate`` with the KV-cache sampler; equal token for token while prompt + output fit
    in max_seq_len - 1. Raises ValueError as ``generate``, or as ``check_keep``."""
    sampling.check(model.config.vocab_size)
    encoded, new = encode_prompt(prompt), sampling.max_new_tokens
    prompt_window(encoded, 1)  # the empty-prompt error
    bucket = min(len(encoded), context_len(model.config.max_seq_len))
    budget = {"chunk": new, "max_new_tokens": new, "max_prompt_bytes": len(encoded)}
    settings = EngineSettings(
        buckets=(bucket,), batch_sizes=(1,), context_keep=context_keep, prefix_cache_mib=0, **budget
    )  # one prompt: nothing to reuse
    engine = Engine.for_model(model, params, settings)
    [done] = engine.generate([Request(encoded, new, sampling.temperature, sampling.top_k, sampling.seed)])
    return done.text
