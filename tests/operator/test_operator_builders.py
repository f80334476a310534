"""Each builder tested on its own; every built object passes `kubernetes-validate --strict`."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
from hybridcache.operator import builders
from hybridcache.operator.spec import HybridCacheSpec
from hybridcache.services import contract

NAME = "demo"
CPU = HybridCacheSpec.parse({
    "model": {"arch": "qwen3_5_text", "path": "/app/models/tiny"},
    "combine": {"gpusPerPod": 0}, "scatter": {"gpusPerPod": 0},
    "engine": {"dtype": "float32"},
})
GPU = HybridCacheSpec.parse({
    "model": {"arch": "qwen3_next", "pvc": {"claimName": "weights", "subPath": "qwen3-next"}},
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H200"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "router": {"replicas": 2, "resources": {"requests": {"cpu": "2", "memory": "4Gi"}}},
    "scatter": {"gpusPerPod": 1, "autoscaling": {"mode": "Operator", "maxReplicas": 8}},
    "cacheTier": {"replicas": 2, "storage": {"size": "200Gi", "storageClassName": "fast"}},
    "etcd": {"endpoints": ["etcd-0.etcd:2379", "etcd-1.etcd:2379"]},
    "observability": {"otlpEndpoint": "http://otel-collector:4317", "serviceMonitor": {"enabled": True}},
})
OCI = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "uri": "oci://registry.example/models/q:1"}})
VERSION = kubernetes_validate.latest_version()


def validate_strict(obj):
    kubernetes_validate.validate(obj, VERSION, strict=True)


def container(obj):
    return obj["spec"]["template"]["spec"]["containers"][0]


def arg(args, flag):
    return args[args.index(flag) + 1]


@pytest.mark.parametrize("spec", [CPU, GPU, OCI], ids=["cpu", "gpu", "oci"])
def test_every_built_object_validates_strictly(spec):
    objects = builders.children(spec, NAME, scatter_replicas=3)
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD kind: kubernetes-validate has no schema for it (checked below)
        validate_strict(obj)
    names = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(names) == len(set(names)), "duplicate children"


def test_strict_validation_catches_a_mistake():
    bad = copy.deepcopy(builders.router_deployment(CPU, NAME))
    container(bad)["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_strict(bad)


def test_children_cover_every_role_and_kind():
    kinds = sorted(o["kind"] for o in builders.children(GPU, NAME, 2))
    assert kinds == sorted([*["Service"] * 4, "StatefulSet", *["Deployment"] * 3,
                            *["PodDisruptionBudget"] * 4, "NetworkPolicy", "ServiceMonitor"])
    assert "ServiceMonitor" not in [o["kind"] for o in builders.children(CPU, NAME, 1)]


def test_every_pod_mounts_the_deployment_secret_and_reads_it_from_the_file():
    secret = builders.deployment_secret(NAME, "s" * 64)
    validate_strict(secret)
    assert secret["metadata"]["name"] == "demo-secret" and secret["stringData"] == {"secret": "s" * 64}
    workloads = [o for o in builders.children(GPU, NAME, 2) if o["kind"] in ("Deployment", "StatefulSet")]
    assert len(workloads) == 4
    for obj in workloads:
        c, pod = container(obj), obj["spec"]["template"]["spec"]
        path = arg(c["args"], "--secret-file")
        mount = next(m for m in c["volumeMounts"] if m["name"] == "secret")
        assert mount["readOnly"] and path == f"{mount['mountPath']}/{builders.SECRET_KEY}"
        volume = next(v for v in pod["volumes"] if v["name"] == "secret")
        assert volume["secret"] == {"secretName": "demo-secret", "defaultMode": 0o440}
        # the secret itself is in no argument and no environment variable
        assert "s" * 64 not in repr(c)


def test_api_key_comes_from_the_referenced_secret_into_the_router_only():
    keyed = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"},
                                   "auth": {"apiKeySecret": {"name": "clients", "key": "token"}}})
    env = {e["name"]: e for e in container(builders.router_deployment(keyed, NAME))["env"]}
    assert env["HYBRIDCACHE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "clients", "key": "token"}}
    assert "--api-key" not in container(builders.router_deployment(keyed, NAME))["args"]
    for obj in (builders.combine_deployment(keyed, NAME), builders.router_deployment(CPU, NAME)):
        assert "HYBRIDCACHE_API_KEY" not in {e["name"] for e in container(obj)["env"]}
    validate_strict(builders.router_deployment(keyed, NAME))
    default_key = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"},
                                         "auth": {"apiKeySecret": {"name": "clients"}}})
    assert default_key.auth.api_key_key == "apiKey"


def test_cache_budgets_go_to_the_roles_that_hold_each_cache():
    budgets = {"entryBytes": 1 << 30, "prefixBytes": 1 << 29, "hostBytes": 0, "kvBytes": 1 << 31, "tierBytes": 1 << 34}
    spec = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "cache": budgets})

    def flags(obj):
        args = container(obj)["args"]
        return {a: args[i + 1] for i, a in enumerate(args) if a.endswith("-bytes")}

    assert flags(builders.combine_deployment(spec, NAME)) == {
        "--entry-cache-bytes": str(1 << 30), "--prefix-cache-bytes": str(1 << 29), "--host-cache-bytes": "0",
        "--kv-cache-bytes": str(1 << 31)}
    assert flags(builders.scatter_deployment(spec, NAME, 1)) == {
        "--entry-cache-bytes": str(1 << 30), "--prefix-cache-bytes": str(1 << 29), "--host-cache-bytes": "0"}
    assert flags(builders.cache_tier_statefulset(spec, NAME)) == {"--cache-bytes": str(1 << 34)}
    assert flags(builders.router_deployment(spec, NAME)) == {}
    # what the builders pass, serve parses into those fields
    from hybridcache.services.cli import build_parser
    from hybridcache.services.config import config_from_args

    args = container(builders.combine_deployment(spec, NAME))["args"]
    parsed = config_from_args(build_parser().parse_args([a.replace("$(POD_IP)", "10.0.0.1") for a in args]))
    assert (parsed.entry_cache_bytes, parsed.kv_cache_bytes) == (1 << 30, 1 << 31)
    assert not flags(builders.combine_deployment(CPU, NAME))
    for bad in ({"entryBytes": 0}, {"tierBytes": "1Gi"}, {"bogus": 1}):
        with pytest.raises(Exception, match="spec.cache"):
            HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "cache": bad})


def test_router_deployment():
    obj = builders.router_deployment(GPU, NAME)
    assert obj["metadata"]["name"] == "demo-router" and obj["spec"]["replicas"] == 2
    c = container(obj)
    assert c["args"][:2] == ["serve", "router"]
    assert arg(c["args"], "--grpc-port") == "50051" and arg(c["args"], "--http-port") == "8000"
    assert arg(c["args"], "--combine") == "demo-combine:50061"
    assert arg(c["args"], "--cache-tier") == "demo-cache-tier:50081"
    assert arg(c["args"], "--scatter") == "demo-scatter:50071"
    assert arg(c["args"], "--etcd") == "etcd-0.etcd:2379"
    assert arg(c["args"], "--host") == "$(POD_IP)" and arg(c["args"], "--device") == "cpu"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in c["env"]
    assert arg(c["args"], "--otlp-endpoint") == "http://otel-collector:4317"
    assert c["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert "nodeSelector" not in obj["spec"]["template"]["spec"], "CPU role must not pin to GPU nodes"
    assert obj["spec"]["selector"]["matchLabels"] == builders.selector_labels(NAME, "router")


def test_scatter_deployment_takes_replicas_from_the_caller():
    obj = builders.scatter_deployment(GPU, NAME, replicas=5)
    assert obj["spec"]["replicas"] == 5
    c = container(obj)
    assert c["args"][:2] == ["serve", "scatter"]
    assert arg(c["args"], "--router") == "demo-router:50051"
    assert arg(c["args"], "--device") == "cuda"
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    pod = obj["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert obj["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]


def test_combine_deployment_engine_flags():
    c = container(builders.combine_deployment(GPU, NAME))
    assert c["args"][:2] == ["serve", "combine"]
    assert arg(c["args"], "--seam-window") == "8" and arg(c["args"], "--dtype") == "bfloat16"
    assert arg(c["args"], "--prefix-policy") == "exact_replay"
    assert arg(c["args"], "--cuda-graphs") == "on"
    assert arg(c["args"], "--model") == "/models/qwen3-next"
    # its peers: the scatter workers too (their Describe asked as they join, not on a request's path)
    assert arg(c["args"], "--scatter") == "demo-scatter:50071"
    assert arg(c["args"], "--router") == "demo-router:50051"
    assert arg(c["args"], "--cache-tier") == "demo-cache-tier:50081"
    eager = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "engine": {"cudaGraphs": False}})
    assert arg(container(builders.combine_deployment(eager, NAME))["args"], "--cuda-graphs") == "off"


def test_tensor_parallel_workers_hold_their_gpus_and_pass_the_size():
    """engine.tensorParallelSize N: every worker pod asks for its N GPUs and starts N ranks; the
    router keys entries by the split, so it gets the size too."""
    tp = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "engine": {"tensorParallelSize": 2},
                                "combine": {"gpusPerPod": 2}, "scatter": {"gpusPerPod": 2}})
    for build in (builders.combine_deployment, lambda s, n: builders.scatter_deployment(s, n, 1)):
        obj = build(tp, NAME)
        validate_strict(obj)
        c = container(obj)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
        assert arg(c["args"], "--tensor-parallel-size") == "2" and arg(c["args"], "--device") == "cuda"
    assert arg(container(builders.router_deployment(tp, NAME))["args"], "--tensor-parallel-size") == "2"
    assert arg(container(builders.combine_deployment(GPU, NAME))["args"], "--tensor-parallel-size") == "1"


def test_worker_pods_take_the_gpu_memory_utilization_the_router_does_not():
    spec = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"},
                                  "engine": {"gpuMemoryUtilization": 0.8}})
    for build in (builders.combine_deployment, lambda s, n: builders.scatter_deployment(s, n, 1)):
        assert arg(container(build(spec, NAME))["args"], "--gpu-memory-utilization") == "0.8"
        assert arg(container(build(GPU, NAME))["args"], "--gpu-memory-utilization") == "0.9"
    assert "--gpu-memory-utilization" not in container(builders.router_deployment(spec, NAME))["args"]
    with pytest.raises(ValueError, match="gpuMemoryUtilization"):
        HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "engine": {"gpuMemoryUtilization": 2}})
    with pytest.raises(ValueError, match="gpusPerPod must be 2"):
        HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "engine": {"tensorParallelSize": 2},
                               "combine": {"gpusPerPod": 1}, "scatter": {"gpusPerPod": 2}})


def test_cache_tier_statefulset():
    obj = builders.cache_tier_statefulset(GPU, NAME)
    assert obj["kind"] == "StatefulSet" and obj["spec"]["serviceName"] == "demo-cache-tier"
    claim = obj["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "200Gi"
    assert claim["spec"]["storageClassName"] == "fast"
    c = container(obj)
    assert "--seam-window" not in c["args"] and arg(c["args"], "--spill-dir") == builders.CACHE_DIR
    assert "limits" not in c["resources"], "the cache tier asks for no GPU"
    cpu = builders.cache_tier_statefulset(CPU, NAME)
    assert "volumeClaimTemplates" not in cpu["spec"]
    assert {"name": "cache", "emptyDir": {}} in cpu["spec"]["template"]["spec"]["volumes"]


def test_pods_run_non_root_with_a_read_only_root():
    for obj in builders.children(GPU, NAME, 1):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        sc = pod["containers"][0]["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]


def test_model_sources():
    pvc = builders.router_deployment(GPU, NAME)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pvc
    oci = builders.router_deployment(OCI, NAME)["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "image": {"reference": "registry.example/models/q:1",
                                       "pullPolicy": "IfNotPresent"}} in oci
    in_image = builders.router_deployment(CPU, NAME)
    assert all(v["name"] != "model" for v in in_image["spec"]["template"]["spec"]["volumes"])
    assert arg(container(in_image)["args"], "--model") == "/app/models/tiny"


def test_services_per_role():
    router = builders.service(GPU, NAME, "router")
    assert router["spec"]["type"] == "ClusterIP"
    assert {p["port"] for p in router["spec"]["ports"]} == {50051, 8000}
    for role in ("combine", "scatter", "cache-tier"):
        svc = builders.service(GPU, NAME, role)
        assert svc["spec"]["clusterIP"] == "None", "workers need per-pod addresses"
        assert svc["spec"]["selector"] == builders.selector_labels(NAME, role)
        assert [p["name"] for p in svc["spec"]["ports"]] == ["grpc", "http"]


def test_no_environment_variable_is_set_that_nothing_reads():
    """Every variable a pod is given is read: by the serving processes (services/), or by the
    kubelet in the pod's own arguments (`$(NAME)`)."""
    import re

    source = "\n".join(p.read_text() for p in (Path(__file__).resolve().parents[2] / "services").rglob("*.py"))
    pods = [o["spec"]["template"]["spec"] for o in builders.children(GPU, NAME, 2) if "template" in o.get("spec", {})]
    assert len(pods) == 4
    for pod in pods:
        for c in pod["containers"]:
            assert "envFrom" not in c
            args = " ".join(c["args"])
            for var in c.get("env", []):
                name = var["name"]
                assert f"$({name})" in args or re.search(rf"[\"']{name}[\"']", source), (c["name"], name)


