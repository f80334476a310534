"""The HybridCache custom resource's spec, parsed once at the boundary into frozen dataclasses.

The CRD (manifests/crd/hybridcache.yaml) is the source of the schema and its defaults. The same
defaults are repeated here because a spec may reach the operator without server-side defaulting
(an older CRD, tests against the emulator); tests/operator/test_operator_spec.py checks that
parsing a bare spec gives the same result as parsing it after applying the CRD's defaults. The
engine's settings are the exception: they default to the runtime config's own defaults
(services/config.py, the one source the `hybridcache` commands take theirs from), and the CRD
declares none for them.
Builders and the autoscaler take these objects, never the raw dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridcache.services import contract
from hybridcache.services.config import default_of

DEFAULT_IMAGE = "hybridcache/hybridcache-serve:0.1.0"
AUTOSCALING_MODES = ("Operator", "External", "Disabled")
METRICS_SOURCES = ("Router", "Prometheus")
DTYPES = ("bfloat16", "float32")  # what `hybridcache serve --dtype` accepts
PREFIX_POLICIES = ("checkpoint", "suffix_replay", "exact_replay")


class SpecError(ValueError):
    """The spec is inconsistent in a way the CRD's schema could not catch (an old CRD)."""


@dataclass(frozen=True)
class Resources:
    requests: Mapping[str, str] = field(default_factory=dict)
    limits: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> Resources:
        raw = raw or {}
        return cls(
            requests={k: str(v) for k, v in (raw.get("requests") or {}).items()},
            limits={k: str(v) for k, v in (raw.get("limits") or {}).items()},
        )


@dataclass(frozen=True)
class ModelSpec:
    """Where the weights are: a directory in the image, a PVC, or an OCI image volume."""

    arch: str
    path: str | None = None
    pvc_claim: str | None = None
    pvc_sub_path: str = ""
    uri: str | None = None

    # Mount point of a PVC or OCI model volume inside every pod.
    MOUNT = "/models"

    @property
    def directory(self) -> str:
        """The --model DIR every role is started with."""
        if self.path is not None:
            return self.path
        if self.pvc_claim is not None:
            return f"{self.MOUNT}/{self.pvc_sub_path}".rstrip("/")
        return self.MOUNT

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> ModelSpec:
        pvc = raw.get("pvc") or None
        model = cls(
            arch=str(raw.get("arch", "")),
            path=raw.get("path"),
            pvc_claim=pvc["claimName"] if pvc else None,
            pvc_sub_path=(pvc or {}).get("subPath", ""),
            uri=raw.get("uri"),
        )
        sources = [s for s in (model.path, model.pvc_claim, model.uri) if s is not None]
        if len(sources) != 1:
            raise SpecError("spec.model needs exactly one of path, pvc, uri")
        if model.uri is not None and not model.uri.startswith("oci://"):
            raise SpecError("spec.model.uri must be an oci:// image reference")
        return model


@dataclass(frozen=True)
class RoleSpec:
    name: str  # one of contract.ROLES
    replicas: int
    grpc_port: int
    http_port: int
    gpus_per_pod: int = 0
    resources: Resources = field(default_factory=Resources)
    # Disk-tier volume size per pod (cache tier only); empty means an emptyDir.
    storage_size: str = ""
    storage_class: str = ""

    @classmethod
    def parse(cls, role: str, raw: Mapping[str, Any] | None, *, replicas: int, gpus: int) -> RoleSpec:
        raw = raw or {}
        ports = contract.ROLES[role]
        storage = raw.get("storage") or {}
        return cls(
            name=role,
            replicas=int(raw.get("replicas", replicas)),
            grpc_port=int(raw.get("grpcPort", ports.grpc)),
            http_port=int(raw.get("httpPort", ports.http)),
            gpus_per_pod=int(raw.get("gpusPerPod", gpus)),
            resources=Resources.parse(raw.get("resources")),
            storage_size=str(storage.get("size", "")),
            storage_class=storage.get("storageClassName", ""),
        )


