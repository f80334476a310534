"""Scatter-worker autoscaling by cold-segment queue depth.

`decide` is a pure function of (queue depth, current replicas, policy, recent recommendations,
now), with the semantics of the HorizontalPodAutoscaler's behaviour field:

- raw recommendation = ceil(depth / target per replica), clamped to [min, max];
- scale up only to the *lowest* recommendation seen within the scale-up window, scale down only
  to the *highest* seen within the scale-down window (so a burst or a lull shorter than the window
  changes nothing, and the direction cannot reverse inside a window);
- move at most `max_step` replicas per decision, except that a current count outside [min, max]
  (the bounds were just edited) goes straight to the nearest bound.

The readers fetch the depth from Prometheus (`/api/v1/query`) or from the router's /metrics.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from hybridcache.operator.spec import AutoscalingSpec, HybridCacheSpec
from hybridcache.services import contract
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Recommendation:
    time: float  # seconds since the epoch
    replicas: int


@dataclass(frozen=True)
class Decision:
    replicas: int
    raw: int  # the unstabilized recommendation for this depth, recorded for later decisions
    reason: str
    history: tuple[Recommendation, ...]  # what to keep for the next decision

    def changed(self, current: int) -> bool:
        return self.replicas != current


def raw_recommendation(depth: float, policy: AutoscalingSpec) -> int:
    wanted = math.ceil(max(depth, 0.0) / policy.target_queue_depth)
    return min(max(wanted, policy.min_replicas), policy.max_replicas)


def decide(
    depth: float,
    current: int,
    policy: AutoscalingSpec,
    history: tuple[Recommendation, ...],
    now: float,
) -> Decision:
    raw = raw_recommendation(depth, policy)
    keep = max(policy.scale_up_window_s, policy.scale_down_window_s)
    history = tuple(r for r in history if now - r.time <= keep and r.time <= now)
    in_up = [r.replicas for r in history if now - r.time < policy.scale_up_window_s]
    in_down = [r.replicas for r in history if now - r.time < policy.scale_down_window_s]
    up_to = min([raw, *in_up])
    down_to = max([raw, *in_down])
    new_history = (*history, Recommendation(time=now, replicas=raw))

    if current < policy.min_replicas or current > policy.max_replicas:
        bounded = min(max(current, policy.min_replicas), policy.max_replicas)
        return Decision(bounded, raw, "OutOfBounds", new_history)
    if current < up_to:
        target, reason = min(up_to, current + policy.max_step), "ScaleUp"
    elif current > down_to:
        target, reason = max(down_to, current - policy.max_step), "ScaleDown"
    elif raw != current:
        target, reason = current, "Stabilizing"
    else:
        target, reason = current, "Steady"
    return Decision(target, raw, reason, new_history)


def scatter_replicas(spec: HybridCacheSpec, desired_in_status: int | None) -> int:
    """Scatter replicas to build: the autoscaler's last choice (kept in status) in Operator mode,
    else spec.scatter.replicas, which HPA/KEDA write through /scale in External mode."""
    policy = spec.autoscaling
    if not policy.operator_driven:
        return spec.scatter.replicas
    base = spec.scatter.replicas if desired_in_status is None else desired_in_status
    return min(max(base, policy.min_replicas), policy.max_replicas)


class MetricsUnavailable(RuntimeError):
    """The queue depth could not be read; the autoscaler then keeps the current replicas."""


def default_query(namespace: str, name: str) -> str:
    router_service = f"{name}-router"
    return (
        f'sum({contract.METRIC_COLD_QUEUE_DEPTH}{{namespace="{namespace}",service="{router_service}"}})'
    )


def read_prometheus(base_url: str, query: str, timeout: float = 5.0) -> float:
    """Run an instant query; an empty result means nothing is queued."""
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": query})
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = json.load(response)
    except urllib.error.HTTPError as exc:
        # Prometheus explains a rejected query (400 bad_data, 422 execution) in a JSON body.
        try:
            body = json.load(exc)
        except ValueError:
            raise MetricsUnavailable(f"Prometheus query failed: {exc}") from exc
    except (OSError, ValueError) as exc:
        raise MetricsUnavailable(f"Prometheus query failed: {exc}") from exc
    if body.get("status") != "success":
        raise MetricsUnavailable(f"Prometheus answered {body.get('errorType')}: {body.get('error')}")
    result = body["data"]["result"]
    if body["data"]["resultType"] == "scalar":
        return float(result[1])
    return sum(float(sample["value"][1]) for sample in result)


def parse_queue_depth(exposition: str) -> float:
    """Sum the cold-segment queue depth gauge over its label sets in a /metrics scrape."""
    for family in text_string_to_metric_families(exposition):
        if family.name == contract.METRIC_COLD_QUEUE_DEPTH:
            return sum(s.value for s in family.samples if s.name == contract.METRIC_COLD_QUEUE_DEPTH)
    raise MetricsUnavailable(f"{contract.METRIC_COLD_QUEUE_DEPTH} is not in the scrape")


def read_router_metrics(url: str, timeout: float = 5.0) -> float:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            text = response.read().decode()
    except (OSError, ValueError) as exc:
        raise MetricsUnavailable(f"router /metrics failed: {exc}") from exc
    return parse_queue_depth(text)


def read_queue_depth(policy: AutoscalingSpec, namespace: str, name: str, router_http_port: int) -> float:
    source = policy.metrics_source
    if source.type == "Prometheus":
        return read_prometheus(source.url, source.query or default_query(namespace, name))
    url = source.url or f"http://{name}-router.{namespace}.svc:{router_http_port}/metrics"
    return read_router_metrics(url)
