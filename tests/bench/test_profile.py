"""The profile's grouping of HLO ops (``jaxray.bench.profile.op_groups``): named scopes are found under
the transforms JAX wraps them in, matmuls by what a fusion holds, while loops left out."""

from jaxray.bench.profile import group_of, op_groups

HLO = """
%fused_computation.1 (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %dot.1 = f32[4,4]{1,0} dot(%p, %p), metadata={op_name="jit(f)/transpose(jvp(attention))/dot"}
}

%fused_computation.2 (p: f32[4,4]) -> f32[4,4] {
  %p = f32[4,4]{1,0} parameter(0)
  ROOT %dot.2 = f32[4,4]{1,0} dot(%p, %p), metadata={op_name="jit(step)/jvp(Transformer)/dot_general"}
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4]{1,0} parameter(0)
  %fusion.1 = f32[4,4]{1,0} fusion(%a), kind=kOutput, calls=%fused_computation.1
  %fusion.2 = f32[4,4]{1,0} fusion(%fusion.1), kind=kOutput, calls=%fused_computation.2
  %add.3 = f32[4,4]{1,0} add(%fusion.2, %a), metadata={op_name="jit(step)/jvp(norm)/add"}
  ROOT %multiply.4 = f32[4,4]{1,0} multiply(%add.3, %a), metadata={op_name="jit(step)/optimizer/mul"}
}
"""


def test_scopes_are_found_under_transforms_and_matmuls_by_their_fusions():
    groups = op_groups(HLO)
    assert groups["fusion.1"] == "attention"
    assert groups["fusion.2"] == "matmul"
    assert groups["add.3"] == "norm"
    assert groups["multiply.4"] == "optimizer"
    assert group_of("splash_mha_dkv_no_residuals.3", groups) == "attention"
    assert group_of("copy.9", groups) == "other"