@dataclass(frozen=True)
class EngineSpec:
    # the pods' dtype; unset: bfloat16 on GPU pods, the runtime config's default (float32) on CPU ones
    dtype: str | None = None
    seam_window: int = default_of("seam_window")
    prefix_policy: str = default_of("prefix_policy")
    cuda_graphs: bool = default_of("cuda_graphs")
    # ranks each worker splits its model over (one GPU each): a worker pod holds that many GPUs
    tensor_parallel_size: int = default_of("tensor_parallel_size")
    # share of each GPU's memory a worker pod may use (vLLM's --gpu-memory-utilization)
    gpu_memory_utilization: float = default_of("gpu_memory_utilization")

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> EngineSpec:
        raw = raw or {}
        engine = cls(
            dtype=raw.get("dtype", cls.dtype),
            seam_window=int(raw.get("seamWindow", cls.seam_window)),
            prefix_policy=raw.get("prefixPolicy", cls.prefix_policy),
            cuda_graphs=raw.get("cudaGraphs", cls.cuda_graphs),
            tensor_parallel_size=int(raw.get("tensorParallelSize", cls.tensor_parallel_size)),
            gpu_memory_utilization=float(raw.get("gpuMemoryUtilization", cls.gpu_memory_utilization)),
        )
        if engine.tensor_parallel_size < 1:
            raise SpecError(f"engine.tensorParallelSize must be >= 1, got {engine.tensor_parallel_size}")
        if not 0 < engine.gpu_memory_utilization <= 1:
            raise SpecError(f"engine.gpuMemoryUtilization must be in (0, 1], got {engine.gpu_memory_utilization}")
        if engine.dtype not in (None, *DTYPES) or engine.prefix_policy not in PREFIX_POLICIES:
            raise SpecError(f"unknown engine.dtype or engine.prefixPolicy: {engine}")
        if not isinstance(engine.cuda_graphs, bool):
            raise SpecError(f"engine.cudaGraphs must be true or false, got {engine.cuda_graphs!r}")
        return engine


@dataclass(frozen=True)
class MetricsSource:
    """Where the autoscaler reads the cold-segment queue depth."""

    type: str = "Router"
    url: str = ""  # Prometheus base URL (type Prometheus)
    query: str = ""  # PromQL override; empty means the default query for this HybridCache


@dataclass(frozen=True)
class AutoscalingSpec:
    mode: str = "Disabled"
    min_replicas: int = 1
    max_replicas: int = 4
    target_queue_depth: float = 4.0  # cold segments queued per scatter worker
    scale_up_window_s: int = 0
    scale_down_window_s: int = 300
    max_step: int = 2
    metrics_source: MetricsSource = field(default_factory=MetricsSource)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> AutoscalingSpec:
        raw = raw or {}
        source = raw.get("metricsSource") or {}
        spec = cls(
            mode=raw.get("mode", cls.mode),
            min_replicas=int(raw.get("minReplicas", cls.min_replicas)),
            max_replicas=int(raw.get("maxReplicas", cls.max_replicas)),
            target_queue_depth=float(raw.get("targetQueueDepthPerReplica", cls.target_queue_depth)),
            scale_up_window_s=int(raw.get("scaleUpStabilizationSeconds", cls.scale_up_window_s)),
            scale_down_window_s=int(raw.get("scaleDownStabilizationSeconds", cls.scale_down_window_s)),
            max_step=int(raw.get("maxStep", cls.max_step)),
            metrics_source=MetricsSource(
                type=source.get("type", "Router"),
                url=source.get("url", ""),
                query=source.get("query", ""),
            ),
        )
        if spec.mode not in AUTOSCALING_MODES or spec.metrics_source.type not in METRICS_SOURCES:
            raise SpecError(f"unknown autoscaling mode or metrics source: {spec}")
        if not 1 <= spec.min_replicas <= spec.max_replicas:
            raise SpecError("scatter.autoscaling needs 1 <= minReplicas <= maxReplicas")
        if spec.metrics_source.type == "Prometheus" and not spec.metrics_source.url:
            raise SpecError("scatter.autoscaling.metricsSource.url is required for Prometheus")
        return spec

    @property
    def operator_driven(self) -> bool:
        return self.mode == "Operator"


@dataclass(frozen=True)
class ObservabilitySpec:
    otlp_endpoint: str = ""
    service_monitor: bool = False
    scrape_interval: str = "15s"

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> ObservabilitySpec:
        raw = raw or {}
        monitor = raw.get("serviceMonitor") or {}
        return cls(
            otlp_endpoint=raw.get("otlpEndpoint", ""),
            service_monitor=bool(monitor.get("enabled", False)),
            scrape_interval=monitor.get("interval", cls.scrape_interval),
        )


# spec.cache fields -> the RuntimeConfig fields (services/config.py) they set
CACHE_BUDGETS = {"entryBytes": "entry_cache_bytes", "prefixBytes": "prefix_cache_bytes",
                 "hostBytes": "host_cache_bytes", "kvBytes": "kv_cache_bytes", "tierBytes": "tier_cache_bytes"}


@dataclass(frozen=True)
class CacheSpec:
    """Cache budgets in bytes, by RuntimeConfig field name; absent ones are left to each process."""

    budgets: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> CacheSpec:
        raw = raw or {}
        unknown = sorted(set(raw) - set(CACHE_BUDGETS))
        if unknown:
            raise SpecError(f"unknown spec.cache field(s): {', '.join(unknown)}")
        budgets = {}
        for name, value in raw.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "hostBytes" else 1):
                raise SpecError(f"spec.cache.{name} must be a positive number of bytes, got {value!r}")
            budgets[CACHE_BUDGETS[name]] = value
        return cls(budgets)


@dataclass(frozen=True)
class AuthSpec:
    """The router's API key, by Secret reference (the operator never reads its value)."""

    api_key_secret: str | None = None
    api_key_key: str = "apiKey"

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> AuthSpec:
        ref = (raw or {}).get("apiKeySecret") or None
        if ref is None:
            return cls()
        if not ref.get("name"):
            raise SpecError("spec.auth.apiKeySecret needs a name")
        return cls(api_key_secret=ref["name"], api_key_key=ref.get("key", cls.api_key_key))


