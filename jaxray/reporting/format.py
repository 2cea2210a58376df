"""Values as report text and as JSON. Missing values are ``None`` (empty cells); NaN and inf stay
in text and become ``null`` in JSON."""

from __future__ import annotations

import math
from typing import Any

WORKLOAD_ORDER = ("mlp", "shared_block_mlp", "transformer")  # the order reports show workloads in


def json_safe(value: Any) -> Any:
    """A JSON-safe copy: non-finite floats become None, arrays and numpy scalars plain Python."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if hasattr(value, "tolist"):  # numpy / jax scalars and arrays
        return json_safe(value.tolist())
    return str(value)  # Paths and anything else: keep something readable


def number(value: Any) -> float | None:
    """The value as a float, or None when missing or not a number (NaN/inf are kept)."""
    try:
        return None if value is None or isinstance(value, (bool, str)) else float(value)
    except (TypeError, ValueError):
        return None


def finite(value: Any) -> float | None:
    """The value as a float when it is a finite number, else None (missing, text, NaN, inf)."""
    v = number(value)
    return v if v is not None and math.isfinite(v) else None


def fmt(value: Any, spec: str) -> str:
    """``format(value, spec)`` for a number, "" when missing or not a number."""
    v = number(value)
    return "" if v is None else format(v, spec)  # NaN/inf show as "nan"/"inf": a diverged run


def mib(n: Any) -> float | None:
    """Bytes as MiB (None when not a number)."""
    v = number(n)
    return None if v is None else v / 2**20


def cell(text: Any) -> str:
    """``text`` as one Markdown table cell: a "|" or newline inside would break the table's layout."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def short_error(error: Any, limit: int = 80) -> str:
    """The first non-empty line of an error (not its traceback), cut to ``limit`` characters."""
    text = next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def throughput(row: dict) -> tuple[float | None, str]:
    """(value, unit) of a trial row's throughput: tokens/s for the transformer, examples/s otherwise."""
    if row.get("workload") == "transformer" or "tokens_per_sec" in row:
        return number(row.get("tokens_per_sec")), "tok/s"
    return number(row.get("examples_per_sec")), "ex/s"


def step_rates(row: dict[str, Any]) -> dict[str, float]:
    """A log row's throughput from its ``ms_per_step``: ``examples_per_sec`` (its examples per step over
    it) and, where it counts tokens, ``tokens_per_sec``; {} without ``ms_per_step``."""
    ms, step, examples = row.get("ms_per_step"), row.get("step"), row.get("examples")
    if not (ms and step and examples):
        return {}
    rates = {"examples_per_sec": examples / step / ms * 1e3}
    if row.get("tokens"):
        rates["tokens_per_sec"] = rates["examples_per_sec"] * row["tokens"] / examples
    return rates


def workloads(rows: list[dict]) -> list[str]:
    """The workloads of ``rows`` in WORKLOAD_ORDER, then any others by name ("?" for a row without)."""
    present = {r.get("workload", "?") for r in rows}
    return [w for w in WORKLOAD_ORDER if w in present] + sorted(present - set(WORKLOAD_ORDER))


def describe(row: dict) -> str:
    """A trial's grid point in words: "bfloat16, width 64, batch 128, peak lr 0.003"."""
    lr = row.get("learning_rate")
    return (
        f"{row.get('dtype', '?')}, width {row.get('width', '?')}, batch {row.get('global_batch', '?')}, "
        f"peak lr {lr if lr is None else format(lr, 'g')}"
    )


# What a diverged trial's final report records (``jaxray.train.run.Diverged.row``), kept in its row.
DIVERGED_KEYS = ("diverged_step", "diverged_metric", "diverged_value")


def diverged_error(row: dict) -> str | None:
    """A diverged trial's ``error``, "diverged at step 300: loss nan (not finite)"; None without
    ``diverged_step``."""
    if row.get("diverged_step") is None:
        return None
    found = f"{row.get('diverged_metric')} {row.get('diverged_value')}"
    return f"diverged at step {row['diverged_step']}: {found} (not finite)"
