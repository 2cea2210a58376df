"""A checkpoint of given params for tests that need one without training: the train state of the
trial's fresh optimiser at step 0 around ``params``, written by ``checkpoint.save_state`` as training
does (so it also resumes)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxray import checkpoint
from jaxray.config import TrialConfig
from jaxray.train.step import init_state, optimizer_for


def save_params(directory: str | Path, params: Any, trial: TrialConfig) -> Path:
    """``params`` (and ``trial``'s configs) as a committed checkpoint in ``directory``; its path."""
    state = init_state(params, optimizer_for(trial)[0])
    return checkpoint.save_state(directory, state, trial, [], {})
