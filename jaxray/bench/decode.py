"""``decode``: new tokens/s of the KV-cache sampler (``jaxray.inference.engine``, default window
policy and context_keep = S) against full-window recompute (``sampling.sample``) and, when found,
the notebook's sampler script (its own process), on the same model, prompt and token count. jaxray
rows: the median of ``repeats`` calls after a warm-up call; ratios are over full recompute and notebook."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxray import checkpoint, runs
from jaxray.bench.compare import run_json
from jaxray.bench.report import Report, run_cases
from jaxray.bench.throughput import environment, time_calls
from jaxray.config import ModelConfig
from jaxray.inference.engine import Engine, Request
from jaxray.inference.sampling import prompt_window, sample
from jaxray.inference.settings import EngineSettings
from jaxray.models import build

LAB = ModelConfig(
    workload="transformer", width=256, num_layers=4, num_heads=4, max_seq_len=256, attention="xla"
)
TARGET = 20.0  # KV-cache tokens/s over full-window tokens/s at batch 1
COLUMNS = "sampler batch new_tokens tokens_per_sec ms_per_token vs_full vs_notebook"


def load_model(path: str | None):
    """(model, params): the checkpoint's transformer, or the lab's with fresh weights."""
    if path:
        return checkpoint.restore(runs.resolve(path, workload="transformer"))
    model = build(LAB)
    return model, model.init(jax.random.key(0))


def _rates(seconds: float, tokens: int, batch: int) -> dict[str, float]:
    return {
        "seconds": seconds,
        "tokens_per_sec": tokens / seconds,
        "ms_per_token": seconds * batch / tokens * 1e3,
    }


def _cases(model, params, prompt: bytes, new_tokens: int, batches, temperature: float, repeats: int):
    size = model.config.max_seq_len

    def kv(batch: int, keep: int | None):
        shapes = {"buckets": (min(len(prompt), size),), "batch_sizes": (batch,), "chunk": new_tokens}
        settings = EngineSettings(**shapes, max_new_tokens=new_tokens, context_keep=keep)

        def run():
            engine = Engine.for_model(model, params, settings)
            compile_s = engine.compile()["compile_s"]
            requests = [Request(prompt, new_tokens, temperature, None, seed) for seed in range(batch)]
            median_s, _ = time_calls(lambda i: engine.generate(requests), calls=1, repeats=repeats)
            return {"compile_s": compile_s, **_rates(median_s, new_tokens * batch, batch)}

        return {"sampler": f"kv-cache, context_keep {keep or size // 2}", "batch": batch}, run

    def full():
        window, length = prompt_window(prompt, size)
        logits_fn = jax.tree_util.Partial(model.apply, params)
        args = (jnp.asarray(window), jnp.int32(length))

        def call(i: int) -> jax.Array:
            return sample(logits_fn, *args, jax.random.key(i), jnp.float32(temperature), new_tokens)

        return _rates(time_calls(call, calls=1, repeats=repeats)[0], new_tokens, 1)

    cases = [kv(b, None) for b in batches] + [kv(1, size)]
    return cases + [({"sampler": "full recompute (jaxray.inference.sampling.sample)", "batch": 1}, full)]


def decode_benchmark(args, reference: Path | None) -> Report:
    """The report of the module docstring from ``decode``'s options; no notebook row without ``reference``."""
    model, params = load_model(args.checkpoint)
    prompt, n = args.prompt.encode("utf-8"), args.new_tokens
    cases = _cases(model, params, prompt, n, args.batch_sizes, args.temperature, args.repeats)
    if reference is not None:
        cmd = [sys.executable, str(reference), "--new-tokens", str(n), "--temperature", str(args.temperature)]

        def notebook():
            rates = [run_json(cmd, None, args.timeout, "new_tokens_per_sec") for _ in range(args.repeats)]
            return _rates(n / statistics.median(r["new_tokens_per_sec"] for r in rates), n, 1)

        cases.append(({"sampler": f"notebook ({reference.name})", "batch": 1}, notebook))
    rows = run_cases([({**fields, "new_tokens": n}, run) for fields, run in cases], "decode")
    return _report([r | environment(1) for r in rows], model.config, n, len(prompt), reference)


def _report(rows: list[dict], cfg: ModelConfig, new_tokens: int, prompt_bytes: int, reference) -> Report:
    def rate(prefix: str) -> float | None:
        ok = (r for r in rows if r["sampler"].startswith(prefix) and r["batch"] == 1 and not r.get("error"))
        return next((r.get("tokens_per_sec") for r in ok), None)

    full, notebook = rate("full recompute"), rate("notebook")
    kv = rate(f"kv-cache, context_keep {cfg.max_seq_len // 2}")
    for r in rows:
        if r.get("tokens_per_sec"):
            r["vs_full"] = r["tokens_per_sec"] / full if full else None
            r["vs_notebook"] = r["tokens_per_sec"] / notebook if notebook else None
    summary = {"kv_vs_full": kv / full if kv and full else None, "target": TARGET}
    summary["kv_vs_notebook"] = kv / notebook if kv and notebook else None
    fills = cfg.max_seq_len - prompt_bytes
    window = (
        f"the window fills after {fills} new tokens, so the context_keep policy is exercised"
        if new_tokens > fills
        else "the window never fills, so both context_keep rows do the same work"
    )
    notes = [
        f"Model: d_model {cfg.width}, {cfg.num_layers} layers, {cfg.num_heads} heads, max_seq_len "
        f"{cfg.max_seq_len}, {cfg.dtype}; prompt {prompt_bytes} bytes + {new_tokens} new tokens: {window}.",
        f"Target: KV-cache >= {TARGET:g}x the full-window sampler's tokens/s at batch 1; batch > 1 rows "
        "count the tokens of every row.",
    ]
    if reference is None:
        notes.append("The notebook row was skipped: no reference_generate.py found (pass --reference).")
    return Report(
        "decode", "Decode: KV cache vs full-window recompute", rows, COLUMNS, notes, summary=summary
    )
