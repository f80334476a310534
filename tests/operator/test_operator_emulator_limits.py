"""What the emulator does NOT do, stated as tests, so nobody reads a green run as proof of it.

Each of these is checked on a real API server by scripts/e2e-real-cluster.sh instead.
"""

from __future__ import annotations

import pytest
from hybridcache.operator import kube

NS = "default"
CM = f"/api/v1/namespaces/{NS}/configmaps"
DEPLOY = f"/apis/apps/v1/namespaces/{NS}/deployments"
HC = f"/apis/serving.hybridcache.io/v1alpha1/namespaces/{NS}/hybridcaches"


def test_no_garbage_collection_of_owned_children(client):
    owner = client.request("POST", CM, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    client.request("POST", CM, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {
        "name": "child", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
                                              "uid": owner["metadata"]["uid"]}]}})
    client.request("DELETE", f"{CM}/owner")
    assert client.request("GET", f"{CM}/child")["metadata"]["name"] == "child", "a real server deletes it"


def test_no_defaulting_of_builtin_kinds(client):
    created = client.request("POST", DEPLOY, {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "bare"},
        "spec": {"selector": {"matchLabels": {"a": "b"}},
                 "template": {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": []}}},
    })
    assert "strategy" not in created["spec"] and "replicas" not in created["spec"]


def test_no_schema_validation_of_builtin_kinds(client):
    created = client.request("POST", DEPLOY, {"apiVersion": "apps/v1", "kind": "Deployment",
                                              "metadata": {"name": "nonsense"}, "spec": {"replicas": "many"}})
    assert created["spec"]["replicas"] == "many", "a real server answers 422"


def test_no_pruning_of_unknown_fields_in_custom_resources(client):
    created = client.request("POST", HC, {
        "apiVersion": "serving.hybridcache.io/v1alpha1", "kind": "HybridCache", "metadata": {"name": "p"},
        "spec": {"model": {"arch": "a", "path": "/m"}, "unknownField": 1},
    })
    assert created["spec"]["unknownField"] == 1, "a real server prunes it"


def test_no_server_side_apply(client):
    with pytest.raises(kube.ApiError) as exc:
        client.request("PATCH", f"{CM}/x", {"metadata": {"name": "x"}}, "application/apply-patch+yaml")
    assert exc.value.status in (404, 415)


def test_no_table_output_for_printer_columns(client):
    client.request("POST", HC, {"apiVersion": "serving.hybridcache.io/v1alpha1", "kind": "HybridCache",
                                "metadata": {"name": "t"}, "spec": {"model": {"arch": "a", "path": "/m"}}})
    listed = client.request("GET", HC)
    assert listed["kind"] == "List", "a real server answers kind Table to kubectl's Accept header"


def test_no_openapi_endpoint(client):
    with pytest.raises(kube.ApiError) as exc:
        client.request("GET", "/openapi/v2")
    assert exc.value.status == 404
