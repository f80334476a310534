"""Fetch or recompute: the router's cost model (DESIGN §5).

Python gRPC on loopback moves an entry slower than a GPU recomputes its segment
(benchmarks/transport_loopback.py), so per warm
segment the router compares the time to move its entry over the path it would take with the time
to prefill it again, and picks the sooner. Bandwidths and prefill speed are running averages of
what the services measure; the defaults are starting values until the first measurements.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# Starting points until the services report measurements: entry Get over loopback as recorded in
# benchmarks/results/transport_loopback_cpu_*.json (2-core CPU machine, checksums included).
DEFAULT_BANDWIDTH = {"grpc": 0.08e9, "shm": 0.17e9, "local": 50e9}
DEFAULT_LATENCY_S = {"grpc": 2e-3, "shm": 1e-3, "local": 0.0}


@dataclass
class CostModel:
    prefill_tokens_per_s: float = 2000.0
    bandwidth: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BANDWIDTH))
    latency_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_LATENCY_S))
    smoothing: float = 0.3  # weight of a new measurement in the running average
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fetch_seconds(self, nbytes: int, path: str) -> float:
        return self.latency_s.get(path, 0.0) + nbytes / self.bandwidth[path]

    def recompute_seconds(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def choose(self, nbytes: int, tokens: int, path: str) -> str:
        """"fetch" or "recompute", whichever is sooner (fetch on a tie: it saves compute)."""
        return "fetch" if self.fetch_seconds(nbytes, path) <= self.recompute_seconds(tokens) else "recompute"

    def observe_transfer(self, path: str, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            old = self.bandwidth.get(path, nbytes / seconds)
            self.bandwidth[path] = (1 - self.smoothing) * old + self.smoothing * nbytes / seconds

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        with self._lock:
            a = self.smoothing
            self.prefill_tokens_per_s = (1 - a) * self.prefill_tokens_per_s + a * tokens / seconds
