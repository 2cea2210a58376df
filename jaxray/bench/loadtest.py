"""HTTP load test of a running ``python -m jaxray.serve`` app: ``python -m jaxray.bench.loadtest``.

  python -m jaxray.bench.loadtest --url http://127.0.0.1:8000 --clients 1,4,16,64 --duration 20 \\
      --max-new-tokens 64 --prompt "ROMEO:" --json

For each concurrency level N, N closed-loop clients (asyncio tasks sharing one aiohttp session with
at most N connections) each send one warm-up ``POST /generate``, wait for the others, then send
requests back to back for ``duration`` seconds, each request with its own seed. It runs as its own
process so that the load generator's CPU time is not the server's (``client_cpu_pct`` shows how much
of one core it used: on a 2-core machine it competes with the replica).

How the figures are counted (one row per level):

- ``requests``: measured requests (started inside the window, warm-ups excluded) that answered 200.
- ``rps`` and ``new_tokens_per_s``: each answered request counts in proportion to the part of its
  [start, end] interval inside the window, divided by the window's length. Closed-loop clients
  finish in bursts (a batch ends together), so counting only whole requests that end in the window
  would be off by up to one burst; requests in flight at the end still finish and are counted
  for the part inside the window.
- ``p50_ms``/``p95_ms``/``p99_ms``/``mean_ms``: client-side latency (request sent to body read) of
  the measured requests that answered 200, in milliseconds (``numpy.percentile``, linear).
- ``errors_4xx``, ``errors_5xx``, ``dropped`` (connection refused, reset or closed, a body cut
  short, a timeout) and ``errors_other`` (a 200 whose body is not the /generate JSON) count every
  request, warm-ups and the tail included: the check "zero 5xx, zero dropped" covers all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Literal
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from jaxray.argtypes import (
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    positive_int_list,
)

Outcome = Literal["ok", "4xx", "5xx", "dropped", "other"]
DROPPED_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)
SEED_STRIDE = 1_000_003  # client c's k-th request uses seed base + c * stride + k: distinct for < 1M requests
RECONNECT_PAUSE_S = 0.1  # after a dropped connection: a dead server is not hammered in a tight loop


@dataclass(frozen=True)
class LoadSettings:
    """What one load test sends. ``url``: the app's base URL (``http://host:port``);
    ``clients``: concurrency levels, run in order; ``duration_s``: measured seconds per level;
    ``timeout_s``: a request taking longer counts as dropped. Raises ValueError on a bad value."""

    url: str
    clients: tuple[int, ...] = (1, 4, 16, 64)
    duration_s: float = 20.0
    max_new_tokens: int = 64
    prompt: str = "ROMEO:"
    temperature: float = 0.8
    top_k: int | None = None
    seed: int = 0
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        check_url(self.url)
        if (
            not self.clients
            or any(n < 1 for n in self.clients)
            or len(set(self.clients)) != len(self.clients)
        ):
            raise ValueError(f"clients must be distinct integers >= 1, got {self.clients}")
        for name in ("duration_s", "timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.prompt:
            raise ValueError("prompt must not be empty")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in 0..2**32-1, got {self.seed}")

    def payload(self, seed: int) -> dict:
        """The /generate JSON body for one request."""
        body = {
            "prompt": self.prompt,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "seed": seed % 2**32,
        }
        return body if self.top_k is None else {**body, "top_k": self.top_k}


@dataclass(frozen=True)
class Sample:
    """One request: ``start_s``/``end_s`` on the event loop's clock (seconds), ``status`` (HTTP code,
    0 when no response came), ``new_tokens`` (0 unless ok), ``error`` (the first line of what went
    wrong, '' when ok) and whether it was a warm-up."""

    start_s: float
    end_s: float
    outcome: Outcome
    status: int = 0
    new_tokens: int = 0
    error: str = ""
    warmup: bool = False

    @property
    def latency_ms(self) -> float:
        return (self.end_s - self.start_s) * 1e3


def check_url(url: str) -> str:
    """``url`` if it is ``http(s)://host[:port]`` with no path beyond '/'; raises ValueError naming it."""
    try:
        parts = urlsplit(url)
        port = parts.port  # parses the port: raises ValueError when it is not a number in 0..65535
    except ValueError as err:
        raise ValueError(f"bad --url {url!r}: {err}") from None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path not in ("", "/")
        or port == 0
    ):
        raise ValueError(f"bad --url {url!r}: expected http://HOST:PORT (the app's base URL, no path)")
    return url


def outcome_of(status: int) -> Outcome:
    """Classify an HTTP status: 2xx ok, 4xx, 5xx; anything else (1xx, 3xx) is 'other'."""
    if 200 <= status < 300:
        return "ok"
    if 400 <= status < 500:
        return "4xx"
    return "5xx" if 500 <= status < 600 else "other"


