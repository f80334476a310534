"""`hybridcache serve ROLE`: one service process (router, combine, scatter or cache-tier).

Each role listens for gRPC on --grpc-port and serves /health and /metrics (the router: the whole
HTTP API) on --http-port, registers itself in the directory (etcd with --etcd, else in-process
with the peers given by flags), prints one `ready` line and runs until SIGINT/SIGTERM.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from hybridcache.services import security
from hybridcache.services.config import add_config_flags, config_from_args
from hybridcache.services.contract import ROLES
from hybridcache.services.devices import WORKER_ROLES, DeviceMemoryError, starting, warm_up_measured
from hybridcache.services.directory import make_directory
from hybridcache.services.observability import metrics, tracing
from hybridcache.services.observability.http import serve_health_and_metrics
from hybridcache.services.observability.stats import stage
from hybridcache.services.protocol import rpc

log = logging.getLogger("hybridcache.serve")


def add_serve_flags(p) -> None:
    p.add_argument("role", choices=sorted(ROLES), help="which service this process runs")
    p.add_argument("--model", help="model directory (HF format); default: the embedded default model")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on and to register")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default: the role's port in services/contract.py)")
    p.add_argument("--http-port", type=int, help="HTTP port: the API on the router, /health and /metrics elsewhere")
    p.add_argument("--etcd", help="etcd endpoint HOST:PORT (default: in-process directory from the flags below)")
    p.add_argument("--router", help="router gRPC address (informational for workers)")
    p.add_argument("--combine", action="append", default=[], help="combine worker gRPC address (repeatable)")
    p.add_argument("--cache-tier", action="append", default=[], help="cache-tier gRPC address (repeatable)")
    p.add_argument("--scatter", action="append", default=[], help="scatter worker gRPC address (repeatable)")
    p.add_argument("--spill-dir", help="cache tier: spill evicted entries to this directory")
    p.add_argument("--assignment", default="lpt", choices=["lpt", "round_robin"], help="router: cold-segment dispatch")
    p.add_argument("--otlp-endpoint", help="OTLP/gRPC endpoint for traces")
    p.add_argument(
        "--warmup",
        default="auto",
        choices=["auto", "on", "off"],
        help="scatter/combine: run synthetic requests through every kernel path before registering "
        "(/health answers 503 meanwhile); auto = on with --device cuda, where kernels compile on first use",
    )
    p.add_argument("--die-with-parent", type=int, metavar="PID",
                   help="exit (SIGTERM) when the process PID that started this one dies (`hybridcache up` "
                   "gives its own pid)")
    add_config_flags(p)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel for SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG; set after exec, so it
    holds for this process), then exit now if it is already gone. The signal follows the parent
    *thread* that started this process: `hybridcache up` starts every child from its main thread."""
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        raise SystemExit(0)


def role_config(config, role: str):
    """The settings a role's engine runs with: a scatter worker only builds entries (recording
    passes, never from CUDA graphs) and decodes nothing, so its CUDA graphs of assemblies and decode
    steps are off (they would hold its GPU memory for nothing)."""
    if role == "scatter":
        return dataclasses.replace(config, cuda_graphs=False, decode_cuda_graphs=False)
    return config


# combine workers' worth of seats and queues the router's gRPC door holds threads for
ROUTER_DOOR_COMBINES = 4


def grpc_threads(role: str, config) -> int:
    """Threads of a role's gRPC server. A streamed Generate holds one for its whole request, and a
    call that finds none waits, unseen, for one to free: a combine worker gets one for every
    request it may hold (--max-num-seqs running, --max-waiting queued), the router's door as many
    for each of ROUTER_DOOR_COMBINES combine workers (its admission refuses past their seats and
    queues: a refusal needs a thread too, hence the margin, which also holds the combine worker's
    routers' Tokens streams, one each); the other roles answer short calls."""
    held = config.max_num_seqs + config.max_waiting
    if role == "combine":
        return max(32, held + 8)
    if role == "router":
        return max(32, ROUTER_DOOR_COMBINES * held + 8)
    return 32


