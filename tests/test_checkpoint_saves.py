"""A save that cannot finish (issue 15, point 7), on a real full disk (a small tmpfs, see
``full_disk``): ``checkpoint.save_state`` and ``checkpoint.save`` raise CheckpointSaveError naming
the folder, the step and the OS error in words, never TensorStore's status or spec, and a
checkpoint saved before on the same disk still verifies and restores. Also the words themselves
(``checkpoint.failures.cause``) for the errors Orbax, TensorStore and Python raise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from full_disk import fill, small_tmpfs

from jaxray import checkpoint
from jaxray.checkpoint.failures import cause
from jaxray.config import parse_trial
from jaxray.models import build
from jaxray.train.step import init_state, make_optimizer

TRIAL = parse_trial({"model": {"workload": "mlp", "width": 64}})
NO_SPACE = "[Errno 28] No space left on device"
INTERNALS = ("os_error_code", "RESOURCE_EXHAUSTED", "TensorStore", "<", "Traceback")


@pytest.fixture(scope="module")
def state():
    fresh = init_state(build(TRIAL.model).init(jax.random.key(0)), make_optimizer(1e-3, 0.0))
    return fresh._replace(step=jnp.asarray(40, fresh.step.dtype))


# 0: the first file fails; 100 KiB: Orbax is stopped in the middle of the arrays (~600 KiB in all).
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
        assert not any(word in message for word in INTERNALS), message
        with pytest.raises(
            checkpoint.CheckpointSaveError, match=r"could not save the checkpoint in .*Errno 28"
        ):
            checkpoint.save(disk / "params_only", state.params, TRIAL)
        # The unfinished one is never taken for a checkpoint; the earlier one is whole.
        with pytest.raises(checkpoint.CheckpointError, match="incomplete|is not a checkpoint"):
            checkpoint.verify(disk / "step_40")
        assert checkpoint.verify(earlier)["step"] == 40
        restored, _, history = checkpoint.restore_state(earlier, jax.eval_shape(lambda: state))
        assert history == [{"step": 20}]
        for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_cause_of_an_os_error_is_pythons_words():
    assert cause(OSError(28, "No space left on device", "/d/f")) == f"{NO_SPACE}: /d/f"
    # pyarrow's copy (Ray Train's upload) words it its own way; the errno is what counts.
    pyarrow_style = OSError(28, "Error writing bytes to file. Detail: [errno 28] No space left on device")
    assert cause(pyarrow_style) == NO_SPACE
    # A TensorStore error (Orbax's write of an array) carries the OS error as a code.
    tensorstore = ValueError(
        'RESOURCE_EXHAUSTED: Error writing local file "/d/ck/params/_sharding": Failed writing: '
        '"/d/ck/params/_sharding.__lock": Failed to write 493 bytes to file 8: No space left on '
        "device [os_error_code='28']"
    )
    assert cause(tensorstore) == f"{NO_SPACE}: /d/ck/params/_sharding"
    wrapped = Exception("Encountered error while writing")
    wrapped.__cause__ = tensorstore
    assert cause(wrapped) == f"{NO_SPACE}: /d/ck/params/_sharding"


def test_the_cause_never_carries_tensorstores_spec_or_a_repr():
    orbax = Exception(
        "Encountered error while reading array index: (slice(0, 784, 1),). See full TensorStore "
        "details: <bound method pybind11_detail_function_record_v1_system_libstdcpp.spec of "
        "TensorStore({\n  'base': {'driver': 'zarr'}})>."
    )
    orbax.__cause__ = ValueError(
        'FAILED_PRECONDITION: Error reading "w1/0.0" in OCDBT database at local file "/d/params/": '
        "Truncated Zstd-compressed stream; at byte 0"
    )
    assert cause(orbax) == (
        'Error reading "w1/0.0" in OCDBT database at local file "/d/params/": Truncated '
        "Zstd-compressed stream; at byte 0"
    )
    alone = Exception(orbax.args[0])  # no cause to fall back on: the text up to the spec
    assert cause(alone) == "Encountered error while reading array index: (slice(0, 784, 1),)"
    assert cause(RuntimeError("")) == "RuntimeError"
