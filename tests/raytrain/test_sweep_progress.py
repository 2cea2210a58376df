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


def test_a_row_with_ms_per_step_shows_the_throughput_the_summary_table_computes():
    """A trial ASHA stops keeps its last row's figure: tokens per step over ``ms_per_step``, as
    ``reporting.format.step_rates`` computes it for the table, not the tokens over the time since the trial
    started (compile and start-up included: the demo's stopped trial said 6,756 against 13,170)."""
    file = io.StringIO()
    display = SweepDisplay(steps=2000, file=file)
    with display.progress:
        row = {"step": 250, "loss": 2.3555, "val_loss": 2.3624, "examples": 4000, "tokens": 252_000}
        display.result(
            "transformer_b16_float32_w128_lr0.002", row | {"ms_per_step": 76.54, "time_total_s": 37.3}
        )
        display.end("transformer_b16_float32_w128_lr0.002", "stopped early at step 250")
    assert "13,170 tok/s" in file.getvalue()  # 1,008 tokens a step in 76.54 ms


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as the one `make demo` prints on."""

    def isatty(self) -> bool:
        return True


def test_on_a_terminal_what_others_print_stays_out_of_the_rows(capsys):
    # `make demo` on a terminal showed Tune's tables among the rows: rich's live display pointed
    # sys.stdout at the terminal, and what Ray and Tune print belongs to the run's log.
    file = Terminal()
    display = SweepDisplay(steps=10, file=file)
    with display.progress:
        display.result("mlp_b8_float32_w64", {"step": 5, "loss": 1.0})
        print("Trial status: 1 RUNNING")  # Tune, in the driver
    assert "Trial status" not in file.getvalue() and "mlp_b8_float32_w64" in file.getvalue()
    assert "Trial status: 1 RUNNING" in capsys.readouterr().out  # where it was printed: the log, there


def test_a_row_without_ms_per_step_counts_from_the_row_before():
    """The first row after a restart has no ``ms_per_step``: its speed is over the time since the row
    before it, rows with ``ms_per_step`` included (not since the trial's first row)."""
    file = io.StringIO()
    display = SweepDisplay(steps=100, file=file)
    with display.progress:
        display.result("mlp_b8", {"step": 50, "examples": 400, "time_total_s": 2.0})
        display.result("mlp_b8", {"step": 100, "examples": 800, "time_total_s": 4.0, "ms_per_step": 40.0})
        display.result("mlp_b8", {"step": 150, "examples": 1200, "time_total_s": 10.0})
        display.end("mlp_b8", "done")
    assert "67 ex/s" in file.getvalue()  # (1200 - 800) / (10 - 4) s; since the first row: 100
