"""Config parsing: good configs load, bad ones fail early with the field and allowed values named."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from tune_cli import tune_main as run_cli

from jaxray.config import ConfigError, TrainConfig, WorkersConfig, parse_trial
from jaxray.config.experiment import MODEL_PRESETS, SweepConfig, load_experiment

ROOT = Path(__file__).resolve().parents[1]
GOOD = """
experiment: t
workers: {num_workers: 1, devices_per_worker: 4}
sweeps:
  - workload: mlp
    train: {steps: 5}
    search_space: {global_batch: [256, 512], dtype: [float32, bfloat16], width: [64]}
"""


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


SHIPPED = sorted(p.stem for p in (ROOT / "tune_configs").glob("*.yaml"))


def test_the_shipped_configs_are_all_found():
    shipped = {"demo", "quick", "smoke", "lab6_data_parallel", "lab7_transformer", "gpu_gpt2_small"}
    assert shipped <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_configs_load(name):
    # Every grid point is validated too; accelerator: gpu is only a config value, so this holds on a CPU.
    exp = load_experiment(ROOT / "tune_configs" / f"{name}.yaml")
    assert exp.experiment == name and exp.sweeps
    for sweep in exp.sweeps:
        assert [parse_trial(t) for t in sweep.trial_dicts(exp.base())]


PRESET_SWEEP = """
experiment: t
data: {seq_len: 1024}
sweeps:
  - workload: transformer
    model: MODEL
    search_space: {global_batch: [16]}
