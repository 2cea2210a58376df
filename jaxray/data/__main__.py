"""``python -m jaxray.data prepare``: see ``--help``. Options are checked before any file is read."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jaxray.argtypes import checked, folder, positive_int
from jaxray.data.prepare import (
    DATASETS,
    DEFAULT_ROW_GROUP_ROWS,
    DEFAULT_ROWS_PER_FILE,
    DEFAULT_SEQ_LEN,
    out_problem,
    prepare,
)
from jaxray.data.sources import DataFileError


def seq_len_arg(text: str) -> int:
    value = positive_int(text)
    return checked(value, value >= 2, "an integer >= 2 (input and shifted target)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxray.data", description="Data preparation.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("prepare", help="write a dataset as Parquet files and a manifest for Ray Data")
    s.add_argument("--dataset", required=True, choices=DATASETS)
    s.add_argument("--out", required=True, type=Path, help="new (or empty) folder to write")
    s.add_argument(
        "--data-dir",
        type=folder,
        default=None,
        help="folder with the source files (default: JAXRAY_DATA_DIR, then jaxray's search order)",
    )
    s.add_argument(
        "--seq-len",
        type=seq_len_arg,
        default=None,
        help=f"tinyshakespeare only: bytes per sequence T (default {DEFAULT_SEQ_LEN})",
    )
    s.add_argument(
        "--rows-per-file",
        type=positive_int,
        default=DEFAULT_ROWS_PER_FILE,
        help=f"rows per Parquet file, the last one may hold fewer (default {DEFAULT_ROWS_PER_FILE})",
    )
    s.add_argument(
        "--row-group-rows",
        type=positive_int,
        default=DEFAULT_ROW_GROUP_ROWS,
        help=f"rows per Parquet row group (default {DEFAULT_ROW_GROUP_ROWS})",
    )
    args = p.parse_args(argv)
    if args.seq_len is not None and args.dataset != "tinyshakespeare":
        s.error(f"argument --seq-len: applies to --dataset tinyshakespeare only, not {args.dataset}")
    if args.row_group_rows > args.rows_per_file:
        s.error(
            f"argument --row-group-rows: {args.row_group_rows} is more than "
            f"--rows-per-file {args.rows_per_file}"
        )
    problem = out_problem(args.out)
    if problem:
        s.error(f"argument --out: {problem} (nothing was changed)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        manifest = prepare(
            args.dataset,
            args.out,
            args.data_dir,
            args.seq_len or DEFAULT_SEQ_LEN,
            args.rows_per_file,
            args.row_group_rows,
        )
    except (ValueError, DataFileError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"error: writing {args.out} failed: {err} (nothing was left behind)", file=sys.stderr)
        return 1
    splits = ", ".join(
        f"{name} {s['rows']} rows in {len(s['files'])} files" for name, s in manifest["splits"].items()
    )
    print(f"wrote {args.out}: {args.dataset}, {splits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
