"""Pure builders: one function per child object of a HybridCache, `(spec, name, ...) -> dict`.

No I/O and no clock here. The handlers adopt what these return (owner reference, namespace) and
apply it. Every role runs the same image; the role is the first argument of `hybridcache serve`.
"""

from __future__ import annotations

from typing import Any

from hybridcache.operator.spec import HybridCacheSpec, RoleSpec
from hybridcache.services.config import config_fields, default_of, flag_name

MANAGER = "hybridcache-operator"
UID = 10001
CACHE_DIR = "/var/cache/hybridcache"
# The deployment secret (services/security.py): one Secret per HybridCache, mounted into every pod.
SECRET_DIR = "/var/run/hybridcache/secret"
SECRET_KEY = "secret"

Manifest = dict[str, Any]


def child_name(name: str, role: str) -> str:
    return f"{name}-{role}"


def instance_labels(name: str) -> dict[str, str]:
    """Selects every pod of one HybridCache."""
    return {"app.kubernetes.io/name": "hybridcache", "app.kubernetes.io/instance": name}


def selector_labels(name: str, role: str) -> dict[str, str]:
    return {**instance_labels(name), "app.kubernetes.io/component": role}


def labels(name: str, role: str | None = None) -> dict[str, str]:
    common = {
        "app.kubernetes.io/name": "hybridcache",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/part-of": "hybridcache",
        "app.kubernetes.io/managed-by": MANAGER,
    }
    if role is not None:
        common["app.kubernetes.io/component"] = role
    return common


def scatter_selector(name: str) -> str:
    """The label selector string the /scale subresource reports for HPA."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name, "scatter").items()))


def _address(spec: HybridCacheSpec, name: str, role: str) -> str:
    return f"{child_name(name, role)}:{spec.role(role).grpc_port}"


def serve_args(spec: HybridCacheSpec, name: str, role: RoleSpec) -> list[str]:
    """Arguments of `hybridcache serve ROLE ...` (services/api/serve.py) for one role.

    Peers are addressed by their Service names; the worker Services are headless, so each name
    resolves to every ready pod of that role. `--host` is the pod IP (listen and register)."""
    args = [
        "serve", role.name,
        "--model", spec.model.directory,
        "--host", "$(POD_IP)",
        "--grpc-port", str(role.grpc_port),
        "--http-port", str(role.http_port),
        "--secret-file", f"{SECRET_DIR}/{SECRET_KEY}",
    ]
    if spec.etcd_endpoints:
        # serve takes one endpoint; the etcd client finds the rest of the cluster from it.
        args += ["--etcd", spec.etcd_endpoints[0]]
    peers = {
        "router": ("scatter", "combine", "cache-tier"),
        # the combine worker asks each scatter worker's Describe as it joins (whether it shares
        # the combine worker's GPU, the transport between them), not on a request's path
        "combine": ("router", "scatter", "cache-tier"),
        "scatter": ("router", "combine", "cache-tier"),
        "cache-tier": (),
    }[role.name]
    for peer in peers:
        args += [f"--{peer}", _address(spec, name, peer)]
    if role.name == "cache-tier":
        args += ["--spill-dir", CACHE_DIR]
    else:
        args += [
            "--seam-window", str(spec.engine.seam_window),
            "--dtype", spec.engine.dtype or ("bfloat16" if role.gpus_per_pod else default_of("dtype")),
            "--prefix-policy", spec.engine.prefix_policy,
            "--cuda-graphs", "on" if spec.engine.cuda_graphs else "off",
            "--device", "cuda" if role.gpus_per_pod else "cpu",
            # the workers start their other ranks themselves; the router keys entries by the split
            "--tensor-parallel-size", str(spec.engine.tensor_parallel_size),
        ]
        if role.name in ("combine", "scatter"):
            # a pod owns its GPUs: the whole share is its own (`up` splits it between co-located workers)
            args += ["--gpu-memory-utilization", f"{spec.engine.gpu_memory_utilization:g}"]
    if spec.observability.otlp_endpoint:
        args += ["--otlp-endpoint", spec.observability.otlp_endpoint]
    # each cache budget to the roles whose processes hold that cache (the config field's roles)
    budget_fields = {f.name: f for f in config_fields()}
    for name, value in sorted(spec.cache.budgets.items()):
        f = budget_fields[name]
        if role.name in f.metadata["roles"]:
            args += [flag_name(f), str(value)]
    return args


def deployment_secret(name: str, secret: str) -> Manifest:
    """The Secret holding the deployment secret. `secret` is made by the handler when the Secret is
    first created and never replaced afterwards (kube.Kube.create_if_absent): rotating it would
    split running pods into two deployments that refuse each other's calls and entries."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": child_name(name, "secret"), "labels": labels(name)},
        "type": "Opaque",
        "stringData": {SECRET_KEY: secret},
    }


