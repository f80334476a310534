"""The runtime config: one frozen dataclass, one field per setting, each in one section (model,
cache, scheduler, server, security, devices), and the flags of every command that builds one
(`hybridcache generate | demo | eval | serve | up`) generated from its fields (as vLLM's
`EngineArgs`): a field's default is the flag's default, its `help` the flag's help, its `section`
the group its flag is listed in and the commands that offer it (a command takes the sections it
uses: `generate` has no server or security flags), its `roles` the `hybridcache serve` roles that
`hybridcache up` forwards it to.

To add a setting, add a field here with `setting(...)`; its flag, its forwarding and its row in
docs/configuration.md (`python scripts/gen_config_docs.py`) follow. Importable without torch (the
router and the command-line parser need no tensors).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hybridcache.services.devices import CPU_CACHE_BYTES

MODES = ("full", "prefix", "pic", "naive")
ENTRY_POLICIES = ("exact", "single_state")
ENTRY_STATE_DTYPES = ("float32", "bfloat16")
POLICIES = ("checkpoint", "suffix_replay", "exact_replay")
ANCHOR_DTYPES = ("bfloat16", "float8_e4m3fn")  # besides "model" (the model's dtype)
DEVICES = ("cpu", "cuda")
KERNELS = ("auto", "reference")
SDPA_BACKEND_NAMES = ("flash", "efficient", "cudnn", "math")
DTYPES = ("float32", "bfloat16")
# `hybridcache serve` roles that build an engine: scatter and combine workers run the model; the
# router plans requests (tokens, segment keys, limits) without one.
WORKERS = ("combine", "scatter")
ENGINE_ROLES = ("router", *WORKERS)
SERVICE_ROLES = (*ENGINE_ROLES, "cache-tier")


def parse_warmup_shape(text: str | None) -> tuple[int, int, int, int] | None:
    """"16+32x1024+64" -> (16, 32, 1024, 64): a system prompt of 16 tokens, 32 segments of 1024 and
    a 64-token question; "32x1024+64" has no system prompt; "none" or "" -> None. ValueError
    (one line) on anything else."""
    import re

    if text is None or text.strip().lower() in ("", "none"):
        return None
    m = re.fullmatch(r"(?:(\d+)\+)?(\d+)x(\d+)\+(\d+)", text.strip())
    if m is None or int(m.group(2)) < 1 or int(m.group(3)) < 1:
        raise ValueError(f"--warmup-shape must be [SYSTEM+]NxL+Q (e.g. 16+32x1024+64) or none, got {text!r}")
    return int(m.group(1) or 0), int(m.group(2)), int(m.group(3)), int(m.group(4))


# The sections of the config: what each holds. A command takes the sections it uses.
SECTIONS = {
    "model": "the model served and how the API names and presents it",
    "cache": "segment entries, the prefix cache and where entries move",
    "scheduler": "continuous batching: admission, prefill budgets, decode, warm-up",
    "server": "the router's request limits, timeouts and draining; the servers' stats lines and request log",
    "security": "API key, TLS and the deployment secret",
    "devices": "where and how the model runs: device, memory share, parallelism, kernels, CUDA graphs",
}
# sections of the commands that run one engine in-process only (generate, eval)
ENGINE_SECTIONS = ("model", "cache", "scheduler", "devices")


def setting(default: Any, help: str, *, section: str, roles: tuple[str, ...] = WORKERS, choices: tuple | None = None,
            flag: str | None = None, metavar: str | None = None, type: type | None = None, env: str | None = None):
    """A config field that is also a command-line flag (`--field-name` unless `flag` is given), in
    `section` (one of SECTIONS).
    `type` parses the flag's value (default: the default's type; needed when the default is None,
    which means "unset": such a field is not forwarded, each process decides). `env` names an
    environment variable read when the flag is not given: a secret's way in, which `hybridcache up`
    uses to hand it to a service instead of an argument (argument lists are public to `ps`)."""
    if section not in SECTIONS:
        raise ValueError(f"unknown config section {section!r}")
    return field(default=default, metadata={"help": help, "section": section, "roles": roles, "choices": choices,
                                            "flag": flag, "metavar": metavar, "type": type, "env": env})


@dataclass(frozen=True)
class PrefixPolicy:
    """How prefix pages keep the linear layers' state (cache/policies.py implements it)."""

    name: str = "exact_replay"
    page_size: int = 64
    checkpoint_every: int = 4  # pages between dense checkpoints (checkpoint, exact_replay); 4 = 256 tokens
    anchors_per_page: int = 4  # r: anchors kept per page by suffix_replay (the page's last r tokens)
    replay_anchors: int = 64  # k: most anchors a suffix_replay hit replays per group
    # None: anchors in the model's dtype; "bfloat16": bf16 whatever the model's dtype; "float8_e4m3fn": fp8
    # with a per-row fp32 scale (suffix_replay only)
    anchor_dtype: str | None = None
    # checkpoint only: also the dense state at the last page boundary a finished request (prompt and
    # output) reached, as SGLang's mamba radix cache keeps each finished request's final state
    request_end_checkpoints: bool = False

    def __post_init__(self):
        if self.name not in POLICIES:
            raise ValueError(f"prefix policy must be one of {', '.join(POLICIES)}, got {self.name!r}")
        if self.page_size <= 0:
            raise ValueError("page_size must be positive")
        if self.checkpoint_every <= 0:
            raise ValueError("checkpoint_every must be >= 1 page")
        if not 1 <= self.anchors_per_page <= self.page_size:
            raise ValueError(f"anchors_per_page must be in [1, {self.page_size}]")
        if self.replay_anchors <= 0:
            raise ValueError("replay_anchors must be >= 1")
        if self.anchor_dtype is not None and self.anchor_dtype not in ANCHOR_DTYPES:
            raise ValueError(
                f"anchor_dtype must be None (the model's dtype) or one of {', '.join(ANCHOR_DTYPES)}, "
                f"got {self.anchor_dtype!r}"
            )
        if self.anchor_dtype is not None and self.name != "suffix_replay":
            raise ValueError(f"anchor_dtype {self.anchor_dtype} is only allowed with suffix_replay "
                             f"({self.name} must stay exact)")
        if self.request_end_checkpoints and self.name != "checkpoint":
            raise ValueError(f"checkpoint_request_ends (request-end states) is a setting of the checkpoint policy, "
                             f"not of {self.name}")

    @property
    def stores_checkpoints(self) -> bool:
        return self.name != "suffix_replay"

    @property
    def anchors_kept(self) -> int:
        """Anchors per page (the last ones of the page)."""
        kept = {"checkpoint": 0, "suffix_replay": self.anchors_per_page, "exact_replay": self.page_size}
        return kept[self.name]

    def anchor_row_bytes(self, hidden_size: int, model_itemsize: int) -> int:
        """Bytes one token's anchor takes at one group entry, as stored."""
        if self.anchor_dtype == "float8_e4m3fn":
            return hidden_size + 4  # fp8 values and one fp32 scale per row
        if self.anchor_dtype == "bfloat16":
            return hidden_size * 2
        return hidden_size * model_itemsize

    @property
    def checkpoint_tokens(self) -> int:
        return self.page_size * self.checkpoint_every

    def is_checkpoint_position(self, pos: int) -> bool:
        return self.stores_checkpoints and pos > 0 and pos % self.checkpoint_tokens == 0

    def request_end_position(self, length: int) -> int:
        """Where a request whose state reached `length` tokens keeps its request-end state: the last
        page boundary at or before it (0: none, or the policy keeps no request ends)."""
        return length // self.page_size * self.page_size if self.request_end_checkpoints else 0

    def usable(self, node) -> bool:
        """Can a hit end at this node (a cache/radix.py PageNode)?"""
        return self.name != "checkpoint" or node.payload.checkpoint is not None