def test_engine_defaults_come_from_the_runtime_config():
    """One default per setting: the operator's engine settings are the runtime config's defaults
    and the CRD states none of them."""
    import yaml
    from hybridcache.services.config import default_of

    bare = HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}})
    for field in ("seam_window", "prefix_policy", "cuda_graphs", "tensor_parallel_size", "gpu_memory_utilization"):
        assert getattr(bare.engine, field) == default_of(field), field
    crd = yaml.safe_load((Path(__file__).resolve().parents[2] / "manifests" / "crd" / "hybridcache.yaml").read_text())
    engine = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["engine"]
    assert not [k for k, v in engine["properties"].items() if "default" in v]
    # unset dtype: bfloat16 on GPU pods, the runtime config's on CPU ones
    gpu_args = container(builders.combine_deployment(GPU, NAME))["args"]
    cpu_args = container(builders.combine_deployment(CPU, NAME))["args"]
    assert gpu_args[gpu_args.index("--dtype") + 1] == (GPU.engine.dtype or "bfloat16")
    assert cpu_args[cpu_args.index("--dtype") + 1] == (CPU.engine.dtype or default_of("dtype"))


def test_pod_disruption_budgets():
    for role in contract.ROLES:
        pdb = builders.pod_disruption_budget(GPU, NAME, role)
        assert pdb["spec"]["maxUnavailable"] == 1
        assert pdb["spec"]["selector"]["matchLabels"] == builders.selector_labels(NAME, role)