def _resources(spec: HybridCacheSpec, role: RoleSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if role.resources.requests:
        resources["requests"] = dict(role.resources.requests)
    limits = dict(role.resources.limits)
    if role.gpus_per_pod:
        limits[spec.gpu_resource_name] = str(role.gpus_per_pod)
    if limits:
        resources["limits"] = limits
    return resources


def _container(spec: HybridCacheSpec, name: str, role: RoleSpec) -> Manifest:
    health = {"httpGet": {"path": "/health", "port": "http"}}
    mounts = [{"name": "tmp", "mountPath": "/tmp"}, {"name": "secret", "mountPath": SECRET_DIR, "readOnly": True}]
    if spec.model.path is None:
        mounts.append({"name": "model", "mountPath": spec.model.MOUNT, "readOnly": True})
    if role.gpus_per_pod and not node_local(spec, role):
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if role.name == "cache-tier":
        mounts.append({"name": "cache", "mountPath": CACHE_DIR})
    env = [
        # the address the pod listens on and registers (`--host $(POD_IP)`)
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]
    if role.name == "router" and spec.auth.api_key_secret:
        # the router's --api-key, from the user's Secret straight into its environment
        env.append({"name": "HYBRIDCACHE_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": spec.auth.api_key_secret, "key": spec.auth.api_key_key}}})
    return {
        "name": role.name,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": serve_args(spec, name, role),
        "ports": [
            {"name": "grpc", "containerPort": role.grpc_port, "protocol": "TCP"},
            {"name": "http", "containerPort": role.http_port, "protocol": "TCP"},
        ],
        "env": env,
        "resources": _resources(spec, role),
        "startupProbe": {**health, "periodSeconds": 10, "failureThreshold": 60},
        "readinessProbe": {**health, "periodSeconds": 5, "failureThreshold": 3},
        # liveness asks only whether the process answers: /health is 503 while a worker warms up
        # its kernels or while the router waits for a combine worker, which must not restart them
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }


def _volumes(spec: HybridCacheSpec, name: str, role: RoleSpec) -> list[Manifest]:
    volumes: list[Manifest] = [
        {"name": "tmp", "emptyDir": {}},
        # readable by the pod's group (fsGroup) only
        {"name": "secret", "secret": {"secretName": child_name(name, "secret"), "defaultMode": 0o440}},
    ]
    if spec.model.pvc_claim is not None:
        volumes.append({
            "name": "model",
            "persistentVolumeClaim": {"claimName": spec.model.pvc_claim, "readOnly": True},
        })
    elif spec.model.uri is not None:
        reference = spec.model.uri.removeprefix("oci://")
        volumes.append({"name": "model", "image": {"reference": reference, "pullPolicy": "IfNotPresent"}})
    if role.gpus_per_pod and not node_local(spec, role):
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if role.name == "cache-tier" and not role.storage_size:
        volumes.append({"name": "cache", "emptyDir": {}})
    return volumes


def node_local(spec: HybridCacheSpec, role: RoleSpec) -> bool:
    """Whether the role's pods take part in the node-local entry path (spec.transport.nodeLocal):
    scatter and combine pods, which move entries between them."""
    return spec.transport.node_local and role.name in ("combine", "scatter")


def _node_local_settings(spec: HybridCacheSpec, name: str, role: RoleSpec) -> Manifest:
    """The pod settings the node-local entry path needs (services/transport/__init__.py picks the
    path from what each end can see):
    - hostIPC: one IPC namespace and the host's /dev/shm on both ends. CUDA IPC handles open only
      there, torch's CUDA IPC reference counters are files in /dev/shm, and the shm transport
      writes its blocks there (a pod's own /dev/shm emptyDir would hide it, so none is mounted);
    - hostPID: one PID namespace, through which the driver resolves the process that exported a
      CUDA allocation;
    - scatter pods prefer the nodes of this instance's combine pods (same kubernetes.io/hostname),
      so that there is a node-local pair to use it."""
    out: Manifest = {"hostIPC": True, "hostPID": True}
    if role.name == "scatter":
        out["affinity"] = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"labelSelector": {"matchLabels": selector_labels(name, "combine")},
                                "topologyKey": "kubernetes.io/hostname"},
        }]}}
    return out


def pod_template(spec: HybridCacheSpec, name: str, role: RoleSpec) -> Manifest:
    pod_spec: Manifest = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": UID,
            "runAsGroup": UID,
            "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [_container(spec, name, role)],
        "volumes": _volumes(spec, name, role),
    }
    if node_local(spec, role):
        pod_spec.update(_node_local_settings(spec, name, role))
    if role.gpus_per_pod:
        if spec.node_selector:
            pod_spec["nodeSelector"] = dict(spec.node_selector)
        if spec.tolerations:
            pod_spec["tolerations"] = [t.to_manifest() for t in spec.tolerations]
    return {
        "metadata": {"labels": labels(name, role.name)},
        "spec": pod_spec,
    }


