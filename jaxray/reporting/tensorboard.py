"""TensorBoard event files for a training run (tensorboardX)."""

from __future__ import annotations

import logging
from pathlib import Path

from tensorboardX import SummaryWriter

log = logging.getLogger(__name__)


class TensorBoardLogger:
    """Writes each logged row as scalars ``train/<name>`` at its ``step``. Use as a context manager:
    without ``close()`` tensorboardX loses the last scalars."""

    def __init__(self, logdir: str | Path):
        self._logdir = Path(logdir)
        self._writer = SummaryWriter(str(logdir))

    def __call__(self, row: dict[str, float]) -> None:
        step = int(row["step"])
        for name, value in row.items():
            if name != "step":  # held-out metrics under val/ (val/loss), the rest under train/
                tag = f"val/{name[4:]}" if name.startswith("val_") else f"train/{name}"
                self._writer.add_scalar(tag, value, step)

    def add_final(self, summary: dict, step: int) -> None:
        for name, value in summary.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"final/{name}", value, step)

    def close(self) -> None:
        """Flush and close; an OSError (a full disk) names the event folder."""
        try:
            self._writer.flush()
            self._writer.close()
        except OSError as err:
            raise OSError(f"could not write the TensorBoard events in {self._logdir}: {err}") from None

    def __enter__(self) -> TensorBoardLogger:
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            self.close()
        except OSError as err:
            if kind is None:
                raise
            # An exception is already on its way out: a failing close must not replace it.
            log.warning("%s", err)
