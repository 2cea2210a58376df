"""``engine --checkpoint DIR``: ``bench serve``'s closed-loop load on the serving engine in this
process (its ``Scheduler``: continuous batching, the prefix cache, chunked prefill), no HTTP and no
Ray, so a host where Ray Serve cannot start (a TPU VM without sockets) measures them as the CPU does.
Each client's request is a group of one; TTFT and ITL are taken when its tokens reach the client."""

from __future__ import annotations

import asyncio
import time

from jaxray.bench.load import Sample, check_shared_bytes, load_report
from jaxray.bench.load import run_level as _run_level
from jaxray.bench.report import Report
from jaxray.inference.engine import Engine, Request
from jaxray.inference.load import load_engine
from jaxray.inference.scheduler import Scheduler
from jaxray.inference.settings import EngineSettings, engine_settings


class InProcess:
    """The transport of ``bench engine``: requests straight to a ``Scheduler`` of ``engine``."""

    def __init__(self, engine: Engine):
        self.engine = engine

    async def __aenter__(self) -> InProcess:
        self.scheduler = Scheduler(self.engine, self.engine.max_batch_size)  # its events: this loop's
        return self

    async def __aexit__(self, *exc) -> None:
        self.scheduler.close()

    async def send(self, body: dict, warmup: bool = False) -> Sample:
        """One request of ``body`` (/generate's fields); an engine error is the sample's 5xx."""
        loop, texts, tokens = asyncio.get_running_loop(), [], 0
        request = Request(body["prompt"].encode(), body["max_new_tokens"], body["temperature"],
                          body.get("top_k"), body["seed"])  # fmt: skip
        start, kind, error = loop.time(), "ok", ""
        try:
            self.engine.check(request)  # as serve does, before the batch: a bad one fails alone
        except ValueError as err:
            return Sample(start, loop.time(), "4xx", 400, 0, str(err)[:300], warmup)
        try:
            async for step in self.scheduler.run([request]):
                if step[0]:
                    texts.append(loop.time())
                    tokens += len(step[0])
        except Exception as err:  # noqa: BLE001 - the engine's error is this request's outcome
            kind, error, texts, tokens = "5xx", f"{type(err).__name__}: {err}", [], 0
        gaps = tuple(b - a for a, b in zip(texts, texts[1:]))
        first = texts[0] if texts else None
        return Sample(
            start, loop.time(), kind, 200 * (kind == "ok"), tokens, error[:300], warmup, first, gaps
        )

    async def stats(self) -> dict:
        return self.scheduler.stats()


def engine_report(args) -> Report:
    """Every level of ``args.clients`` on the engine of ``args.checkpoint`` (compiled first)."""
    if not args.checkpoint:
        raise ValueError("--checkpoint: a trained transformer's folder (runs/<experiment>) is needed")
    settings = engine_settings(args)
    check_load(args, settings)
    engine = load_engine(args.checkpoint, settings)
    compiled = engine.compile()
    args.timeout = float("inf")  # nothing drops in-process
    level = lambda clients, shared: asyncio.run(_run_level(args, clients, shared, InProcess(engine)))  # noqa: E731
    begin = time.perf_counter()
    report = load_report(args, level, "engine", "Engine in-process: closed-loop load, no HTTP")
    cache = engine.info()["prefix_cache"]
    target = f"the engine of {args.checkpoint} in this process ({engine.config.max_seq_len} positions)"
    pool = (
        f"off ({why_no_cache(engine)})"
        if cache is None
        else f"{cache['mib']:.0f} MiB in {cache['blocks']} blocks"
    )
    report.notes[:0] = [
        f"{target}: {args.max_new_tokens} new tokens per request (temperature {args.temperature:g}, its "
        f"own seed), {args.duration:g} s per level after a warm-up per client; compile "
        f"{compiled['compile_s']:.1f} s, levels {time.perf_counter() - begin:.0f} s.",
        f"prefix cache: {pool}; KV cache {engine.kv_cache_dtype}; batch sizes "
        f"{list(engine.settings.batch_sizes)}, buckets {list(engine.buckets)}.",
    ]
    for row in report.rows:  # this process holds the engine too: its CPU time is not the clients'
        row.pop("client_cpu_pct", None)
    report.columns = report.columns.replace(" client_cpu_pct", "")
    report.summary |= {"prefix_cache": cache, "compile_s": compiled["compile_s"]}
    report.summary |= {"kv_cache_dtype": engine.kv_cache_dtype}
    report.summary["settings"] = engine.settings.model_dump()  # what the run compiled, to compare runs
    return report


def check_load(args, settings: EngineSettings) -> None:
    """ValueError, before anything compiles, for load options no request could pass: shared bytes
    not below the prompt's, prompts longer than ``max_prompt_bytes``, more new tokens than its cap."""
    check_shared_bytes(args)
    longest = max(args.prompt_bytes or len(args.prompt.encode()), args.long_bytes if args.long_clients else 0)
    if longest > settings.max_prompt_bytes:
        raise ValueError(f"prompts of {longest} bytes exceed --max-prompt-bytes {settings.max_prompt_bytes}")
    if args.max_new_tokens > settings.max_new_tokens:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} exceeds the engine's cap {settings.max_new_tokens}"
        )


def why_no_cache(engine: Engine) -> str:
    """Why ``engine`` has no prefix cache, in words."""
    if engine.settings.prefix_cache_mib == 0:
        return "--prefix-cache-mib 0"
    if engine.programs.start_cached is None:
        return "an export artifact has no prefix-cache programs"
    if engine.settings.prefix_block >= engine.config.max_seq_len:
        return f"a block of {engine.settings.prefix_block} tokens is not shorter than the window"
    return "the device had no room for the default size (logged)"
