"""Benchmark tables name their columns by row field; the sizes come from presets.yaml."""

from __future__ import annotations

import dataclasses

import pytest

from jaxray.bench import checkpointing, decode, ingest, serving
from jaxray.bench.columns import FIELDS, columns
from jaxray.bench.presets import PRESETS


def test_columns_reads_header_and_format_from_fields_and_keeps_written_out_columns():
    custom = ("final train loss", "final_loss", ".4f")
    assert columns("ms_per_step final_loss", custom) == [
        ("ms/step", "ms_per_step", ".2f"),
        ("final loss", "final_loss", ".6f"),
        custom,
    ]


def test_an_unknown_field_is_refused_by_name():
    with pytest.raises(KeyError, match="'ms_per_stepp'"):
        columns("ms_per_step ms_per_stepp")


@pytest.mark.parametrize("module", [checkpointing, decode, ingest, serving])
def test_every_benchmark_table_reads_known_fields(module):
    assert module.COLUMNS and all(key in FIELDS for _, key, _ in module.COLUMNS)


def test_presets_yaml_gives_every_preset_its_sizes_with_shared_shapes_merged():
    assert set(PRESETS) == {"cpu", "gpu", "tiny"}
    for preset in PRESETS.values():
        assert all(size["workload"] for size in [preset.dispatch, *preset.precision, *preset.devices])
        assert dataclasses.asdict(preset)["sweep_batches"]
    lm = PRESETS["cpu"].precision[-1]
    assert lm == {"workload": "transformer", "width": 128, "seq_len": 128, "max_seq_len": 128,
                  "global_batch": 16, "steps": 4, "repeats": 5}  # fmt: skip
