"""The CRD itself, and HybridCache samples checked against its schema and CEL rules."""

from __future__ import annotations

from pathlib import Path

import crd_validation
import kubernetes_validate
import pytest
import yaml
from hybridcache.services import contract

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "manifests" / "examples").glob("*.yaml"))


def test_crd_validates_strictly_and_names_match_the_contract():
    crd = crd_validation.crd()
    kubernetes_validate.validate(crd, kubernetes_validate.latest_version(), strict=True)
    assert crd["spec"]["group"] == contract.API_GROUP
    assert crd["spec"]["names"]["kind"] == contract.KIND and crd["spec"]["names"]["shortNames"] == ["hc"]
    (version,) = crd["spec"]["versions"]
    assert version["name"] == contract.API_VERSION and version["subresources"]["status"] == {}


def _schema_has(path: str) -> bool:
    node = crd_validation.schema()
    for part in path.strip(".").split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return False
    return True


def test_scale_subresource_and_printer_columns_point_at_schema_fields():
    (version,) = crd_validation.crd()["spec"]["versions"]
    scale = version["subresources"]["scale"]
    for key in ("specReplicasPath", "statusReplicasPath", "labelSelectorPath"):
        assert _schema_has(scale[key]), scale[key]
    assert scale["specReplicasPath"] == ".spec.scatter.replicas"
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert set(columns) == {"Model", "Ready", "Scatter", "Desired", "Cold-Queue", "Age"}
    for name, path in columns.items():
        if "?" not in path and name != "Age":
            assert _schema_has(path), path


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_valid(path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    samples = [d for d in docs if d["kind"] == contract.KIND]
    assert samples
    for doc in samples:
        admitted = crd_validation.admit(doc)
        # admission keeps what the example sets and fills the CRD's default (8) where it is silent
        assert admitted["spec"]["engine"]["seamWindow"] == doc["spec"].get("engine", {}).get("seamWindow", 8)
    for doc in docs:
        if doc["kind"] != contract.KIND:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def sample(**spec):
    base = {"model": {"arch": "qwen3_next", "path": "/m"}}
    base.update(spec)
    return {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "metadata": {"name": "s"}, "spec": base}


def test_defaults_are_applied():
    spec = crd_validation.admit(sample())["spec"]
    assert spec["scatter"]["autoscaling"] == {
        "mode": "Disabled", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepthPerReplica": 4,
        "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 300, "maxStep": 2,
        "metricsSource": {"type": "Router", "url": "", "query": ""},
    }
    # the engine's settings default to the runtime config's, in the operator: the CRD states none
    assert spec["engine"] == {}
    assert spec["paused"] is False


@pytest.mark.parametrize("spec, where", [
    ({"scatter": {"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}}, "minReplicas must not exceed"),
    ({"model": {"arch": "a", "path": "/m", "pvc": {"claimName": "w"}}}, "exactly one"),
    ({"model": {"arch": "a"}}, "exactly one"),
    ({"model": {"arch": "a", "uri": "https://example.com/m"}}, "oci://"),
    ({"cacheTier": {"replicas": 3}}, "etcd.endpoints"),
    ({"scatter": {"replicas": 9, "autoscaling": {"mode": "Operator", "maxReplicas": 4}}}, "within"),
    ({"scatter": {"autoscaling": {"metricsSource": {"type": "Prometheus"}}}}, "url is required"),
    ({"scatter": {"autoscaling": {"mode": "Sometimes"}}}, "mode"),
    ({"scatter": {"autoscaling": {"targetQueueDepthPerReplica": 0}}}, "targetQueueDepthPerReplica"),
    ({"engine": {"dtype": "float16"}}, "dtype"),
    ({"engine": {"seamWindow": -1}}, "seamWindow"),
    ({"engine": {"gpuMemoryUtilization": 0}}, "gpuMemoryUtilization"),
    ({"engine": {"gpuMemoryUtilization": 1.5}}, "gpuMemoryUtilization"),
    ({"etcd": {"endpoints": ["no-port"]}}, "endpoints"),
    ({"router": {"replicas": 0}}, "replicas"),
])
def test_invalid_samples_are_rejected(spec, where):
    with pytest.raises(crd_validation.Invalid) as exc:
        crd_validation.admit(sample(**spec))
    assert where in str(exc.value)


def test_valid_variants_are_accepted():
    for spec in (
        {"model": {"arch": "a", "uri": "oci://registry.example/m:1"}},
        {"model": {"arch": "a", "pvc": {"claimName": "w"}}},
        {"cacheTier": {"replicas": 3}, "etcd": {"endpoints": ["etcd:2379"]}},
        {"scatter": {"replicas": 0, "autoscaling": {"mode": "External"}}},
        {"scatter": {"autoscaling": {"metricsSource": {"type": "Prometheus", "url": "http://p:9090"}}}},
    ):
        crd_validation.admit(sample(**spec))
