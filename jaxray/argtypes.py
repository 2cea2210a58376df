"""Argument types shared by the command lines (argparse turns their errors into exit code 2 with
the option's name). Nothing here imports JAX: parsing happens before XLA_FLAGS is final."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

MAX_CPU_DEVICES = 256  # forced host devices; thousands make XLA's start-up hang
# --checkpoint's help where a train/<trial> folder is accepted (sampling adds its workload).
CHECKPOINT_HELP = (
    "a checkpoint folder (or its URI: s3://, gs://), a train/<trial> folder, or runs/<experiment>"
)
TRANSFORMER_CHECKPOINT_HELP = f"{CHECKPOINT_HELP} (its best transformer)"


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default unless its help already says it ("(default ...)")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def cli_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A command line whose --help shows every option's default."""
    return argparse.ArgumentParser(prog=prog, description=description, formatter_class=_DefaultsHelp)


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def checked(value: int, ok: bool, expected: str) -> int:
    """``value`` if ``ok``, else argparse's error "expected EXPECTED, got VALUE"."""
    if not ok:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def cpu_device_count(text: str) -> int:
    """A forced CPU device count, 1..MAX_CPU_DEVICES."""
    value = positive_int(text)
    return checked(value, value <= MAX_CPU_DEVICES, f"at most {MAX_CPU_DEVICES} forced CPU devices")


def mesh_sizes(text: str) -> dict[str, int]:
    """``data=D,fsdp=F,tensor=T`` (any of the three, -1 for the rest) -> ``{axis: size}``."""
    sizes = {}
    for part in text.split(","):
        axis, _, size = part.partition("=")
        if axis.strip() not in ("data", "fsdp", "tensor") or not size.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(
                f"expected data=D,fsdp=F,tensor=T (any of them; -1: the rest), got {text!r}"
            )
        sizes[axis.strip()] = int(size)
    return sizes


def folder(text: str) -> str:
    """An existing directory."""
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


FORCE_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def cpu_xla_flags(devices: int, flags: str = "") -> str:
    """``flags`` (the user's XLA_FLAGS) with ``FORCE_DEVICES_FLAG=devices`` added; a device count
    already in them is replaced, every other flag kept in its order."""
    kept = [f for f in flags.split() if f.split("=", 1)[0] != FORCE_DEVICES_FLAG]
    return " ".join([*kept, f"{FORCE_DEVICES_FLAG}={devices}"])


def int_list(text: str) -> tuple[int, ...]:
    """Comma-separated positive integers, e.g. ``32,128,256`` (repeats allowed)."""
    try:
        return tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated positive integers, got {text!r}"
        ) from None


def name_list(text: str) -> list[str]:
    """Comma-separated names, e.g. ``attention,gpt2_b16``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return names


def positive_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated distinct positive integers, e.g. ``1,4,16,64``."""
    values = tuple(positive_int(part) for part in text.split(",") if part.strip()) or (positive_int(""),)
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a value is listed twice: {text}")
    return values


def _finite(text: str, ok, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return _finite(text, lambda v: v > 0, "a finite number > 0")


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    return _finite(text, lambda v: v >= 0, "a finite number >= 0")


def port(text: str) -> int:
    """A TCP port, 1..65535."""
    value = positive_int(text)
    return checked(value, value <= 65535, "a TCP port 1..65535")


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, such as ``'{"min_replicas": 1, "max_replicas": 2}'``."""
    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value


def context_keep(text: str) -> int:
    """Bytes of context kept when the window is full: an integer >= 2 (max_seq_len checked later)."""
    value = positive_int(text)
    return checked(value, value >= 2, "an integer >= 2 (bytes kept when the window is full)")


# Field name -> (argparse type, help text, help's default when the field's default is None).
FieldOptions = dict[str, tuple[Callable[[str], Any], str, str]]


def add_field_options(
    parser: argparse.ArgumentParser, model: Any, options: FieldOptions, names: Iterable[str], note: str = ""
) -> None:
    """One option per field in ``names`` of pydantic ``model`` (``max_batch_size`` ->
    ``--max-batch-size``), defaulting to None so the model's default applies; ``note`` ends each help."""
    for name in names:
        kind, what, when_none = options[name]
        default = model.model_fields[name].default
        shown = when_none if default is None else default
        shown = ",".join(map(str, shown)) if isinstance(shown, tuple) else str(shown)
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=kind, default=None, help=f"{what} (default {shown}){note}")


def given_options(args: argparse.Namespace, options: FieldOptions) -> dict[str, Any]:
    """{field: value} for the ``options`` given on the command line."""
    return {name: getattr(args, name) for name in options if getattr(args, name, None) is not None}
