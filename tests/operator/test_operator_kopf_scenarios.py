"""The operator under kopf against the strict emulator: create, per-role update, pause, scaling by
the timer, External mode, delete, restart, and injected 409/422/500 answers.

The tests play the parts the emulator does not (the Deployment controller marking pods ready,
HPA writing /scale); they never set server-managed fields themselves.
"""

from __future__ import annotations

import json

import kmock
import prometheus_client
import pytest
from hybridcache.services import contract
from k8s_harness import running_operator, wait_for
from prometheus_server import free_port

NS = "default"
HC = f"/apis/serving.hybridcache.io/v1alpha1/namespaces/{NS}/hybridcaches"
APPS = f"/apis/apps/v1/namespaces/{NS}"
MERGE = "application/merge-patch+json"
WORKLOADS = {"deployments": ["router", "combine", "scatter"], "statefulsets": ["cache-tier"]}
CHILD_RESOURCES = ["/v1/configmaps", "/v1/services", "apps/v1/deployments", "apps/v1/statefulsets",
                   "policy/v1/poddisruptionbudgets", "networking.k8s.io/v1/networkpolicies"]
DEPLOYMENTS = kmock.resource("apps", "v1", "deployments")
SECRETS = kmock.resource("", "v1", "secrets")


def create(client, name="demo", **spec):
    body = {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.KIND,
            "metadata": {"name": name},
            "spec": {"model": {"arch": "qwen3_5_text", "path": "/app/models/tiny"}, **spec}}
    return client.request("POST", HC, body)


def hc(client, name="demo"):
    return client.request("GET", f"{HC}/{name}")


def children(emulator):
    return {(o["kind"], o["metadata"]["name"]): o for r in CHILD_RESOURCES for o in emulator.objects(r)}


def condition(obj, type_):
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), {})


def deployment(client, role, name="demo"):
    return client.request("GET", f"{APPS}/deployments/{name}-{role}")


def settled(client, name="demo", generation=1):
    return wait_for(lambda: hc(client, name).get("status", {}).get("observedGeneration") == generation,
                    what=f"observedGeneration {generation}")


def play_workload_controller(client, name="demo"):
    """What the Deployment/StatefulSet controllers would report once pods are ready."""
    for plural, roles in WORKLOADS.items():
        for role in roles:
            live = client.request("GET", f"{APPS}/{plural}/{name}-{role}")
            n = live["spec"]["replicas"]
            client.request("PATCH", f"{APPS}/{plural}/{name}-{role}/status", {"status": {
                "replicas": n, "readyReplicas": n, "updatedReplicas": n, "availableReplicas": n}}, MERGE)


