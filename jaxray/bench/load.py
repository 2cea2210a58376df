"""``serve --url URL``: closed-loop HTTP load on a running ``python -m jaxray.serve``. Per level, N clients
send a warm-up ``POST /generate``, then streamed requests back to back for ``duration`` s, each its own
seed. req/s and tokens/s count each answer's share inside the window; latency, TTFT and ITL are
client-clock ms over measured successes. Outcomes: ok; 4xx and 5xx by HTTP status, 5xx also for an
``event: error`` mid-stream; dropped for a connection cut, refused or timed out before the done event;
other for an answer that is not /generate's."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from collections.abc import AsyncIterator
from contextlib import aclosing, suppress
from dataclasses import dataclass

import aiohttp
import numpy as np

from jaxray.bench.report import Report, curve, line_chart
from jaxray.reporting.format import finite

COLUMNS = "clients prompts requests rps new_tokens_per_s p50_ms p95_ms p99_ms ttft_p50_ms ttft_p99_ms"
COLUMNS += " ttft_p50_vs_random itl_p50_ms itl_p99_ms rows_per_step engine_busy_pct errors_4xx errors_5xx"
COLUMNS += " dropped long_requests long_errors long_ttft_p50_ms client_cpu_pct"
ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ,.", np.uint8)  # of --prompt-bytes prompts
STREAM_ERROR = "5xx"  # the outcome of an error event mid-stream: it fails the zero-5xx bar as HTTP 5xx do


@dataclass(frozen=True)
class Sample:
    """One request: start/end (the done event) and first text event on the event loop's clock (s),
    outcome ok/4xx/5xx/dropped/other."""

    start_s: float
    end_s: float
    outcome: str
    status: int = 0
    new_tokens: int = 0
    error: str = ""
    warmup: bool = False
    first_s: float | None = None
    gaps_s: tuple[float, ...] = ()  # between one text event and the next (inter-token latency, ITL)

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_s is None else (self.first_s - self.start_s) * 1e3


async def events(lines: AsyncIterator[bytes]) -> AsyncIterator[tuple[str, str]]:
    """Server-sent events as (event name, data) from a stream of lines; the name defaults to message."""
    name, data = "message", []
    async for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield name, "\n".join(data)
            name, data = "message", []
        elif line.startswith("event:"):
            name = line.removeprefix("event:").strip()
        elif line.startswith("data:"):
            data.append(line.removeprefix("data:").removeprefix(" "))


async def read_stream(resp: aiohttp.ClientResponse) -> tuple[str, int, list[float], float, str]:
    """(outcome, new tokens, the times of its text events, end time, error) of /generate's stream."""
    loop, texts = asyncio.get_running_loop(), []
    async with aclosing(events(resp.content)) as stream:
        async for name, data in stream:
            body = json.loads(data)
            if name == "error" or "error" in body:
                return STREAM_ERROR, 0, texts, loop.time(), f"error event: {data}"
            if body.get("text"):
                texts.append(loop.time())
            if body.get("done"):
                end = loop.time()
                with suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    await resp.content.read()  # to the stream's end, so the connection can be kept
                return "ok", int(body["new_tokens"]), texts, end, ""
    return "dropped", 0, texts, loop.time(), "the stream ended before its done event"


async def send(
    session: aiohttp.ClientSession, url: str, body: dict, warmup: bool = False, stream: bool = True
) -> Sample:
    """POST ``body`` to ``url``/generate as a stream (or, not ``stream``, for one JSON answer: no
    TTFT); HTTP, stream and connection failures become the Sample's outcome."""
    loop = asyncio.get_running_loop()
    start, status, tokens, texts, end = loop.time(), 0, 0, [], None
    try:
        async with session.post(f"{url.rstrip('/')}/generate", json=body | {"stream": stream}) as resp:
            status = resp.status
            if status == 200 and not stream:
                kind, error, tokens = "ok", "", int(json.loads(await resp.read())["new_tokens"])
            elif status != 200:  # its status is the outcome, also where the body is then cut
                kind, error = {4: "4xx", 5: "5xx"}.get(status // 100, "other"), f"HTTP {status}"
                with suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    error += f": {(await resp.read()).decode(errors='replace')}"
            elif resp.content_type != "text/event-stream":
                kind, error = "other", f"HTTP 200 answered {resp.content_type}, not text/event-stream"
            else:
                kind, tokens, texts, end, error = await read_stream(resp)
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError) as err:
        kind, error = "dropped", f"{type(err).__name__}: {err}"
    except (aiohttp.ClientError, ValueError, KeyError, TypeError) as err:  # not HTTP, or not /generate's
        kind, error = "other", f"{type(err).__name__}: {err}"
    end = end if end is not None else loop.time()
    ok, gaps = kind == "ok", tuple(b - a for a, b in zip(texts, texts[1:]))
    first, gaps = (texts[0] if texts else None, gaps) if ok else (None, ())
    return Sample(start, end, kind, status, tokens if ok else 0, error[:300], warmup, first, gaps)


