"""Every checkpoint read verifies, and run folders are relocatable (issue 15, points 2 and 3), on real
Orbax saves: a damaged file is refused naming it and both digests; through a run folder the trial's
newest good checkpoint is used with a warning; a run folder copied elsewhere (the original deleted)
reads its own checkpoints; a recorded path outside the folder is never followed."""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import pytest
from checkpoint_copies import flip_a_byte, largest_params_file

from jaxray import checkpoint, runs
from jaxray.config import parse_trial
from jaxray.models import build
from jaxray.raytrain.resume import checkpoint_name
from jaxray.reporting.sweep import write_reports
from jaxray.train.step import init_state, make_optimizer

TRIAL = parse_trial({"model": {"workload": "mlp", "width": 8}})
TRIAL_NAME = TRIAL.name()  # its folder, as a sweep names it


@pytest.fixture(scope="module")
def state():
    return init_state(build(TRIAL.model).init(jax.random.key(0)), make_optimizer(1e-3, 0.0))


def run_folder(root: Path, state, steps=(10, 20), recorded: bool = False) -> Path:
    """A run folder as a sweep leaves it: ``train/<trial>/checkpoint_step_*`` (real full-state
    saves, as the workers write them) and summary.json from the real writer, whose row names the
    newest checkpoint by its absolute path, as Tune reports it, and (``recorded``, as runs since
    round 12 of issue 15 write it) its manifest's SHA-256."""
    saved = [
        checkpoint.save_state(root / "train" / TRIAL_NAME / checkpoint_name(s, 1), state, TRIAL, [], {})
        for s in steps
    ]
    row = {"trial": TRIAL_NAME, "workload": "mlp", "test_accuracy": 0.9, "checkpoint": str(saved[-1])}
    if recorded:
        row["checkpoint_sha256"] = checkpoint.manifest_sha256(saved[-1])
    write_reports(root, [row], {TRIAL_NAME: []})
    return root


def test_a_damaged_params_file_is_refused_naming_it_and_both_digests(tmp_path, state):
    params_only = checkpoint.save(tmp_path / "params_only", state.params, TRIAL)
    full = checkpoint.save_state(tmp_path / "full", state, TRIAL, [], {})
    target = jax.eval_shape(lambda: state)
    for directory, manifest in ((params_only, checkpoint.CHECKSUMS), (full, checkpoint.TRAIN_STATE)):
        victim = largest_params_file(directory)
        rel = victim.relative_to(directory).as_posix()
        expected, found = flip_a_byte(victim)
        assert json.loads((directory / manifest).read_text())["files"][rel] == expected
        readers = [checkpoint.restore, checkpoint.open_for_reading]
        if manifest == checkpoint.TRAIN_STATE:
            readers.append(lambda d: checkpoint.restore_state(d, target))
        for read in readers:
            with pytest.raises(checkpoint.CheckpointError) as err:
                read(directory)
            message = str(err.value)
            assert rel in message and expected in message and found in message and manifest in message


def test_saves_record_every_file_and_an_undamaged_one_restores(tmp_path, state):
    params_only = checkpoint.save(tmp_path / "ck", state.params, TRIAL)
    listed = json.loads((params_only / checkpoint.CHECKSUMS).read_text())["files"]
    assert {checkpoint.MODEL_CONFIG, checkpoint.TRIAL_CONFIG} <= set(listed)
    assert any(name.startswith("params/") for name in listed)
    _, params = checkpoint.restore(params_only)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(state.params)))


def test_a_checkpoint_older_than_checksums_loads_with_one_warning(tmp_path, state, caplog):
    old = checkpoint.save(tmp_path / "old", state.params, TRIAL)
    (old / checkpoint.CHECKSUMS).unlink()
    with caplog.at_level(logging.WARNING, logger="jaxray.checkpoint"):
        checkpoint.restore(old)
        checkpoint.restore(old)
    warned = [r for r in caplog.records if "loaded unverified" in r.getMessage()]
    assert len(warned) == 1 and str(old) in warned[0].getMessage()


