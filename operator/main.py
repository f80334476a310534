"""Kopf handlers for HybridCache. Run as `kopf run -m hybridcache.operator.main`.

Handlers stay thin: parse the spec once, build the children, adopt and apply them, patch status.
Children are owned by the HybridCache (ownerReferences), so deleting it garbage-collects them and
no finalizer is needed. API errors become kopf retries (409, 429, 5xx) or permanent failures
(other 4xx, recorded in the Degraded condition).
"""

from __future__ import annotations

import datetime
import logging
import os
import secrets
import time
from typing import Any

import kopf
import kubernetes
import prometheus_client
from hybridcache.operator import autoscaler, builders, kube
from hybridcache.operator import status as statuses
from hybridcache.operator.spec import HybridCacheSpec, SpecError
from hybridcache.services import contract

RESOURCE = (contract.API_GROUP, contract.API_VERSION, "hybridcaches")
TIMER_INTERVAL = float(os.environ.get("HYBRIDCACHE_TIMER_INTERVAL", "15"))
RETRY_DELAY = float(os.environ.get("HYBRIDCACHE_RETRY_DELAY", "10"))
METRICS_PORT = int(os.environ.get("HYBRIDCACHE_OPERATOR_METRICS_PORT", "0"))

SCATTER_REPLICAS = prometheus_client.Gauge(
    contract.METRIC_SCATTER_REPLICAS,
    "Scatter workers the operator wants for a HybridCache",
    # not `namespace`: a scrape of the operator's pod gives every series that target label (the
    # operator's own namespace), and Prometheus would rename this one's to exported_namespace
    ["hybridcache_namespace", "hybridcache"],
)

_api: kube.Kube | None = None


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_: Any) -> None:
    global _api
    prefix = contract.API_GROUP
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=prefix)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=prefix, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{prefix}/finalizer"
    settings.posting.level = logging.WARNING
    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    _api = kube.Kube(kubernetes.client.ApiClient())
    if METRICS_PORT:
        prometheus_client.start_http_server(METRICS_PORT)
        logger.info("operator metrics on :%d/metrics", METRICS_PORT)


def api() -> kube.Kube:
    assert _api is not None, "the startup handler has not run"
    return _api


def parse(spec: dict[str, Any]) -> HybridCacheSpec:
    try:
        return HybridCacheSpec.parse(spec)
    except SpecError as exc:
        raise kopf.PermanentError(f"invalid spec: {exc}") from exc