def prompt_for(args, seed: int, shared: bool, level: int) -> str:
    """``args.prompt``; with ``--prompt-bytes``, that many letters drawn from ``seed`` and the
    ``level`` (its clients: no random prompt repeats an earlier level's, which a prefix cache would
    hold), the first ``--shared-bytes`` of them the same for every request when ``shared``."""
    if not args.prompt_bytes:
        return args.prompt
    head = min(args.shared_bytes, args.prompt_bytes) if shared else 0
    return letters(2**32, head) + letters([seed, level, shared], args.prompt_bytes - head)


def letters(seed, n: int) -> str:
    """``n`` letters of ``ALPHABET`` drawn by ``np.random.default_rng(seed)``."""
    return np.random.default_rng(seed).choice(ALPHABET, n).tobytes().decode()


def prompts_label(args, shared: bool) -> str:
    if not args.prompt_bytes:
        return f"{len(args.prompt.encode())} B"
    return f"{args.prompt_bytes} B" + (f", first {args.shared_bytes} shared" if shared else " random")


class Http:
    """The transport of ``bench serve``: /generate and /info of a running server at ``url``."""

    def __init__(self, url: str, timeout_s: float, connections: int):
        self.url, self.timeout, self.connections = url, aiohttp.ClientTimeout(total=timeout_s), connections

    async def __aenter__(self) -> Http:
        connector = aiohttp.TCPConnector(limit=self.connections)
        self.session = await aiohttp.ClientSession(connector=connector, timeout=self.timeout).__aenter__()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.session.__aexit__(*exc)

    async def send(self, body: dict, warmup: bool = False) -> Sample:
        return await send(self.session, self.url, body, warmup)

    async def stats(self) -> dict:
        return await engine_stats(self.session, self.url)


async def run_level(args, clients: int, shared: bool = False, transport=None) -> dict:
    """One level: warm-ups, then ``args.duration`` s of closed-loop requests; the level's row.
    ``transport``: an async context manager with ``send(body, warmup) -> Sample`` and ``stats()``
    (the engine's counters, as ``GET /info``'s); default ``Http`` to ``args.url``."""
    body = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature}
    body |= {"top_k": args.top_k} if args.top_k else {}
    ask = lambda seed: body | {"seed": seed, "prompt": prompt_for(args, seed, shared, clients)}  # noqa: E731
    long = args.long_clients
    async with transport or Http(args.url, args.timeout, clients + long) as s:
        seeds = [(args.seed + c * 1_000_003) % 2**32 for c in range(clients)]
        samples = list(await asyncio.gather(*(s.send(ask(k), True) for k in seeds)))
        loop, longs = asyncio.get_running_loop(), []
        before = await s.stats()
        cpu0, start = time.process_time(), loop.time()

        async def client(seed: int, into: list, make) -> None:
            k = 1
            while loop.time() < start + args.duration:
                into.append(sample := await s.send(make((seed + k) % 2**32)))
                k += 1
                if sample.outcome != "ok":  # a dead server, or one refusing every request at once
                    await asyncio.sleep(0.1)  # is not hammered in a tight loop

        def ask_long(seed: int) -> dict:  # --long-bytes random letters, never a prefix of another's
            return body | {"seed": seed, "prompt": letters([seed, clients, 2], args.long_bytes)}

        await asyncio.gather(
            *(client(k, samples, ask) for k in seeds),
            *(client(2**31 + k * 7_919, longs, ask_long) for k in range(long)),
        )
        wall = loop.time() - start
        after = await s.stats()
    row = summarize(samples, clients, start, start + args.duration) | engine_share(before, after, wall)
    row |= {"prompts": prompts_label(args, shared), "shared": shared}
    if long:  # the clients' figures above are the short prompts' streams alone
        done = [x for x in longs if x.outcome == "ok"]
        ttft = [x.ttft_ms for x in done if x.ttft_ms is not None]
        row |= {"long_requests": len(done), "long_errors": len(longs) - len(done)}
        row["long_ttft_p50_ms"] = float(np.percentile(ttft, 50)) if ttft else None
    return row | {"client_cpu_pct": 100.0 * (time.process_time() - cpu0) / wall}


