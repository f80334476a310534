"""Names shared by the services, the operator, the chart and the dashboards.

One place for what crosses component boundaries as plain strings: the roles a pod can run
(`hybridcache serve ROLE`), their default ports, and the Prometheus metric names the services
export. The operator's builders, the dashboards and the alert rules are tested against these.
"""

from __future__ import annotations

from dataclasses import dataclass

API_GROUP = "serving.hybridcache.io"
API_VERSION = "v1alpha1"
KIND = "HybridCache"


@dataclass(frozen=True, slots=True)
class RolePorts:
    grpc: int
    http: int  # HTTP API (router only) and /metrics, /health for every role


ROLES: dict[str, RolePorts] = {
    "router": RolePorts(grpc=50051, http=8000),
    "combine": RolePorts(grpc=50061, http=9061),
    "scatter": RolePorts(grpc=50071, http=9071),
    "cache-tier": RolePorts(grpc=50081, http=9081),
}

# Prometheus metric names (without the _bucket/_sum/_count/_total suffixes that
# prometheus-client adds to histograms and counters; counters are declared with their
# `_total` name here as they appear in a scrape).
METRIC_TTFT_SECONDS = "hybridcache_time_to_first_token_seconds"  # histogram
METRIC_INTER_TOKEN_SECONDS = "hybridcache_inter_token_latency_seconds"  # histogram
METRIC_COLD_QUEUE_DEPTH = "hybridcache_cold_segment_queue_depth"  # gauge, the scaling signal
# counter, label tier=gpu|worker|host|tier|disk|prefix (gpu / worker: a combine worker's own cache on a
# CUDA / CPU-only worker)
METRIC_CACHE_QUERIES = "hybridcache_cache_queries_total"
METRIC_CACHE_HITS = "hybridcache_cache_hits_total"  # counter, label tier
# counter, label path=shm|grpc|cuda_ipc|..., tensor_parallel: entry slices between a worker's ranks
METRIC_BYTES_MOVED = "hybridcache_bytes_moved_total"
METRIC_ENTRY_BUILD_SECONDS = "hybridcache_entry_build_seconds"  # histogram
# counter, labels door=http|grpc and status: the HTTP status code the request was answered with (a
# gRPC call's status as the HTTP code of the same meaning: OK 200, INVALID_ARGUMENT 400, UNAUTHENTICATED
# 401, RESOURCE_EXHAUSTED 429, CANCELLED 499, INTERNAL 500, UNAVAILABLE 503); counted by the router
METRIC_REQUESTS = "hybridcache_requests_total"
METRIC_CACHE_BYTES = "hybridcache_cache_bytes"  # gauge, label tier
METRIC_SCATTER_REPLICAS = "hybridcache_scatter_replicas"  # gauge (exported by the operator)
# A combine worker's scheduler: requests by state=waiting|prefilling|running (gauge; waiting is the
# queue depth); requests ended, by reason=stop|length|abort|error, the tokens they generated, and
# running requests preempted (recomputed later) for lack of attention K/V budget (counters)
METRIC_SCHEDULER_REQUESTS = "hybridcache_scheduler_requests"
METRIC_SCHEDULER_FINISHED = "hybridcache_scheduler_finished_total"
METRIC_SCHEDULER_GENERATED_TOKENS = "hybridcache_scheduler_generated_tokens_total"
METRIC_SCHEDULER_PREEMPTIONS = "hybridcache_scheduler_preemptions_total"
# A combine worker's memory in use (gauges, 0..1): the attention K/V budget the running requests have
# reserved, and its own segment-entry cache (of its byte budget)
METRIC_KV_CACHE_USAGE = "hybridcache_kv_cache_usage_ratio"
METRIC_ENTRY_CACHE_USAGE = "hybridcache_entry_cache_usage_ratio"
# The router's view of every request it answered, over both doors (counters): prompt tokens, the
# part of them served from caches filled by earlier requests (label cache=prefix|entry), tokens
# generated; and each request's latency from arrival to its last token (histogram)
METRIC_PROMPT_TOKENS = "hybridcache_prompt_tokens_total"
METRIC_CACHED_TOKENS = "hybridcache_cached_tokens_total"
METRIC_GENERATION_TOKENS = "hybridcache_generation_tokens_total"
METRIC_E2E_SECONDS = "hybridcache_e2e_request_latency_seconds"
# counter, label reason=checksum|seal|layout: entries a reader refused (a tensor's CRC failed; the
# HMAC seal did not verify: forged, or written by another deployment; the shapes or dtypes are not
# the model's entry layout). Every refused entry is a miss.
METRIC_ENTRIES_REJECTED = "hybridcache_entries_rejected_total"
METRIC_UNAUTHENTICATED = "hybridcache_unauthenticated_requests_total"  # counter, label door=grpc|http
# histogram, label generation=0|1|2: the interpreter's garbage-collector pauses (every thread of the
# process waits them out, a request's engine step included)
METRIC_GC_PAUSE_SECONDS = "hybridcache_gc_pause_seconds"
# histogram, label kind=decode|prefill|mixed: a combine worker's scheduler steps by what they ran
# (decode only, prefill only, both), each step's wall time: what running streams wait between tokens
METRIC_SCHEDULER_STEP_SECONDS = "hybridcache_scheduler_step_seconds"

ALL_METRICS = (
    METRIC_TTFT_SECONDS,
    METRIC_INTER_TOKEN_SECONDS,
    METRIC_COLD_QUEUE_DEPTH,
    METRIC_CACHE_QUERIES,
    METRIC_CACHE_HITS,
    METRIC_BYTES_MOVED,
    METRIC_ENTRY_BUILD_SECONDS,
    METRIC_REQUESTS,
    METRIC_CACHE_BYTES,
    METRIC_SCATTER_REPLICAS,
    METRIC_SCHEDULER_REQUESTS,
    METRIC_SCHEDULER_FINISHED,
    METRIC_SCHEDULER_GENERATED_TOKENS,
    METRIC_SCHEDULER_PREEMPTIONS,
    METRIC_KV_CACHE_USAGE,
    METRIC_ENTRY_CACHE_USAGE,
    METRIC_PROMPT_TOKENS,
    METRIC_CACHED_TOKENS,
    METRIC_GENERATION_TOKENS,
    METRIC_E2E_SECONDS,
    METRIC_ENTRIES_REJECTED,
    METRIC_UNAUTHENTICATED,
    METRIC_GC_PAUSE_SECONDS,
    METRIC_SCHEDULER_STEP_SECONDS,
)

# vLLM's names for the same series, exported beside ours (label model_name, the served model's name)
# where a vLLM dashboard or autoscaler looks for them: the request counts and cache use on the
# combine workers (they run the scheduler), the token counters and latencies on the router (what a
# client sees). gpu_cache_usage_perc is vLLM V0's name of kv_cache_usage_perc; both are 0..1.
VLLM_NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
VLLM_NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
VLLM_KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
VLLM_GPU_CACHE_USAGE = "vllm:gpu_cache_usage_perc"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens_total"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"
VLLM_TTFT_SECONDS = "vllm:time_to_first_token_seconds"
VLLM_E2E_SECONDS = "vllm:e2e_request_latency_seconds"

VLLM_METRICS = (
    VLLM_NUM_REQUESTS_RUNNING,
    VLLM_NUM_REQUESTS_WAITING,
    VLLM_KV_CACHE_USAGE,
    VLLM_GPU_CACHE_USAGE,
    VLLM_PROMPT_TOKENS,
    VLLM_GENERATION_TOKENS,
    VLLM_TTFT_SECONDS,
    VLLM_E2E_SECONDS,
)
