"""Export a trained transformer with ``jax.export``; ``python -m jaxray.export``.

Command line of ``jaxray.inference.artifact``. A failed write exits 1 with one line naming --out
and the OS error, having removed what it wrote."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

from jaxray.argtypes import TRANSFORMER_CHECKPOINT_HELP, cli_parser
from jaxray.folders import removed_if_failed
from jaxray.inference.artifact import ATTENTION_NOTE, check_out, export_checkpoint
from jaxray.inference.load import check_checkpoint
from jaxray.inference.settings import add_engine_options, engine_settings
from jaxray.reporting import checkpoint_line


def _write_failure(out: Path, err: OSError) -> str:
    """What a failed write of the artifact into ``out`` tells the user."""
    if err.errno in (errno.ENOTEMPTY, errno.EEXIST):  # the final rename found --out taken
        return (
            f"--out {out} was filled while this export ran (another export into it, say: {err}); "
            f"what is there now is kept and this export's files are removed: choose another --out"
        )
    advice = "free space or choose another --out" if err.errno == errno.ENOSPC else "choose another --out"
    return f"the export to --out {out} could not be written ({err}); nothing was left there: {advice}"


def main(argv: list[str] | None = None) -> int:
    p = cli_parser(
        "python -m jaxray.export",
        "Export a trained transformer's forward and KV-cache sampling programs with jax.export "
        "(XLA attention), weights and a manifest.",
    )
    p.add_argument("--checkpoint", required=True, help=TRANSFORMER_CHECKPOINT_HELP)
    p.add_argument("--out", required=True, help="a new (or empty) folder for the artifact; never overwritten")
    add_engine_options(p, ("buckets", "batch_sizes", "chunk", "context_keep", "kv_cache_dtype"))
    args = p.parse_args(argv)
    out = Path(args.out).absolute()
    try:
        with removed_if_failed(out):
            check_out(out)
            settings = engine_settings(args)
            source = check_checkpoint(args.checkpoint, settings, purpose="exported")
            print(checkpoint_line.describe(source.path), file=sys.stderr, flush=True)
            manifest = export_checkpoint(source, out, settings)
    except ValueError as err:  # CheckpointError, ExportError, AttentionError, a context_keep out of range
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # writing the artifact: its temporary folder is already removed
        print(f"error: {_write_failure(out, err)}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in out.iterdir())
    print(
        f"exported {len(manifest['functions'])} programs of {manifest['checkpoint']} to {args.out} "
        f"({size / 2**20:.1f} MiB): buckets {manifest['buckets']}, batch sizes "
        f"{manifest['batch_sizes']}, chunk {manifest['chunk']}, context_keep {manifest['context_keep']}, "
        f"platforms {', '.join(manifest['platforms'])}"
    )
    print(f"attention: xla ({ATTENTION_NOTE})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
