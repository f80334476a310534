"""The frozen spec: parsing, defaults that agree with the CRD, and the contract's ports."""

from __future__ import annotations

import dataclasses

import crd_validation
import pytest
from hybridcache.operator.spec import HybridCacheSpec, SpecError
from hybridcache.services import contract

MINIMAL = {"model": {"arch": "qwen3_next", "path": "/app/models/tiny"}}


def test_bare_spec_parses_like_the_crd_defaulted_one():
    defaulted = crd_validation.admit({"apiVersion": "x", "kind": "HybridCache", "spec": dict(MINIMAL)})["spec"]
    assert defaulted != MINIMAL, "the CRD should have filled in defaults"
    assert HybridCacheSpec.parse(MINIMAL) == HybridCacheSpec.parse(defaulted)


def test_crd_port_defaults_are_the_contract_ports():
    spec = HybridCacheSpec.parse(MINIMAL)
    for role, ports in contract.ROLES.items():
        assert (spec.role(role).grpc_port, spec.role(role).http_port) == (ports.grpc, ports.http)
    schema = crd_validation.schema()["properties"]["spec"]["properties"]
    keys = {"router": "router", "combine": "combine", "scatter": "scatter", "cache-tier": "cacheTier"}
    for role, ports in contract.ROLES.items():
        props = schema[keys[role]]["properties"]
        assert props["grpcPort"]["default"] == ports.grpc
        assert props["httpPort"]["default"] == ports.http


def test_spec_is_frozen():
    spec = HybridCacheSpec.parse(MINIMAL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.paused = True  # type: ignore[misc]


def test_full_spec_fields():
    spec = HybridCacheSpec.parse({
        "model": {"arch": "kimi_linear", "pvc": {"claimName": "weights", "subPath": "kimi"}},
        "image": "example/hybridcache:1",
        "nodeSelector": {"gpu": "h200"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "scatter": {"replicas": 2, "gpusPerPod": 2, "autoscaling": {
            "mode": "Operator", "minReplicas": 2, "maxReplicas": 8, "targetQueueDepthPerReplica": 3,
            "maxStep": 1, "metricsSource": {"type": "Prometheus", "url": "http://prom:9090"},
        }},
        "cacheTier": {"replicas": 3, "storage": {"size": "100Gi"}},
        "etcd": {"endpoints": ["etcd:2379"]},
        "engine": {"dtype": "float32", "seamWindow": 16, "prefixPolicy": "suffix_replay"},
        "paused": True,
    })
    assert spec.model.directory == "/models/kimi"
    assert spec.scatter.gpus_per_pod == 2 and spec.autoscaling.max_replicas == 8
    assert spec.autoscaling.operator_driven and spec.autoscaling.metrics_source.type == "Prometheus"
    assert spec.cache_tier.storage_size == "100Gi" and spec.etcd_endpoints == ("etcd:2379",)
    assert spec.engine.seam_window == 16 and spec.paused
    assert spec.tolerations[0].to_manifest() == {"key": "nvidia.com/gpu", "operator": "Exists",
                                                 "effect": "NoSchedule"}


@pytest.mark.parametrize("bad, match", [
    ({"model": {"arch": "a"}}, "exactly one"),
    ({"model": {"arch": "a", "path": "/m", "uri": "oci://x"}}, "exactly one"),
    ({"model": {"arch": "a", "uri": "s3://bucket/m"}}, "oci://"),
    ({**MINIMAL, "scatter": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "minReplicas"),
    ({**MINIMAL, "scatter": {"autoscaling": {"mode": "Sometimes"}}}, "mode"),
    ({**MINIMAL, "scatter": {"autoscaling": {"metricsSource": {"type": "Prometheus"}}}}, "url"),
    ({**MINIMAL, "cacheTier": {"replicas": 2}}, "etcd"),
    ({**MINIMAL, "engine": {"cudaGraphs": "yes"}}, "cudaGraphs"),
    ({**MINIMAL, "engine": {"dtype": "float16"}}, "dtype"),
    ({}, "model"),
])
def test_inconsistent_specs_are_rejected(bad, match):
    with pytest.raises(SpecError, match=match):
        HybridCacheSpec.parse(bad)
