"""``python -m jaxray.export`` onto a full disk (a real tmpfs, filled to ENOSPC, or with a little space
left so that a file is cut off half-written): one error line naming --out and the OS error, exit
code 1, nothing of the failed export left behind (its temporary folder, the folders above --out it
created), and an earlier artifact on the same disk untouched."""

from __future__ import annotations

import errno
import hashlib
from pathlib import Path

import pytest
from full_disk import fill, small_tmpfs

from jaxray import export as export_cli

OPTIONS = ["--buckets", "8", "--batch-sizes", "1", "--chunk", "8"]


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize(
    "leave",
    [0, pytest.param(64 << 10, marks=pytest.mark.slow)],
    ids=["full", "cut-off-mid-file"],  # slow: CI
)
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(
    trained_transformer, tmp_path, capsys, leave
):
    with small_tmpfs(tmp_path / "disk", 8) as disk:
        earlier = disk / "earlier"
        assert (
            export_cli.main(["--checkpoint", str(trained_transformer), "--out", str(earlier), *OPTIONS]) == 0
        )
        kept = digests(earlier)
        capsys.readouterr()
        fill(disk, leave=leave)
        for out in (disk / "new", disk / "a" / "b" / "new"):
            code = export_cli.main(["--checkpoint", str(trained_transformer), "--out", str(out), *OPTIONS])
            err = capsys.readouterr().err  # after the line naming the checkpoint (test_chosen_checkpoint.py)
            named, err = err.split("\n", 1)
            assert named.startswith("checkpoint: ") and code == 1
            assert err.count("\n") == 1 and "Traceback" not in err
            assert err.startswith(f"error: the export to --out {out} could not be written")
            assert "No space left on device" in err
            assert sorted(p.name for p in disk.iterdir()) == ["earlier", "filler"]
        assert digests(earlier) == kept


def test_an_out_taken_by_another_export_meanwhile_is_not_called_a_full_disk(tmp_path):
    from jaxray.export import _write_failure  # noqa: PLC0415 (the wording alone, no export needed)

    taken = _write_failure(tmp_path, OSError(errno.ENOTEMPTY, "Directory not empty"))
    assert "was filled while this export ran" in taken and "free space" not in taken
    full = _write_failure(tmp_path, OSError(errno.ENOSPC, "No space left on device"))
    assert "free space or choose another --out" in full