async def engine_stats(session: aiohttp.ClientSession, url: str) -> dict:
    """The engine's counters from ``GET /info`` (``server.engine``: decode calls, rows decoded, admit
    and decode seconds); {} when it does not answer. With several replicas, the one that answered."""
    try:
        async with session.get(f"{url.rstrip('/')}/info") as resp:
            engine = ((await resp.json()).get("server") or {}).get("engine")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
        return {}
    return engine if isinstance(engine, dict) else {}


def engine_share(before: dict, after: dict, wall_s: float) -> dict:
    """Over a level (``wall_s`` seconds, counters ``before`` and ``after`` it): ``rows_per_step``, the
    mean rows each decode call advanced (how full the batch ran), and ``engine_busy_pct``, the share
    of the wall clock the engine thread spent in prefill and decode calls. None when unknown."""
    keys = ("decode_calls", "rows_decoded", "admit_s", "decode_s")
    if not all(isinstance(d.get(k), int | float) for d in (before, after) for k in keys):
        return {"rows_per_step": None, "engine_busy_pct": None}
    calls, rows = (after[k] - before[k] for k in keys[:2])
    busy = after["admit_s"] + after["decode_s"] - before["admit_s"] - before["decode_s"]
    return {"rows_per_step": rows / calls if calls else None, "engine_busy_pct": 100.0 * busy / wall_s}


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
    ttft = np.array([s.ttft_ms for s in ok if s.ttft_ms is not None], dtype=float)
    ttft_p50, ttft_p99 = np.percentile(ttft, [50, 99]).tolist() if ttft.size else (None, None)
    gaps = np.array([g for s in ok for g in s.gaps_s], dtype=float) * 1e3
    itl_p50, itl_p99 = np.percentile(gaps, [50, 99]).tolist() if gaps.size else (None, None)
    errors = [s for s in samples if s.outcome != "ok"]
    count = {k: sum(s.outcome == k for s in errors) for k in ("4xx", "5xx", "dropped", "other")}
    return {
        "case": f"{clients} clients", "clients": clients, "duration_s": duration, "requests": len(ok),
        "rps": float(share.sum() / duration), "new_tokens": int(tokens.sum()),
        "new_tokens_per_s": float((share * tokens).sum() / duration),
        "p50_ms": p50, "p95_ms": p95, "p99_ms": p99, "mean_ms": float(latency.mean()) if ok else None,
        "ttft_p50_ms": ttft_p50, "ttft_p99_ms": ttft_p99, "itl_p50_ms": itl_p50, "itl_p99_ms": itl_p99,
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


def serve_report(args) -> Report:
    """Every level of ``args.clients`` in turn against ``args.url``. ValueError when /healthz fails."""
    url = args.url.rstrip("/")
    if get_json(f"{url}/healthz") is None:
        raise ValueError(f"--url {args.url}: GET /healthz did not answer; start python -m jaxray.serve first")
    data = (get_json(f"{url}/v1/models") or {}).get("data")  # the served model's id, if it says
    model = data[0].get("id") if isinstance(data, list) and data and isinstance(data[0], dict) else None
    level = lambda clients, shared: asyncio.run(run_level(args, clients, shared))  # noqa: E731
    report = load_report(args, level, "serve", "Serve: closed-loop HTTP load")
    report.notes[:0] = serve_notes(args, f"{url}, model {model or 'unknown (GET /v1/models did not answer)'}")
    report.summary["model"] = model
    return report


def check_shared_bytes(args) -> None:
    """ValueError unless ``--shared-bytes`` (when given) is below ``--prompt-bytes``."""
    if args.shared_bytes and not 0 < args.shared_bytes < args.prompt_bytes:
        raise ValueError(f"--shared-bytes {args.shared_bytes} needs --prompt-bytes above it")


# Issue 56's bars: over HTTP (``serve``) on the 2-core CPU, 16 and 64 clients against one and a shared
# prefix's TTFT with default settings; in-process (``engine``) on an accelerator, 16 clients and a prefix.
TARGETS = {"serve": {16: 3.5, 64: 4.5, "shared": 0.75}, "engine": {16: 8.0, 64: None, "shared": 0.5}}


def load_report(args, level, name: str, title: str) -> Report:
    """Every level of ``args.clients`` in turn (``level(clients, shared)``: its row), twice with
    ``--shared-bytes``; the scaling and shared-prefix ratios in the summary and the notes."""
    rows = []
    check_shared_bytes(args)
    for clients in args.clients:
        for shared in (False, True) if args.shared_bytes else (False,):
            row = level(clients, shared)
            if not row["requests"]:
                row["error"] = f"no request answered 200 (first error: {row['first_error'] or 'none'})"
            rows.append(row)
    by = {r["clients"]: r for r in rows if not r["shared"]}
    one, sixteen, many = (finite(by.get(n, {}).get("new_tokens_per_s")) for n in (1, 16, 64))
    bars = TARGETS[name]
    summary = {"scaling_16_vs_1": sixteen / one if one and sixteen is not None else None, "target": bars[16]}
    summary |= {"scaling_64_vs_1": many / one if one and many is not None else None, "target_64": bars[64]}
    summary |= {"target_shared_ttft": bars["shared"]}
    summary |= {"zero_errors_64": not (by[64]["errors_5xx"] or by[64]["dropped"])} if 64 in by else {}
    top = by[max(by)]
    summary |= {"max_clients": top["clients"]}
    for row in (r for r in rows if r["shared"]):  # shared-prefix TTFT over random prompts'
        random_p50, shared_p50 = finite(by[row["clients"]].get("ttft_p50_ms")), finite(row.get("ttft_p50_ms"))
        ratio = shared_p50 / random_p50 if random_p50 and shared_p50 is not None else None
        row["ttft_p50_vs_random"] = summary[f"shared_ttft_p50_vs_random_{row['clients']}"] = ratio
    summary |= {f"ttft_{p}_ms_at_max_clients": top.get(f"ttft_{p}_ms") for p in ("p50", "p99")}
    notes = load_notes(args, rows, summary, top)

    def chart(y: str):
        return lambda rows, path: line_chart(path, {"": curve(rows, "clients", y)}, "clients (log2)", y, True)

    charts = {f"{name}_{y}.png": chart(y) for y in ("new_tokens_per_s", "p95_ms", "ttft_p99_ms")}
    return Report(name, title, rows, COLUMNS, notes, charts, summary)


def serve_notes(args, target: str) -> list[str]:
    """What was sent to ``target`` and how it is counted."""
    return [
        f"{target}: {args.max_new_tokens} new "
        f"tokens after {prompts_label(args, False) if args.prompt_bytes else repr(args.prompt)} per request "
        f"(temperature {args.temperature:g}, its own seed), "
        f"streamed; {args.duration:g} s per level after a warm-up per client.",
        "req/s and new tok/s count each request's share inside the window; latency (to the done event) and "
        "TTFT (to the first text event) are client-side; errors count every request; 5xx counts error "
        f"events mid-stream too; dropped: cut, refused or over {args.timeout:g} s before the done event.",
    ]


def load_notes(args, rows: list[dict], summary: dict, top: dict) -> list[str]:
    """The ratios against their targets, what ITL and the engine's figures are."""
    notes = []
    if x := summary["scaling_16_vs_1"]:
        notes.append(f"16 vs 1 client: {x:.2f}x the new tokens/s{_target('>=', summary['target'], 'x')}")
    if x := summary["scaling_64_vs_1"]:
        notes.append(f"64 vs 1 client: {x:.2f}x the new tokens/s{_target('>=', summary['target_64'], 'x')}")
    notes.append(
        "ITL: time between consecutive text events of a stream; rows/step: mean rows a decode call "
        "advanced, engine busy: share of the level the engine thread spent in prefill and decode "
        "(both the engine's counters: over HTTP GET /info's, one replica's)"
    )
    if args.long_clients:
        notes.append(
            f"{args.long_clients} more client(s) sent {args.long_bytes}-byte random prompts meanwhile: 'long "
            "requests' and 'long TTFT' are theirs; every other figure is the other clients' streams'"
        )
    if not any(r.get("itl_p50_ms") for r in rows):
        notes.append(
            f"no ITL: each stream had one text event (--max-new-tokens {args.max_new_tokens} within a chunk)"
        )
    for clients in args.clients if args.shared_bytes else ():
        if (x := summary.get(f"shared_ttft_p50_vs_random_{clients}")) is not None:
            shared = f"{clients} client(s), first {args.shared_bytes} bytes shared"
            bar = _target("<=", summary["target_shared_ttft"], "")
            notes.append(f"{shared}: TTFT p50 {x:.2f}x the random prompts'{bar}")
    if (t99 := summary["ttft_p99_ms_at_max_clients"]) is not None:
        t50 = summary["ttft_p50_ms_at_max_clients"]
        notes.append(f"{top['clients']} clients: time to first token p50 {t50:.1f} ms, p99 {t99:.1f} ms")
    return notes


def _target(sign: str, value: float | None, unit: str) -> str:
    """ " (target >= 3.5x)" for a note; "" without a target."""
    return "" if value is None else f" (target {sign} {value:g}{unit})"
