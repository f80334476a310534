"""The autoscaler's PromQL against a real Prometheus on 127.0.0.1 scraping a real exporter."""

from __future__ import annotations

import time

import prometheus_client
import pytest
from hybridcache.operator import autoscaler
from hybridcache.operator.spec import HybridCacheSpec
from hybridcache.services import contract
from prometheus_server import free_port, prometheus


def test_autoscaler_query_against_real_prometheus(tmp_path):
    registry = prometheus_client.CollectorRegistry()
    depth = prometheus_client.Gauge(contract.METRIC_COLD_QUEUE_DEPTH, "queued cold segments", ["worker"],
                                    registry=registry)
    depth.labels("0").set(9)
    depth.labels("1").set(4)
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=registry)
    # A second HybridCache's router in another namespace: the default query must not count it.
    other = prometheus_client.CollectorRegistry()
    prometheus_client.Gauge(contract.METRIC_COLD_QUEUE_DEPTH, "queued", registry=other).set(100)
    other_port = free_port()
    other_server, other_thread = prometheus_client.start_http_server(other_port, addr="127.0.0.1",
                                                                     registry=other)
    try:
        targets = [
            (f"127.0.0.1:{port}", {"namespace": "serving", "service": "demo-router"}),
            (f"127.0.0.1:{other_port}", {"namespace": "elsewhere", "service": "demo-router"}),
        ]
        with prometheus(tmp_path, targets) as url:
            spec = HybridCacheSpec.parse({
                "model": {"arch": "qwen3_next", "path": "/m"},
                "scatter": {"autoscaling": {"mode": "Operator", "metricsSource": {"type": "Prometheus",
                                                                                 "url": url}}},
            })
            deadline = time.monotonic() + 20
            while autoscaler.read_prometheus(url, "count(up == 1)") < 2:
                assert time.monotonic() < deadline, "Prometheus did not scrape both targets"
                time.sleep(0.2)
            value = autoscaler.read_queue_depth(spec.autoscaling, "serving", "demo", 8000)
            assert value == 13.0
            decision = autoscaler.decide(value, 1, spec.autoscaling, (), time.time())
            assert decision.raw == 4 and decision.replicas == 3  # ceil(13/4), max step 2

            custom = autoscaler.read_prometheus(url, f"max({contract.METRIC_COLD_QUEUE_DEPTH})")
            assert custom == 100.0
            with pytest.raises(autoscaler.MetricsUnavailable, match="bad_data"):
                autoscaler.read_prometheus(url, "sum(")
    finally:
        for s, t in ((server, thread), (other_server, other_thread)):
            s.shutdown()
            t.join(5)

    with pytest.raises(autoscaler.MetricsUnavailable):
        autoscaler.read_prometheus(url, "up", timeout=1)