async def send(session: aiohttp.ClientSession, url: str, body: dict, warmup: bool = False) -> Sample:
    """POST ``body`` to ``url``/generate and time it; never raises for HTTP or connection failures
    (they become the Sample's outcome)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        async with session.post(f"{url.rstrip('/')}/generate", json=body) as resp:
            raw = await resp.read()
            status, outcome = resp.status, outcome_of(resp.status)
    except DROPPED_ERRORS as err:
        return Sample(start, loop.time(), "dropped", error=_describe(err), warmup=warmup)
    except aiohttp.ClientError as err:  # e.g. a malformed HTTP answer: the server spoke, but not HTTP
        return Sample(start, loop.time(), "other", error=_describe(err), warmup=warmup)
    end = loop.time()
    if outcome != "ok":
        error = f"HTTP {status}: {_describe(raw.decode(errors='replace'))}"
        return Sample(start, end, outcome, status, error=error, warmup=warmup)
    try:
        tokens = json.loads(raw)["new_tokens"]
        if not isinstance(tokens, int) or tokens < 0:
            raise ValueError(f"new_tokens is {tokens!r}")
    except (ValueError, KeyError, TypeError) as err:  # a 200 that is not the contract's answer
        return Sample(
            start, end, "other", status, error=f"bad /generate body: {_describe(err)}", warmup=warmup
        )
    return Sample(start, end, "ok", status, new_tokens=tokens, warmup=warmup)


def _describe(what: object) -> str:
    """The first line (<= 200 characters) of an exception ("Type: message") or of a response body."""
    text = f"{type(what).__name__}: {what}" if isinstance(what, BaseException) else str(what)
    lines = text.strip().splitlines()
    return lines[0][:200] if lines else ""


async def _client(
    session,
    settings: LoadSettings,
    index: int,
    warm: asyncio.Barrier,
    start: asyncio.Event,
    window: list[float],
    samples: list[Sample],
) -> None:
    """One closed-loop client: a warm-up request, then (once every client is warm and the driver has
    set ``window`` = [start_s, end_s]) requests back to back until the window ends."""
    seed = settings.seed + index * SEED_STRIDE
    samples.append(await send(session, settings.url, settings.payload(seed), warmup=True))
    await warm.wait()
    await start.wait()
    loop, k = asyncio.get_running_loop(), 1
    while loop.time() < window[1]:
        sample = await send(session, settings.url, settings.payload(seed + k))
        samples.append(sample)
        k += 1
        if sample.outcome == "dropped":
            await asyncio.sleep(RECONNECT_PAUSE_S)


async def run_level(settings: LoadSettings, clients: int) -> dict:
    """Run ``clients`` closed-loop clients for ``settings.duration_s`` seconds; returns the level's
    row (see ``summarize``) plus ``client_cpu_pct``, this process's CPU time over the level as a
    percentage of one core."""
    connector = aiohttp.TCPConnector(limit=clients)  # one keep-alive connection per client, no pool waits
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    samples: list[Sample] = []
    warm, start, window = asyncio.Barrier(clients + 1), asyncio.Event(), [0.0, 0.0]
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [
            asyncio.create_task(_client(session, settings, i, warm, start, window, samples))
            for i in range(clients)
        ]
        await warm.wait()  # every warm-up has answered (or failed): the window starts with N warm clients
        loop = asyncio.get_running_loop()
        cpu0, window[0] = time.process_time(), loop.time()
        window[1] = window[0] + settings.duration_s
        start.set()
        await asyncio.gather(*tasks)
        wall = loop.time() - window[0]
    row = summarize(samples, clients, window[0], window[1])
    row["client_cpu_pct"] = 100.0 * (time.process_time() - cpu0) / wall
    return row


def summarize(samples: list[Sample], clients: int, start_s: float, end_s: float) -> dict:
    """The row of one level from its samples and its measured window [start_s, end_s] (seconds).

    Keys: clients, duration_s, requests, rps (requests/s), new_tokens, new_tokens_per_s,
    p50_ms, p95_ms, p99_ms, mean_ms (None when no request answered), errors_4xx, errors_5xx,
    dropped, errors_other, first_error ('' when none). See the module docstring for how each is
    counted. Raises ValueError when the window is empty.
    """
    duration = end_s - start_s
    if not duration > 0:
        raise ValueError(f"empty window [{start_s}, {end_s}]")
    ok = [s for s in samples if s.outcome == "ok" and not s.warmup]
    share = np.array([_overlap(s, start_s, end_s) for s in ok], dtype=float)
    tokens = np.array([s.new_tokens for s in ok], dtype=float)
    latencies = np.array([s.latency_ms for s in ok], dtype=float)
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]).tolist() if ok else (None, None, None)
    errors = [s for s in samples if s.outcome != "ok"]
    count = {kind: sum(s.outcome == kind for s in errors) for kind in ("4xx", "5xx", "dropped", "other")}
    return {
        "clients": clients,
        "duration_s": duration,
        "requests": len(ok),
        "rps": float(share.sum() / duration),
        "new_tokens": int(tokens.sum()),
        "new_tokens_per_s": float((share * tokens).sum() / duration),
        "p50_ms": p50,
        "p95_ms": p95,
        "p99_ms": p99,
        "mean_ms": float(latencies.mean()) if ok else None,
        "errors_4xx": count["4xx"],
        "errors_5xx": count["5xx"],
        "dropped": count["dropped"],
        "errors_other": count["other"],
        "first_error": errors[0].error if errors else "",
    }


def _overlap(sample: Sample, start_s: float, end_s: float) -> float:
    """The fraction (0..1) of ``sample``'s [start, end] interval inside [start_s, end_s]."""
    length = sample.end_s - sample.start_s
    inside = min(sample.end_s, end_s) - max(sample.start_s, start_s)
    if length <= 0:  # a zero-length request counts wholly if it lies in the window
        return float(start_s <= sample.start_s <= end_s)
    return max(0.0, inside) / length


