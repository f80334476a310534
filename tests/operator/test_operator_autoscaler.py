"""The scaling decision, property-tested, and the two readers of the queue depth."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from hybridcache.operator import autoscaler
from hybridcache.operator.autoscaler import Recommendation, decide
from hybridcache.operator.spec import AutoscalingSpec, HybridCacheSpec
from hybridcache.services import contract
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def policies(draw):
    low = draw(st.integers(1, 10))
    return AutoscalingSpec(
        mode="Operator",
        min_replicas=low,
        max_replicas=draw(st.integers(low, 20)),
        target_queue_depth=draw(st.sampled_from([0.5, 1.0, 2.0, 4.0, 7.5])),
        scale_up_window_s=draw(st.integers(0, 120)),
        scale_down_window_s=draw(st.integers(0, 600)),
        max_step=draw(st.integers(1, 5)),
    )


depths = st.floats(min_value=0, max_value=500, allow_nan=False)
histories = st.lists(st.tuples(st.floats(0, 600), st.integers(1, 20)), max_size=8).map(
    lambda items: tuple(Recommendation(time=1000.0 - age, replicas=r) for age, r in items)
)
NOW = 1000.0


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(policy=policies(), current=st.integers(0, 25), history=histories, a=depths, b=depths)
def test_monotonic_in_depth(policy, current, history, a, b):
    low, high = sorted((a, b))
    assert decide(low, current, policy, history, NOW).replicas <= decide(high, current, policy, history,
                                                                           NOW).replicas


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(policy=policies(), current=st.integers(0, 25), history=histories, depth=depths)
def test_always_within_bounds(policy, current, history, depth):
    replicas = decide(depth, current, policy, history, NOW).replicas
    assert policy.min_replicas <= replicas <= policy.max_replicas


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(policy=policies(), history=histories, depth=depths, data=st.data())
def test_max_step_respected_inside_bounds(policy, history, depth, data):
    current = data.draw(st.integers(policy.min_replicas, policy.max_replicas))
    assert abs(decide(depth, current, policy, history, NOW).replicas - current) <= policy.max_step


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(policy=policies(), start=st.integers(1, 20),
       ticks=st.lists(st.tuples(st.floats(0.5, 60), depths), min_size=2, max_size=30))
def test_no_flapping_inside_the_stabilization_windows(policy, start, ticks):
    """After a scale-up nothing scales down within the down window, and vice versa."""
    now, current, history = 0.0, min(max(start, policy.min_replicas), policy.max_replicas), ()
    last_up = last_down = None
    for gap, depth in ticks:
        now += gap
        decision = decide(depth, current, policy, history, now)
        history = decision.history
        if decision.replicas > current:
            assert last_down is None or now - last_down >= policy.scale_up_window_s
            last_up = now
        elif decision.replicas < current:
            assert last_up is None or now - last_up >= policy.scale_down_window_s
            last_down = now
        current = decision.replicas


def test_examples():
    policy = AutoscalingSpec(mode="Operator", min_replicas=1, max_replicas=8, target_queue_depth=4,
                             scale_up_window_s=0, scale_down_window_s=60, max_step=2)
    up = decide(20, 1, policy, (), NOW)
    assert (up.replicas, up.raw, up.reason) == (3, 5, "ScaleUp")
    # the lull inside the down window keeps the replicas
    steady = decide(0, 3, policy, up.history, NOW + 30)
    assert (steady.replicas, steady.reason) == (3, "Stabilizing")
    down = decide(0, 3, policy, steady.history, NOW + 61)
    assert (down.replicas, down.reason) == (1, "ScaleDown")
    assert decide(0, 12, policy, (), NOW).replicas == 8, "out of bounds goes straight to the bound"
    assert len(decide(0, 1, policy, tuple(Recommendation(NOW - 500, 4) for _ in range(5)), NOW).history) == 1


def test_scatter_replicas_by_mode():
    base = {"model": {"arch": "a", "path": "/m"}}
    disabled = HybridCacheSpec.parse({**base, "scatter": {"replicas": 7}})
    assert autoscaler.scatter_replicas(disabled, desired_in_status=2) == 7
    external = HybridCacheSpec.parse({**base, "scatter": {"replicas": 7, "autoscaling": {"mode": "External"}}})
    assert autoscaler.scatter_replicas(external, desired_in_status=2) == 7
    operator = HybridCacheSpec.parse({**base, "scatter": {"replicas": 1, "autoscaling": {
        "mode": "Operator", "minReplicas": 1, "maxReplicas": 4}}})
    assert autoscaler.scatter_replicas(operator, desired_in_status=None) == 1
    assert autoscaler.scatter_replicas(operator, desired_in_status=3) == 3
    assert autoscaler.scatter_replicas(operator, desired_in_status=9) == 4


SCRAPE = f"""# HELP {contract.METRIC_COLD_QUEUE_DEPTH} Cold segments waiting for a scatter worker
# TYPE {contract.METRIC_COLD_QUEUE_DEPTH} gauge
{contract.METRIC_COLD_QUEUE_DEPTH}{{worker="a"}} 3.0
{contract.METRIC_COLD_QUEUE_DEPTH}{{worker="b"}} 4.0
# TYPE {contract.METRIC_REQUESTS} counter
{contract.METRIC_REQUESTS}{{status="ok"}} 12.0
"""


def test_parse_router_scrape():
    assert autoscaler.parse_queue_depth(SCRAPE) == 7.0
    with pytest.raises(autoscaler.MetricsUnavailable):
        autoscaler.parse_queue_depth(f"# TYPE {contract.METRIC_REQUESTS} counter\n")


def test_read_router_metrics_over_http():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = SCRAPE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert autoscaler.read_router_metrics(url) == 7.0
    finally:
        server.shutdown()
    with pytest.raises(autoscaler.MetricsUnavailable):
        autoscaler.read_router_metrics(url, timeout=1)


def test_default_query_selects_this_instance_router():
    assert autoscaler.default_query("ns", "demo") == (
        f'sum({contract.METRIC_COLD_QUEUE_DEPTH}{{namespace="ns",service="demo-router"}})'
    )