def test_network_policy_opens_only_api_and_metrics_ports_to_outsiders():
    policy = builders.network_policy(GPU, NAME)
    same_instance, outside = policy["spec"]["ingress"]
    assert same_instance["from"][0]["podSelector"]["matchLabels"] == builders.instance_labels(NAME)
    ports = {p["port"] for p in outside["ports"]}
    assert ports == {50051} | {p.http for p in contract.ROLES.values()}


def test_service_monitor_scrapes_every_role():
    monitor = builders.service_monitor(GPU, NAME)
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == NAME


def test_builders_are_pure():
    assert builders.children(GPU, NAME, 2) == builders.children(GPU, NAME, 2)
    assert builders.scatter_selector(NAME) == (
        "app.kubernetes.io/component=scatter,app.kubernetes.io/instance=demo,app.kubernetes.io/name=hybridcache"
    )


@pytest.mark.parametrize("spec", [CPU, GPU], ids=["cpu", "gpu"])
def test_args_parse_with_the_real_serve_command(spec):
    """The flags the builders pass are the ones `hybridcache serve` (services/api/serve.py) takes."""
    import argparse

    from hybridcache.services.api.serve import add_serve_flags

    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_flags(parser)
    for role in spec.roles:
        args = [a.replace("$(POD_IP)", "10.0.0.7") for a in builders.serve_args(spec, NAME, role)]
        assert args[0] == "serve"
        parsed = parser.parse_args(args[1:])
        assert parsed.role == role.name and parsed.http_port == role.http_port
        assert parsed.host == "10.0.0.7"


