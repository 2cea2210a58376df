"""Reading a Prometheus endpoint in tests: ``scrape`` parses it with ``prometheus_client``'s text
parser, ``value`` sums the samples matching a name and labels, ``wait_for`` polls until a
condition on the samples holds (Ray's metrics agent shows a value one report interval after it
was recorded)."""

from __future__ import annotations

import time
from collections.abc import Callable

import requests
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def scrape(url: str, timeout: float = 10.0) -> list[Sample]:
    """Every sample ``url`` serves (a histogram's ``_bucket``/``_count``/``_sum`` and a counter's
    ``_total`` are samples with those names)."""
    response = requests.get(url, timeout=timeout)
    response.raise_for_status()
    return [sample for family in text_string_to_metric_families(response.text) for sample in family.samples]


def value(samples: list[Sample], name: str, **labels) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels`` (values compared as
    strings: ``status=200`` matches ``"200"``); 0.0 when none match."""
    wanted = {key: str(val) for key, val in labels.items()}
    return sum(
        sample.value
        for sample in samples
        if sample.name == name and all(sample.labels.get(key) == val for key, val in wanted.items())
    )


def label_values(samples: list[Sample], name: str, label: str) -> set[str]:
    """The values ``label`` takes among the samples named ``name``."""
    return {sample.labels[label] for sample in samples if sample.name == name and label in sample.labels}


NOISE = ("Component", "NodeAddress", "SessionName", "Version", "WorkerId", "otel_scope_")  # Ray's labels


def _short(labels: dict) -> dict:
    return {key: val for key, val in labels.items() if not key.startswith(NOISE)}


def wait_for(
    url: str, predicate: Callable[[list[Sample]], bool], timeout: float = 30.0, every: float = 0.25
) -> list[Sample]:
    """Scrapes ``url`` until ``predicate(samples)`` is true and returns those samples; fails after
    ``timeout`` seconds showing the last scrape's samples of jaxray and of Serve's HTTP counter."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(url)
        if predicate(samples):
            return samples
        if time.monotonic() > deadline:
            ours = [s for s in samples if s.name.startswith(("ray_jaxray_", "ray_serve_num_http_requests"))]
            shown = "\n".join(f"  {s.name}{_short(s.labels)} {s.value}" for s in ours)
            raise AssertionError(f"{url}: not true within {timeout:.0f} s; last scrape:\n{shown}")
        time.sleep(every)