def _engine(config, model_dir: str):
    """The role's engine. Cache budgets not given are sized once the model is loaded, from the
    device memory it left free (devices.with_cache_budgets), and stated in the log."""
    import torch
    from hybridcache.services.devices import with_cache_budgets
    from hybridcache.services.runtime.engine import Engine
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.tokenizer import Tokenizer

    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda given but no CUDA device is visible")
    if config.tensor_parallel_size > 1:
        from hybridcache.services.runtime.tensor_parallel.ranks import open_engine

        # rank 0 of a group this process starts (tensor_parallel/ranks.py): its Engine over every rank's runner
        return open_engine(model_dir, config)
    model = load_model(model_dir, config.device, config.torch_dtype)
    config = with_cache_budgets(config, model.device)
    return Engine(model, Tokenizer.from_dir(model_dir), config)


def warmup_kv_bytes(engine, config) -> int:
    """A planned worker's provisional K/V budget: room for its longest warm-up request (its warm-up
    shape, else the small ones) and a chunk of new tokens, twice over; at most a budget given."""
    from hybridcache.services.runtime.scheduler import KV_CHUNK_TOKENS, kv_bytes_per_token

    shape = engine.warmup_shape()
    tokens = max(shape[0] + shape[1] * shape[2] + shape[3] + 3 if shape else 0, 8 * (config.seam_window + 160))
    need = 2 * (tokens + KV_CHUNK_TOKENS) * kv_bytes_per_token(engine.model)
    return min(need, config.kv_cache_bytes) if config.kv_cache_bytes else need


