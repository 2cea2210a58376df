"""The experiment YAML README.md shows is tune_configs/demo.yaml, the file `make demo` runs, word
for word, and that file sweeps the design's axes: global batch x dtype x width in one workload,
the peak learning rate in the transformer's."""

from __future__ import annotations

import re
from pathlib import Path

from jaxray.config.experiment import load_experiment

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tune_configs" / "demo.yaml"


def test_the_readmes_yaml_is_the_demos_own_text():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```$", readme, flags=re.S | re.M)
    assert blocks == [DEMO.read_text(encoding="utf-8")]
    assert "$(PY) -m jaxray.tune --config tune_configs/demo.yaml" in (ROOT / "Makefile").read_text()


def test_the_demo_sweeps_batch_dtype_and_width_and_the_transformers_learning_rate():
    sweeps = {s.workload: s.axes() for s in load_experiment(DEMO).sweeps}
    assert any(all(len(axes[a]) >= 2 for a in ("global_batch", "dtype", "width")) for axes in sweeps.values())
    assert len(sweeps["transformer"]["learning_rate"]) >= 2
