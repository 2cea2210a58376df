"""Serving metrics: ``ray.serve.metrics`` objects recorded in each replica, scraped from every node's
Ray metrics agent (``metrics_url()``) with the ``ray_`` prefix and Serve's labels, within Ray's report
interval (10 s by default). Names are vLLM's with ``jaxray_`` for ``vllm:`` (Ray drops ``:``);
``EXPORTED`` lists them as scraped. HTTP requests: Serve's ``ray_serve_num_http_requests_total``. No JAX."""

from __future__ import annotations

import threading
import time

PREFIX = "jaxray_"  # Ray names; the scrape adds "ray_" (and "_total" to counters)
MODEL_TAG = "model_name"  # vLLM's label for the served model
ABORTED = "abort"  # finished_reason of a request that ended without one (error, cancel, disconnect)
GAUGE_REFRESH_S = 0.5  # Ray ages out a gauge not set for 2 report intervals (>= 2 s): set it again

# Histogram bucket upper bounds, seconds.
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
TTFT_BUCKETS_S += [7.5, 10.0, 20.0, 40.0, 60.0]
ITL_BUCKETS_S = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4]
ITL_BUCKETS_S += [0.5, 0.75, 1.0, 2.5, 5.0]
E2E_BUCKETS_S = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0]
E2E_BUCKETS_S += [40.0, 50.0, 60.0, 120.0, 240.0, 300.0]

_REQ = (MODEL_TAG, "route")
# Each metric once: attribute of _Metrics -> (kind, Ray name less PREFIX, labels besides Ray's and
# Serve's, description (the scrape's HELP), histogram buckets).
METRICS: dict[str, tuple[str, str, tuple[str, ...], str, list[float] | None]] = {
    "ttft": ("histogram", "time_to_first_token_seconds", _REQ,
             "Time to first token (s): request start to the first generated chunk.", TTFT_BUCKETS_S),
    "itl": ("histogram", "inter_token_latency_seconds", _REQ,
            "Inter-token latency (s/token): time since the previous chunk divided by the chunk's "
            "tokens, observed once per chunk after the first.", ITL_BUCKETS_S),
    "e2e": ("histogram", "e2e_request_latency_seconds", _REQ,
            "End-to-end request latency (s): request start to finish.", E2E_BUCKETS_S),
    "running": ("gauge", "num_requests_running", (MODEL_TAG,),
                "Requests generating in this replica (a first token produced, not finished).", None),
    "waiting": ("gauge", "num_requests_waiting", (MODEL_TAG,),
                "Requests waiting in this replica for their first token (queued or in prefill).", None),
    "prompt_tokens": ("counter", "prompt_tokens", _REQ, "Prompt tokens of finished requests (tokens).", None),
    "generation_tokens": ("counter", "generation_tokens", _REQ, "Generated tokens (tokens).", None),
    "success": ("counter", "request_success", (*_REQ, "finished_reason"),
                'Finished requests by finish reason ("abort": ended without one).', None),
    "prefix_queries": ("counter", "prefix_cache_queries", (MODEL_TAG,),
                       "Prompt tokens looked up in the prefix cache (tokens).", None),
    "prefix_hits": ("counter", "prefix_cache_hits", (MODEL_TAG,),
                    "Prompt tokens read from the prefix cache, not computed (tokens).", None),
}  # fmt: skip
# Names as a Prometheus scrape shows them -> (kind, labels besides Ray's and Serve's, description).
EXPORTED = {
    f"ray_{PREFIX}{name}{'_total' if kind == 'counter' else ''}": (kind, labels, description)
    for kind, name, labels, description, _ in METRICS.values()
}