"""


def preset_trials(tmp_path, model: str, text: str = PRESET_SWEEP) -> list:
    exp = load_experiment(write(tmp_path, text.replace("MODEL", model)))
    return [parse_trial(t) for t in exp.sweeps[0].trial_dicts(exp.base())]


def test_gpt2_small_preset_expands(tmp_path):
    (trial,) = preset_trials(tmp_path, "{preset: gpt2_small}")
    m = trial.model
    assert (m.width, m.num_layers, m.num_heads, m.max_seq_len, m.head_dim, m.ffn_dim) == (
        768,
        12,
        12,
        1024,
        64,
        3072,
    )
    assert m.attention == "auto" and trial.data.seq_len == 1024


def test_shipped_gpt2_small_config_is_the_preset_in_bfloat16():
    exp = load_experiment(ROOT / "tune_configs" / "gpu_gpt2_small.yaml")
    (trial,) = [parse_trial(t) for t in exp.sweeps[0].trial_dicts(exp.base())]
    shape = {k: getattr(trial.model, k) for k in MODEL_PRESETS["gpt2_small"]}
    assert shape == MODEL_PRESETS["gpt2_small"] and trial.data.seq_len == 1024
    assert (trial.model.dtype, trial.model.attention, trial.train.global_batch) == ("bfloat16", "auto", 16)
    assert trial.workers.accelerator == "gpu" and trial.workers.total_devices == 1


def test_keys_given_next_to_a_preset_win(tmp_path):
    longer = PRESET_SWEEP.replace("seq_len: 1024", "seq_len: 2048")
    (trial,) = preset_trials(tmp_path, "{preset: gpt2_small, num_layers: 2, max_seq_len: 2048}", longer)
    assert (trial.model.num_layers, trial.model.num_heads, trial.model.max_seq_len) == (2, 12, 2048)
    searched = PRESET_SWEEP.replace("global_batch: [16]", "global_batch: [16], width: [384, 768]")
    assert [t.model.width for t in preset_trials(tmp_path, "{preset: gpt2_small}", searched)] == [384, 768]


def test_a_transformer_trained_on_windows_shorter_than_its_positions_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        preset_trials(tmp_path, "{preset: gpt2_small}", PRESET_SWEEP.replace("seq_len: 1024", "seq_len: 256"))
    assert "sweeps.0: data.seq_len 256 is below model.max_seq_len 1024: positions 255..1022" in str(err.value)


@pytest.mark.parametrize("preset", ["gpt3", "[gpt2_small]", "12"])
def test_an_unknown_preset_is_refused_with_the_allowed_names(tmp_path, preset):
    with pytest.raises(ConfigError) as err:
        preset_trials(tmp_path, f"{{preset: {preset}}}")
    message = str(err.value)
    assert "sweeps.0: model.preset" in message and "is not a known preset; allowed: gpt2_small" in message, (
        message
    )


def test_a_preset_applies_to_the_transformer_only(tmp_path):
    mlp_with_preset = GOOD.replace("train: {steps: 5}", "train: {steps: 5}\n    model: {preset: gpt2_small}")
    with pytest.raises(ConfigError, match=re.escape("model key(s) preset do not apply to workload 'mlp'")):
        load_experiment(write(tmp_path, mlp_with_preset))


def test_demo_grid_has_ten_trials_and_sweeps_the_transformers_learning_rate():
    exp = load_experiment(ROOT / "tune_configs" / "demo.yaml")
    trials = [t for s in exp.sweeps for t in s.trial_dicts(exp.base())]
    assert sorted(t["model"]["workload"] for t in trials) == ["mlp"] * 8 + ["transformer"] * 2
    assert [t["train"]["learning_rate"] for t in trials if t["model"]["workload"] == "transformer"] == [
        3e-3,
        2e-3,
    ]


def test_an_unsearched_learning_rate_is_the_grids_one_value_and_in_every_trials_name():
    """The learning rate is always an axis of the grid: train's, else the workload's default."""
    fixed = SweepConfig.model_validate({"workload": "mlp", "train": {"learning_rate": 0.01}})
    default = SweepConfig.model_validate({"workload": "transformer"})
    assert fixed.axes()["learning_rate"] == [0.01] and default.axes()["learning_rate"] == [3e-4]
    trial = parse_trial(default.trial_dicts({})[0])
    assert trial.name() == "transformer_b256_float32_w256_lr0.0003" and fixed.grid_size() == 1


def test_numbers_stay_numbers_and_inapplicable_worker_keys_are_refused():
    """YAML 1.1 reads ``1.0e7`` as a string: the sweep keeps the number it trains with (summary rows,
    trial names); an elastic-only key with a fixed num_workers is refused as it would do nothing."""
    import yaml

    sweep = SweepConfig.model_validate(yaml.safe_load("{workload: mlp, train: {learning_rate: 1.0e7}}"))
    assert sweep.axes()["learning_rate"] == [1.0e7] and sweep.train["learning_rate"] == 1.0e7
    with pytest.raises(ValueError, match="applies to elastic workers only .* fixed num_workers 2"):
        WorkersConfig(num_workers=2, elastic_resize_monitor_interval_s=5)
    assert WorkersConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=5).elastic


def test_good_config_expands_grid(tmp_path):
    exp = load_experiment(write(tmp_path, GOOD))
    trials = exp.sweeps[0].trial_dicts(exp.base())
    assert len(trials) == 4
    assert {(t["train"]["global_batch"], t["model"]["dtype"]) for t in trials} == {
        (256, "float32"),
        (256, "bfloat16"),
        (512, "float32"),
        (512, "bfloat16"),
    }
    assert exp.sweeps[0].metric == "test_accuracy" and exp.sweeps[0].mode == "max"


@pytest.mark.parametrize(
    "old,new,expected",
    [
        (
            "global_batch: [256, 512]",
            "global_batch: [256, 510]",
            "not divisible by the 4 devices it is split over",
        ),
        ("dtype: [float32, bfloat16]", "dtype: [float32, float64]", "'float32', 'bfloat16' or 'float16'"),
        ("workload: mlp", "workload: resnet", "'mlp', 'shared_block_mlp' or 'transformer'"),
        (
            "train: {steps: 5}",
            "train: {stpes: 5}",
            "sweeps.0.train.stpes: unknown key; allowed: steps, global_batch",
        ),
        ("train: {steps: 5}", "train: {steps: 0}", "steps"),
        ("train: {steps: 5}", "train: {steps: many}", "steps"),
        ("experiment: t", "experiment: t\nexperimnet: u", "experimnet: unknown key"),
        ("width: [64]", "width: [-3]", "width"),
        (
            "train: {steps: 5}",
            "train: {steps: true}",
            "sweeps.0.train.steps: Input should be a valid integer",
        ),
        ("train: {steps: 5}", "train: {steps: 2.5}", "sweeps.0.train.steps: Input should be a valid integer"),
        (
            "train: {steps: 5}",
            "train: {steps: 5, learning_rate: true}",
            "sweeps.0.train.learning_rate: a boolean is not a number",
        ),
        ("width: [64]", "width: [64, 64]", "width lists a value twice: [64, 64]"),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    model: {num_heads: 2}",
            "model key(s) num_heads do not apply to workload 'mlp'; allowed: none",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    metric: val_loss",
            "allowed: test_accuracy, test_loss, final_train_loss",
        ),
        ("experiment: t", "experiment: t\nexperiment: u", "duplicate key 'experiment'"),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    early_stopping: {type: hyperband}",
            "sweeps.0.early_stopping.type: Input should be 'asha'",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    early_stopping: {metric: test_loss}",
            "sweeps.0.early_stopping.metric: Input should be 'loss', 'accuracy', 'val_loss' or "
            "'val_accuracy'",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    early_stopping: {reduction_factor: 1}",
            "sweeps.0.early_stopping.reduction_factor",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    early_stopping: {grace: 3}",
            "early_stopping.grace: unknown key",
        ),
        ("experiment: t", "experiment: t\nmax_concurrent_trials: 0", "max_concurrent_trials"),
        (
            "train: {steps: 5}",
            "train: {steps: 5, checkpoint_score: val_loss}",
            "train.checkpoint_score val_loss needs train.eval_every (the held-out metrics); without it "
            "use one of loss, accuracy",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5, checkpoint_score: test_loss}",
            "checkpoint_score: Input should be 'val_loss', 'val_accuracy', 'loss' or 'accuracy'",
        ),
        # A fresh user's "." made runs/ itself a run folder; ".." wrote one into the working folder.
        ("experiment: t", 'experiment: "."', "experiment: '.' is not a folder name of its own"),
        ("experiment: t", 'experiment: ".."', "experiment: '..' is not a folder name of its own"),
    ],
)
def test_bad_config_names_the_field(tmp_path, old, new, expected):
    assert old in GOOD
    with pytest.raises(ConfigError) as err:
        exp = load_experiment(write(tmp_path, GOOD.replace(old, new)))
        for s in exp.sweeps:  # train dicts are validated when a trial is built
            [parse_trial(t) for t in s.trial_dicts(exp.base())]
    message = str(err.value)
    if "..." in expected:
        head, tail = expected.split("...")
        assert head in message and tail in message, message
    else:
        assert expected in message, message


def test_a_workload_in_two_sweeps_is_rejected(tmp_path):
    twice = GOOD + "  - workload: mlp\n    search_space: {global_batch: [1024]}\n"
    with pytest.raises(ConfigError, match="workload mlp appears in more than one sweep"):
        load_experiment(write(tmp_path, twice))


def test_not_utf8(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(b"\xff\xfeexperiment: t\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_experiment(path)


def test_invalid_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_experiment(write(tmp_path, "experiment: [unclosed"))
    with pytest.raises(ConfigError, match="config file not found"):
        load_experiment(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_experiment(write(tmp_path, "- just\n- a list\n"))


def test_transformer_checks():
    with pytest.raises(ConfigError, match="divisible by num_heads"):
        parse_trial({"model": {"workload": "transformer", "width": 130, "num_heads": 4}})
    with pytest.raises(ConfigError, match="exceeds model.max_seq_len"):
        parse_trial({"model": {"workload": "transformer", "max_seq_len": 64}, "data": {"seq_len": 128}})


def test_cli_rejects_a_batch_larger_than_the_data(tmp_path, real_dir):
    big = write(tmp_path, GOOD.replace("global_batch: [256, 512]", "global_batch: [100000]"))
    proc = run_cli("--config", big, "--data-dir", real_dir, "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert "global_batch: 100000 is larger than the 60000 training samples of mlp" in proc.stderr
    assert not (tmp_path / "o").exists()


def test_cli_refuses_an_out_that_is_a_file(tmp_path, real_dir):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    proc = run_cli("--config", ROOT / "tune_configs" / "smoke.yaml", "--data-dir", real_dir, "--out", a_file)
    assert proc.returncode == 2 and f"--out {a_file} cannot be written" in proc.stderr, proc.stderr
    assert a_file.read_text() == "x"


def test_cli_rejects_bad_config_before_starting_ray(tmp_path):
    bad = write(tmp_path, GOOD.replace("global_batch: [256, 512]", "global_batch: [256, 510]"))
    proc = run_cli("--config", bad, "--out", tmp_path / "o")
    assert proc.returncode == 2
    assert "global_batch 510 is not divisible by the 4 devices it is split over" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_cli_names_a_parquet_folder_that_is_not_prepared(tmp_path, real_dir):
    (tmp_path / "pq" / "fashion-mnist").mkdir(parents=True)  # a folder without a manifest
    config = write(
        tmp_path, GOOD.replace("experiment: t", f"experiment: t\ndata: {{parquet: {tmp_path / 'pq'}}}")
    )
    proc = run_cli("--config", config, "--data-dir", real_dir, "--out", tmp_path / "o")
    assert proc.returncode == 2 and "data.parquet:" in proc.stderr and "manifest.json" in proc.stderr, (
        proc.stderr
    )
    assert not (tmp_path / "o").exists()


def test_data_parquet_names_a_missing_folder_and_a_dataset_folder(tmp_path):
    from jaxray.data.manifest import ManifestError
    from jaxray.data.workloads import parquet_folder

    trial = lambda root: parse_trial({"model": {"workload": "mlp"}, "data": {"parquet": str(root)}})  # noqa: E731
    with pytest.raises(ManifestError, match=f"{tmp_path / 'none'} does not exist"):
        parquet_folder(trial(tmp_path / "none"))
    (tmp_path / "fashion-mnist").mkdir()
    (tmp_path / "fashion-mnist" / "manifest.json").write_text("{}")
    with pytest.raises(
        ManifestError,
        match="is one prepared dataset; data.parquet names the folder that holds "
        "fashion-mnist and tinyshakespeare folders",
    ):
        parquet_folder(trial(tmp_path / "fashion-mnist"))


def test_fault_injection_is_no_config_key():
    with pytest.raises(ConfigError, match="fault"):
        parse_trial({"model": {"workload": "mlp"}, "fault": {"kill_at_step": 5}})


@pytest.mark.parametrize("value", ["1", "0", "yes", "off", "'true'", "2.0"])
def test_booleans_take_only_true_or_false(tmp_path, value):
    config = GOOD.replace(
        "  - workload: mlp\n", f"  - workload: transformer\n    model: {{scan_layers: {value}}}\n"
    )
    with pytest.raises(ConfigError) as err:
        load_experiment(write(tmp_path, config))
    shown = {"yes": "'yes'", "off": "'off'"}.get(value, value)  # YAML 1.2: only true/false are booleans
    assert f"model.scan_layers: Input should be true or false, got {shown}" in str(err.value), str(err.value)


def test_booleans_true_and_false_still_load():
    for value in (True, False):
        trial = parse_trial({"model": {"workload": "transformer", "scan_layers": value}})
        assert trial.model.scan_layers is value


def test_cpu_devices_per_worker_has_the_command_lines_bound():
    from jaxray.argtypes import MAX_CPU_DEVICES

    def trial(devices, accelerator="cpu"):
        workers = {"devices_per_worker": devices, "accelerator": accelerator}
        return parse_trial(
            {"model": {"workload": "mlp"}, "train": {"global_batch": 1024}, "workers": workers}
        )

    assert trial(MAX_CPU_DEVICES).workers.total_devices == MAX_CPU_DEVICES
    assert trial(1024, "gpu").workers.devices_per_worker == 1024  # GPUs are counted by Ray
    with pytest.raises(ConfigError) as err:
        trial(1024)
    assert (
        f"workers: devices_per_worker must be at most {MAX_CPU_DEVICES} forced host devices on CPU "
        f"(accelerator cpu), got 1024" in str(err.value)
    ), str(err.value)


def test_a_compile_cache_that_is_a_file_is_refused_by_name(tmp_path):
    """Before Ray starts: JAX would fail inside every worker a minute later."""
    (path := tmp_path / "cache").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"workers: compile_cache '.*cache' is a file: give a folder"):
        parse_trial({"model": {"workload": "mlp"}, "workers": {"compile_cache": str(path)}})
    assert parse_trial({"model": {"workload": "mlp"}, "workers": {"compile_cache": str(tmp_path)}})
    relative = parse_trial({"model": {"workload": "mlp"}, "workers": {"compile_cache": "cache"}})
    assert relative.workers.compile_cache == str(Path.cwd() / "cache")  # the workers start elsewhere
    inside = f"{path}/sub"  # a folder cannot be made under a file either
    with pytest.raises(ConfigError, match=rf"compile_cache '{inside}' is inside the file {path}: give a"):
        parse_trial({"model": {"workload": "mlp"}, "workers": {"compile_cache": inside}})


def test_jax_s_own_cache_variable_that_names_a_file_is_refused_by_name(tmp_path, monkeypatch):
    """Where a sweep or a local run plans its trials (before Ray); a saved config still parses."""
    (path := tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(path))
    unset = r"exp.yaml:\n  workers: compile_cache \(unset: \$JAX_COMPILATION_CACHE_DIR\) '.*cache' is a file"
    with pytest.raises(ConfigError, match=unset):
        load_experiment(write(tmp_path, GOOD))
    assert parse_trial({"model": {"workload": "mlp"}})
    off = GOOD.replace("devices_per_worker: 4}", "devices_per_worker: 4, compile_cache: ''}")
    assert load_experiment(write(tmp_path, off)).plans("x.yaml")  # off: the variable is not read


def test_a_yaml_with_too_many_cpu_devices_is_refused(tmp_path):
    config = GOOD.replace("devices_per_worker: 4", "devices_per_worker: 1024")
    with pytest.raises(ConfigError, match=r"workers: devices_per_worker must be at most 256 .* got 1024"):
        load_experiment(write(tmp_path, config))


@pytest.mark.parametrize(
    "old, new, expected",
    [
        ("dtype: [float32, bfloat16]", "dtype: [float64]", "'bfloat16' or 'float16', got 'float64'"),
        ("workload: mlp", "workload: resnet", "or 'transformer', got 'resnet'"),
        ("train: {steps: 5}", "train: {steps: 0}", "train.steps: Input should be greater than 0, got 0"),
        ("train: {steps: 5}", "train: {steps: -3}", "greater than 0, got -3"),
        ("train: {steps: 5}", "train: {steps: 2.5}", "train.steps: Input should be a valid integer, got 2.5"),
        ("train: {steps: 5}", "train: {steps: }", "train.steps: Input should be a valid integer, got null"),
        ("width: [64]", "width: [0]", "search_space.width.0: Input should be greater than 0, got 0"),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    early_stopping: {metric: test_loss}",
            "early_stopping.metric: Input should be 'loss', 'accuracy', 'val_loss' or 'val_accuracy', "
            "got 'test_loss'",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    early_stopping: {reduction_factor: 1}",
            "early_stopping.reduction_factor: Input should be greater than or equal to 2, got 1",
        ),
        (
            "train: {steps: 5}",
            "train: {steps: 5}\n    mode: maximum",
            "sweeps.0.mode: Input should be 'min' or 'max', got 'maximum'",
        ),
        ("experiment: t", "experiment: t\nmax_concurrent_trials: 0", "greater than 0, got 0"),
        ("experiment: t", "experiment: a b", "experiment: String should match pattern"),
        ("experiment: t", "experiment: a b", "got 'a b'"),
        ("train: {steps: 5}", "train: {steps: 5, weight_decay: -0.1}", "or equal to 0, got -0.1"),
        ("experiment: t", "experiment: t\ndata: {seq_len: 1}", "data: seq_len must be >= 2 (next-byte"),
        ("experiment: t", "experiment: t\ndata: {seq_len: 1}", "two tokens), got 1"),
        (
            "width: [64]",
            "width: [1]",
            "width must be >= 2 for mlp (the second hidden layer is width // 2), got 1",
        ),
    ],
)
def test_choice_and_range_messages_repeat_the_value(tmp_path, old, new, expected):
    assert old in GOOD
    with pytest.raises(ConfigError) as err:
        exp = load_experiment(write(tmp_path, GOOD.replace(old, new)))
        for s in exp.sweeps:
            [parse_trial(t) for t in s.trial_dicts(exp.base())]
    assert expected in str(err.value), str(err.value)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"])
def test_an_empty_file_is_called_empty(tmp_path, text):
    with pytest.raises(ConfigError) as err:
        load_experiment(write(tmp_path, text))
    message = str(err.value)
    assert "the file is empty; it needs at least experiment and sweeps" in message, message
    assert "NoneType" not in message


@pytest.mark.parametrize(
    "setting, shown",
    [
        ("learning_rate: .nan", "nan"),
        ("learning_rate: .inf", "inf"),
        ("learning_rate: nan", "'nan'"),
        ("learning_rate: -.inf", "-inf"),
        ("weight_decay: .nan", "nan"),
        ("weight_decay: -.inf", "-inf"),
    ],
)
def test_nan_and_infinity_are_not_finite(tmp_path, setting, shown):
    config = GOOD.replace("train: {steps: 5}", f"train: {{steps: 5, {setting}}}")
    with pytest.raises(ConfigError) as err:
        exp = load_experiment(write(tmp_path, config))
        [parse_trial(t) for t in exp.sweeps[0].trial_dicts(exp.base())]
    message = str(err.value)
    field = setting.split(":")[0]
    assert f"train.{field}: not finite (NaN and infinity are not allowed), got {shown}" in message, message
    assert "greater than" not in message


def test_a_sweeps_mesh_reaches_its_trials_and_the_rest_goes_to_data(tmp_path):
    config = GOOD.replace("    train: {steps: 5}", "    train: {steps: 5}\n    parallel: {fsdp: 2}")
    exp = load_experiment(write(tmp_path, config))
    trials = [parse_trial(t) for t in exp.sweeps[0].trial_dicts(exp.base())]
    assert {tuple(t.mesh_shape.values()) for t in trials} == {(2, 2, 1)}  # data is the rest (-1)
    assert parse_trial({"model": {"workload": "mlp"}}).mesh_shape == {"data": 1, "fsdp": 1, "tensor": 1}
    tensor = parse_trial({"model": {"workload": "mlp"}, "workers": {"devices_per_worker": 4},
                          "parallel": {"fsdp": -1, "tensor": 2}})  # fmt: skip
    assert tensor.mesh_shape == {"data": 1, "fsdp": 2, "tensor": 2}  # data left out: 1 beside a -1


@pytest.mark.parametrize(
    ("setting", "expected"),
    [
        ("fsdp: 3", "parallel.fsdp 3 x parallel.tensor 1 cannot make a mesh of the trial's 4 devices "
                    "(workers.num_workers x workers.devices_per_worker): the fixed sizes' product (3) must "
                    "divide 4"),
        ("{data: 2, fsdp: 1, tensor: 1}", "parallel.data 2 x parallel.fsdp 1 x parallel.tensor 1 cannot "
                                          "make a mesh of the trial's 4 devices (workers.num_workers x "
                                          "workers.devices_per_worker): their product (2) must be 4, or one "
                                          "size -1 for the rest"),
        ("{data: -1, tensor: -1}", "parallel sizes must be positive, with at most one -1 (the rest)"),
        ("fsdp: 0", "parallel sizes must be positive, with at most one -1 (the rest)"),
        ("fsdp: -2", "parallel.fsdp: Input should be greater than or equal to -1, got -2"),
        ("model: 2", "parallel.model: unknown key; allowed: data, fsdp, tensor"),
    ],
)  # fmt: skip
def test_a_bad_mesh_is_refused_naming_the_numbers(tmp_path, setting, expected):
    config = GOOD.replace("    train: {steps: 5}", "    train: {steps: 5}\n    parallel: " + (
        setting if setting.startswith("{") else "{" + setting + "}"))  # fmt: skip
    with pytest.raises(ConfigError) as err:
        load_experiment(write(tmp_path, config))
    assert expected in str(err.value), str(err.value)


def test_fsdp_may_span_workers_tensor_may_not():
    two_by_two = {"model": {"workload": "mlp"}, "workers": {"num_workers": 2, "devices_per_worker": 2},
                  "train": {"global_batch": 8}}  # fmt: skip
    assert parse_trial({**two_by_two, "parallel": {"fsdp": 4}}).mesh_shape == {
        "data": 1,
        "fsdp": 4,
        "tensor": 1,
    }
    with pytest.raises(ConfigError) as err:
        parse_trial({**two_by_two, "parallel": {"tensor": 4}})
    assert (
        "parallel.tensor 4 must divide workers.devices_per_worker 2 (allowed: 1, 2): a tensor-parallel "
        "group all-reduces every layer, so it stays within one worker" in str(err.value)
    ), str(err.value)


def test_learning_rates_that_print_alike_get_names_of_their_own():
    sweep = SweepConfig.model_validate(
        {"workload": "mlp", "search_space": {"learning_rate": [1e-3, 1.000001e-3]}}
    )
    names = [parse_trial(t).name() for t in sweep.trial_dicts({})]
    assert names == ["mlp_b256_float32_w256_lr0.001", "mlp_b256_float32_w256_lr0.001000001"]


def test_a_fixed_learning_rate_of_zero_is_refused_not_replaced(tmp_path):
    config = tmp_path / "zero.yaml"
    config.write_text("experiment: x\nsweeps:\n  - workload: mlp\n    train: {learning_rate: 0}\n")
    with pytest.raises(ConfigError, match=r"sweeps\.0\.train\.learning_rate"):
        load_experiment(config)


def test_checkpoints_by_default_every_tenth_kept_by_score():
    """About every tenth of the steps (a multiple of log_every); ranked by val_loss with held-out
    metrics, else the training loss; accuracies maximised; and one lost node survived (max_failures 1)."""
    train = TrainConfig(steps=1000, log_every=20)
    assert (train.checkpoint_interval, train.score) == (100, ("loss", "min"))
    # A tenth rounded up to a multiple of log_every: each checkpoint goes with a logged row.
    assert TrainConfig(steps=95, log_every=25).checkpoint_interval == 25
    assert TrainConfig(steps=5).checkpoint_interval == 5
    assert TrainConfig(steps=100, checkpoint_every=7).checkpoint_interval == 7
    assert TrainConfig(steps=100, log_every=5, eval_every=10).score == ("val_loss", "min")
    assert TrainConfig(checkpoint_score="accuracy").score == ("accuracy", "max")
    assert WorkersConfig().max_failures == 1 and WorkersConfig().max_preemption_failures == -1
    assert WorkersConfig().max_driver_failures == 1
    with pytest.raises(ValueError, match="max_driver_failures"):
        WorkersConfig(max_driver_failures=-2)


def test_an_elastic_range_is_checked_at_every_size_before_ray():
    def trial(workers):
        return {
            "model": {"workload": "mlp"},
            "train": {"global_batch": 8},
            "workers": {"num_workers": workers},
        }

    assert parse_trial(trial([1, 2])).workers.worker_range == (1, 2)
    assert parse_trial(trial([1, 2])).workers.total_devices == 2
    with pytest.raises(ConfigError) as err:
        parse_trial(trial([2, 3]))
    assert "global_batch 8 is not divisible by the 3 devices" in str(err.value)
    assert "(with 3 of workers.num_workers [2, 3])" in str(err.value)
    with pytest.raises(ConfigError, match=r"num_workers \[min, max\] needs min <= max, got \[2, 1\]"):
        parse_trial(trial([2, 1]))


@pytest.mark.parametrize("workers", [[0, 2], "2", [2], [1, 2, 3], True])
def test_a_worker_count_is_a_number_or_a_pair(workers):
    trial = {"model": {"workload": "mlp"}, "train": {"global_batch": 8}, "workers": {"num_workers": workers}}
    with pytest.raises(
        ConfigError, match=r"workers.num_workers: num_workers must be a positive integer or \[min, max\]"
    ):
        parse_trial(trial)


@pytest.mark.parametrize(
    "storage,match",
    [
        ("s3:/bucket/runs", "expected a URI such as s3://bucket/prefix"),
        ("", "expected a URI such as s3://bucket/prefix"),
        ("file://host/shared/runs", "expected file:///absolute/path (no host)"),
        ("s3://", "expected a URI"),
        ("s3://key:secret@bucket/p", "give the endpoint, region and credentials in the environment"),
        ("s3://bucket/p?endpoint_override=h:9000", "not in the URI, which the run folder records"),
        ("shared/runs", "is a relative folder: it would mean another place from each working directory"),
    ],
)
def test_storage_is_a_uri_without_credentials(tmp_path, storage, match):
    path = tmp_path / "exp.yaml"
    path.write_text(f"experiment: x\nstorage: {storage!r}\nsweeps: [{{workload: mlp}}]\n")
    with pytest.raises(ConfigError, match=re.escape(match)) as err:
        load_experiment(path)
    assert "storage" in str(err.value)
    path.write_text("experiment: x\nstorage: s3://bucket/prefix/\nsweeps: [{workload: mlp}]\n")
    assert load_experiment(path).storage == "s3://bucket/prefix"
    path.write_text("experiment: x\nstorage: S3://bucket/prefix\nsweeps: [{workload: mlp}]\n")
    assert load_experiment(path).storage == "s3://bucket/prefix"
    # A folder every node mounts: an absolute one, as a file:// URI.
    path.write_text(f"experiment: x\nstorage: {tmp_path / 'shared'}\nsweeps: [{{workload: mlp}}]\n")
    assert load_experiment(path).storage == (tmp_path / "shared").as_uri()


def test_the_accelerator_and_its_tpu_slice_keys_are_checked():
    def workers(**given):
        return parse_trial(
            {"model": {"workload": "mlp"}, "train": {"global_batch": 8}, "workers": given}
        ).workers

    assert workers(accelerator="tpu", devices_per_worker=4).accelerator == "tpu"
    multi = workers(accelerator="tpu", num_workers=2, topology="4x4", accelerator_type="TPU-V5LITEPOD")
    assert multi.topology == "4x4"
    refusals = {
        "must be one of (1, 2, 4, 8) with accelerator tpu, got 3": {
            "accelerator": "tpu",
            "devices_per_worker": 3,
        },
        "topology: TPU slice keys, they need accelerator tpu, not gpu": {
            "accelerator": "gpu",
            "topology": "2x2",
        },
        "Ray needs workers.topology": {"accelerator": "tpu", "num_workers": 2},
        "Input should be 'cpu', 'gpu' or 'tpu'": {"accelerator": "cuda"},
        "use_gpu: unknown key": {"use_gpu": True},
    }
    for message, given in refusals.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            workers(**given)
