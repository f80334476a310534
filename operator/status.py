"""Pure functions from observed children to the HybridCache's status.

One condition per role (`RouterReady`, `CombineReady`, `ScatterReady`, `CacheTierReady`) and
aggregates over them in the KServe manner: `Ready` (every role serves), `Progressing` (a role has
fewer ready or updated pods than wanted, or the spec is not yet reconciled), `Degraded` (the last
reconcile failed permanently; set by the handler, carried over here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridcache.operator.spec import HybridCacheSpec

ROLE_CONDITIONS = {
    "router": "RouterReady",
    "combine": "CombineReady",
    "scatter": "ScatterReady",
    "cache-tier": "CacheTierReady",
}
STATUS_KEYS = {"router": "router", "combine": "combine", "scatter": "scatter", "cache-tier": "cacheTier"}


@dataclass(frozen=True)
class RoleObservation:
    wanted: int
    replicas: int = 0
    ready: int = 0
    updated: int = 0

    @classmethod
    def from_workload(cls, workload: dict[str, Any] | None, wanted: int) -> RoleObservation:
        if workload is None:
            return cls(wanted=wanted)
        status = workload.get("status") or {}
        return cls(
            wanted=int((workload.get("spec") or {}).get("replicas", wanted)),
            replicas=int(status.get("replicas", 0)),
            ready=int(status.get("readyReplicas", 0)),
            updated=int(status.get("updatedReplicas", 0)),
        )

    @property
    def serving(self) -> bool:
        return self.wanted == 0 or self.ready >= 1

    @property
    def settled(self) -> bool:
        return self.ready >= self.wanted and self.updated >= self.wanted


def condition(type_: str, ok: bool, reason: str, message: str, generation: int) -> dict[str, Any]:
    return {
        "type": type_,
        "status": "True" if ok else "False",
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
    }


def stamp_transitions(
    conditions: list[dict[str, Any]], previous: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """Keep lastTransitionTime from the previous condition of a type whose status did not change."""
    before = {c["type"]: c for c in previous}
    stamped = []
    for c in conditions:
        old = before.get(c["type"])
        same = old is not None and old.get("status") == c["status"] and "lastTransitionTime" in old
        stamped.append({**c, "lastTransitionTime": old["lastTransitionTime"] if same else now})
    return stamped


def role_conditions(observed: dict[str, RoleObservation], generation: int) -> list[dict[str, Any]]:
    result = []
    for role, type_ in ROLE_CONDITIONS.items():
        obs = observed[role]
        message = f"{obs.ready}/{obs.wanted} pods ready"
        result.append(condition(type_, obs.serving, "PodsReady" if obs.serving else "NoPodReady", message,
                                generation))
    return result


def aggregate(
    observed: dict[str, RoleObservation],
    generation: int,
    observed_generation: int,
    paused: bool,
    degraded: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    per_role = role_conditions(observed, generation)
    not_ready = [c["type"] for c in per_role if c["status"] != "True"]
    ready = condition(
        "Ready", not not_ready,
        "AllRolesReady" if not not_ready else "RolesNotReady",
        "every role has a ready pod" if not not_ready else "not ready: " + ", ".join(not_ready),
        generation,
    )
    unsettled = [role for role, obs in observed.items() if not obs.settled]
    if paused:
        progressing = condition("Progressing", False, "Paused", "spec.paused is set", generation)
    elif observed_generation < generation:
        progressing = condition("Progressing", True, "Reconciling", "spec not yet applied", generation)
    elif unsettled:
        progressing = condition("Progressing", True, "RollingOut", "waiting for: " + ", ".join(unsettled),
                                generation)
    else:
        progressing = condition("Progressing", False, "Settled", "every role has its pods", generation)
    if degraded is None:
        degraded = condition("Degraded", False, "Reconciled", "", generation)
    return [ready, progressing, degraded, *per_role]


def roles_status(observed: dict[str, RoleObservation]) -> dict[str, Any]:
    return {
        STATUS_KEYS[role]: {"replicas": obs.replicas, "readyReplicas": obs.ready}
        for role, obs in observed.items()
    }


def wanted_replicas(spec: HybridCacheSpec, scatter: int) -> dict[str, int]:
    return {
        "router": spec.router.replicas,
        "combine": spec.combine.replicas,
        "scatter": scatter,
        "cache-tier": spec.cache_tier.replicas,
    }
