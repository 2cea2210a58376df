"""Byte-level sampling: checks, prompt window and encoding shared by every sampler, the per-token
draw and masks, and the full-recompute sampler ``sample`` (the whole window per new byte, in one
``lax.fori_loop``; prompts keep their last max_seq_len - 1 bytes). ``kv_decode`` uses the same
``draw`` and key schedule, so both give the same tokens for the same seed."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxray.data.shakespeare import bytes_to_text

# Cap on bytes per call (the loop is one compiled program); seeds are 32-bit.
MAX_NEW_TOKENS = 10_000
MAX_SEED = 2**32 - 1

# [1, T] int32 -> [1, T, V] float32, as a jax.tree_util.Partial so params travel as traced leaves.
TokensToLogits = Callable[[jax.Array], jax.Array]


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k"))
def sample(
    tokens_to_logits: TokensToLogits,
    window: jax.Array,
    length: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    max_new_tokens: int,
    top_k: int | None = None,
) -> jax.Array:
    """[max_new_tokens] int32 bytes sampled after the prompt ``window[:length]`` (1 <= length <= T) of
    ``window`` [T] int32, zeros after it; T is the context read (``context_len``: the window slides once
    full)."""
    size = window.shape[0]

    def step(i, carry):
        window, length, key, out = carry
        key, subkey = jax.random.split(key)
        logits = tokens_to_logits(window[None])[0, length - 1]
        if top_k is not None:  # static: the top_k most likely only
            logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
        token = draw(logits, subkey, temperature)
        appended = window.at[jnp.minimum(length, size - 1)].set(token)
        slid = jnp.roll(window, -1).at[size - 1].set(token)
        window = jnp.where(length < size, appended, slid)
        return window, jnp.minimum(length + 1, size), key, out.at[i].set(token)

    out = jnp.zeros((max_new_tokens,), jnp.int32)
    return jax.lax.fori_loop(0, max_new_tokens, step, (window, length, key, out))[3]


def context_len(max_seq_len: int) -> int:
    """Positions a transformer of ``max_seq_len`` reads at inference: max_seq_len - 1. Training
    predicts from positions 0..T-2 of its T-byte windows (``jaxray.train.step``'s logits[:, :-1]), so
    the output at position T - 1 is never trained and its position embedding gets no gradient."""
    return max_seq_len - 1


def prompt_window(prompt: bytes, context: int, size: int | None = None) -> tuple[np.ndarray, int]:
    """The prompt's last ``context`` bytes left-aligned in a [size] (default [context]) int32 window,
    and its length. Raises ValueError for an empty prompt."""
    if not prompt:
        raise ValueError("prompt is empty: give at least one character")
    tail = np.frombuffer(prompt[-context:], np.uint8).astype(np.int32)
    window = np.zeros((size or context,), np.int32)
    window[: len(tail)] = tail
    return window, len(tail)


def check_sampling(
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    vocab_size: int = 256,
    seed: int = 0,
    cap: int = MAX_NEW_TOKENS,
    top_p: float = 1.0,
) -> None:
    """ValueError naming the argument outside its range: ``max_new_tokens`` 1..cap, ``temperature``
    finite >= 0, ``top_k`` 1..vocab_size, ``top_p`` (0, 1], ``seed`` 0..2**32 - 1."""
    if not 1 <= max_new_tokens <= cap:
        raise ValueError(f"max_new_tokens must be in 1..{cap}, got {max_new_tokens}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in 0..{MAX_SEED}, got {seed}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be in 1..{vocab_size}, got {top_k}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def encode_prompt(prompt: str) -> bytes:
    """``prompt`` as UTF-8 bytes. ValueError naming the prompt if it holds lone surrogates."""
    try:
        return prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"prompt is not valid Unicode text ({err.reason} at position {err.start}); pass UTF-8 text"
        ) from None


@dataclass(frozen=True)
class Sampling:
    """Options of both samplers' ``generate``: temperature 0 is greedy, top_k None: all."""

    max_new_tokens: int
    temperature: float = 0.8
    seed: int = 0
    top_k: int | None = None

    def check(self, vocab_size: int = 256) -> None:
        """``check_sampling`` of these options for a model of ``vocab_size`` tokens (default: bytes)."""
        check_sampling(self.max_new_tokens, self.temperature, self.top_k, vocab_size, self.seed)


def generate(model, params, prompt: str, sampling: Sampling) -> str:
    """The text sampled after ``prompt`` (invalid UTF-8 becomes U+FFFD). Raises ValueError for an
    empty prompt or as ``check_sampling``."""
    sampling.check(model.config.vocab_size)
    window, length = prompt_window(encode_prompt(prompt), context_len(model.config.max_seq_len))
    tokens_to_logits = jax.tree_util.Partial(model.apply, params)
    key, temperature = jax.random.key(sampling.seed), jnp.float32(sampling.temperature)
    window, length = jnp.asarray(window), jnp.int32(length)
    new = sample(tokens_to_logits, window, length, key, temperature, sampling.max_new_tokens, sampling.top_k)
    return bytes_to_text(np.asarray(new))


def printable(text: str) -> str:
    """``text`` with control characters other than newline and tab replaced by U+FFFD."""
    return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd" for c in text)


def next_tokens(
    logits: jax.Array, rng: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
):
    """Sample one token per row. logits [B, V] float32; rng [B, 2] uint32 key data; temperature [B];
    top_k [B] int32; top_p [B] float32 in (0, 1]. Returns (tokens [B] int32, rng [B, 2]); same key
    schedule as ``sample``."""
    logits = jnp.where(top_k_mask(logits, top_k), logits, -jnp.inf)
    logits = jnp.where(top_p_mask(logits, temperature, top_p), logits, -jnp.inf)

    def row(logits, key_data, temperature):
        key, subkey = jax.random.split(jax.random.wrap_key_data(key_data))
        return draw(logits, subkey, temperature), jax.random.key_data(key)

    return jax.vmap(row)(logits, rng, temperature)


def draw(logits: jax.Array, key: jax.Array, temperature: jax.Array) -> jax.Array:
    """One token from logits [V] float32 (-inf: excluded): argmax when temperature <= 0, else a
    draw from softmax(logits / temperature) by inverting its CDF at one uniform number (cheaper
    than ``jax.random.categorical``'s V Gumbel draws)."""
    probs = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6))
    cdf = jnp.cumsum(probs)
    above = cdf > jax.random.uniform(key) * cdf[-1]  # the first token whose CDF passes u is drawn
    greedy = jnp.argmax(logits)  # also where rounding left no CDF entry above u
    drawn = jnp.where(above.any(), jnp.argmax(above), greedy)
    return jnp.where(temperature > 0, drawn, greedy).astype(jnp.int32)