def serve(args) -> int:
    """Run the role until SIGINT/SIGTERM; a bad flag, model or port is one error line and status 2."""
    if args.die_with_parent:
        die_with_parent(args.die_with_parent)
    try:
        return _serve(args)
    except (ValueError, OSError, DeviceMemoryError) as e:
        print(f"hybridcache: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def _serve(args) -> int:
    from hybridcache.services.runtime.modelzoo import default_model_dir

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {args.role} %(levelname)s %(message)s")
    config = config_from_args(args)
    if args.model is None and args.role != "cache-tier":
        args.model = str(default_model_dir())
    ports = ROLES[args.role]
    grpc_port = args.grpc_port or ports.grpc
    http_port = args.http_port if args.http_port is not None else ports.http
    address = f"{args.host}:{grpc_port}"
    tracing.setup_tracing(args.role, args.otlp_endpoint)
    metrics.watch_gc()  # each collection's pause in hybridcache_gc_pause_seconds and the requests' stats
    if args.role != "cache-tier":
        metrics.bind_model(config.served_model_name or Path(args.model).name)  # vLLM-named series' label
    if config.secret_file is None:
        raise security.SecretError("no deployment secret: --secret-file names the file that holds it "
                                   "(`hybridcache up` and the operator make one)")
    secret = security.DeploymentSecret.load(config.secret_file)
    security.install(secret)
    directory = make_directory(args.etcd, {"combine": args.combine, "cache-tier": args.cache_tier,
                                           "scatter": args.scatter})
    # Workers and the cache tier answer members of the deployment only; the router's gRPC door is
    # the public Inference service.
    interceptors = [security.TokenInterceptor(secret.token)]
    api_keys = []
    if args.role == "router":
        api_keys = security.load_api_keys(config.api_key, config.api_key_file)
        interceptors = [security.ApiKeyInterceptor(api_keys)] if api_keys else []
    options = security.INTERNAL_GRPC_OPTIONS
    if args.role == "router":
        # the public door reads no message over the request limit (gRPC answers RESOURCE_EXHAUSTED)
        options = [("grpc.max_receive_message_length", config.max_request_bytes),
                   ("grpc.max_send_message_length", 1 << 30)]
    server = grpc.server(ThreadPoolExecutor(max_workers=grpc_threads(args.role, config)), options=options,
                         interceptors=interceptors)
    # /health (the router's own HTTP API aside) is up from the start and says 503 ("starting",
    # "warming up") until the role serves
    health = {"status": "starting", "role": args.role, "address": address}
    http_runner = None
    warm = args.role in ("scatter", "combine") and (
        args.warmup == "on" or (args.warmup == "auto" and config.device == "cuda")
    )
    if args.role != "router":
        serve_health_and_metrics(args.host, http_port, lambda: dict(health, directory=directory.backend),
                                 idle_timeout_s=config.http_header_timeout_s)
    engine = combine = scatter = None
    # a combine worker on one GPU sizes its caches from what its warm-up measured (CombineServicer.plan_memory)
    plans = args.role == "combine" and warm and config.device == "cuda" and config.tensor_parallel_size == 1
    config = role_config(config, args.role)
    if args.role in WORKER_ROLES:
        with stage("loading the model %s on %s", args.model, config.device):
            engine = starting("loading the model", config.device, config.gpu_memory_utilization,
                              lambda: _engine(config, args.model))

    if args.role == "cache-tier":
        from hybridcache.services.cache_tier.server import CacheTierServicer
        from hybridcache.services.cache_tier.store import TierStore, return_freed_entries

        return_freed_entries()  # its resident memory follows the entries it holds (store.py)
        store = TierStore(config.tier_cache_bytes, args.spill_dir)
        rpc.add_CacheTierServicer_to_server(CacheTierServicer(store), server)
    elif args.role == "scatter":
        from hybridcache.services.scatter.worker import ScatterServicer

        scatter = ScatterServicer(engine, config.max_num_batched_tokens, arena_bytes=config.ipc_arena_bytes,
                                  members=directory.members)
        rpc.add_ScatterServicer_to_server(scatter, server)
    elif args.role == "combine":
        from hybridcache.services.combine.worker import CombineServicer
        from hybridcache.services.runtime.scheduler import scheduler_config

        # a worker that plans its memory (CombineServicer.plan_memory) warms up over a provisional K/V
        # budget, just enough for its warm-up requests, and sizes its caches from what that measured
        provisional = warmup_kv_bytes(engine, config) if plans else None
        combine = CombineServicer(engine, dtype=config.dtype,
                                  scheduling=scheduler_config(config, engine.model.device, provisional),
                                  members=directory.members)
        rpc.add_CombineServicer_to_server(combine, server)
    else:
        from hybridcache.services.api.grpc_inference import InferenceServicer
        from hybridcache.services.router.router import Router, RouterConfig

        router = Router(args.model, directory, RouterConfig(assignment=args.assignment), config)
        inference = InferenceServicer(router, api_keys)
        rpc.add_InferenceServicer_to_server(inference, server)

    if args.role == "router" and config.tls_certfile:
        bound = server.add_secure_port(address, grpc.ssl_server_credentials([_key_and_cert(config)]))
    else:
        bound = server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")
    if engine is not None and warm:
        # before the server starts and registers: no request comes here until the kernels are built
        health["status"] = "warming up"
        with stage("warm-up"):
            health["warmup"] = warm_up_measured(config.device, config.gpu_memory_utilization,
                                                (combine or scatter).warmup)
        log.info("warm-up done: %s", health["warmup"])
        if plans:
            health["memory"] = starting("planning its memory", config.device, config.gpu_memory_utilization,
                                        lambda: combine.plan_memory(config, health["warmup"]))
    # What the process holds by now (the model, its kernels and CUDA graphs, the libraries) lives
    # as long as it does: frozen out of the collector's sight, so that the full collections Python
    # runs by itself now and then, on some request's path, walk only what requests made (a warm
    # worker of the shipped model tracks ~300k objects, a full collection of which took 104 ms on
    # a 2-core CPU, 0 ms frozen: gc_pause_cpu_ac05456.json, tools/gc_pause.py)
    gc.collect()
    gc.freeze()
    health["gc_frozen_objects"] = gc.get_freeze_count()
    server.start()
    health["status"] = "ok"
    if args.role == "router":
        # Serve at once; /health says 503 until a combine worker has answered (pods start in any order).
        threading.Thread(target=router.connect, kwargs={"timeout_s": float("inf")}, daemon=True).start()
        http_runner = _start_api(router, args, http_port, config, api_keys)
    directory.register(args.role, address)
    stop = threading.Event()
    if combine is not None and config.stats_interval_s > 0:
        combine.stats.run(stop)
    if args.role in ("combine", "router"):
        # the scatter workers' Endpoints (their Describe) asked as they join, not on a request's path
        holder = combine if args.role == "combine" else router
        holder._scatter_endpoints.watch(lambda: directory.members("scatter"), stop)
    if args.role in ("cache-tier", "scatter"):
        # Writers of shared-memory blocks clean up after receivers that died before reading them.
        from hybridcache.services.transport.shm import sweep_stale

        def sweep():
            while not stop.wait(60.0):
                sweep_stale()

        threading.Thread(target=sweep, name="shm-sweeper", daemon=True).start()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(json.dumps({"ready": args.role, "grpc": address, "http": f"{args.host}:{http_port}",
                      "pid": os.getpid(), "host": socket.gethostname()}), flush=True)
    stop.wait()
    directory.deregister(args.role, address)
    directory.close()
    # The router drains: both doors stop listening at once, requests in flight get the grace period.
    grace = config.drain_grace_s if args.role == "router" else 1.0
    if args.role == "router":
        log.info("draining: in-flight requests have %s s", grace)
    if args.role == "router":
        # both doors stop taking requests at once; those still running when the grace ends get an
        # error (SSE error event, 503, gRPC UNAVAILABLE) before their connections close: the gRPC
        # server's own end of the grace (which closes what is left) comes a moment after ours
        stopped = server.stop(grace=grace + 3)
        threading.Thread(target=inference.drain, args=(grace,), name="drain", daemon=True).start()
        http_runner()
    else:
        stopped = server.stop(grace=grace)
    stopped.wait()
    if combine is not None:
        combine.close()
    if getattr(engine, "group", None) is not None:
        engine.group.shutdown()  # the tensor-parallel followers this process started
    gc.unfreeze()  # the interpreter's last collection sees everything again as it exits
    return 0


def _key_and_cert(config) -> tuple[bytes, bytes]:
    with open(config.tls_keyfile, "rb") as k, open(config.tls_certfile, "rb") as c:
        return k.read(), c.read()


def _tls_context(config):
    """The HTTPS context of --tls-certfile/--tls-keyfile, None without them (a bad file: OSError)."""
    if not config.tls_certfile:
        return None
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(config.tls_certfile, config.tls_keyfile)
    return ctx


def _start_api(router, args, http_port: int, config, api_keys: list[str]):
    """Run the aiohttp app in its own thread; returns a function that stops it."""
    import asyncio

    from hybridcache.services.api.http import Api, start_server

    loop = asyncio.new_event_loop()
    from hybridcache.services.api.chat_template import ChatTemplate

    template = ChatTemplate.load(args.model, config.chat_template)
    api = Api(router, served_model=config.served_model_name or Path(args.model).name, config=config,
              api_key=api_keys, chat_template=template)
    runner = loop.run_until_complete(start_server(api.app(), args.host, http_port, config, _tls_context(config)))
    threading.Thread(target=loop.run_forever, name="http", daemon=True).start()

    async def drain():
        for site in list(runner.sites):
            await site.stop()  # no new connections
        ended = await api.drain(config.drain_grace_s)
        if ended:
            log.info("drain: %d request(s) still running at the end of the grace ended with an error", ended)
        await runner.cleanup()  # closes the connections

    def stop():
        asyncio.run_coroutine_threadsafe(drain(), loop).result(timeout=config.drain_grace_s + 15)
        loop.call_soon_threadsafe(loop.stop)

    return stop