class _Metrics:
    """This process's (a replica's) metric objects, attributes named as in ``METRICS``."""

    def __init__(self):
        # Deferred: importing this module needs no Ray (routes.py has none); a replica has it.
        from ray.serve.metrics import Counter, Gauge, Histogram

        kinds = {"histogram": Histogram, "gauge": Gauge, "counter": Counter}
        for attr, (kind, name, labels, description, buckets) in METRICS.items():
            options = {"boundaries": buckets} if buckets else {}
            setattr(self, attr, kinds[kind](PREFIX + name, description, tag_keys=labels, **options))
        self.lock = threading.Lock()
        self.counts: dict[str, list[int]] = {}  # model -> [waiting, running] in this process
        self.prefix: dict[str, tuple[object, list[int]]] = {}  # model -> (PrefixCache, counts sent)
        threading.Thread(target=self._refresh, name="jaxray-metrics-gauges", daemon=True).start()

    def move(self, model: str, waiting: int, running: int) -> None:
        """Adds ``waiting`` and ``running`` (each -1, 0 or 1) to the counts of ``model``."""
        with self.lock:
            counts = self.counts.setdefault(model, [0, 0])
            counts[:] = counts[0] + waiting, counts[1] + running
            self._set(model, counts)

    def _set(self, model: str, counts: list[int]) -> None:
        for gauge, value in zip((self.waiting, self.running), counts):
            gauge.set(value, tags={MODEL_TAG: model})

    def _refresh(self) -> None:
        """Sets the gauges again (an idle replica's 0 would age out) and adds the prefix caches' counts."""
        while True:
            time.sleep(GAUGE_REFRESH_S)
            with self.lock:
                for model, counts in self.counts.items():
                    self._set(model, counts)
                for model, (cache, sent) in self.prefix.items():
                    now = [cache.queries, cache.hits]
                    for counter, value, before in zip((self.prefix_queries, self.prefix_hits), now, sent):
                        if value > before:
                            counter.inc(value - before, tags={MODEL_TAG: model})
                    sent[:] = now


_metrics: _Metrics | None = None
_create = threading.Lock()


def _get() -> _Metrics:
    """This process's metrics, created on first use (in a replica's Serve context: its labels)."""
    global _metrics
    with _create:
        _metrics = _metrics or _Metrics()
    return _metrics


class RequestTimer:
    """One generation request's metrics from its arrival at ``route`` (e.g. ``"/v1/completions"``) for
    ``model``: waiting until its first ``tokens``, then running until ``finish``; no-ops after it."""

    __slots__ = ("_m", "_tags", "_start", "_last", "_done")

    def __init__(self, route: str, model: str):
        self._m = _get()
        self._tags = {MODEL_TAG: model, "route": route}
        self._start = time.perf_counter()
        self._last: float | None = None  # when the previous chunk came; None (waiting) before the first
        self._done = False
        self._m.move(model, waiting=1, running=0)

    def tokens(self, n: int) -> None:
        """A chunk of ``n`` new tokens now (``n`` <= 0: nothing): the first observes the TTFT (s), later
        ones the inter-token latency, (seconds since the previous chunk) / ``n``."""
        if n <= 0 or self._done:
            return
        now = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(now - self._start, tags=self._tags)
            self._m.move(self._tags[MODEL_TAG], waiting=-1, running=1)
        else:
            self._m.itl.observe((now - self._last) / n, tags=self._tags)
        self._last = now
        self._m.generation_tokens.inc(n, tags=self._tags)

    def finish(self, prompt_tokens: int, finish_reason: str | None) -> None:
        """The request ended (answered, failed or cancelled): observes the end-to-end latency (s), counts
        ``prompt_tokens`` and one request under ``finish_reason`` (None: ``"abort"``). Once only."""
        if self._done:
            return
        self._done, m = True, self._m
        m.move(self._tags[MODEL_TAG], *((-1, 0) if self._last is None else (0, -1)))
        m.e2e.observe(time.perf_counter() - self._start, tags=self._tags)
        if prompt_tokens > 0:
            m.prompt_tokens.inc(prompt_tokens, tags=self._tags)
        m.success.inc(1, tags={**self._tags, "finished_reason": finish_reason or ABORTED})


def watch_prefix_cache(model: str, cache) -> None:
    """Export ``cache``'s (a ``PrefixCache``) token counts as ``model``'s prefix_cache_queries and _hits."""
    m = _get()
    with m.lock:
        m.prefix[model] = (cache, [0, 0])


def metrics_url() -> str | None:
    """``http://<node address>:<port>/metrics`` of the head node's Ray metrics agent (else the first alive
    node's; each exports its replicas' metrics, a local Ray's all of them), or None before ``ray.init``."""
    import ray  # deferred: importing this module needs no Ray

    if not ray.is_initialized():
        return None
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    nodes.sort(key=lambda node: "node:__internal_head__" not in node.get("Resources", {}))
    for node in nodes:
        address, port = node.get("NodeManagerAddress"), node.get("MetricsExportPort")
        if address and port and port > 0:
            return f"http://{f'[{address}]' if ':' in address else address}:{port}/metrics"
    return None