def apply_all(objects: list[dict[str, Any]], owner: dict[str, Any], create_only: bool = False) -> dict[str, int]:
    kopf.adopt(objects, owner=owner)
    outcomes: dict[str, int] = {}
    for obj in objects:
        try:
            outcome = api().create_if_absent(obj) if create_only else api().apply(obj)
        except kube.ApiError as exc:
            what = f"{obj['kind']} {obj['metadata']['name']}: {exc}"
            if exc.status in (409, 429) or exc.status >= 500:
                raise kopf.TemporaryError(what, delay=RETRY_DELAY) from exc
            raise kopf.PermanentError(what) from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def degraded_condition(ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return statuses.condition("Degraded", not ok, reason, message, generation)


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
def reconcile(
    spec: dict[str, Any], status: dict[str, Any], meta: dict[str, Any], body: kopf.Body, patch: kopf.Patch,
    name: str, logger: logging.Logger, **_: Any,
) -> None:
    generation = int(meta.get("generation", 0))
    if spec.get("paused"):
        logger.info("paused: children left as they are")
        return
    try:
        hc = parse(spec)
        replicas = autoscaler.scatter_replicas(hc, status.get("scatter", {}).get("desiredReplicas"))
        # the deployment secret first (the pods mount it), made once and then left alone
        apply_all([builders.deployment_secret(name, secrets.token_hex(32))], owner=body, create_only=True)
        outcomes = apply_all(builders.children(hc, name, replicas), owner=body)
    except kopf.PermanentError as exc:
        # Recorded now; the timer carries Degraded over until a later spec reconciles.
        patch.status["conditions"] = _merge_conditions(
            status, [degraded_condition(False, "ReconcileFailed", str(exc), generation)]
        )
        raise
    logger.info("children reconciled: %s", outcomes)
    patch.status["observedGeneration"] = generation
    patch.status["conditions"] = _merge_conditions(
        status, [degraded_condition(True, "Reconciled", "", generation)]
    )


def _merge_conditions(status: dict[str, Any], updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    now = _now()
    previous = list(status.get("conditions") or [])
    kept = [c for c in previous if c["type"] not in {u["type"] for u in updates}]
    return kept + statuses.stamp_transitions(updates, previous, now)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@kopf.timer(*RESOURCE, interval=TIMER_INTERVAL, initial_delay=min(TIMER_INTERVAL, 5.0))
def observe_and_scale(
    spec: dict[str, Any], status: dict[str, Any], meta: dict[str, Any], body: kopf.Body, patch: kopf.Patch,
    name: str, namespace: str, logger: logging.Logger, **_: Any,
) -> None:
    """Read the children's readiness into status; in Operator mode, scale the scatter workers."""
    try:
        hc = HybridCacheSpec.parse(spec)
    except SpecError:
        return  # reconcile has recorded Degraded
    workloads = {
        role: api().get("apps/v1", "StatefulSet" if role == "cache-tier" else "Deployment", namespace,
                        builders.child_name(name, role))
        for role in statuses.ROLE_CONDITIONS
    }
    scatter_live = workloads["scatter"]
    current = autoscaler.scatter_replicas(hc, status.get("scatter", {}).get("desiredReplicas"))
    if scatter_live is not None:
        current = int(scatter_live["spec"]["replicas"])
    desired = current

    if hc.autoscaling.operator_driven and not hc.paused and scatter_live is not None:
        scaled = _autoscale(hc, status, namespace, name, current, logger)
        if scaled is not None:
            decision, record = scaled
            patch.status.update(record)
            if decision.changed(current):
                apply_all([builders.scatter_deployment(hc, name, decision.replicas)], owner=body)
                scatter_live["spec"]["replicas"] = decision.replicas
                logger.info("scatter %d -> %d (%s)", current, decision.replicas, decision.reason)
            desired = decision.replicas
    SCATTER_REPLICAS.labels(namespace, name).set(desired)

    wanted = statuses.wanted_replicas(hc, desired)
    observed = {
        role: statuses.RoleObservation.from_workload(workloads[role], wanted[role]) for role in wanted
    }
    generation = int(meta.get("generation", 0))
    previous = list(status.get("conditions") or [])
    degraded = next((c for c in previous if c["type"] == "Degraded"), None)
    conditions = statuses.aggregate(
        observed, generation, int(status.get("observedGeneration", 0)), hc.paused, degraded
    )
    patch.status["roles"] = statuses.roles_status(observed)
    patch.status["scatter"] = {
        "replicas": observed["scatter"].replicas,
        "readyReplicas": observed["scatter"].ready,
        "desiredReplicas": desired,
        "selector": builders.scatter_selector(name),
    }
    patch.status["conditions"] = statuses.stamp_transitions(conditions, previous, _now())


def _autoscale(
    hc: HybridCacheSpec, status: dict[str, Any], namespace: str, name: str, current: int,
    logger: logging.Logger,
) -> tuple[autoscaler.Decision, dict[str, Any]] | None:
    """The scaling decision for this tick and the status fields that record it."""
    try:
        depth = autoscaler.read_queue_depth(hc.autoscaling, namespace, name, hc.router.http_port)
    except autoscaler.MetricsUnavailable as exc:
        logger.warning("queue depth unavailable, scatter replicas kept: %s", exc)
        return None
    state = status.get("autoscaling") or {}
    history = tuple(
        autoscaler.Recommendation(time=float(r["time"]), replicas=int(r["replicas"]))
        for r in state.get("recommendations") or ()
    )
    decision = autoscaler.decide(depth, current, hc.autoscaling, history, now=time.time())
    autoscaling_status = {
        "lastDecision": {
            "time": _now(),
            "queueDepth": depth,
            "fromReplicas": current,
            "toReplicas": decision.replicas,
            "reason": decision.reason,
        },
        "recommendations": [{"time": r.time, "replicas": r.replicas} for r in decision.history],
    }
    return decision, {"autoscaling": autoscaling_status, "coldQueueDepth": depth}
