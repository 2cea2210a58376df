"""TensorBoard event files for a training run (tensorboardX)."""

from __future__ import annotations

from pathlib import Path

from tensorboardX import SummaryWriter


class TensorBoardLogger:
    """Writes each logged row as scalars ``train/<name>`` at its ``step``; ``close`` flushes.

    Without ``flush()`` and ``close()`` at the end tensorboardX loses the last scalars, so use it as a
    context manager.
    """

    def __init__(self, logdir: str | Path):
        self._writer = SummaryWriter(str(logdir))

    def __call__(self, row: dict[str, float]) -> None:
        step = int(row["step"])
        for name, value in row.items():
            if name != "step":
                self._writer.add_scalar(f"train/{name}", value, step)

    def add_final(self, summary: dict, step: int) -> None:
        for name, value in summary.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"final/{name}", value, step)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