def test_an_unfinished_full_state_save_is_refused(tmp_path, state):
    unfinished = checkpoint.save_state(tmp_path / "ck", state, TRIAL, [], {})
    (unfinished / checkpoint.TRAIN_STATE).unlink()  # killed before its manifest
    with pytest.raises(checkpoint.CheckpointError, match="incomplete: train_state.json is missing"):
        checkpoint.restore(unfinished)


def test_summary_json_records_checkpoints_relative_to_the_run_folder(tmp_path, state):
    folder = run_folder(tmp_path / "run", state)
    [row] = runs.read_summary(folder)
    assert row["checkpoint"] == f"train/{TRIAL_NAME}/{checkpoint_name(20, 1)}"
    assert checkpoint.resolve(folder) == folder / row["checkpoint"]


def cut_the_params_digest(newest: Path) -> str:
    """Cut "params" out of the arrays train_state.json records (a fresh user's edit); the refusal."""
    doc = json.loads((newest / checkpoint.TRAIN_STATE).read_text())
    del doc["arrays"]["params"]
    (newest / checkpoint.TRAIN_STATE).write_text(json.dumps(doc))
    return "its arrays record 'opt_state', not"


def damage_the_params(newest: Path) -> str:
    flip_a_byte(largest_params_file(newest))
    return "does not match its checksum"


@pytest.mark.parametrize("damage", [damage_the_params, cut_the_params_digest])
def test_through_a_run_folder_the_newest_good_checkpoint_is_used_with_a_warning(
    tmp_path, state, caplog, damage
):
    folder = run_folder(tmp_path / "run", state)
    newest, older = (folder / "train" / TRIAL_NAME / checkpoint_name(s, 1) for s in (20, 10))
    refusal = damage(newest)
    with pytest.raises(checkpoint.CheckpointError, match=refusal):
        checkpoint.restore(newest)  # given directly: refused
    for given in (folder, folder / "train" / TRIAL_NAME):  # runs/<experiment>, a Ray Train run folder
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="jaxray.checkpoint"):
            assert checkpoint.resolve(given) == older
        assert str(newest) in caplog.text and f"using {older} instead" in caplog.text
    checkpoint.restore(checkpoint.resolve(folder))
    flip_a_byte(largest_params_file(older))
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint") as err:
        checkpoint.resolve(folder)
    assert str(newest) in str(err.value) and str(older) in str(err.value)


def swap_the_two(newest: Path, older: Path, other_state) -> None:
    """The older checkpoint renamed into the newest's place, and the newest into the older's."""
    newest.rename(newest.with_name("swap"))
    older.rename(newest)
    newest.with_name("swap").rename(older)


def copy_in_another_runs(newest: Path, older: Path, other_state) -> None:
    """Another run's checkpoint (other weights, consistent with itself) copied into the newest's place."""
    shutil.rmtree(newest)
    checkpoint.save_state(newest, other_state, TRIAL, [], {})


@pytest.mark.parametrize("by_hand", [swap_the_two, copy_in_another_runs])
def test_a_checkpoint_put_in_the_place_the_summary_names_is_never_used_for_it(
    tmp_path, state, caplog, by_hand
):
    """Round 12: each file check passes on a folder put there by hand; the SHA-256 of its manifest,
    which the summary row records, tells it from the one the run saved."""
    folder = run_folder(tmp_path / "run", state, recorded=True)
    newest, older = (folder / "train" / TRIAL_NAME / checkpoint_name(s, 1) for s in (20, 10))
    by_hand(newest, older, state._replace(params=jax.tree.map(lambda x: x + 1, state.params)))
    with caplog.at_level(logging.WARNING, logger="jaxray.checkpoint"):
        assert checkpoint.resolve(folder) == older
    assert f"{newest} is not the checkpoint the run's summary.json names" in caplog.text
    assert f"using {older} instead" in caplog.text
    checkpoint.restore(newest)  # given directly it is what it is: nothing to compare it with


