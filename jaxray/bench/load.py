"""``serve --url URL``: closed-loop HTTP load on a running ``python -m jaxray.serve``: per level, N clients
send a warm-up ``POST /generate``, then requests back to back for ``duration`` s, each its own seed. req/s
and tokens/s count each answer's share inside the window; latency (ms) is over measured 200s."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass

import aiohttp
import numpy as np

from jaxray.bench.report import Report, curve, line_chart
from jaxray.reporting.format import finite

COLUMNS = "clients requests rps new_tokens_per_s p50_ms p95_ms p99_ms errors_4xx errors_5xx dropped"
COLUMNS += " decode_calls mean_rows client_cpu_pct"


@dataclass(frozen=True)
class Sample:
    """One request: start/end on the event loop's clock (s), outcome ok/4xx/5xx/dropped/other."""

    start_s: float
    end_s: float
    outcome: str
    status: int = 0
    new_tokens: int = 0
    error: str = ""
    warmup: bool = False

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3


async def send(session: aiohttp.ClientSession, url: str, body: dict, warmup: bool = False) -> Sample:
    """POST ``body`` to ``url``/generate; HTTP and connection failures become the Sample's outcome."""
    loop = asyncio.get_running_loop()
    start, status, tokens = loop.time(), 0, 0
    try:
        async with session.post(f"{url.rstrip('/')}/generate", json=body) as resp:
            status, raw = resp.status, await resp.read()
        kind = {2: "ok", 4: "4xx", 5: "5xx"}.get(status // 100, "other")
        error = "" if kind == "ok" else f"HTTP {status}: {raw.decode(errors='replace')}"
        tokens = int(json.loads(raw)["new_tokens"]) if kind == "ok" else 0
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as err:
        kind, error = "dropped", f"{type(err).__name__}: {err}"
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as err:  # not HTTP, or not /generate's body
        kind, error = "other", f"{type(err).__name__}: {err}"
    return Sample(start, loop.time(), kind, status, tokens if kind == "ok" else 0, error[:300], warmup)


async def run_level(args, clients: int) -> dict:
    """One level: warm-ups, then ``args.duration`` s of closed-loop requests; the level's row."""
    body = {"prompt": args.prompt, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    body |= {"top_k": args.top_k} if args.top_k else {}
    timeout, connector = aiohttp.ClientTimeout(total=args.timeout), aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        seeds = [(args.seed + c * 1_000_003) % 2**32 for c in range(clients)]
        samples = list(await asyncio.gather(*(send(s, args.url, body | {"seed": k}, True) for k in seeds)))
        loop = asyncio.get_running_loop()
        cpu0, start = time.process_time(), loop.time()

        async def client(seed: int) -> None:
            k = 1
            while loop.time() < start + args.duration:
                samples.append(sample := await send(s, args.url, body | {"seed": (seed + k) % 2**32}))
                k += 1
                if sample.outcome == "dropped":
                    await asyncio.sleep(0.1)  # a dead server is not hammered in a tight loop

        await asyncio.gather(*(client(k) for k in seeds))
        wall = loop.time() - start
    row = summarize(samples, clients, start, start + args.duration)
    return row | {"client_cpu_pct": 100.0 * (time.process_time() - cpu0) / wall}


def summarize(samples: list[Sample], clients: int, start_s: float, end_s: float) -> dict:
    """The level's row from its samples and measured window [start_s, end_s] (s)."""
    duration = end_s - start_s
    if not duration > 0:
        raise ValueError(f"empty window [{start_s}, {end_s}]")
    ok = [s for s in samples if s.outcome == "ok" and not s.warmup]
    t0, t1 = np.array([(s.start_s, s.end_s) for s in ok], dtype=float).reshape(-1, 2).T
    share = np.clip(np.minimum(t1, end_s) - np.maximum(t0, start_s), 0, None) / np.maximum(t1 - t0, 1e-9)
    tokens = np.array([s.new_tokens for s in ok], dtype=float)
    latency = np.array([s.latency_ms for s in ok], dtype=float)
    p50, p95, p99 = np.percentile(latency, [50, 95, 99]).tolist() if ok else (None, None, None)
    errors = [s for s in samples if s.outcome != "ok"]
    count = {k: sum(s.outcome == k for s in errors) for k in ("4xx", "5xx", "dropped", "other")}
    return {
        "case": f"{clients} clients", "clients": clients, "duration_s": duration, "requests": len(ok),
        "rps": float(share.sum() / duration), "new_tokens": int(tokens.sum()),
        "new_tokens_per_s": float((share * tokens).sum() / duration),
        "p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "mean_ms": float(latency.mean()) if ok else None,
        "errors_4xx": count["4xx"], "errors_5xx": count["5xx"], "dropped": count["dropped"],
        "errors_other": count["other"], "first_error": errors[0].error if errors else "",
    }  # fmt: skip


def get_json(url: str, timeout_s: float = 10.0) -> dict | None:
    """``GET url`` as JSON; None when it does not answer 200 with JSON."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return json.load(resp)
    except (OSError, ValueError):
        return None


def _engine_counts(url: str) -> tuple[int, int] | None:
    """(decode calls, rows decoded) so far, from the app's ``GET /info``."""
    engine = ((get_json(f"{url}/info") or {}).get("server") or {}).get("engine") or {}
    return (engine["decode_calls"], engine["rows_decoded"]) if "decode_calls" in engine else None


def serve_report(args) -> Report:
    """Every level of ``args.clients`` in turn against ``args.url``. ValueError when /healthz fails."""
    url = args.url.rstrip("/")
    if get_json(f"{url}/healthz") is None:
        raise ValueError(f"--url {args.url}: GET /healthz did not answer; start python -m jaxray.serve first")
    rows = []
    for clients in args.clients:
        before = _engine_counts(url)
        row = asyncio.run(run_level(args, clients))
        after = _engine_counts(url)
        calls = after[0] - before[0] if before and after else None
        row |= {"decode_calls": calls, "mean_rows": (after[1] - before[1]) / calls if calls else None}
        if not row["requests"]:
            row["error"] = f"no request answered 200 (first error: {row['first_error'] or 'none'})"
        rows.append(row)
    by = {r["clients"]: r for r in rows}
    one, sixteen = (finite(by.get(n, {}).get("new_tokens_per_s")) for n in (1, 16))
    summary = {"scaling_16_vs_1": sixteen / one if one and sixteen is not None else None, "target": 4.0}
    summary |= {"zero_errors_64": not (by[64]["errors_5xx"] or by[64]["dropped"])} if 64 in by else {}
    notes = [
        f"{url}: {args.max_new_tokens} new tokens after {args.prompt!r} per request (temperature "
        f"{args.temperature:g}, its own seed); {args.duration:g} s per level after a warm-up per client.",
        "req/s and new tok/s count each request's share inside the window; latency is client-side; "
        f"errors count every request (over {args.timeout:g} s: dropped); decode calls: GET /info.",
    ]
    if x := summary["scaling_16_vs_1"]:
        notes.append(f"16 vs 1 client: {x:.2f}x the new tokens/s (target >= 4x)")

    def chart(y: str):
        return lambda rows, path: line_chart(path, {"": curve(rows, "clients", y)}, "clients (log2)", y, True)

    charts = {f"serve_{y}.png": chart(y) for y in ("new_tokens_per_s", "p95_ms")}
    return Report("serve", "Serve: closed-loop HTTP load", rows, COLUMNS, notes, charts, summary)
