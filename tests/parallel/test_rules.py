"""Logical axis names on every param (``jaxray.models.axes``), the one rule table to mesh axes
(``jaxray.parallel.mesh.RULES``) and the mesh checks that refuse a bad ``parallel`` before anything
is built, naming the numbers."""

from __future__ import annotations

import jax
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxray.config import ConfigError, parse_trial
from jaxray.models import build
from jaxray.models.axes import axes_of, param_name
from jaxray.parallel.checks import abstract_params, check_mesh, check_trial
from jaxray.parallel.mesh import make_mesh, spec_for, unsplittable
from jaxray.train.step import init_state


def logical_axes(tree) -> dict[str, tuple]:
    """``{param name: logical names}`` for every leaf of ``tree`` (params, a TrainState, or their
    ``ShapeDtypeStruct``s). Raises KeyError naming a leaf of 1+ dimensions that has no names."""
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        axes = axes_of(path, len(getattr(leaf, "shape", ())))
        if axes is None:
            raise KeyError(f"no logical axis names for param {param_name(path)} {tuple(leaf.shape)}")
        named[param_name(path)] = axes
    return named


MODELS = {
    "mlp": {"workload": "mlp", "width": 64},
    "shared_block_mlp": {"workload": "shared_block_mlp", "width": 64},
    "transformer": {"workload": "transformer", "width": 64, "num_layers": 2},
}


@pytest.mark.parametrize("workload", list(MODELS))
def test_every_param_and_adam_moment_has_one_name_per_dimension(workload):
    model = build(parse_trial({"model": MODELS[workload]}).model)
    params = jax.eval_shape(model.init, jax.random.key(0))
    named = logical_axes(params)
    shapes = {k: v.shape for k, v in zip(named, jax.tree.leaves(params))}
    assert len(named) == len(jax.tree.leaves(params))
    assert all(len(axes) == len(shapes[name]) for name, axes in named.items())
    state = jax.eval_shape(lambda: init_state(model.init(jax.random.key(0)), optax.adamw(1e-3)))
    logical_axes(state)  # Adam's moments (named as their params), counts and the step: no KeyError


def test_transformer_names_as_the_field_writes_them():
    named = logical_axes(abstract_params(parse_trial({"model": MODELS["transformer"]}).model))
    assert named["token_embed.embedding"] == ("vocab", "embed")
    assert named["blocks.0.attn.query.kernel"] == ("embed", "heads", "head_dim")
    assert named["blocks.1.attn.out.kernel"] == ("heads", "head_dim", "embed")
    assert named["blocks.0.fc_up.kernel"] == ("embed", "mlp")
    assert named["blocks.0.fc_down.kernel"] == ("mlp", "embed")
    assert named["lm_head.kernel"] == ("embed", "vocab")


def test_rules_map_names_to_mesh_axes_and_leave_size_one_axes_out():
    assert spec_for(("batch",)) == P(("data", "fsdp"))
    assert spec_for(("embed", "heads", "head_dim")) == P("fsdp", "tensor", None)
    assert spec_for(("norm",)) == P(None)
    mesh = make_mesh()  # one device here: (data 1, fsdp 1, tensor 1)
    assert mesh.axis_names == ("data", "fsdp", "tensor")
    assert spec_for(("vocab", "embed"), mesh) == P(None, None)


def test_an_uneven_split_names_the_param_dimension_and_sizes():
    trial = parse_trial({"model": MODELS["transformer"]})  # 4 heads, ffn 256, vocab 256
    problems = unsplittable(abstract_params(trial.model), {"data": 1, "fsdp": 1, "tensor": 3})
    assert problems == [  # 2 layers: q/k/v kernels and biases, out kernel; feed-forward; LM head, embedding
        "parallel.tensor 3 does not divide 'heads' of size 4 (dimension 0 of blocks.0.attn.key.bias [4, 16], "
        "and 13 more params)",
        "parallel.tensor 3 does not divide 'mlp' of size 256 (dimension 0 of blocks.0.fc_down.kernel "
        "[256, 64], and 5 more params)",
        "parallel.tensor 3 does not divide 'vocab' of size 256 (dimension 1 of lm_head.kernel [64, 256], "
        "and 1 more params)",
    ]
    with pytest.raises(ConfigError) as err:
        check_mesh(trial, {"data": 1, "fsdp": 1, "tensor": 3})
    assert "the mesh data=1,fsdp=1,tensor=3 cannot split the params of the transformer of width 64" in str(
        err.value
    )
    check_mesh(trial, {"data": 1, "fsdp": 2, "tensor": 4})  # every split even: no error


def test_check_trial_splits_the_batch_over_data_and_fsdp_only():
    trial = parse_trial({"model": MODELS["mlp"], "train": {"global_batch": 8}})
    assert check_trial(trial, {"data": 2, "fsdp": 2, "tensor": 1}) == 2
    assert check_trial(trial, {"data": 1, "fsdp": 2, "tensor": 2}) == 4  # tensor shares rows
    with pytest.raises(
        ConfigError, match="global_batch 8 is not divisible by the 3 devices it is split over"
    ):
        check_trial(trial, {"data": 3, "fsdp": 1, "tensor": 1})