OTHER_TRIAL = parse_trial({"model": {"workload": "mlp", "width": 8}, "train": {"global_batch": 32}})


def test_a_checkpoint_of_another_trial_in_a_trials_folder_is_never_used_for_it(tmp_path, state, caplog):
    """Round 13: another trial's checkpoint copied into a trial's folder under a newer name, or two
    trial folders swapped, passed every digest check and was used (and named) as the trial's."""
    folder = run_folder(tmp_path / "run", state, recorded=True)
    trial_dir = folder / "train" / TRIAL_NAME
    stray = checkpoint.save_state(trial_dir / checkpoint_name(90, 1), state, OTHER_TRIAL, [], {})
    with caplog.at_level(logging.WARNING, logger="jaxray.checkpoint"):
        assert checkpoint.resolve(trial_dir) == trial_dir / checkpoint_name(20, 1)
    said = f"{stray} lies in the folder of trial {TRIAL_NAME} but is a checkpoint of trial "
    assert said + OTHER_TRIAL.name() in caplog.text
    assert f"(trial {OTHER_TRIAL.name()}," in checkpoint.describe(stray)  # its own trial, given directly
    shutil.rmtree(stray)
    # Both checkpoints of the trial folder another trial's (the folders swapped): none is used.
    for step in (10, 20):
        shutil.rmtree(trial_dir / checkpoint_name(step, 1))
        checkpoint.save_state(trial_dir / checkpoint_name(step, 1), state, OTHER_TRIAL, [], {})
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint") as err:
        checkpoint.resolve(folder)
    assert str(err.value).count(f"is a checkpoint of trial {OTHER_TRIAL.name()}") == 1  # the older one


def test_a_copied_run_folder_reads_its_own_checkpoints_once_the_original_is_gone(tmp_path, state):
    original = run_folder(tmp_path / "cluster" / "runs" / "x", state)
    copy = Path(shutil.copytree(original, tmp_path / "laptop" / "x-copy"))
    assert checkpoint.resolve(copy) == copy / "train" / TRIAL_NAME / checkpoint_name(20, 1)
    shutil.rmtree(original)
    resolved = checkpoint.resolve(copy)
    assert resolved.is_relative_to(copy)
    checkpoint.restore(resolved)


def test_an_old_run_folder_with_absolute_paths_reads_the_copy_inside_it(tmp_path, state, caplog):
    original = run_folder(tmp_path / "train" / "runs" / "x", state)  # "train" above the folder too
    rows = runs.read_summary(original)
    rows[0]["checkpoint"] = str(original / rows[0]["checkpoint"])  # as summary.json was written before
    (original / runs.SUMMARY_JSON).write_text(json.dumps(rows))
    assert checkpoint.resolve(original) == Path(rows[0]["checkpoint"])  # inside its own folder: as it is
    copy = Path(shutil.copytree(original, tmp_path / "elsewhere" / "x"))
    with caplog.at_level(logging.WARNING, logger="jaxray.runs"):
        resolved = checkpoint.resolve(copy)  # the original still exists: never followed
    assert resolved == copy / "train" / TRIAL_NAME / checkpoint_name(20, 1)
    assert rows[0]["checkpoint"] in caplog.text and "outside the run folder" in caplog.text
    shutil.rmtree(original)
    checkpoint.restore(checkpoint.resolve(copy))


def test_a_recorded_path_outside_the_folder_is_refused_naming_it(tmp_path, state):
    folder = run_folder(tmp_path / "run", state)
    outside = checkpoint.save(tmp_path / "elsewhere" / "ck", state.params, TRIAL)  # a good checkpoint
    rows = runs.read_summary(folder)
    for recorded in (str(outside), "../elsewhere/ck"):
        (folder / runs.SUMMARY_JSON).write_text(json.dumps([{**rows[0], "checkpoint": recorded}]))
        with pytest.raises(checkpoint.CheckpointError, match="outside the run folder") as err:
            checkpoint.resolve(folder)
        assert recorded in str(err.value) and "never followed" in str(err.value)
    assert runs.record_path(folder, outside) == str(outside)  # the writer keeps it absolute, not "../"


