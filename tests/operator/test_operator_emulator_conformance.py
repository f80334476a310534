"""Conformance of the strict emulator: every API-server behaviour the operator tests rely on.

Runs against the emulator by default. Against a real cluster (with the HybridCache CRD
installed): HYBRIDCACHE_CONFORMANCE_KUBECONFIG=~/.kube/config pytest this file; it uses the
namespace `hc-conformance` (created when missing).
"""

from __future__ import annotations

import json
import os
import ssl
import threading
import urllib.request
from pathlib import Path

import crd_validation
import pytest
from hybridcache.operator import kube
from k8s_emulator import standard_types
from k8s_harness import EmulatorThread, client_from, wait_for, write_kubeconfig

NS = "hc-conformance"
CM = f"/api/v1/namespaces/{NS}/configmaps"
HC = f"/apis/serving.hybridcache.io/v1alpha1/namespaces/{NS}/hybridcaches"
MERGE = "application/merge-patch+json"
REAL = os.environ.get("HYBRIDCACHE_CONFORMANCE_KUBECONFIG")


@pytest.fixture
def api(tmp_path):
    if REAL:
        client = client_from(Path(REAL))
        try:
            client.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                          "metadata": {"name": NS}})
        except kube.ApiError as exc:
            assert exc.status == 409
        yield client
        return
    with EmulatorThread(standard_types(admit_hybridcache=crd_validation.admit)) as emu:
        write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        yield client_from(tmp_path / "kubeconfig")


def configmap(name, **data):
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": {"t": name}},
            "data": data}


def hybridcache(name, **spec):
    return {"apiVersion": "serving.hybridcache.io/v1alpha1", "kind": "HybridCache",
            "metadata": {"name": name}, "spec": {"model": {"arch": "qwen3_next", "path": "/m"}, **spec}}


def cleanup(api, path):
    try:
        api.request("DELETE", path)
    except kube.ApiError as exc:
        assert exc.status == 404


def test_create_assigns_server_fields(api):
    created = api.request("POST", CM, configmap("c-create", a="1"))
    try:
        meta = created["metadata"]
        assert meta["uid"] and meta["resourceVersion"] and meta["creationTimestamp"]
        assert meta["namespace"] == NS
        with pytest.raises(kube.ApiError) as exc:
            api.request("POST", CM, configmap("c-create", a="2"))
        assert (exc.value.status, exc.value.reason) == (409, "AlreadyExists")
        assert api.request("GET", f"{CM}/c-create")["data"] == {"a": "1"}
    finally:
        cleanup(api, f"{CM}/c-create")


def test_resource_version_changes_on_every_write_and_guards_updates(api):
    first = api.request("POST", CM, configmap("c-rv", a="1"))
    try:
        second = api.request("PATCH", f"{CM}/c-rv", {"data": {"a": "2"}}, MERGE)
        assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
        stale = {**configmap("c-rv", a="3"), "metadata": {**configmap("c-rv")["metadata"],
                                                          "resourceVersion": first["metadata"]["resourceVersion"]}}
        with pytest.raises(kube.ApiError) as exc:
            api.request("PUT", f"{CM}/c-rv", stale)
        assert (exc.value.status, exc.value.reason) == (409, "Conflict")
        with pytest.raises(kube.ApiError) as exc:
            api.request("PATCH", f"{CM}/c-rv", {"metadata": {"resourceVersion": first["metadata"]["resourceVersion"]},
                                                "data": {"a": "4"}}, MERGE)
        assert exc.value.status == 409
        fresh = dict(stale, metadata={**stale["metadata"], "resourceVersion": second["metadata"]["resourceVersion"]})
        replaced = api.request("PUT", f"{CM}/c-rv", fresh)
        assert replaced["data"] == {"a": "3"} and replaced["metadata"]["uid"] == first["metadata"]["uid"]
    finally:
        cleanup(api, f"{CM}/c-rv")


