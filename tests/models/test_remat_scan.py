"""``model.remat`` and ``model.scan_layers`` change how the step runs, not what it computes nor the
params: loss and gradients equal the plain model's, and the parameter tree (what a checkpoint holds) is
the same, so a checkpoint restores across these settings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxray.config import ModelConfig
from jaxray.models import build

BASE = {"workload": "transformer", "width": 64, "num_heads": 2, "num_layers": 3, "max_seq_len": 64}
SLOW = pytest.mark.slow  # each ~5 s of compiles; the first and last cover both switches: make test-all
SETTINGS = [
    pytest.param({"remat": "full"}),
    pytest.param({"remat": "dots"}, marks=SLOW),
    pytest.param({"scan_layers": True}, marks=SLOW),
    pytest.param({"scan_layers": True, "remat": "full"}, marks=SLOW),
    pytest.param({"scan_layers": True, "remat": "dots", "attention": "dense"}),
]


def _loss_and_grads(model, params, tokens):
    def loss(p):
        logits = model.apply(p, tokens)
        return jnp.mean(
            jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, tokens[..., None], -1)[..., 0]
        )

    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_loss_and_gradients_equal_the_plain_models(setting):
    tokens = jax.random.randint(jax.random.key(1), (2, 64), 0, 256)
    plain, other = build(ModelConfig(**BASE)), build(ModelConfig(**BASE, **setting))
    params = plain.init(jax.random.key(0))
    loss, grads = _loss_and_grads(plain, params, tokens)
    other_loss, other_grads = _loss_and_grads(other, params, tokens)
    assert float(other_loss) == pytest.approx(float(loss), abs=1e-5)
    for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads)):
        np.testing.assert_allclose(h, g, atol=1e-5)


def test_the_parameter_tree_is_the_same_whatever_the_settings():
    def tree(**setting):
        shapes = jax.eval_shape(build(ModelConfig(**BASE, **setting)).init, jax.random.key(0))
        return jax.tree_util.tree_flatten_with_path(shapes)

    plain = tree()
    for setting in (p.values[0] for p in SETTINGS):
        assert tree(**setting) == plain


def test_a_train_state_saved_with_scan_and_remat_restores_into_the_plain_model(tmp_path):
    from jaxray import checkpoint
    from jaxray.config import parse_trial
    from jaxray.parallel.mesh import make_mesh
    from jaxray.train.step import abstract_state, init_state, optimizer_for

    scanned = parse_trial({"model": {**BASE, "scan_layers": True, "remat": "dots"}, "data": {"seq_len": 64}})
    plain = parse_trial({"model": BASE, "data": {"seq_len": 64}})
    tx, _ = optimizer_for(scanned)
    state = init_state(build(scanned.model).init(jax.random.key(0)), tx)
    folder = checkpoint.save_state(tmp_path / "ck", state, scanned, [], {})
    target = abstract_state(build(plain.model), optimizer_for(plain)[0], make_mesh(jax.devices()[:1]))
    restored, doc, _ = checkpoint.restore_state(folder, target)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params)):
        np.testing.assert_array_equal(a, b)
    tokens = jax.random.randint(jax.random.key(2), (1, 64), 0, 256)
    np.testing.assert_allclose(
        build(plain.model).apply(restored.params, tokens),
        build(scanned.model).apply(state.params, tokens),
        atol=1e-5,
    )


def _sharded_loss(data_dir, *extra: str) -> float:
    import json
    import os
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "jaxray.bench", "throughput", "--workload", "transformer", "--width", "64",
           "--seq-len", "128", "--batch", "8", "--devices", "4", "--cpu-devices", "4", "--mesh",
           "fsdp=2,tensor=2", "--steps", "3", "--repeats", "1", "--json", "--out", "", "--compile-cache", "",
           "--data-dir", str(data_dir), *extra]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TQDM_DISABLE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])["final_loss"]


@pytest.mark.slow  # 4-device subprocess runs (~35 s); CI runs it
def test_scan_and_remat_train_alike_on_an_fsdp_and_tensor_mesh(real_dir):
    plain = _sharded_loss(real_dir)
    assert _sharded_loss(real_dir, "--scan-layers", "--remat", "dots") == pytest.approx(plain, abs=1e-5)
