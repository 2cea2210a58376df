"""The cuDNN-or-XLA decision, unit-tested without a GPU, and the errors a user sees."""

import jax
import pytest
from saved import save_params

from jaxray.config import ConfigError, ModelConfig, parse_trial
from jaxray.models import build
from jaxray.models.attention import AttentionError, Target, choose


def gpu(cc="9.0", dtype="bfloat16", head_dim=64):
    return Target("gpu", cc, dtype, head_dim)


def test_auto_picks_cudnn_where_it_can_run():
    assert choose("auto", gpu()).implementation == "cudnn"
    assert choose("auto", gpu(cc="8.0", dtype="float16", head_dim=128)).implementation == "cudnn"
    assert choose("cudnn", gpu(cc="9.0", head_dim=256)).implementation == "cudnn"


@pytest.mark.parametrize(
    "target, why",
    [
        (Target("cpu", None, "bfloat16", 64), "needs an NVIDIA GPU"),
        (gpu(cc="7.5"), "compute capability 7.5 is below 8.0"),
        (gpu(dtype="float32"), "dtype float32"),
        (gpu(head_dim=60), "head dim 60"),
        (gpu(cc="8.6", head_dim=256), "up to 128"),  # 256 needs Hopper (9.0)
    ],
)
def test_auto_falls_back_to_xla_and_says_why(target, why):
    choice = choose("auto", target)
    assert choice.implementation == "xla" and why in choice.reason
    with pytest.raises(AttentionError, match=why):
        choose("cudnn", target)


def test_xla_is_always_allowed_and_unknown_requests_are_errors():
    assert choose("xla", Target("cpu", None, "float32", 7)).implementation == "xla"
    with pytest.raises(AttentionError, match="one of xla, dense, splash, cudnn, auto"):
        choose("flash", gpu())


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the refusal on a CPU")
def test_explicit_cudnn_on_this_cpu_fails_before_compiling():
    with pytest.raises(AttentionError, match="cannot run here"):
        build(ModelConfig(workload="transformer", dtype="bfloat16", attention="cudnn"))  # no GPU here
    model = build(ModelConfig(workload="transformer", attention="auto"))
    assert model.attention.implementation == "xla" and model.attention.reason


def test_config_names_the_allowed_attention_values():
    with pytest.raises(ConfigError, match="model.attention"):
        parse_trial({"model": {"workload": "transformer", "attention": "flash"}})


@pytest.mark.parametrize(
    "seq_len", [1, 64, pytest.param(100, marks=pytest.mark.slow)]
)  # block 64: one, exactly one, two (the last partial)
def test_blocked_causal_attention_equals_jax_causal_attention(seq_len):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxray.models.transformer import blocked_causal_attention

    rng = np.random.default_rng(seq_len)
    q, k, v = (jnp.asarray(rng.standard_normal((2, seq_len, 4, 16)), jnp.float32) for _ in range(3))
    reference = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    np.testing.assert_allclose(blocked_causal_attention(q, k, v), reference, rtol=1e-5, atol=1e-6)

    def grads(fn):
        return jax.grad(lambda q, k, v: (fn(q, k, v) ** 2).sum(), (0, 1, 2))(q, k, v)

    for ours, theirs in zip(
        grads(blocked_causal_attention),
        grads(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)),
    ):
        np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=2e-5)


def test_the_choice_says_why_in_words():
    fallback = choose("auto", Target("cpu", None, "float32", 64))
    assert fallback.note == "auto: cuDNN attention needs an NVIDIA GPU, this device is cpu"
    assert fallback.describe() == f"attention xla ({fallback.note})"
    assert choose("auto", gpu()).describe() == "attention cudnn (auto: cuDNN can run here)"
    assert choose("xla", gpu()).note == "requested in model.attention"
    assert choose("cudnn", gpu()).describe() == "attention cudnn (requested in model.attention)"


def test_auto_on_tpu_picks_splash_from_512_and_dense_below():
    def picked(seq):
        return choose("auto", Target("tpu", None, "bfloat16", 64, seq)).implementation

    assert [picked(s) for s in (256, 512, 1024, 1000)] == ["dense", "splash", "splash", "dense"]
    float32 = choose("auto", Target("tpu", None, "float32", 64, 256))
    assert float32.implementation == "xla" and "blocked XLA beats dense" in float32.reason
    long = choose("auto", Target("tpu", None, "float32", 64, 1000)).reason  # not a multiple of 128
    assert "sequence length 1000 is not a multiple of 128" in long and "slower" not in long


def test_a_checkpoint_that_asked_for_splash_restores_with_this_devices_attention(tmp_path):
    import jax

    from jaxray import checkpoint

    trial = parse_trial(
        {"model": {"workload": "transformer", "width": 32, "num_heads": 2, "max_seq_len": 128,
                   "attention": "splash"}, "data": {"seq_len": 128}}
    )  # fmt: skip
    save_params(tmp_path / "ck", build(trial.model).init(jax.random.key(0)), trial)
    model, _ = checkpoint.restore(tmp_path / "ck")
    # auto on this device at T 128 in float32: the blocked XLA attention (not splash's interpret mode
    # on a CPU; on a TPU splash from T 512)
    assert model.attention.implementation == "xla"