def top_k_mask(logits: jax.Array, top_k: jax.Array) -> jax.Array:
    """[B, V] bool: the logits of row b among its top_k[b] largest (ties at the k-th value kept),
    computed by counting larger logits rather than sorting; skipped when no row restricts."""

    def ranked(logits):
        larger = (logits[:, None, :] > logits[:, :, None]).sum(axis=-1)  # [B, V]: count of larger logits
        return larger < top_k[:, None]

    return jax.lax.cond(jnp.any(top_k < logits.shape[-1]), ranked, lambda x: jnp.ones(x.shape, bool), logits)


def top_p_mask(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> jax.Array:
    """[B, V] bool: nucleus sampling (Holtzman et al. 2019, as vLLM's ``top_p``): the tokens of row
    b whose more likely tokens hold less than ``top_p[b]`` of softmax(logits / temperature), so the
    most likely token always stays; counts rather than sorts; skipped when every top_p is 1."""

    def nucleus(logits):
        probs = jax.nn.softmax(logits / jnp.maximum(temperature, 1e-6)[:, None])  # [B, V]
        larger = logits[:, None, :] > logits[:, :, None]  # [B, V, V]: token j more likely than i
        kept = (larger * probs[:, None, :]).sum(axis=-1) < top_p[:, None]
        return kept | (top_p >= 1)[:, None]  # a row with top_p 1 keeps all, whatever its batch-mates

    return jax.lax.cond(jnp.any(top_p < 1), nucleus, lambda x: jnp.ones(x.shape, bool), logits)
