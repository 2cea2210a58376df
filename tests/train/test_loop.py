"""jaxray.train.loop.run_loop: hooks run on their own cadence (every N-th step and the last), with the
state after that step; a resumed loop counts global steps. A real compiled step of a tiny MLP."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.config import ModelConfig
from jaxray.models import build
from jaxray.parallel.mesh import make_mesh, replicate, shard_batch
from jaxray.train.loop import Hook, compile_train_step, run_loop
from jaxray.train.step import init_state, make_optimizer

BATCH = 8


@pytest.fixture(scope="module")
def setup():
    """(compiled step, initial state, mesh) of a width-8 MLP on batches of 8 images."""
    mesh = make_mesh(jax.devices()[:1])
    model = build(ModelConfig(workload="mlp", width=8))
    tx = make_optimizer(1e-3, 1e-4)
    state = replicate(init_state(model.init(jax.random.key(0)), tx), mesh)
    step_fn, _ = compile_train_step(model, tx, mesh, state, next(batches(mesh)))
    return step_fn, state, mesh


def batches(mesh, n: int | None = None):
    rng = np.random.default_rng(0)
    for _ in itertools.count() if n is None else range(n):
        images = rng.random((BATCH, 784), dtype=np.float32)  # [B, 784] float32
        yield shard_batch(mesh, {"image": images, "label": rng.integers(0, 10, BATCH, dtype=np.int32)})


def fresh(state):
    # The compiled step donates its state argument: every run starts from its own copy.
    return jax.tree.map(lambda x: x.copy(), state)


def recorder(every: int, seen: list):
    def fn(step, state, metrics):
        seen.append((step, int(state.step), bool(np.isfinite(float(metrics["loss"])))))

    return Hook(every, fn)


def run(setup, num_steps, *everies, start=0):
    step_fn, state, mesh = setup
    seen = [[] for _ in everies]
    hooks = tuple(recorder(e, s) for e, s in zip(everies, seen))
    state = fresh(state)
    if start:  # a restored state carries the step it had reached
        state = state._replace(step=jnp.asarray(start, jnp.int32))
    final, timing = run_loop(step_fn, state, batches(mesh), num_steps, hooks=hooks, start=start)
    return [[step for step, _, _ in s] for s in seen], seen, final, timing


def test_a_hook_runs_every_nth_step_and_at_the_last(setup):
    (steps,), seen, final, timing = run(setup, 10, 3)
    assert steps == [3, 6, 9, 10]
    assert all(state_step == step and finite for step, state_step, finite in seen[0])  # the state after it
    assert int(final.step) == 10 and timing.timed_steps == 9


def test_the_last_step_is_not_called_twice_and_cadences_are_independent(setup):
    (fives, twos, ones), _, _, _ = run(setup, 10, 5, 2, 1)
    assert fives == [5, 10]
    assert twos == [2, 4, 6, 8, 10]
    assert ones == list(range(1, 11))


def test_a_cadence_longer_than_the_run_calls_only_at_the_end(setup):
    (steps,), _, _, _ = run(setup, 4, 100)
    assert steps == [4]


def test_a_resumed_loop_counts_global_steps(setup):
    (steps,), _, final, timing = run(setup, 10, 3, start=4)
    assert steps == [6, 9, 10]
    assert int(final.step) == 10 and timing.timed_steps == 5


def test_a_loop_resumed_at_its_end_runs_nothing(setup):
    (steps,), _, _, timing = run(setup, 10, 3, start=10)
    assert steps == [] and timing.timed_steps == 0


def test_running_out_of_batches_is_an_error(setup):
    step_fn, state, mesh = setup
    with pytest.raises(ValueError, match="the batch iterator ended after 2 of 5 steps"):
        run_loop(step_fn, fresh(state), batches(mesh, 2), 5)
