"""Byte-level sampling from a trained transformer; ``python -m jaxray.generate``.

Two samplers: ``kv_generate`` (the default of the CLI) prefills the prompt once and decodes each
new byte against a KV cache (``jaxray.decoding``); ``generate`` is the learning path's recipe, the
full-recompute sampler below, kept as the reference both are tested against.

``sample`` is pure over a ``tokens_to_logits`` callback (testable without a model). It recomputes the
full fixed-size window for every new byte (the learning path's recipe) but keeps the whole loop on
device in one ``lax.fori_loop``: one compiled program per (window, max_new_tokens), the same at
every step, and no host round trip per byte. Prompts longer than the window keep their last
``max_seq_len`` bytes; once the window is full it slides by one byte per new token.

  python -m jaxray.generate --checkpoint runs/demo --prompt "ROMEO:" --max-new-tokens 300 \\
      --temperature 0.8 --seed 0
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxray import cli
from jaxray.data.shakespeare import decode
from jaxray.decoding import draw

# One call samples up to this many bytes (the whole loop is one compiled program, so the cap bounds
# its run time); seeds are 32-bit.
MAX_NEW_TOKENS = 10_000
MAX_SEED = 2**32 - 1

# [1, T] int32 -> [1, T, V] float32, as a jax.tree_util.Partial so params travel as traced leaves.
TokensToLogits = Callable[[jax.Array], jax.Array]


def _next_token(logits: jax.Array, key: jax.Array, temperature: jax.Array, top_k: Optional[int]) -> jax.Array:
    """logits [V] float32 -> int32 token: argmax when temperature <= 0, else a draw at ``temperature``
    from the ``top_k`` most likely (all when None); ``jaxray.decoding.draw``."""
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][-1]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return draw(logits, key, temperature)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k"))
def sample(tokens_to_logits: TokensToLogits, window: jax.Array, length: jax.Array, key: jax.Array,
           temperature: jax.Array, max_new_tokens: int, top_k: Optional[int] = None) -> jax.Array:
    """Sample ``max_new_tokens`` bytes after the prompt held in ``window``.

    window: [T] int32, the prompt in ``window[:length]`` (1 <= length <= T), zeros after it.
    Returns [max_new_tokens] int32. Causal attention means the padding after position
    ``length - 1`` never changes the logits read there.
    """
    size = window.shape[0]

    def step(i, carry):
        window, length, key, out = carry
        key, subkey = jax.random.split(key)
        logits = tokens_to_logits(window[None])[0, length - 1]
        token = _next_token(logits, subkey, temperature, top_k)
        appended = window.at[jnp.minimum(length, size - 1)].set(token)
        slid = jnp.roll(window, -1).at[size - 1].set(token)
        window = jnp.where(length < size, appended, slid)
        return window, jnp.minimum(length + 1, size), key, out.at[i].set(token)

    out = jnp.zeros((max_new_tokens,), jnp.int32)
    return jax.lax.fori_loop(0, max_new_tokens, step, (window, length, key, out))[3]


def prompt_window(prompt: bytes, max_seq_len: int) -> tuple[np.ndarray, int]:
    """The prompt's last ``max_seq_len`` bytes left-aligned in a [max_seq_len] int32 window, and its length.

    Raises ValueError for an empty prompt.
    """
    if not prompt:
        raise ValueError("prompt is empty: give at least one character")
    tail = np.frombuffer(prompt[-max_seq_len:], np.uint8).astype(np.int32)
    window = np.zeros((max_seq_len,), np.int32)
    window[:len(tail)] = tail
    return window, len(tail)


def check_sampling(max_new_tokens: int, temperature: float, top_k: Optional[int], vocab_size: int = 256,
                   seed: int = 0, cap: int = MAX_NEW_TOKENS) -> None:
    """ValueError naming the argument if ``max_new_tokens`` is outside 1..cap (default
    MAX_NEW_TOKENS), ``temperature`` is negative or not finite, ``top_k`` is outside 1..vocab_size,
    or ``seed`` outside 0..2**32 - 1."""
    if not 1 <= max_new_tokens <= cap:
        raise ValueError(f"max_new_tokens must be in 1..{cap}, got {max_new_tokens}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed must be in 0..{MAX_SEED}, got {seed}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and not 1 <= top_k <= vocab_size:
        raise ValueError(f"top_k must be in 1..{vocab_size}, got {top_k}")


def encode_prompt(prompt: str) -> bytes:
    """``prompt`` as UTF-8 bytes. ValueError naming the prompt if it holds lone surrogates (text a
    shell decoded from invalid UTF-8), which have no UTF-8 form."""
    try:
        return prompt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"prompt is not valid Unicode text ({err.reason} at position {err.start}); "
                         f"pass UTF-8 text") from None


def generate(model, params, prompt: str, max_new_tokens: int, temperature: float = 0.8, seed: int = 0,
             top_k: Optional[int] = None) -> str:
    """The text sampled after ``prompt`` (the prompt itself not included). Invalid UTF-8 in the
    sampled bytes becomes U+FFFD. Raises ValueError for an empty prompt, ``max_new_tokens`` < 1,
    a negative or non-finite temperature, or ``top_k`` outside 1..vocab."""
    check_sampling(max_new_tokens, temperature, top_k, model.config.vocab_size, seed)
    window, length = prompt_window(encode_prompt(prompt), model.config.max_seq_len)
    tokens_to_logits = jax.tree_util.Partial(model.apply, params)
    new = sample(tokens_to_logits, jnp.asarray(window), jnp.int32(length), jax.random.key(seed),
                 jnp.float32(temperature), max_new_tokens, top_k)
    return decode(np.asarray(new))


def kv_generate(model, params, prompt: str, max_new_tokens: int, temperature: float = 0.8, seed: int = 0,
                top_k: Optional[int] = None, context_keep: Optional[int] = None) -> str:
    """As ``generate``, with the KV-cache sampler in one compiled call: equal to ``generate`` token
    for token while prompt + output fit in max_seq_len, and beyond when ``context_keep`` is
    max_seq_len (see ``jaxray.decoding`` for the window policy; default max_seq_len // 2). Raises
    ValueError as ``generate``, or for ``context_keep`` outside 2..max_seq_len."""
    from jaxray.engine import Engine, EngineSettings, Request

    check_sampling(max_new_tokens, temperature, top_k, model.config.vocab_size, seed)
    encoded = encode_prompt(prompt)
    prompt_window(encoded, 1)  # the empty-prompt error
    size = model.config.max_seq_len
    settings = EngineSettings(buckets=(min(len(encoded), size),), batch_sizes=(1,), chunk=max_new_tokens,
                              max_new_tokens=max_new_tokens, max_prompt_bytes=max(len(encoded), 1),
                              context_keep=context_keep)
    engine = Engine.for_model(model, params, settings)
    [done] = engine.generate([Request(encoded, max_new_tokens, temperature, top_k, seed)])
    return done.text


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: control characters other than newline and tab (an
    undertrained model samples bytes such as ESC or carriage return) become U+FFFD."""
    return "".join(c if c in "\n\t" or c.isprintable() else "\ufffd" for c in text)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxray.generate", description="Sample text from a trained transformer.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint folder, a train/<trial> folder, or runs/<experiment> (its best transformer)")
    p.add_argument("--prompt", default="ROMEO:", help="text to continue; only its last max_seq_len bytes are used")
    p.add_argument("--max-new-tokens", type=int, default=300, help="bytes to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely bytes; unset: all")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    p.add_argument("--sampler", choices=("kv", "full"), default="kv",
                   help="kv: prefill once, then a KV-cache decode step per byte; full: recompute the window per byte")
    p.add_argument("--context-keep", type=cli.context_keep, default=None,
                   help="kv: bytes kept when the window is full (2..max_seq_len; default max_seq_len // 2)")
    args = p.parse_args(argv)
    from jaxray import checkpoint

    try:
        check_sampling(args.max_new_tokens, args.temperature, args.top_k, seed=args.seed)
        prompt_window(encode_prompt(args.prompt), 1)  # an empty prompt fails before the restore
        path = checkpoint.resolve(args.checkpoint, workload="transformer")
        workload = checkpoint.load_model_config(path).workload
        if workload != "transformer":
            raise checkpoint.CheckpointError(f"{path} holds a {workload} checkpoint; generation needs a transformer")
        if args.context_keep is not None and args.sampler == "full":
            raise ValueError("--context-keep applies to --sampler kv only")
        model, params = checkpoint.restore(path)
        if args.sampler == "kv":
            text = kv_generate(model, params, args.prompt, args.max_new_tokens, args.temperature, args.seed,
                               args.top_k, args.context_keep)
        else:
            text = generate(model, params, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.top_k)
    except (checkpoint.CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(printable(args.prompt + text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