def run(settings: LoadSettings, progress: bool = True) -> dict:
    """Every level of ``settings`` in turn; returns {"settings": ..., "rows": [one per level]}.
    With ``progress``, one line per level goes to stderr."""
    rows = []
    for clients in settings.clients:
        row = asyncio.run(run_level(settings, clients))
        rows.append(row)
        if progress:
            print(
                f"clients={clients}: {row['rps']:.2f} req/s, {row['new_tokens_per_s']:.1f} new tokens/s, "
                f"p95 {row['p95_ms'] or float('nan'):.0f} ms, 4xx {row['errors_4xx']}, "
                f"5xx {row['errors_5xx']}, dropped {row['dropped']}, "
                f"client CPU {row['client_cpu_pct']:.0f}%",
                file=sys.stderr,
            )
    return {"settings": asdict(settings), "rows": rows}


def url_arg(text: str) -> str:
    """An http(s)://HOST:PORT base URL (an argparse type)."""
    try:
        return check_url(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix(f"bad --url {text!r}: ")) from None


def prompt_arg(text: str) -> str:
    """A non-empty prompt (an argparse type)."""
    if not text:
        raise argparse.ArgumentTypeError("the prompt must not be empty")
    return text


def add_load_options(p: argparse.ArgumentParser) -> None:
    """The load options shared by this command and ``python -m jaxray.bench serve`` (not --url:
    required here, an alternative to --checkpoint there)."""
    p.add_argument(
        "--clients",
        type=positive_int_list,
        default=(1, 4, 16, 64),
        help="comma-separated concurrency levels (default 1,4,16,64)",
    )
    p.add_argument(
        "--duration", type=positive_float, default=20.0, help="measured seconds per level (default 20)"
    )
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=64, help="new tokens per request (default 64)"
    )
    p.add_argument(
        "--prompt", type=prompt_arg, default="ROMEO:", help="the prompt of every request (default 'ROMEO:')"
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="0 is greedy (default 0.8)")
    p.add_argument(
        "--top-k", type=positive_int, default=None, help="sample from the k likeliest bytes (default all)"
    )
    p.add_argument("--seed", type=non_negative_int, default=0, help="first seed; each request gets its own")
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=120.0,
        help="seconds a request may take before it counts as dropped (default 120)",
    )


def settings_from(args: argparse.Namespace, url: str) -> LoadSettings:
    """LoadSettings from parsed ``add_load_options`` arguments (raises ValueError on a bad value)."""
    return LoadSettings(
        url=url,
        clients=tuple(args.clients),
        duration_s=args.duration,
        max_new_tokens=args.max_new_tokens,
        prompt=args.prompt,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        timeout_s=args.timeout,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m jaxray.bench.loadtest",
        description="Closed-loop HTTP load test of a running jaxray Serve app.",
    )
    p.add_argument(
        "--url", type=url_arg, required=True, help="the Serve app's base URL, e.g. http://127.0.0.1:8000"
    )
    add_load_options(p)
    p.add_argument("--json", action="store_true", help="print one JSON object (settings and a row per level)")
    args = p.parse_args(argv)
    try:
        settings = settings_from(args, args.url)
    except ValueError as err:
        p.error(str(err))
    result = run(settings)
    if args.json:
        print(json.dumps(result, allow_nan=False))
    else:
        for row in result["rows"]:
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