def test_a_symlink_in_the_folder_that_leads_out_is_named_and_a_non_path_refused(tmp_path, state, caplog):
    # A fresh user linked a checkpoint path to one outside the folder: it was read without a word.
    folder = run_folder(tmp_path / "run", state)
    outside = checkpoint.save(tmp_path / "elsewhere" / "ck", state.params, TRIAL)
    (folder / "train" / "lnk").symlink_to(outside)
    rows = runs.read_summary(folder)
    (folder / runs.SUMMARY_JSON).write_text(json.dumps([{**rows[0], "checkpoint": "train/lnk"}]))
    with caplog.at_level(logging.WARNING, logger="jaxray.runs"):
        assert checkpoint.resolve(folder) == folder / "train" / "lnk"
    assert f"is {folder / 'train' / 'lnk'}, a symlink to {outside} outside the run folder" in caplog.text
    # A hand-edited row whose checkpoint is no string: one line, not pathlib's TypeError.
    (folder / runs.SUMMARY_JSON).write_text(json.dumps([{**rows[0], "checkpoint": 5}]))
    with pytest.raises(checkpoint.CheckpointError, match="names the checkpoint of trial .* as 5, not a path"):
        checkpoint.resolve(folder)


# Restore errors in words (issue 15, point 5): the checkpoint folder and the cause, never TensorStore's
# spec or an object's repr.
INTERNALS = ("<bound method", "pybind11", "TensorStore(", "<class", " object at 0x", "os_error_code")
READ_AS_A_USER = """
import json, sys
from jaxray import checkpoint
found = []
for path in sys.argv[1:]:
    try:
        checkpoint.restore(checkpoint.resolve(path))
        found.append("restored")
    except checkpoint.CheckpointError as err:
        found.append(str(err))
print(json.dumps(found))
"""


def old_params_only(directory: Path, state) -> Path:
    """A params-only save from before checksums.json: Orbax reads it unverified."""
    saved = checkpoint.save(directory, state.params, TRIAL)
    (saved / checkpoint.CHECKSUMS).unlink()
    return saved


def assert_in_words(message: str, *parts: str) -> None:
    assert all(part in message for part in parts), message
    assert not any(word in message for word in INTERNALS), message


def read_without_permission_override(paths: list[Path]) -> list[str]:
    """What ``restore(resolve(path))`` says for each path, in a process that file permissions bind:
    as root, one whose bounding set lacks CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH (setpriv)."""
    import os  # only here: the one test that needs a process of its own
    import subprocess
    import sys

    cmd = [sys.executable, "-c", READ_AS_A_USER, *map(str, paths)]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root ignores file permissions, and setpriv (to drop that) is not installed")
        cmd = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_file_that_cannot_be_opened_is_named_with_the_os_error(tmp_path, state):
    verified = checkpoint.save(tmp_path / "verified", state.params, TRIAL)
    unverified = old_params_only(tmp_path / "unverified", state)
    config = checkpoint.save(tmp_path / "config", state.params, TRIAL)
    run = run_folder(tmp_path / "run", state)
    victims = [
        largest_params_file(verified),
        largest_params_file(unverified),
        config / checkpoint.MODEL_CONFIG,
        run / runs.SUMMARY_JSON,
    ]
    for victim in victims:
        victim.chmod(0)
    messages = read_without_permission_override([verified, unverified, config, run])
    for message, victim in zip(messages, victims, strict=True):
        assert_in_words(message, "[Errno 13] Permission denied", str(victim))
    assert messages[0].startswith(f"{verified} cannot be read: ")
    assert messages[1].startswith(f"{unverified / 'params'} could not be restored into the model")