def test_missing_objects_are_404(api):
    for method, body in (("GET", None), ("PATCH", {"data": {}}), ("DELETE", None)):
        with pytest.raises(kube.ApiError) as exc:
            api.request(method, f"{CM}/absent", body, MERGE)
        assert exc.value.status == 404


def test_generation_tracks_spec_only_and_status_is_a_subresource(api):
    created = api.request("POST", HC, hybridcache("h-gen"))
    try:
        assert created["metadata"]["generation"] == 1
        assert created["spec"]["router"]["replicas"] == 1, "CRD defaults are applied"
        labelled = api.request("PATCH", f"{HC}/h-gen", {"metadata": {"labels": {"x": "y"}}}, MERGE)
        assert labelled["metadata"]["generation"] == 1
        ignored = api.request("PATCH", f"{HC}/h-gen", {"status": {"observedGeneration": 7}}, MERGE)
        assert "status" not in ignored or "observedGeneration" not in ignored["status"]
        status = api.request("PATCH", f"{HC}/h-gen/status",
                             {"status": {"observedGeneration": 1}, "spec": {"paused": True}}, MERGE)
        assert status["status"]["observedGeneration"] == 1 and status["spec"]["paused"] is False
        assert status["metadata"]["generation"] == 1
        changed = api.request("PATCH", f"{HC}/h-gen", {"spec": {"router": {"replicas": 2}}}, MERGE)
        assert changed["metadata"]["generation"] == 2
        assert changed["status"]["observedGeneration"] == 1, "a spec write keeps the status"
    finally:
        cleanup(api, f"{HC}/h-gen")


def test_invalid_custom_resources_are_422(api):
    bad = hybridcache("h-bad", scatter={"autoscaling": {"minReplicas": 5, "maxReplicas": 2}})
    with pytest.raises(kube.ApiError) as exc:
        api.request("POST", HC, bad)
    assert (exc.value.status, exc.value.reason) == (422, "Invalid")


def test_scale_subresource_drives_scatter_replicas(api):
    api.request("POST", HC, hybridcache("h-scale"))
    try:
        scale = api.request("GET", f"{HC}/h-scale/scale")
        assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
        scale["spec"]["replicas"] = 3
        api.request("PUT", f"{HC}/h-scale/scale", scale)
        hc = api.request("GET", f"{HC}/h-scale")
        assert hc["spec"]["scatter"]["replicas"] == 3 and hc["metadata"]["generation"] == 2
        api.request("PATCH", f"{HC}/h-scale/status", {"status": {"scatter": {"replicas": 2, "selector": "a=b"}}},
                    MERGE)
        assert api.request("GET", f"{HC}/h-scale/scale")["status"] == {"replicas": 2, "selector": "a=b"}
    finally:
        cleanup(api, f"{HC}/h-scale")


def test_finalizers_hold_deletion(api):
    body = configmap("c-fin")
    body["metadata"]["finalizers"] = ["example.com/hold"]
    api.request("POST", CM, body)
    api.request("DELETE", f"{CM}/c-fin")
    held = api.request("GET", f"{CM}/c-fin")
    assert held["metadata"]["deletionTimestamp"]
    api.request("PATCH", f"{CM}/c-fin", {"metadata": {"finalizers": None}}, MERGE)
    wait_for(lambda: _absent(api, f"{CM}/c-fin"), what="deletion after the finalizer went")


def _absent(api, path):
    try:
        api.request("GET", path)
    except kube.ApiError as exc:
        return exc.status == 404
    return False


def test_list_filters_by_label_and_reports_a_resource_version(api):
    for name in ("c-l1", "c-l2"):
        api.request("POST", CM, configmap(name))
    try:
        listed = api.request("GET", f"{CM}?labelSelector=t%3Dc-l2")
        assert [o["metadata"]["name"] for o in listed["items"]] == ["c-l2"]
        assert listed["metadata"]["resourceVersion"]
    finally:
        for name in ("c-l1", "c-l2"):
            cleanup(api, f"{CM}/{name}")


