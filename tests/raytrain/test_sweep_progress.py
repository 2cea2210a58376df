"""The sweep's progress rows (``jaxray.raytrain.progress.SweepDisplay``) from the rows Tune hands
its callback: steps, loss, throughput, status. Off a terminal the final state is printed once."""

from __future__ import annotations

import io

from jaxray.raytrain.progress import SweepDisplay


def test_rows_show_steps_loss_throughput_and_status():
    file = io.StringIO()
    display = SweepDisplay(steps=100, file=file)
    with display.progress:
        display.result("mlp_b8_float32_w64", {"step": 50, "loss": 1.25, "examples": 400, "time_total_s": 2.0})
        display.result("mlp_b8_float32_w64", {"step": 100, "loss": 0.5, "examples": 800, "time_total_s": 4.0})
        display.result(
            "transformer_b8_float32_w32", {"step": 10, "loss": 5.5, "tokens": 640, "time_total_s": 1.0}
        )
        display.end("transformer_b8_float32_w32", "failed")
        display.result("mlp_b8_float32_w64", {"step": 100, "examples_per_sec": 12345.6})
        display.end("mlp_b8_float32_w64", "done")
        assert file.getvalue() == ""  # not a terminal: nothing until the sweep ends
    mlp, transformer = (line.rstrip() for line in file.getvalue().splitlines())
    assert mlp.startswith("mlp_b8_float32_w64 ") and mlp.endswith(" done")
    assert "100/100 steps" in mlp and "loss 0.5000" in mlp and "12,346 ex/s" in mlp  # the worker's figure
    assert transformer.startswith("transformer_b8_float32_w32 ") and transformer.endswith(" failed")
    assert "10/100 steps" in transformer and "loss 5.5000" in transformer and "640 tok/s" in transformer