def _deployment(spec: HybridCacheSpec, name: str, role: RoleSpec, replicas: int) -> Manifest:
    body: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": child_name(name, role.name), "labels": labels(name, role.name)},
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name, role.name)},
            "template": pod_template(spec, name, role),
        },
    }
    if role.gpus_per_pod:
        # A surge pod would wait for a free GPU; replace in place instead.
        body["spec"]["strategy"] = {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1},
        }
    return body


def router_deployment(spec: HybridCacheSpec, name: str) -> Manifest:
    return _deployment(spec, name, spec.router, spec.router.replicas)


def combine_deployment(spec: HybridCacheSpec, name: str) -> Manifest:
    return _deployment(spec, name, spec.combine, spec.combine.replicas)


def scatter_deployment(spec: HybridCacheSpec, name: str, replicas: int) -> Manifest:
    """`replicas` comes from the autoscaler in Operator mode, from spec (or /scale) otherwise."""
    return _deployment(spec, name, spec.scatter, replicas)


def cache_tier_statefulset(spec: HybridCacheSpec, name: str) -> Manifest:
    role = spec.cache_tier
    body: Manifest = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": child_name(name, role.name), "labels": labels(name, role.name)},
        "spec": {
            "replicas": role.replicas,
            "serviceName": child_name(name, role.name),
            "podManagementPolicy": "Parallel",
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name, role.name)},
            "template": pod_template(spec, name, role),
        },
    }
    if role.storage_size:
        claim: Manifest = {
            "metadata": {"name": "cache"},
            "spec": {
                "accessModes": ["ReadWriteOnce"],
                "resources": {"requests": {"storage": role.storage_size}},
            },
        }
        if role.storage_class:
            claim["spec"]["storageClassName"] = role.storage_class
        body["spec"]["volumeClaimTemplates"] = [claim]
    return body


def service(spec: HybridCacheSpec, name: str, role_name: str) -> Manifest:
    """The router gets a ClusterIP Service; workers and the cache tier get headless ones, so the
    router sees every pod (it balances cold segments over each scatter worker's queue)."""
    role = spec.role(role_name)
    body: Manifest = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": child_name(name, role.name), "labels": labels(name, role.name)},
        "spec": {
            "selector": selector_labels(name, role.name),
            "ports": [
                {"name": "grpc", "port": role.grpc_port, "targetPort": "grpc", "protocol": "TCP"},
                {"name": "http", "port": role.http_port, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }
    if role.name == "router":
        body["spec"]["type"] = "ClusterIP"
    else:
        body["spec"]["clusterIP"] = "None"
        body["spec"]["publishNotReadyAddresses"] = role.name == "cache-tier"
    return body


def pod_disruption_budget(spec: HybridCacheSpec, name: str, role_name: str) -> Manifest:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {"name": child_name(name, role_name), "labels": labels(name, role_name)},
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(name, role_name)},
        },
    }


def network_policy(spec: HybridCacheSpec, name: str) -> Manifest:
    """Pods of one HybridCache talk freely to each other; from elsewhere only the router's API
    ports and every role's HTTP port (/metrics, /health) are reachable."""
    http_ports = [{"protocol": "TCP", "port": role.http_port} for role in spec.roles]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "podSelector": {"matchLabels": instance_labels(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": instance_labels(name)}}]},
                {"ports": [{"protocol": "TCP", "port": spec.router.grpc_port}, *http_ports]},
            ],
        },
    }


def service_monitor(spec: HybridCacheSpec, name: str) -> Manifest:
    """A prometheus-operator ServiceMonitor scraping every role's /metrics."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": name, "labels": labels(name)},
        "spec": {
            "selector": {"matchLabels": instance_labels(name)},
            "endpoints": [{
                "port": "http",
                "path": "/metrics",
                "interval": spec.observability.scrape_interval,
            }],
        },
    }


def children(spec: HybridCacheSpec, name: str, scatter_replicas: int) -> list[Manifest]:
    """Every child object of one HybridCache, in the order they are applied."""
    objects = [
        *(service(spec, name, role.name) for role in spec.roles),
        cache_tier_statefulset(spec, name),
        router_deployment(spec, name),
        combine_deployment(spec, name),
        scatter_deployment(spec, name, scatter_replicas),
        *(pod_disruption_budget(spec, name, role.name) for role in spec.roles),
        network_policy(spec, name),
    ]
    if spec.observability.service_monitor:
        objects.append(service_monitor(spec, name))
    return objects
