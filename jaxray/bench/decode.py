"""``python -m jaxray.bench decode``: new tokens/s of the KV-cache sampler against full-window recompute.

Samplers, side by side in one run on the same model (the lab's: d_model 256, 4 layers, 4 heads,
max_seq_len 256, fresh weights unless ``--checkpoint``; speed does not depend on the weights), the
same prompt and the same number of new tokens:

* ``kv-cache``: ``jaxray.inference.engine`` (prefill, then one cached decode step per token, the
  whole loop in one compiled call), with the default window policy (context_keep = S // 2) and with
  context_keep = S (the exact sliding window: a re-prefill of S - 1 bytes per token past S);
* ``full recompute``: ``jaxray.inference.sampling.sample``, the whole window per token, loop on device;
* ``notebook``: the learning path's sampler (``reference_generate.py``, run as its own process:
  the whole window per token and a host round trip per byte).

Each jaxray row is the median of ``repeats`` timed calls after a warm-up call (which compiles);
the notebook row is the median of ``repeats`` runs of the script, each timing itself after its own
warm-up. Ratios are tokens/s over the full-recompute row and over the notebook row.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jaxray import checkpoint
from jaxray.bench import compare
from jaxray.bench.columns import columns
from jaxray.bench.output import Case, Report, run_cases
from jaxray.bench.timing import environment, time_calls
from jaxray.config import ModelConfig
from jaxray.inference.engine import Engine, Request
from jaxray.inference.sampling import prompt_window, sample
from jaxray.inference.settings import EngineSettings
from jaxray.models import build

LAB = ModelConfig(
    workload="transformer", width=256, num_layers=4, num_heads=4, max_seq_len=256, attention="xla"
)
TARGET = 20.0  # the bar: KV-cache tokens/s over full-window tokens/s at 300 new tokens, batch 1
COLUMNS = columns("sampler batch new_tokens tokens_per_sec ms_per_token vs_full vs_notebook")


def load_model(checkpoint_path: str | None):
    """(model, params): the checkpoint's transformer, or the lab's with fresh weights."""
    if checkpoint_path:
        return checkpoint.restore(checkpoint.resolve(checkpoint_path, workload="transformer"))
    model = build(LAB)
    return model, model.init(jax.random.key(0))


def _kv_case(
    model,
    params,
    prompt: bytes,
    new_tokens: int,
    batch: int,
    keep: int | None,
    temperature: float,
    repeats: int,
) -> Case:
    settings = EngineSettings(
        buckets=(min(len(prompt), model.config.max_seq_len),),
        batch_sizes=(batch,),
        chunk=new_tokens,
        max_new_tokens=new_tokens,
        context_keep=keep,
    )
    label = f"kv-cache, context_keep {keep or model.config.max_seq_len // 2}"

    def run() -> dict[str, Any]:
        engine = Engine.for_model(model, params, settings)
        compiled = engine.compile()
        requests = [Request(prompt, new_tokens, temperature, None, seed) for seed in range(batch)]
        timing = time_calls(lambda i: engine.generate(requests), calls=1, repeats=repeats)
        return {"compile_s": compiled["compile_s"], **_rates(timing.median_s, new_tokens * batch, batch)}

    return Case(f"{label}, batch {batch}", {"sampler": label, "batch": batch, "new_tokens": new_tokens}, run)


def _full_case(model, params, prompt: bytes, new_tokens: int, temperature: float, repeats: int) -> Case:
    def run() -> dict[str, Any]:
        window, length = prompt_window(prompt, model.config.max_seq_len)
        logits_fn = jax.tree_util.Partial(model.apply, params)

        def call(i: int) -> jax.Array:
            key = jax.random.key(i)
            return sample(
                logits_fn, jnp.asarray(window), jnp.int32(length), key, jnp.float32(temperature), new_tokens
            )

        return _rates(time_calls(call, calls=1, repeats=repeats).median_s, new_tokens, 1)

    label = "full recompute (jaxray.inference.sampling.sample)"
    return Case(label, {"sampler": label, "batch": 1, "new_tokens": new_tokens}, run)


def _notebook_case(script: Path, new_tokens: int, temperature: float, repeats: int, timeout_s: float) -> Case:
    def run() -> dict[str, Any]:
        cmd = [
            sys.executable,
            str(script),
            "--new-tokens",
            str(new_tokens),
            "--temperature",
            str(temperature),
        ]
        rates = [
            compare._run_json(cmd, None, timeout_s, "new_tokens_per_sec")["new_tokens_per_sec"]
            for _ in range(repeats)
        ]
        return _rates(new_tokens / statistics.median(rates), new_tokens, 1)

    label = f"notebook ({script.name})"
    return Case(label, {"sampler": label, "batch": 1, "new_tokens": new_tokens}, run)


def _rates(seconds: float, tokens: int, batch: int) -> dict[str, float]:
    return {
        "seconds": seconds,
        "tokens_per_sec": tokens / seconds,
        "ms_per_token": seconds / (tokens / batch) * 1e3,
    }


def decode_benchmark(
    new_tokens: int = 300,
    batch_sizes: tuple[int, ...] = (1, 16),
    repeats: int = 3,
    prompt: str = "ROMEO:",
    temperature: float = 0.8,
    reference: Path | None = None,
    checkpoint_path: str | None = None,
    timeout_s: float = 900,
) -> Report:
    """The report described in the module docstring. ``reference``: the notebook sampler script
    (its row is skipped, with a note, when None)."""
    model, params = load_model(checkpoint_path)
    encoded = prompt.encode("utf-8")
    size = model.config.max_seq_len
    cases = [_kv_case(model, params, encoded, new_tokens, b, None, temperature, repeats) for b in batch_sizes]
    cases.append(_kv_case(model, params, encoded, new_tokens, 1, size, temperature, repeats))
    cases.append(_full_case(model, params, encoded, new_tokens, temperature, repeats))
    if reference is not None:
        cases.append(_notebook_case(reference, new_tokens, temperature, repeats, timeout_s))
    rows = [{**r, **environment(1)} for r in run_cases(cases, "decode")]
    return _report(rows, model.config, new_tokens, len(encoded), reference)


def _report(
    rows: list[dict], cfg: ModelConfig, new_tokens: int, prompt_bytes: int, reference: Path | None
) -> Report:
    def rate(prefix: str) -> float | None:
        return next(
            (
                r.get("tokens_per_sec")
                for r in rows
                if r["sampler"].startswith(prefix) and r["batch"] == 1 and not r.get("error")
            ),
            None,
        )

    full, notebook, kv = (
        rate("full recompute"),
        rate("notebook"),
        rate(f"kv-cache, context_keep {cfg.max_seq_len // 2}"),
    )
    for r in rows:
        if r.get("tokens_per_sec"):
            r["vs_full"] = r["tokens_per_sec"] / full if full else None
            r["vs_notebook"] = r["tokens_per_sec"] / notebook if notebook else None
    summary = {
        "kv_vs_full": kv / full if kv and full else None,
        "kv_vs_notebook": kv / notebook if kv and notebook else None,
        "target": TARGET,
    }
    fills = cfg.max_seq_len - prompt_bytes
    window = (
        f"the window fills after {fills} new tokens, so the context_keep policy is exercised"
        if new_tokens > fills
        else "the window never fills, so both context_keep rows do the same work"
    )
    notes = [
        f"Model: d_model {cfg.width}, {cfg.num_layers} layers, {cfg.num_heads} heads, max_seq_len "
        f"{cfg.max_seq_len}, {cfg.dtype}; prompt {prompt_bytes} bytes + {new_tokens} new tokens: {window}.",
        f"Target (issue 4): KV-cache >= {TARGET:g}x the full-window sampler's tokens/s at batch 1.",
        "Batch > 1 rows count the tokens of every row: the throughput a server gets from batching.",
    ]
    if reference is None:
        notes.append("The notebook row was skipped: no reference_generate.py found (pass --reference).")
    return Report(
        "decode", "Decode: KV cache vs full-window recompute", rows, COLUMNS, notes, summary=summary
    )