@dataclass(frozen=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    toleration_seconds: int | None = None

    def to_manifest(self) -> dict[str, Any]:
        body: dict[str, Any] = {"operator": self.operator}
        for name, value in (("key", self.key), ("value", self.value), ("effect", self.effect)):
            if value:
                body[name] = value
        if self.toleration_seconds is not None:
            body["tolerationSeconds"] = self.toleration_seconds
        return body


@dataclass(frozen=True)
class TransportSpec:
    # scatter and combine pods share the node's IPC and PID namespaces (hostIPC, hostPID) and
    # scatter pods prefer a combine pod's node: entries then move by CUDA IPC or /dev/shm
    node_local: bool = False

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> TransportSpec:
        raw = raw or {}
        node_local = raw.get("nodeLocal", cls.node_local)
        if not isinstance(node_local, bool):
            raise SpecError(f"transport.nodeLocal must be true or false, got {node_local!r}")
        return cls(node_local=node_local)


@dataclass(frozen=True)
class HybridCacheSpec:
    model: ModelSpec
    router: RoleSpec
    combine: RoleSpec
    scatter: RoleSpec
    cache_tier: RoleSpec
    image: str = DEFAULT_IMAGE
    image_pull_policy: str = "IfNotPresent"
    gpu_resource_name: str = "nvidia.com/gpu"
    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Toleration, ...] = ()
    engine: EngineSpec = field(default_factory=EngineSpec)
    transport: TransportSpec = field(default_factory=TransportSpec)
    autoscaling: AutoscalingSpec = field(default_factory=AutoscalingSpec)
    etcd_endpoints: tuple[str, ...] = ()
    observability: ObservabilitySpec = field(default_factory=ObservabilitySpec)
    auth: AuthSpec = field(default_factory=AuthSpec)
    cache: CacheSpec = field(default_factory=CacheSpec)
    paused: bool = False

    @property
    def roles(self) -> tuple[RoleSpec, ...]:
        return (self.router, self.combine, self.scatter, self.cache_tier)

    def role(self, name: str) -> RoleSpec:
        return {r.name: r for r in self.roles}[name]

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> HybridCacheSpec:
        """Parse a HybridCache `.spec` (with or without the CRD's defaults applied)."""
        if "model" not in raw:
            raise SpecError("spec.model is required")
        scatter_raw = raw.get("scatter") or {}
        spec = cls(
            model=ModelSpec.parse(raw["model"]),
            router=RoleSpec.parse("router", raw.get("router"), replicas=1, gpus=0),
            combine=RoleSpec.parse("combine", raw.get("combine"), replicas=1, gpus=1),
            scatter=RoleSpec.parse("scatter", scatter_raw, replicas=1, gpus=1),
            cache_tier=RoleSpec.parse("cache-tier", raw.get("cacheTier"), replicas=1, gpus=0),
            image=raw.get("image", DEFAULT_IMAGE),
            image_pull_policy=raw.get("imagePullPolicy", "IfNotPresent"),
            gpu_resource_name=raw.get("gpuResourceName", "nvidia.com/gpu"),
            node_selector=dict(raw.get("nodeSelector") or {}),
            tolerations=tuple(
                Toleration(
                    key=t.get("key", ""),
                    operator=t.get("operator", "Equal"),
                    value=t.get("value", ""),
                    effect=t.get("effect", ""),
                    toleration_seconds=t.get("tolerationSeconds"),
                )
                for t in raw.get("tolerations") or ()
            ),
            engine=EngineSpec.parse(raw.get("engine")),
            transport=TransportSpec.parse(raw.get("transport")),
            autoscaling=AutoscalingSpec.parse(scatter_raw.get("autoscaling")),
            etcd_endpoints=tuple((raw.get("etcd") or {}).get("endpoints") or ()),
            observability=ObservabilitySpec.parse(raw.get("observability")),
            auth=AuthSpec.parse(raw.get("auth")),
            cache=CacheSpec.parse(raw.get("cache")),
            paused=bool(raw.get("paused", False)),
        )
        tp = spec.engine.tensor_parallel_size
        for role in (spec.combine, spec.scatter):
            # one process a GPU: a GPU worker pod holds exactly its ranks' GPUs (0: ranks on the CPU)
            if tp > 1 and role.gpus_per_pod not in (0, tp):
                raise SpecError(f"{role.name}.gpusPerPod is {role.gpus_per_pod}, engine.tensorParallelSize {tp}: "
                                f"a GPU worker runs one rank a GPU, so gpusPerPod must be {tp} (or 0 on the CPU)")
        if spec.cache_tier.replicas > 1 and not spec.etcd_endpoints:
            raise SpecError("more than one cache-tier replica needs etcd.endpoints for the directory")
        return spec
