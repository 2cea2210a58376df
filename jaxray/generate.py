"""Byte-level sampling from a trained transformer; ``python -m jaxray.generate``.

Samplers: ``kv`` (default, ``jaxray.inference.engine.kv_generate``) and ``full``, the full-recompute
reference (``jaxray.inference.sampling.generate``)."""

from __future__ import annotations

import argparse
import sys

from jaxray import argtypes, checkpoint
from jaxray.inference.engine import kv_generate
from jaxray.inference.load import open_transformer
from jaxray.inference.sampling import Sampling, encode_prompt, generate, printable, prompt_window
from jaxray.reporting import checkpoint_line


def main(argv: list[str] | None = None) -> int:
    p = argtypes.cli_parser("python -m jaxray.generate", "Sample text from a trained transformer.")
    p.add_argument("--checkpoint", required=True, help=argtypes.TRANSFORMER_CHECKPOINT_HELP)
    p.add_argument(
        "--prompt", default="ROMEO:", help="text to continue; only its last max_seq_len - 1 bytes are used"
    )
    p.add_argument("--max-new-tokens", type=int, default=300, help="bytes to sample")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature; 0 is greedy")
    p.add_argument("--top-k", type=int, default=None, help="sample from the k most likely bytes; unset: all")
    p.add_argument("--seed", type=int, default=0, help="PRNG seed")
    p.add_argument(
        "--sampler",
        choices=("kv", "full"),
        default="kv",
        help="kv: prefill once, then a KV-cache decode step per byte; full: recompute the window per byte",
    )
    p.add_argument(
        "--context-keep",
        type=argtypes.context_keep,
        default=None,
        help="kv: bytes kept when the window is full (2..max_seq_len - 1; default max_seq_len // 2)",
    )
    args = p.parse_args(argv)
    try:
        text = sample_text(args)
    except (checkpoint.CheckpointError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(printable(args.prompt + text))
    return 0


def sample_text(args: argparse.Namespace) -> str:
    """The text sampled after ``args.prompt`` (prompt excluded), every option checked before the restore;
    the checkpoint is named on stderr. Raises ValueError naming the option, CheckpointError the path."""
    sampling = Sampling(args.max_new_tokens, args.temperature, args.seed, args.top_k)
    sampling.check()
    prompt_window(encode_prompt(args.prompt), 1)  # an empty prompt fails before the restore
    if args.context_keep is not None and args.sampler == "full":
        raise ValueError("--context-keep applies to --sampler kv only")
    opened, _ = open_transformer(args.checkpoint, "sampled")  # an export artifact: refused
    print(checkpoint_line.describe(opened.path), file=sys.stderr, flush=True)
    model, params = checkpoint.restore(opened)
    if args.sampler == "kv":
        return kv_generate(model, params, args.prompt, sampling, args.context_keep)
    return generate(model, params, args.prompt, sampling)


if __name__ == "__main__":
    sys.exit(main())
