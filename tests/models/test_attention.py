"""The cuDNN-or-XLA decision, unit-tested without a GPU, and the errors a user sees."""
import pytest

from jaxray.config import ConfigError, ModelConfig, parse_trial
from jaxray.models import build
from jaxray.models.attention import AttentionError, Target, choose


def gpu(cc="9.0", dtype="bfloat16", head_dim=64):
    return Target("gpu", cc, dtype, head_dim)


def test_auto_picks_cudnn_where_it_can_run():
    assert choose("auto", gpu()).implementation == "cudnn"
    assert choose("auto", gpu(cc="8.0", dtype="float16", head_dim=128)).implementation == "cudnn"
    assert choose("cudnn", gpu(cc="9.0", head_dim=256)).implementation == "cudnn"


@pytest.mark.parametrize("target, why", [
    (Target("cpu", None, "bfloat16", 64), "needs an NVIDIA GPU"),
    (gpu(cc="7.5"), "compute capability 7.5 is below 8.0"),
    (gpu(dtype="float32"), "dtype float32"),
    (gpu(head_dim=60), "head dim 60"),
    (gpu(cc="8.6", head_dim=256), "up to 128"),  # 256 needs Hopper (9.0)
])
def test_auto_falls_back_to_xla_and_says_why(target, why):
    choice = choose("auto", target)
    assert choice.implementation == "xla" and why in choice.reason
    with pytest.raises(AttentionError, match=why):
        choose("cudnn", target)


def test_xla_is_always_allowed_and_unknown_requests_are_errors():
    assert choose("xla", Target("cpu", None, "float32", 7)) .implementation == "xla"
    with pytest.raises(AttentionError, match="one of xla, cudnn, auto"):
        choose("flash", gpu())


def test_explicit_cudnn_on_this_cpu_fails_before_compiling():
    with pytest.raises(AttentionError, match="cannot run here"):
        build(ModelConfig(workload="transformer", dtype="bfloat16", attention="cudnn"))
    model = build(ModelConfig(workload="transformer", attention="auto"))
    assert model.attention.implementation == "xla" and model.attention.reason


def test_config_names_the_allowed_attention_values():
    with pytest.raises(ConfigError, match="model.attention"):
        parse_trial({"model": {"workload": "transformer", "attention": "flash"}})
