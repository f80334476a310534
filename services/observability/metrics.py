"""Prometheus metrics of the services, under the names in services/contract.py (the operator,
the dashboards and the alert rules are tested against those names)."""

from __future__ import annotations

from hybridcache.services import contract as c
from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest


def _name(full: str) -> str:
    # prometheus-client appends _total to counters itself.
    return full.removesuffix("_total")


TTFT = Histogram(c.METRIC_TTFT_SECONDS, "Time from request arrival to the first token",
                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
INTER_TOKEN = Histogram(c.METRIC_INTER_TOKEN_SECONDS, "Time between consecutive tokens",
                        buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
COLD_QUEUE_DEPTH = Gauge(c.METRIC_COLD_QUEUE_DEPTH, "Cold segments dispatched to scatter workers and not yet done",
                         ["worker"])
CACHE_QUERIES = Counter(_name(c.METRIC_CACHE_QUERIES), "Entry lookups by tier", ["tier"])
CACHE_HITS = Counter(_name(c.METRIC_CACHE_HITS), "Entry lookups that hit, by tier", ["tier"])
BYTES_MOVED = Counter(_name(c.METRIC_BYTES_MOVED), "Entry bytes moved between services, by path", ["path"])
ENTRY_BUILD_SECONDS = Histogram(c.METRIC_ENTRY_BUILD_SECONDS, "Seconds to prefill one segment into an entry",
                                buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5))
REQUESTS = Counter(_name(c.METRIC_REQUESTS), "Requests by outcome", ["status"])
CACHE_BYTES = Gauge(c.METRIC_CACHE_BYTES, "Bytes held in entry caches, by tier", ["tier"])


def cache_lookup(tier: str, hit: bool) -> None:
    CACHE_QUERIES.labels(tier=tier).inc()
    if hit:
        CACHE_HITS.labels(tier=tier).inc()


def scrape() -> bytes:
    return generate_latest(REGISTRY)