def test_an_unverified_checkpoint_with_a_damaged_array_names_the_cause(tmp_path, state):
    missing, truncated = (old_params_only(tmp_path / name, state) for name in ("missing", "truncated"))
    largest_params_file(missing).unlink()
    victim = largest_params_file(truncated)
    victim.write_bytes(victim.read_bytes()[:100])
    for directory in (missing, truncated):
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.restore(directory)
        message = str(err.value)
        assert_in_words(message, f"{directory / 'params'} could not be restored into the model", "w1")
    empty = old_params_only(tmp_path / "empty", state)
    shutil.rmtree(empty / "params")
    (empty / "params").mkdir()
    with pytest.raises(checkpoint.CheckpointError, match="holds no arrays that Orbax can read"):
        checkpoint.restore(empty)


def test_no_folder_or_a_file_is_named_as_such(tmp_path, state):
    target = jax.eval_shape(lambda: state)
    for read in (
        checkpoint.restore,
        checkpoint.open_for_reading,
        lambda d: checkpoint.restore_state(d, target),
    ):
        with pytest.raises(checkpoint.CheckpointError, match="is not a checkpoint: no such folder"):
            read(tmp_path / "missing")
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(checkpoint.CheckpointError, match="is not a checkpoint: it is a file"):
        checkpoint.restore(tmp_path / "file")


def test_a_state_of_another_optimiser_names_the_entry_or_the_mismatch(tmp_path, state):
    import optax  # only here: a second optimiser whose state the saved one is not

    from jaxray.train.step import TrainState

    saved = checkpoint.save_state(tmp_path / "ck", state, TRIAL, [], {})
    for other, expected in (
        (
            optax.sgd(1e-3, momentum=0.9),
            "has no optimiser entry 0/trace/b1 (the optimiser expects shape (8,))",
        ),
        (optax.sgd(1e-3), "tree structures do not match"),  # no arrays to compare by name
    ):
        target = jax.eval_shape(lambda o=other: TrainState(state.params, o.init(state.params), state.step))
        with pytest.raises(checkpoint.CheckpointError) as err:
            checkpoint.restore_state(saved, target)
        assert_in_words(
            str(err.value), f"{saved / 'opt_state'} could not be restored into the optimiser", expected
        )


def rewrite_in_place_keeping_mtime(a: Path, _b: Path) -> Callable[[], None]:
    """Flip a byte of the largest params file where it is, then set its times back (cp -p, touch -r)."""
    victim = largest_params_file(a)
    times = victim.stat()

    def change() -> None:
        flip_a_byte(victim)
        os.utime(victim, ns=(times.st_atime_ns, times.st_mtime_ns))

    return change


def move_the_others_params_in(a: Path, b: Path) -> Callable[[], None]:
    def change() -> None:
        (a / "params").rename(a / "params.orig")
        shutil.copytree(b / "params", a / "params")

    return change