def _ssl_context(configuration):
    if not configuration.host.startswith("https"):
        return None
    context = ssl.create_default_context(cafile=configuration.ssl_ca_cert)
    if configuration.cert_file:
        context.load_cert_chain(configuration.cert_file, configuration.key_file)
    return context


def _watch(api, query, count):
    """Collect `count` events of a watch started with `query`, in a thread (the stream is
    open-ended). Same URL, auth headers and TLS material as the client, so it runs on a real cluster."""
    _, url, headers, _, _ = api.client.param_serialize(
        "GET", f"{CM}?watch=true&{query}&timeoutSeconds=5", header_params={"Accept": "application/json"},
        auth_settings=["BearerToken"],
    )
    events = []

    def run():
        request = urllib.request.Request(url, headers=headers)
        with urllib.request.urlopen(request, timeout=10, context=_ssl_context(api.client.configuration)) as stream:
            for line in stream:
                if line.strip():
                    events.append(json.loads(line))
                if len(events) >= count:
                    return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return events, thread


def test_watch_resumes_from_a_resource_version(api):
    listed = api.request("GET", f"{CM}?labelSelector=t%3Dc-w")
    start = listed["metadata"]["resourceVersion"]
    created = api.request("POST", CM, configmap("c-w", a="1"))
    try:
        api.request("PATCH", f"{CM}/c-w", {"data": {"a": "2"}}, MERGE)
        api.request("DELETE", f"{CM}/c-w")
        events, thread = _watch(api, f"labelSelector=t%3Dc-w&resourceVersion={start}", 3)
        thread.join(10)
        assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED"]
        assert events[1]["object"]["data"] == {"a": "2"}
        mid = events[0]["object"]["metadata"]["resourceVersion"]
        assert mid == created["metadata"]["resourceVersion"]
        resumed, thread = _watch(api, f"labelSelector=t%3Dc-w&resourceVersion={mid}", 2)
        thread.join(10)
        assert [e["type"] for e in resumed] == ["MODIFIED", "DELETED"]
    finally:
        cleanup(api, f"{CM}/c-w")


def test_watch_streams_new_events_live(api):
    start = api.request("GET", f"{CM}?labelSelector=t%3Dc-live")["metadata"]["resourceVersion"]
    events, thread = _watch(api, f"labelSelector=t%3Dc-live&resourceVersion={start}", 1)
    api.request("POST", CM, configmap("c-live"))
    try:
        thread.join(10)
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "c-live")]
    finally:
        cleanup(api, f"{CM}/c-live")


@pytest.mark.skipif(bool(REAL), reason="compaction cannot be forced on a real cluster")
def test_compacted_resource_version_is_410(tmp_path):
    with EmulatorThread(standard_types()) as emu:
        write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        api = client_from(tmp_path / "kubeconfig")
        start = api.request("GET", CM)["metadata"]["resourceVersion"]
        api.request("POST", CM, configmap("c-old"))
        emu.call(emu.emulator.compact)
        events, thread = _watch(api, f"resourceVersion={start}", 1)
        thread.join(10)
        assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410


@pytest.mark.skipif(bool(REAL), reason="fault injection is an emulator feature")
def test_injected_faults_answer_once_then_serve(tmp_path):
    import kmock

    with EmulatorThread(standard_types()) as emu:
        write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        api = client_from(tmp_path / "kubeconfig")
        emu.inject(500, kmock.action.CREATE, kmock.resource("", "v1", "configmaps"))
        with pytest.raises(kube.ApiError) as exc:
            api.request("POST", CM, configmap("c-fault"))
        assert exc.value.status == 500
        assert emu.objects("/v1/configmaps") == [], "an injected failure stores nothing"
        api.request("POST", CM, configmap("c-fault"))
        assert [o["metadata"]["name"] for o in emu.objects("/v1/configmaps")] == ["c-fault"]
