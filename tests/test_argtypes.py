"""Settings fields as command-line options: one declaration, the model's default in the help."""

from __future__ import annotations

import pytest

from jaxray.argtypes import add_field_options, cli_parser, given_options
from jaxray.inference.settings import EngineSettings, add_engine_options, engine_overrides
from jaxray.serve.settings import OPTIONS, AppArgs


def _parser():
    p = cli_parser("prog", "test")
    add_field_options(p, AppArgs, OPTIONS, OPTIONS)
    add_engine_options(p)
    return p


def test_options_left_out_keep_the_models_defaults():
    args = _parser().parse_args(["--chunk", "8", "--batch-wait-ms", "2.5"])
    assert engine_overrides(args) == {"chunk": 8}
    assert given_options(args, OPTIONS) == {"batch_wait_ms": 2.5}
    app = AppArgs(checkpoint="x", **given_options(args, OPTIONS), engine=engine_overrides(args))
    assert app.engine == EngineSettings(chunk=8) and app.max_ongoing_requests == 256


def test_help_shows_each_default_once():
    text = " ".join(_parser().format_help().split())  # argparse wraps lines
    assert "(default 32,128,256)" in text and "(default max_seq_len // 2)" in text
    assert "(default 256)" in text and "default: None" not in text


@pytest.mark.parametrize(
    ("argv", "option"), [(["--buckets", "8,x"], "--buckets"), (["--context-keep", "1"], "--context-keep")]
)
def test_a_bad_value_is_refused_by_its_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _parser().parse_args(argv)
    assert exit_info.value.code == 2 and option in capsys.readouterr().err