def write_through_a_shared_mmap(a: Path, _b: Path) -> Callable[[], None]:
    """Map the largest params file shared and dirty its page with the bytes it holds (the hash still
    matches; the write fault updates the times now), so the change later is a store into a dirty
    page: no syscall, no fault, neither mtime nor ctime moves (what a fresh user did)."""
    with open(largest_params_file(a), "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 0)
    middle = len(mapped) // 2
    mapped[middle : middle + 64] = mapped[middle : middle + 64]

    def change() -> None:
        mapped[middle : middle + 64] = bytes(b ^ 0xFF for b in mapped[middle : middle + 64])

    return change


@pytest.mark.parametrize(
    "swap", [move_the_others_params_in, rewrite_in_place_keeping_mtime, write_through_a_shared_mmap]
)
@pytest.mark.parametrize("reader", ["restore", "restore_state"])
def test_a_checkpoint_replaced_while_it_is_read_is_refused(tmp_path, state, monkeypatch, reader, swap):
    # A fresh user moved another checkpoint's params/ in between the digest check and the arrays'
    # read (what a copy of another checkpoint into the folder does): evaluate used those params and
    # recorded the first checkpoint's digest; the next ones rewrote a file in place and set its
    # mtime back, or wrote through a shared mmap. The changes are real; the wrapper only times them.
    other = init_state(build(TRIAL.model).init(jax.random.key(1)), make_optimizer(1e-3, 0.0))
    a = checkpoint.save_state(tmp_path / "a", state, TRIAL, [], {})
    b = checkpoint.save_state(tmp_path / "b", other, TRIAL, [], {})
    read_tree, change, done = checkpoint.restore_tree, swap(a, b), []

    def swapped_then_read(directory, *args):
        if not done:
            change()
            done.append(swap)
        return read_tree(directory, *args)

    monkeypatch.setattr(checkpoint, "restore_tree", swapped_then_read)
    read = (
        checkpoint.restore
        if reader == "restore"
        else lambda d: checkpoint.restore_state(d, jax.eval_shape(lambda: state))
    )
    with pytest.raises(checkpoint.CheckpointError, match="changed while it was read") as err:
        read(a)
    assert str(a) in str(err.value)


@pytest.mark.parametrize("reader", ["restore", "restore_state"])
def test_a_change_undone_before_the_files_are_hashed_again_is_refused(tmp_path, state, monkeypatch, reader):
    # A fresh user flipped bytes through a shared mmap just before the arrays were read and flipped
    # them back just after: the files hash as recorded both times, only the arrays read differ
    # (export then wrote those weights into an artifact that verifies clean).
    a = checkpoint.save_state(tmp_path / "a", state, TRIAL, [], {})
    flip = write_through_a_shared_mmap(a, a)
    read_tree = checkpoint.restore_tree

    def flipped_while_read(directory, *args):
        flip()
        try:
            return read_tree(directory, *args)
        finally:
            flip()  # XOR again: the file is as its save wrote it

    monkeypatch.setattr(checkpoint, "restore_tree", flipped_while_read)
    with pytest.raises(checkpoint.CheckpointError, match="changed while it was read: the arrays") as err:
        if reader == "restore":
            checkpoint.restore(a)
        else:
            checkpoint.restore_state(a, jax.eval_shape(lambda: state))
    assert str(a) in str(err.value)
    monkeypatch.undo()
    checkpoint.open_for_reading(a)  # the files are as saved: the next read is not refused
    checkpoint.restore(a)


def test_a_hand_edited_arrays_record_is_refused_in_words(tmp_path, state, caplog):
    # A fresh user cut "params" out of "arrays": the check of the arrays read was skipped silently.
    saved = checkpoint.save_state(tmp_path / "ck", state, TRIAL, [], {})
    doc = json.loads((saved / checkpoint.TRAIN_STATE).read_text())
    target = jax.eval_shape(lambda: state)
    for arrays, expected in (
        ([], "train_state.json is damaged: its arrays are a list, not an object"),
        ({**doc["arrays"], "params": 5}, "is damaged: arrays['params'] is 5, not a SHA-256"),
        (
            {**doc["arrays"], "model_config.json": "0" * 64},
            "its arrays record 'model_config.json', 'opt_state', 'params', not",
        ),
        (
            {"opt_state": doc["arrays"]["opt_state"]},
            "train_state.json is damaged: its arrays record 'opt_state', not 'params', 'opt_state'",
        ),
        ({**doc["arrays"], "params": "0" * 64}, f"its save recorded {'0' * 64}, so what was read"),
    ):
        (saved / checkpoint.TRAIN_STATE).write_text(json.dumps({**doc, "arrays": arrays}))
        for read in (checkpoint.restore, lambda d: checkpoint.restore_state(d, target)):
            with pytest.raises(checkpoint.CheckpointError, match=re.escape(expected)):
                read(saved)
    # No "arrays" at all: a checkpoint saved before them, read with one warning.
    (saved / checkpoint.TRAIN_STATE).write_text(json.dumps({k: v for k, v in doc.items() if k != "arrays"}))
    with caplog.at_level(logging.WARNING, logger="jaxray.checkpoint"):
        checkpoint.restore(saved)
        checkpoint.restore_state(saved, target)
    assert caplog.text.count("saved before array digests: its files are checked, not the arrays read") == 1