def test_create_builds_every_child_owned_and_reports_ready(emulator, client, operator):
    owner = create(client)
    objs = wait_for(lambda: len(children(emulator)) == 13 and children(emulator), what="13 children")
    for obj in objs.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["uid"], ref["controller"]) == (contract.KIND, owner["metadata"]["uid"], True)
    settled(client)
    wait_for(lambda: condition(hc(client), "Ready").get("status") == "False", what="Ready=False before pods")
    play_workload_controller(client)
    ready = wait_for(lambda: condition(hc(client), "Ready").get("status") == "True" and hc(client),
                     what="Ready=True")
    assert condition(ready, "Progressing")["status"] == "False"
    assert ready["status"]["roles"]["cacheTier"] == {"replicas": 1, "readyReplicas": 1}
    assert ready["status"]["scatter"]["selector"].startswith("app.kubernetes.io/component=scatter")
    (secret,) = emulator.objects("/v1/secrets")
    assert secret["metadata"]["name"] == "demo-secret" and len(secret["stringData"]["secret"]) == 64
    assert secret["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]


def test_per_role_update_changes_only_that_role(emulator, client, operator):
    create(client)
    wait_for(lambda: len(children(emulator)) == 13, what="children")
    settled(client)
    before = {k: o["metadata"]["resourceVersion"] for k, o in children(emulator).items()}
    (secret,) = emulator.objects("/v1/secrets")
    client.request("PATCH", f"{HC}/demo", {"spec": {"router": {"replicas": 3}}}, MERGE)
    wait_for(lambda: deployment(client, "router")["spec"]["replicas"] == 3, what="router scaled")
    settled(client, generation=2)
    after = {k: o["metadata"]["resourceVersion"] for k, o in children(emulator).items()}
    changed = {k for k in before if before[k] != after[k]}
    assert changed == {("Deployment", "demo-router")}
    # a reconcile never rotates the deployment secret (pods would stop trusting each other)
    assert emulator.objects("/v1/secrets") == [secret]


def test_node_local_transport_reaches_the_worker_pods_and_back(emulator, client, operator):
    """spec.transport.nodeLocal through the CRD's admission and the operator into the pods that
    move entries (scatter, combine), and out of them again when turned off."""
    create(client, transport={"nodeLocal": True})
    wait_for(lambda: len(children(emulator)) == 13, what="children")
    settled(client)
    for role in ("combine", "scatter"):
        pod = deployment(client, role)["spec"]["template"]["spec"]
        assert pod["hostIPC"] is True and pod["hostPID"] is True, role
    assert deployment(client, "scatter")["spec"]["template"]["spec"]["affinity"]["podAffinity"]
    assert "hostIPC" not in deployment(client, "router")["spec"]["template"]["spec"]
    with pytest.raises(Exception, match="422|nodeLocal"):
        client.request("PATCH", f"{HC}/demo", {"spec": {"transport": {"nodeLocal": "yes"}}}, MERGE)
    client.request("PATCH", f"{HC}/demo", {"spec": {"transport": {"nodeLocal": False}}}, MERGE)
    wait_for(lambda: "hostIPC" not in deployment(client, "scatter")["spec"]["template"]["spec"],
             what="scatter pods back in their own namespaces")
    assert "hostPID" not in deployment(client, "combine")["spec"]["template"]["spec"]


def test_pause_leaves_children_alone_until_resumed(emulator, client, operator):
    create(client)
    settled(client)
    client.request("PATCH", f"{HC}/demo", {"spec": {"paused": True, "router": {"replicas": 4}}}, MERGE)
    wait_for(lambda: condition(hc(client), "Progressing").get("reason") == "Paused", what="Paused")
    handled = wait_for(lambda: json.loads(hc(client)["metadata"]["annotations"][
        f"{contract.API_GROUP}/last-handled-configuration"])["spec"]["paused"], what="pause handled")
    assert handled
    assert deployment(client, "router")["spec"]["replicas"] == 1
    client.request("PATCH", f"{HC}/demo", {"spec": {"paused": False}}, MERGE)
    wait_for(lambda: deployment(client, "router")["spec"]["replicas"] == 4, what="resumed")


@pytest.fixture
def queue_depth():
    """A router-like /metrics endpoint whose cold-segment queue depth the test sets."""
    registry = prometheus_client.CollectorRegistry()
    gauge = prometheus_client.Gauge(contract.METRIC_COLD_QUEUE_DEPTH, "queued", registry=registry)
    port = free_port()
    server, thread = prometheus_client.start_http_server(port, addr="127.0.0.1", registry=registry)
    gauge.url = f"http://127.0.0.1:{port}/metrics"
    yield gauge
    server.shutdown()
    thread.join(5)


def test_timer_scales_scatter_by_queue_depth(emulator, client, operator, queue_depth):
    queue_depth.set(20)
    create(client, scatter={"replicas": 1, "autoscaling": {
        "mode": "Operator", "minReplicas": 1, "maxReplicas": 4, "targetQueueDepthPerReplica": 4,
        "maxStep": 2, "scaleUpStabilizationSeconds": 0, "scaleDownStabilizationSeconds": 0,
        "metricsSource": {"type": "Router", "url": queue_depth.url}}})
    wait_for(lambda: deployment(client, "scatter")["spec"]["replicas"] == 4, what="scale up to max")
    status = wait_for(lambda: hc(client)["status"].get("scatter", {}).get("desiredReplicas") == 4
                      and hc(client)["status"], what="status")
    assert status["coldQueueDepth"] == 20
    assert status["autoscaling"]["lastDecision"]["toReplicas"] == 4
    steps = [r.data["spec"]["replicas"] for r in emulator.requests(kmock.method.PUT, DEPLOYMENTS)
             if r.data["metadata"]["name"] == "demo-scatter"]
    assert steps == [3, 4], "max step 2 from 1, then the bound"
    queue_depth.set(0)
    wait_for(lambda: deployment(client, "scatter")["spec"]["replicas"] == 1, what="scale down to min")


def scale_to(client, replicas):
    """What HPA/KEDA do: read /scale, write it back; a 409 (the operator wrote status in between)
    means read again."""

    def attempt():
        scale = client.request("GET", f"{HC}/demo/scale")
        scale["spec"]["replicas"] = replicas
        return client.request("PUT", f"{HC}/demo/scale", scale)

    wait_for(attempt, what="a /scale write without conflict")


def test_external_mode_leaves_replicas_to_scale_subresource(emulator, client, operator, queue_depth):
    queue_depth.set(100)
    create(client, scatter={"replicas": 1, "autoscaling": {
        "mode": "External", "minReplicas": 1, "maxReplicas": 8,
        "metricsSource": {"type": "Router", "url": queue_depth.url}}})
    settled(client)
    scale_to(client, 3)
    wait_for(lambda: deployment(client, "scatter")["spec"]["replicas"] == 3, what="follows /scale")
    wait_for(lambda: hc(client)["status"]["scatter"]["desiredReplicas"] == 3, what="status follows")
    assert "autoscaling" not in hc(client)["status"], "the operator's scaler stays off"
    assert deployment(client, "scatter")["spec"]["replicas"] == 3


def test_delete_is_not_blocked(emulator, client, operator):
    owner = create(client)
    wait_for(lambda: len(children(emulator)) == 13, what="children")
    settled(client)
    client.request("DELETE", f"{HC}/demo")
    wait_for(lambda: not emulator.objects("serving.hybridcache.io/v1alpha1/hybridcaches"), what="CR gone")
    # Children go by garbage collection on a real server (not emulated); they point at the owner.
    refs = {o["metadata"]["ownerReferences"][0]["uid"] for o in children(emulator).values()}
    assert refs == {owner["metadata"]["uid"]}


def test_restart_adopts_existing_children_without_duplicates(emulator, client):
    with running_operator():
        create(client)
        wait_for(lambda: len(children(emulator)) == 13, what="children")
        settled(client)
    # the deployment secret is created blind every reconcile (the operator may not read secrets):
    # an existing one answers 409 and stays as it is
    def creates():
        return len(emulator.requests(kmock.action.CREATE)) - len(emulator.requests(kmock.action.CREATE, SECRETS))

    creates_before = creates()
    (secret,) = emulator.objects("/v1/secrets")
    before = {k: o["metadata"]["resourceVersion"] for k, o in children(emulator).items()}
    with running_operator():
        # The resume handler and a timer tick have both run once the status is re-observed.
        marker = hc(client)["metadata"]["resourceVersion"]
        wait_for(lambda: hc(client)["metadata"]["resourceVersion"] != marker, what="operator active again")
        wait_for(lambda: len(emulator.requests(kmock.method.GET, DEPLOYMENTS)) > 0, what="resume ran")
    assert creates() == creates_before, "no child created twice"
    assert emulator.objects("/v1/secrets") == [secret]
    after = {k: o["metadata"]["resourceVersion"] for k, o in children(emulator).items()}
    assert after == before, "resume rewrote nothing"


def test_injected_500_on_create_is_retried(emulator, client, operator):
    emulator.inject(500, kmock.action.CREATE, DEPLOYMENTS)
    create(client)
    wait_for(lambda: len(emulator.objects("apps/v1/deployments")) == 3, what="deployments after retry")
    settled(client)
    failed = [r for r in emulator.requests(kmock.action.CREATE, DEPLOYMENTS)]
    assert len(failed) == 4, "one injected 500, then three creates"


def test_injected_409_on_update_is_retried(emulator, client, operator):
    create(client)
    settled(client)
    emulator.inject(409, kmock.method.PUT, DEPLOYMENTS, reason="Conflict")
    client.request("PATCH", f"{HC}/demo", {"spec": {"combine": {"replicas": 2}}}, MERGE)
    wait_for(lambda: deployment(client, "combine")["spec"]["replicas"] == 2, what="update after conflict")
    settled(client, generation=2)
    assert len(emulator.requests(kmock.method.PUT, DEPLOYMENTS)) == 2


def test_injected_422_marks_degraded(emulator, client, operator):
    emulator.inject(422, kmock.action.CREATE, kmock.resource("networking.k8s.io", "v1", "networkpolicies"),
                    times=100, reason="Invalid")
    create(client)
    degraded = wait_for(lambda: condition(hc(client), "Degraded").get("status") == "True"
                        and condition(hc(client), "Degraded"), what="Degraded=True")
    assert "NetworkPolicy demo" in degraded["message"] and degraded["reason"] == "ReconcileFailed"
    assert "observedGeneration" not in hc(client)["status"], "a failed reconcile is not observed"
    kinds = {k[0] for k in children(emulator)}
    assert "NetworkPolicy" not in kinds and "Deployment" in kinds