@dataclass(frozen=True)
class RuntimeConfig:
    """Every setting of an engine. `EngineConfig` (services/runtime/engine.py) is this class."""

    device: str = setting("cpu", "device the model runs on", choices=DEVICES, section="devices")
    dtype: str = setting("float32", "dtype of the model's weights and activations", choices=DTYPES, section="model")
    mode: str = setting(
        "pic", "full: no cache; prefix: exact prefix cache; pic: prefix cache + position-independent "
        "segment entries; naive: pic without the transition T (an ablation)", choices=MODES, section="cache")
    seam_window: int = setting(
        8, "live tokens at the start of every reused segment (part of the entry key)", roles=ENGINE_ROLES,
        section="cache")
    max_segments: int = setting(64, "most segments a request may have", roles=ENGINE_ROLES, section="cache")
    max_model_len: int | None = setting(
        None, "router: longest prompt plus max_new_tokens accepted (default and ceiling: the model's "
        "max_position_embeddings)", roles=("router",), type=int, section="model")
    served_model_name: str | None = setting(
        None, "router: the model name the API serves, lists in /v1/models and answers to (default: the model "
        "directory's name; 'default' is always an alias); on a combine worker, the model_name label of its "
        "vLLM-named metrics", roles=("router", "combine"), type=str, metavar="NAME", section="model")
    # every command refuses it (cli.main): a field so that vLLM command lines get that clear error
    trust_remote_code: bool = setting(
        False, "refused when set: the server runs only its own implementations of the supported model types, "
        "never Python code from a model directory", roles=ENGINE_ROLES, section="model")
    chat_template: str | None = setting(
        None, "router: a Jinja chat template file for /v1/chat/completions (default: the model directory's "
        "tokenizer_config.json chat_template, else its chat_template.jinja)", roles=("router",), type=str,
        metavar="FILE", section="model")
    segment_separator: str = setting(
        "<<PIC_SEP>>", "router: the marker that splits every prompt text into segments (completion prompts, every "
        "chat message's content, system and developer messages included, /generate text, native requests on HTTP "
        "and gRPC, and `hybridcache generate`'s request files); removed before tokenizing. A request's "
        "`separator` field overrides it; \"\" turns it off",
        roles=("router",), metavar="TEXT", section="cache")
    max_request_bytes: int = setting(
        4 << 20, "router: largest HTTP request body and gRPC Inference message read; a larger one is refused "
        "before it is read or parsed (HTTP 413, gRPC RESOURCE_EXHAUSTED)", roles=("router",), section="server")
    max_prompt_chars: int | None = setting(
        None, "router: most characters of text (system, segments, suffix together) tokenized for one request; "
        "more is refused before tokenizing (default: the served max length times the longest token of the "
        "vocabulary, in characters: no request over it could fit)", roles=("router",), type=int, section="server")
    http_header_timeout_s: int = setting(
        10, "seconds a client has to send a request's line and headers to the router (and an idle keep-alive "
        "connection is kept) before the connection is closed; on the other roles' /health and /metrics, how "
        "long a connection may send nothing", roles=SERVICE_ROLES, section="server")
    drain_grace_s: int = setting(
        20, "router: on SIGTERM it stops taking requests (both doors stop listening) and gives those in flight "
        "this many seconds to finish; `hybridcache up` stops the workers after the router", roles=("router",),
        section="server")
    api_key: str | None = setting(
        None, "router: the API key clients send as `Authorization: Bearer KEY` (HTTP and gRPC Inference; others "
        "get 401 / UNAUTHENTICATED); /health and /livez stay open, /metrics too with --metrics-open. Given on "
        "the command line it shows in `ps`: prefer HYBRIDCACHE_API_KEY or --api-key-file", roles=("router",),
        type=str, metavar="KEY", env="HYBRIDCACHE_API_KEY", section="security")
    api_key_file: str | None = setting(
        None, "router: a file of API keys, one a line (blank lines and # comments left out), each accepted as "
        "--api-key is; readable by the service's user alone (the key then shows in no argument list and no "
        "environment)", roles=("router",), type=str, metavar="PATH", section="security")
    cache_isolation: str = setting(
        "shared", "router: shared: every client's requests hit the same caches (a client may still keep its own "
        "with vLLM's cache_salt field); per-key: every cache (segment entries, part chains, prefix pages, the "
        "cache tier) is keyed by the request's API key, so no client's requests hit, or run faster for, what "
        "another client sent", roles=("router",), choices=("shared", "per-key"), section="security")
    metrics_open: bool = setting(
        False, "router: serve /metrics without the API key (for a Prometheus that sends none); by default it "
        "needs the key when one is set", roles=("router",), section="security")
    tls_certfile: str | None = setting(
        None, "router: PEM certificate (chain) to serve HTTPS and gRPC over TLS with (with --tls-keyfile)",
        roles=("router",), type=str, metavar="PATH", section="security")
    tls_keyfile: str | None = setting(None, "router: PEM private key of --tls-certfile", roles=("router",), type=str,
                                      metavar="PATH", section="security")
    prepare_timeout_s: int = setting(
        10, "router: seconds a request may take to be prepared (parsed, its chat template rendered, tokenized, "
        "planned) before it is answered 503 with Retry-After and its preparation stopped", roles=("router",),
        section="server")
    stats_interval_s: int = setting(
        10, "combine: seconds between the lines of running statistics the worker logs, as vLLM's: prompt and "
        "generation throughput, running and waiting requests, K/V and entry-cache use, prefix and entry cache "
        "hit rates (an idle worker logs one line, then none until it works again; `hybridcache up` shows them); "
        "0 = none", roles=("combine",), section="server")
    log_requests: bool = setting(
        False, "router: log one line per request that reached a combine worker as it ends: its id, HTTP status "
        "and finish reason, prompt, cached and generated tokens, time to first token and in all "
        "(`hybridcache up` shows them)", roles=("router",), section="server")
    token_stream: str = setting(
        "multiplexed", "router: how each combine worker streams tokens back: `multiplexed` (one stream per "
        "worker carrying the tokens of all of this router's requests, a decode step's in one message) or "
        "`per-request` (a stream per request: a message and a thread wake-up per token on both ends)",
        roles=("router",), choices=("multiplexed", "per-request"), section="server")
    http_body_timeout_s: int = setting(
        30, "router: seconds a client has to send a request's body once its headers are in (HTTP 408 after)",
        roles=("router",), section="server")
    gpu_memory_utilization: float = setting(
        0.9, "share of its GPU's total memory a worker may use, weights included; the cache and K/V budgets "
        "left unset are shares of what remains once the model is loaded (at most the memory free then); a "
        "combine worker that warms up on one GPU first measures its warm-up's activation peak and CUDA graphs "
        "and sizes them from what is left, or refuses to start when its configuration does not fit. "
        "`up` splits it between the workers it places on one GPU", type=float, section="devices")
    entry_cache_bytes: int | None = setting(
        None, "segment-entry cache budget (default: 1 GiB on the CPU; on CUDA a share of the worker's "
        "memory pool (--gpu-memory-utilization), stated at start-up)", type=int, section="cache")
    prefix_cache_bytes: int | None = setting(
        None, "prefix page-tree (and part-chain snapshot) budget, which also holds the linear-state checkpoints "
        "running requests keep for their pages until they finish (a checkpoint with no room is not kept) "
        "(default: as --entry-cache-bytes, a smaller share)", type=int, section="cache")
    tier_cache_bytes: int = setting(CPU_CACHE_BYTES, "cache tier: its store's byte budget", roles=("cache-tier",),
                                    flag="--cache-bytes", section="cache")
    warmup_shape: str = setting(
        "16+32x1024+64", "scatter/combine warm-up: besides the small requests that take every path, requests of "
        "this shape ([SYSTEM+]NxL+Q: N segments of L tokens, a Q-token question) cold and then warm, after new "
        "system prompts and after a cached one, through the worker's own request path, so that no such request "
        "compiles, autotunes or captures CUDA graphs on its own path "
        "(N is cut to what the served length allows); none = only the small ones", metavar="[SYS+]NxL+Q",
        section="scheduler")
    transport_bandwidth: str | None = setting(
        None, "router: starting bandwidths of the entry paths in GB/s, PATH=GB/s[,...] with PATH grpc, shm or "
        "cuda_ipc (default: the cost model's); measured transfers update them", roles=("router",), type=str,
        metavar="PATH=GBPS,...", section="cache")
    ipc_arena_bytes: int = setting(
        512 << 20, "scatter: bytes of the device buffer (one per GPU, kept for the worker's life) that entries "
        "sent over CUDA IPC are written into; a combine worker maps it once, so requests open no IPC handle; "
        "a write larger than it grows it; 0: a fresh buffer exported per layer batch", roles=("scatter",),
        section="cache")
    scatter_same_gpu: bool = setting(
        False, "combine: send cold segments to a scatter worker on this worker's own GPU too (default: build "
        "them here: on one GPU the scatter worker's build contends with this worker's and its entries still have "
        "to move)", roles=("combine",), section="cache")
    entry_batch_tokens: int = setting(16384, "padded tokens per batched standalone prefill of cold segments",
        section="scheduler")
    verify_checksums: bool = setting(False, "re-hash every segment entry on every read of the entry cache",
        section="cache")
    prefix_policy: str = setting("exact_replay", "how prefix pages keep the linear layers' state", choices=POLICIES,
        section="cache")
    checkpoint_every: int = setting(
        4, "pages (64 tokens) between dense linear-state checkpoints (checkpoint, exact_replay)", section="cache")
    anchors_per_page: int = setting(4, "suffix_replay: hidden states kept per page at each linear-group entry (r)",
        section="cache")
    replay_anchors: int = setting(64, "suffix_replay: most anchors a hit replays per group (k)", section="cache")
    checkpoint_request_ends: bool = setting(
        False, "checkpoint: also keep the dense linear state where each finished request (prompt and output) "
        "ended, at its last page boundary, as SGLang's mamba radix cache keeps every finished request's final "
        "state: the next turn of a conversation resumes there (its bytes count in --prefix-cache-bytes)",
        section="cache")
    # Checked in __post_init__ (one error line, exit 2), not by argparse choices: it depends on prefix_policy.
    anchor_dtype: str = setting(
        "model", "suffix_replay: anchor storage; model: the model's dtype; bfloat16; float8_e4m3fn keeps fp8 values "
        "with a per-anchor fp32 scale (about half the bytes of bf16 anchors)", metavar="{model,bfloat16,float8_e4m3fn}",
        section="cache")
    entry_policy: str = setting(
        "exact", "segment entries (pic): exact composition T S + S, or single_state (a reused segment keeps "
        "only its own state)", choices=ENTRY_POLICIES, section="cache")
    host_cache_bytes: int = setting(
        0, "segment entries evicted from the device cache move to a host-memory tier of this many bytes "
        "(pinned with CUDA) and are staged back layer by layer on a hit; 0 = off", section="cache")
    entry_state_dtype: str = setting(
        "float32", "storage of the segment entries' linear-layer T and S; bfloat16 halves a delta-rule entry "
        "(composition keeps its running state in fp32)", choices=ENTRY_STATE_DTYPES, section="cache")
    secret_file: str | None = setting(
        None, "file holding the deployment secret (services/security.py): internal gRPC calls carry a token "
        "derived from it and cache entries are sealed with it; `hybridcache serve` needs one, `hybridcache up` "
        "makes one per run unless given", roles=SERVICE_ROLES, type=str, metavar="PATH", section="security")
    tensor_parallel_size: int = setting(
        1, "ranks one worker splits its model over by head (one GPU each, vLLM's name): the worker starts the "
        "other ranks itself; part of the entry key, so entries of another split are misses", roles=ENGINE_ROLES,
        section="devices")
    # A setting of the model: engines sharing one model share it.
    cuda_graphs: bool = setting(
        True, "on CUDA, run the live pass of assembled prompts from CUDA graphs of their shapes "
        "(off: every forward eagerly)", section="devices")
    decode_cuda_graphs: bool = setting(
        True, "on CUDA, run batched decode steps from CUDA graphs captured per padded batch size (1, 2, 4, "
        "multiples of 8 up to --max-num-seqs), for models whose forward has no host synchronization "
        "(off: every decode step eagerly, through the same paged K/V; tests/kernels/test_decode_graphs_gpu.py "
        "checks graph against eager steps on a GPU)", section="devices")
    batch_plain_prefills: bool = setting(
        True, "prefill the prompts admitted in one scheduler step together when each runs all live from an "
        "empty state (no segments, no system prompt, no prefix-cache hit, shorter than a prefix-cache "
        "checkpoint interval): one batched standalone forward of each prompt but its last token, which "
        "runs in the next decode step and yields the first output token (off: each prompt's own forward)",
        section="scheduler")
    paged_prefill: bool = setting(
        True, "prefill each request in the slot it decodes in, its attention K/V written into the slot's pages "
        "chunk by chunk and read there (no contiguous copy of a long prompt's K/V; on CUDA an assembly then "
        "runs planned, from one CUDA graph per bucket of layouts); off: K/V kept contiguous while prefilling "
        "and moved into pages when the request starts decoding, assemblies graphed per exact layout shape",
        section="scheduler")
    decode_overlap: bool = setting(
        True, "on CUDA, launch each decode step before the host handles the step before it, when no running "
        "request asks for logprobs: the picks (greedy or sampled on the GPU) stay on the device as the next "
        "step's inputs, and the host emits one step's tokens while the GPU runs the next (a request that "
        "stops on a token runs one step more, its result dropped; off: the host reads every step's tokens "
        "before the next)",
        section="scheduler")
    cuda_graph_shapes: int = setting(
        4, "assembly buckets (and exact layout shapes of forwards outside the scheduler) whose CUDA graphs are "
        "kept, least recently used dropped", section="devices")
    # The two below choose the op implementations (services/runtime/backends.py) of the engine's runner.
    kernels: str = setting(
        "auto", "auto: the fast kernels (fla, Triton) for CUDA tensors and the PyTorch references elsewhere; "
        "reference: the references everywhere (to compare against)", choices=KERNELS, section="devices")
    # cuDNN's attention is left out by default: it builds an execution graph for every new shape,
    # and every request has its own context length and live-token count, as does every decode step.
    sdpa_backends: str = setting(
        "flash,efficient,math", "SDPA backends allowed on CUDA: a comma list of flash, efficient, cudnn, math; "
        "or torch (torch's own choice)", section="devices")

    # Continuous batching (services/runtime/scheduler.py): the combine worker and the in-process commands
    # (`hybridcache generate`, `demo`, `eval`: runtime/llm.py) run every request through a Scheduler; the
    # scatter worker batches cold segments by the token budget.
    max_num_seqs: int = setting(16, "most requests decoding at once (one batched decode step over them all)",
                                roles=("combine", "router"), section="scheduler")
    max_waiting: int = setting(
        64, "requests queued for admission; one more is refused (HTTP 429 with Retry-After, gRPC "
        "RESOURCE_EXHAUSTED); the router refuses past it at once, counting its own requests in flight",
        roles=("combine", "router"), section="scheduler")
    max_queue_wait_s: float = setting(
        5.0, "router: the longest a request is let wait for a seat at a combine worker, as estimated when it "
        "comes (from the work the seated requests have left and a request's mean work, services/router/"
        "admission.py); one that would wait longer is refused at once (HTTP 429 with Retry-After, gRPC "
        "RESOURCE_EXHAUSTED), before anything is planned or built for it", roles=("router",), section="scheduler")
    max_num_batched_tokens: int = setting(
        8192, "prefill tokens (cold segment builds, assemblies) a scheduler step spends besides its decode "
        "step: a longer prompt or assembly is prefilled in chunks of this many live tokens, one a step (fewer "
        "deep into a long prompt, where each token also attends to the keys before it: the budget counts "
        "tokens at zero context), so running streams wait at most one chunk between tokens (smaller: "
        "steadier inter-token latency, a long prompt's first token later); on a scatter worker, the cold "
        "tokens of different requests built in one batched call", section="scheduler")
    chunk_layer_parts: int = setting(
        4, "steps a prefill chunk of a prompt without cached spans (a long plain prompt) is run over, a run "
        "of consecutive layers each, the chunk that many times the tokens one step's budget buys (at most "
        "--entry-batch-tokens): each step does about its budget's work, and the chunk's host overhead "
        "(launches, Python) is spread over more tokens (1: a chunk's whole forward in one step)",
        roles=("combine",), section="scheduler")
    kv_cache_bytes: int | None = setting(
        None, "attention K/V the running requests may reserve, each its prompt and 256-token chunks of "
        "output as it grows; a request waits until its first chunk fits, running ones are preempted "
        "(recomputed later) when growth does not (default: 4 GiB on the CPU; on CUDA a share of the "
        "worker's memory pool (--gpu-memory-utilization))", roles=("combine",), type=int, section="scheduler")

    def __post_init__(self):
        if self.anchor_dtype is None:  # the Python spelling of "model"
            object.__setattr__(self, "anchor_dtype", "model")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}, got {getattr(self, f.name)!r}")
        if self.seam_window < 0:
            raise ValueError("seam_window must be >= 0")
        if self.ipc_arena_bytes < 0:
            raise ValueError("ipc_arena_bytes must be >= 0")
        if self.max_segments < 1:
            raise ValueError("max_segments must be >= 1")
        for name in ("max_request_bytes", "http_header_timeout_s", "http_body_timeout_s", "drain_grace_s",
                     "prepare_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("--tls-certfile and --tls-keyfile go together")
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must be >= 0 (0 = no stats lines), got {self.stats_interval_s}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be empty")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty")
        if self.cache_isolation == "per-key" and self.api_key is None and self.api_key_file is None:
            raise ValueError("--cache-isolation per-key needs API keys (--api-key-file, HYBRIDCACHE_API_KEY or "
                             "--api-key)")
        if self.max_prompt_chars is not None and self.max_prompt_chars <= 0:
            raise ValueError(f"max_prompt_chars must be positive, got {self.max_prompt_chars}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        for name in ("entry_cache_bytes", "prefix_cache_bytes", "tier_cache_bytes"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"cache budgets must be positive, got {name}={getattr(self, name)}")
        if self.entry_batch_tokens <= 0:
            raise ValueError("entry_batch_tokens must be positive")
        if self.host_cache_bytes < 0:
            raise ValueError("host_cache_bytes must be >= 0 (0 = no host tier)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_layer_parts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if not self.max_queue_wait_s > 0:
            raise ValueError(f"max_queue_wait_s must be positive, got {self.max_queue_wait_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.cuda_graph_shapes < 1:
            raise ValueError("cuda_graph_shapes must be >= 1")
        sdpa_backend_names(self.sdpa_backends)  # validates
        from hybridcache.services.router.cost import parse_bandwidths

        parse_bandwidths(self.transport_bandwidth)  # validates
        parse_warmup_shape(self.warmup_shape)  # validates
        _ = self.page_policy  # validates the policy's parameters

    @property
    def page_policy(self) -> PrefixPolicy:
        return PrefixPolicy(
            self.prefix_policy,
            checkpoint_every=self.checkpoint_every,
            anchors_per_page=self.anchors_per_page,
            replay_anchors=self.replay_anchors,
            anchor_dtype=None if self.anchor_dtype == "model" else self.anchor_dtype,
            # a setting of the checkpoint policy, ignored by the others (as they ignore each other's)
            request_end_checkpoints=self.checkpoint_request_ends and self.prefix_policy == "checkpoint",
        )

    @property
    def state_dtype(self):
        """The torch dtype of the entries' T and S."""
        import torch

        return getattr(torch, self.entry_state_dtype)

    @property
    def torch_dtype(self):
        """The torch dtype of the model."""
        import torch

        return getattr(torch, self.dtype)

    @property
    def uses_prefix_cache(self) -> bool:
        return self.mode != "full"

    @property
    def uses_entries(self) -> bool:
        return self.mode in ("pic", "naive")


def sdpa_backend_names(spec: str) -> tuple[str, ...] | None:
    """The backend names of an --sdpa-backends spec, in order; None for "torch" (no restriction)."""
    if spec.strip() == "torch":
        return None
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    if not names or any(n not in SDPA_BACKEND_NAMES for n in names):
        raise ValueError(f"sdpa_backends {spec!r}: expected torch or a comma list of {', '.join(SDPA_BACKEND_NAMES)}")
    return names


def flag_name(f) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _on_off(text: str) -> bool:
    if text in ("on", "true", "1"):
        return True
    if text in ("off", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def flag_kwargs(f) -> dict:
    """The add_argument keywords of a field's flag: its one default, type, choices and help."""
    kind = f.metadata.get("type") or type(f.default)
    kw: dict = {"dest": f.name, "default": f.default,
                "help": f.metadata["help"] if f.default is None else
                f"{f.metadata['help']} (default: {format_value(f.default)})"}
    if kind is bool:
        # `--flag` alone is on, as vLLM's switches (`--trust-remote-code`)
        kw.update(type=_on_off, metavar="{on,off}", nargs="?", const=True)
    else:
        kw["type"] = kind
        if f.metadata.get("choices"):
            kw["choices"] = list(f.metadata["choices"])
        else:
            kw["metavar"] = flag_name(f)[2:].upper().replace("-", "_")
    if f.metadata.get("metavar"):
        kw["metavar"] = f.metadata["metavar"]
    return kw


def default_of(name: str):
    """The one default of a RuntimeConfig field (the operator and SchedulerConfig take theirs here)."""
    return next(f.default for f in fields(RuntimeConfig) if f.name == name)


def config_fields(exclude: tuple[str, ...] = (), sections: tuple[str, ...] = tuple(SECTIONS)) -> list:
    """The RuntimeConfig fields of `sections`, but the `exclude`d ones."""
    return [f for f in fields(RuntimeConfig) if f.name not in exclude and f.metadata["section"] in sections]


def add_config_flags(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                     sections: tuple[str, ...] = tuple(SECTIONS)) -> None:
    """One flag per RuntimeConfig field of `sections` (but `exclude`d ones), a group per section."""
    for name in sections:
        group = parser.add_argument_group(f"{name} ({SECTIONS[name]})")
        for f in config_fields(exclude, (name,)):
            assert f.default is not MISSING, f.name
            group.add_argument(flag_name(f), **flag_kwargs(f))


def config_from_args(args: argparse.Namespace, **overrides) -> RuntimeConfig:
    """The RuntimeConfig of parsed flags (fields without a flag keep their defaults; an unset one
    with an `env` variable takes its value); a bad value raises ValueError with a one-line message."""
    values = {f.name: getattr(args, f.name) for f in fields(RuntimeConfig) if hasattr(args, f.name)}
    for f in fields(RuntimeConfig):
        if f.metadata.get("env") and values.get(f.name) is None and os.environ.get(f.metadata["env"]):
            values[f.name] = os.environ[f.metadata["env"]]
    return RuntimeConfig(**{**values, **overrides})


def format_value(value) -> str:
    """A value as its flag spells it ("unset" for None, which has no spelling: the flag is left out)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def config_env(config: RuntimeConfig, role: str) -> dict[str, str]:
    """The environment variables that hand a role the set fields it takes that have one."""
    return {f.metadata["env"]: str(getattr(config, f.name)) for f in fields(config)
            if f.metadata.get("env") and getattr(config, f.name) is not None and role in f.metadata["roles"]}


def config_args(config: RuntimeConfig, role: str | None = None) -> list[str]:
    """The command-line form of a config: every field's flag and value (only the fields `role`
    takes, when given; unset ones left out): how `hybridcache up` passes its settings to the
    services it starts. For a role, fields with an `env` variable are left out too (config_env)."""
    out: list[str] = []
    for f in fields(config):
        value = getattr(config, f.name)
        if role is not None and f.metadata.get("env"):
            continue
        if value is not None and (role is None or role in f.metadata["roles"]):
            out += [flag_name(f), format_value(value)]
    return out
