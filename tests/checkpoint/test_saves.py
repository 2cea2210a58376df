"""A save that cannot finish, on a real full disk (a small tmpfs, see ``full_disk``):
``checkpoint.save_state`` raises CheckpointSaveError naming the folder, the
step and the cause, and a checkpoint saved before on the same disk still verifies and restores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from full_disk import fill, small_tmpfs

from jaxray import checkpoint
from jaxray.config import parse_trial
from jaxray.models import build
from jaxray.train.step import init_state, make_optimizer

TRIAL = parse_trial({"model": {"workload": "mlp", "width": 64}})
NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
def state():
    fresh = init_state(build(TRIAL.model).init(jax.random.key(0)), make_optimizer(1e-3, 0.0))
    return fresh._replace(step=jnp.asarray(40, fresh.step.dtype))


# 0: the first file fails; 100 KiB: less than the arrays (~600 KiB), refused before Orbax writes any.
@pytest.mark.parametrize("leave", [0, 100 << 10])
# Orbax's background writer, stopped by the full disk, leaves an "Event loop is closed" behind.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_save_onto_a_full_disk_says_where_which_step_and_why(tmp_path, state, leave):
    with small_tmpfs(tmp_path / "disk", 8) as disk:
        earlier = checkpoint.save_state(disk / "step_20", state, TRIAL, [{"step": 20}], {})
        fill(disk, leave)
        with pytest.raises(checkpoint.CheckpointSaveError) as err:
            checkpoint.save_state(disk / "step_40", state, TRIAL, [], {})
        message = str(err.value)
        assert message.startswith(f"could not save the checkpoint of step 40 in {disk / 'step_40'}: ")
        assert NO_SPACE in message and isinstance(err.value, OSError)
        if leave:  # the small files fit: the arrays are refused before a byte of them is written
            assert "the arrays need 0.6 MiB" in message, message
            assert not (disk / "step_40" / "params").exists()
        # The unfinished one is never taken for a checkpoint; the earlier one is whole.
        with pytest.raises(checkpoint.CheckpointError, match="incomplete|is not a checkpoint"):
            checkpoint.verify(disk / "step_40")
        assert checkpoint.verify(earlier)["step"] == 40
        restored, _, history = checkpoint.restore_state(earlier, jax.eval_shape(lambda: state))
        assert history == [{"step": 20}]
        for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(a, b)
