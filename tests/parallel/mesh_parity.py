"""Run in a subprocess with 4 forced host devices (XLA_FLAGS set before jax is imported).

``mesh_parity.py DATA_DIR``: for each workload, the same float32 params (one seed, placed on each
mesh by ``state_shardings``) and the same 3 global batches on meshes (1 device), (data 4), (fsdp 4),
(tensor 4), (data 2 x tensor 2), (fsdp 2 x tensor 2). Prints one JSON line: per workload and mesh the
max |difference| from the 1-device run of the logits, the loss, every gradient (by param name,
relative to the gradient's largest magnitude) and the params after 3 AdamW steps; the specs of each
param and Adam moment after the steps, the share of their bytes the first device holds, the replica
groups of the compiled step's all-reduces and whether it has any scatter.
"""

from __future__ import annotations

import functools
import json
import re
import sys

import jax
import numpy as np

from jaxray.bench.parity import param_diffs
from jaxray.config import parse_trial
from jaxray.data.batching import train_batches
from jaxray.data.workloads import load_arrays
from jaxray.models import build
from jaxray.models.axes import param_name
from jaxray.parallel.mesh import make_mesh, shard_batch, state_shardings
from jaxray.train.loop import compile_train_step
from jaxray.train.step import LOSSES, init_state, loss_and_grads, model_inputs, optimizer_for

STEPS, BATCH = 3, 8
MESHES = {
    "one": (1, {}),
    "data4": (4, {}),
    "fsdp4": (4, {"fsdp": 4}),
    "tensor4": (4, {"tensor": 4}),
    "data2_tensor2": (4, {"tensor": 2}),
    "fsdp2_tensor2": (4, {"fsdp": 2, "tensor": 2}),
}
MODELS = {
    "mlp": {"workload": "mlp", "width": 32},
    "shared_block_mlp": {"workload": "shared_block_mlp", "width": 32, "block_repeats": 2},
    "transformer": {
        "workload": "transformer",
        "width": 64,
        "num_heads": 4,
        "num_layers": 2,
        "max_seq_len": 32,
    },
}
# XLA writes replica groups as lists ({{0,1},{2,3}}) or as mesh axes (mesh['axis_0'=2,...] {'axis_1'}).
GROUPS = re.compile(r"replica_groups=(\{\{[\d,{}]*\}\}|mesh\[[^\]]*\] \{[^}]*\})")


def specs(tree) -> dict[str, list]:
    """``{param name: [mesh axis or axes or None per dimension]}`` of a tree of jax Arrays."""
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        param_name(path): [list(a) if isinstance(a, tuple) else a for a in x.sharding.spec]
        for path, x in flat
    }


def explicit(groups: str) -> list[list[int]]:
    """Replica groups as lists of device ids: ``{{0,1},{2,3}}`` as written, or ``mesh['axis_0'=2,
    'axis_1'=2] {'axis_1'}`` (ids 0..N-1 laid out in that shape, grouped along the named axes)."""
    if groups.startswith("{{"):
        return [[int(i) for i in g.split(",")] for g in groups[2:-2].split("},{")]
    layout, named = groups.split("]", 1)
    sizes = [int(n) for n in re.findall(r"=(\d+)", layout)]
    along = [int(a) for a in re.findall(r"'axis_(\d+)'", named)]
    ids = np.arange(int(np.prod(sizes))).reshape(sizes)
    ids = np.moveaxis(ids, along, list(range(len(sizes) - len(along), len(sizes))))
    return ids.reshape(-1, int(np.prod([sizes[a] for a in along]))).tolist()


def all_reduce_groups(hlo: str) -> list[list[list[int]]]:
    """The distinct replica groups (``explicit``) of the all-reduces in compiled HLO text."""
    found = {m.group(1) for line in hlo.splitlines() if " all-reduce(" in line for m in GROUPS.finditer(line)}
    return sorted(explicit(g) for g in found)


def device_share(tree) -> float:
    """Bytes of ``tree`` held on the first device over the bytes of the whole tree."""
    leaves = [x for x in jax.tree.leaves(tree) if hasattr(x, "addressable_shards")]
    first = jax.devices()[0]
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards if s.device == first)
    return held / sum(x.nbytes for x in leaves)


def run_mesh(model, tx, params, batches, mesh) -> dict:
    state = init_state(params, tx)
    state = jax.device_put(state, state_shardings(state, mesh))
    first = shard_batch(mesh, batches[0])
    grad_fn = functools.partial(loss_and_grads, apply=model.apply, loss_fn=LOSSES[model.config.workload])
    logits = jax.jit(model.apply)(state.params, model_inputs(first))
    (loss, _), grads = jax.jit(grad_fn)(state.params, first)
    step, _ = compile_train_step(model, tx, mesh, state, first)
    hlo = step.as_text()
    for batch in batches:
        state, _ = step(state, shard_batch(mesh, batch))
    mu, nu = state.opt_state[-1][0].mu, state.opt_state[-1][0].nu  # AdamW: (..., (adam, ...))
    flat_grads = jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]
    return {
        "logits": np.asarray(jax.device_get(logits)),
        "loss": float(loss),
        "grads": {param_name(p): np.asarray(g) for p, g in flat_grads},
        "params": jax.device_get(state.params),
        "specs": {"params": specs(state.params), "mu": specs(mu), "nu": specs(nu)},
        "all_reduce_groups": all_reduce_groups(hlo),
        "scatter": " scatter(" in hlo,
        "params_share": device_share(state.params),
        "opt_state_share": device_share(state.opt_state),
    }


def compare(ref: dict, got: dict) -> dict:
    # Relative to the gradient's largest magnitude; the attention key bias's is zero in exact
    # arithmetic (softmax ignores what it adds to every score), so it is compared absolutely.
    grads = {}
    for name, g in got["grads"].items():
        scale = 1.0 if name.endswith("key.bias") else float(np.max(np.abs(ref["grads"][name])))
        grads[name] = float(np.max(np.abs(g - ref["grads"][name]))) / scale
    return {
        "logits": float(np.max(np.abs(got["logits"] - ref["logits"]))),
        "loss": abs(got["loss"] - ref["loss"]),
        "grads": grads,
        **param_diffs(ref["params"], got["params"]),
        **{k: got[k] for k in ("specs", "all_reduce_groups", "scatter", "params_share", "opt_state_share")},
    }


def run(workload: str, data_dir: str) -> dict:
    lm = workload == "transformer"
    trial = parse_trial(
        {
            "model": MODELS[workload],
            "data": {"data_dir": data_dir, **({"seq_len": 32} if lm else {})},
            "train": {"steps": STEPS, "global_batch": BATCH},
        }
    )
    train_arrays, _ = load_arrays(trial)
    model = build(trial.model)
    tx, _ = optimizer_for(trial)
    params = jax.device_get(model.init(jax.random.key(0)))
    batches = train_batches(train_arrays, BATCH, trial.train.seed)
    batches = [next(batches) for _ in range(STEPS)]
    runs = {
        name: run_mesh(model, tx, params, batches, make_mesh(jax.devices()[:n], **axes))
        for name, (n, axes) in MESHES.items()
    }
    return {name: compare(runs["one"], got) for name, got in runs.items()}


if __name__ == "__main__":
    print(json.dumps({w: run(w, sys.argv[1]) for w in MODELS}))