NODE_LOCAL = HybridCacheSpec.parse({
    "model": {"arch": "qwen3_next", "pvc": {"claimName": "weights"}},
    "transport": {"nodeLocal": True},
})


def test_node_local_transport_pod_settings():
    combine, scatter = builders.combine_deployment(NODE_LOCAL, NAME), builders.scatter_deployment(NODE_LOCAL, NAME, 2)
    for obj in (combine, scatter):
        validate_strict(obj)
        pod = obj["spec"]["template"]["spec"]
        # one IPC namespace and /dev/shm (CUDA IPC handles, torch's reference counters, shm blocks)
        # and one PID namespace (the driver resolves the exporting process)
        assert pod["hostIPC"] is True and pod["hostPID"] is True
        # the pod's own /dev/shm would hide the host's
        assert all(m["mountPath"] != "/dev/shm" for m in container(obj)["volumeMounts"])
        assert all(v["name"] != "dshm" for v in pod["volumes"])
        # the hardening stays: no privilege, no capability
        assert container(obj)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in container(obj)["securityContext"]
    (term,) = scatter["spec"]["template"]["spec"]["affinity"]["podAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"labelSelector": {"matchLabels": builders.selector_labels(NAME, "combine")},
                                       "topologyKey": "kubernetes.io/hostname"}
    combine_labels = combine["spec"]["template"]["metadata"]["labels"]
    assert builders.selector_labels(NAME, "combine").items() <= combine_labels.items()
    assert "affinity" not in combine["spec"]["template"]["spec"]
    # the router and the cache tier stay in their own namespaces; without the setting nobody shares
    for obj in (builders.router_deployment(NODE_LOCAL, NAME), builders.cache_tier_statefulset(NODE_LOCAL, NAME),
                builders.combine_deployment(GPU, NAME), builders.scatter_deployment(GPU, NAME, 1)):
        pod = obj["spec"]["template"]["spec"]
        assert "hostIPC" not in pod and "hostPID" not in pod and "affinity" not in pod
    mounts = container(builders.scatter_deployment(GPU, NAME, 1))["volumeMounts"]
    assert any(m["mountPath"] == "/dev/shm" for m in mounts)
    with pytest.raises(ValueError, match="nodeLocal"):
        HybridCacheSpec.parse({"model": {"arch": "qwen3_next", "path": "/m"}, "transport": {"nodeLocal": "yes"}})
