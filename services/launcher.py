"""`hybridcache up`: router, N scatter workers, a combine worker and a cache tier as local
processes on 127.0.0.1, the same services the operator runs as pods; with --device cuda the
workers on GPUs (services/devices.py), the router and the cache tier on the CPU."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from hybridcache.services.config import RuntimeConfig, add_config_flags, config_args, config_env, config_from_args
from hybridcache.services.security import DeploymentSecret

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now and not handed out before by this process: the services bind
    their ports only after all are chosen, so the OS could otherwise give one port twice."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free local port found")


@dataclass
class Service:
    role: str
    grpc: str
    http: str
    proc: subprocess.Popen
    log: list[str] = field(default_factory=list)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


class LocalCluster:
    """Start, watch and stop the local services. Every child is stopped on stop() or on error."""

    def __init__(self, model_dir: str | Path, port: int = 8000, scatter_workers: int = 2, etcd: str | None = None,
                 config: RuntimeConfig | None = None, env: dict | None = None,
                 extra: dict[str, list[str]] | None = None, ready_timeout_s: float = 120.0, cache_tiers: int = 1,
                 gpus: tuple[int, ...] = (0,), **settings):
        """`config` (with `settings`: RuntimeConfig fields set over it) goes to every service, each
        role getting the fields it takes; `extra` adds flags per role. With device cuda the workers
        take the `gpus` round robin (services/devices.py)."""
        from hybridcache.services.devices import place_services

        if scatter_workers < 0:
            raise ValueError("scatter_workers must be >= 0")
        if cache_tiers < 1:
            raise ValueError("cache_tiers must be >= 1")
        self.n_tiers = cache_tiers
        self.model_dir = str(model_dir)
        self.run_dir = Path(tempfile.mkdtemp(prefix="hybridcache-up-"))
        self.port = port
        self.n_scatter = scatter_workers
        self.etcd = etcd
        self.config = replace(config or RuntimeConfig(), **settings)
        # One deployment secret per run (unless given), in a file only this user can read: the
        # children read it from there, so it shows in no argument list and no environment.
        if self.config.secret_file is None:
            self.secret = DeploymentSecret.generate()
            self.config = replace(self.config, secret_file=str(self.secret.write(self.run_dir / "secret")))
            self._own_secret = True
        else:
            self.secret = DeploymentSecret.load(self.config.secret_file) if Path(
                self.config.secret_file).is_file() else None
            self._own_secret = False
        # Several torch processes share the cores: one intra-op thread each avoids oversubscription.
        self.env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.extra = extra or {}
        self.timeout = ready_timeout_s
        self.services: list[Service] = []
        # start order of the workers: the combine worker takes the first GPU
        placed = place_services(["cache-tier", "router", "combine"] + ["scatter"] * scatter_workers,
                                self.config.device, gpus)
        self.placement = {"cache-tier": placed[0], "router": placed[1], "combine": placed[2]}
        self.scatter_placement = placed[3:]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, role: str, grpc_port: int, http_port: int, flags: list[str], env: dict | None = None,
               placement=None) -> Service:
        placement = placement or self.placement[role]
        env = dict(placement.env, **(env or {}))
        cmd = [sys.executable, "-m", "hybridcache.services.cli", "serve", role, "--grpc-port", str(grpc_port),
               "--http-port", str(http_port), *config_args(self.config, role)]
        if role != "cache-tier":
            cmd += ["--model", self.model_dir]
        if self.etcd:
            cmd += ["--etcd", self.etcd]
        cmd += flags + self.extra.get(role, [])
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(self.env, **config_env(self.config, role), **(env or {})),
                                start_new_session=True)
        svc = Service(role, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", proc)
        self.services.append(svc)
        return svc

    def _wait_ready(self, svc: Service) -> None:
        deadline = time.monotonic() + self.timeout
        ready = threading.Event()

        def drain():
            for line in svc.proc.stdout:
                svc.log.append(line.rstrip())
                del svc.log[:-200]
                if line.startswith('{"ready"'):
                    ready.set()

        threading.Thread(target=drain, daemon=True).start()
        while not ready.wait(0.05):
            if svc.proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(svc.log[-15:])
                raise RuntimeError(f"{svc.role} did not become ready (exit {svc.proc.poll()}):\n{tail}")

    def start(self, scatter_env: list[dict] | None = None) -> LocalCluster:
        try:
            tiers = [self._spawn("cache-tier", free_port(), free_port(), []) for _ in range(self.n_tiers)]
            scatters = [self._spawn("scatter", free_port(), free_port(), [],
                                    env=(scatter_env or [{}] * self.n_scatter)[i] if scatter_env else None,
                                    placement=self.scatter_placement[i])
                        for i in range(self.n_scatter)]
            combine = self._spawn("combine", free_port(), free_port(), [])
            for s in [*tiers, *scatters, combine]:
                self._wait_ready(s)
            flags = ["--combine", combine.grpc]
            for t in tiers:
                flags += ["--cache-tier", t.grpc]
            for s in scatters:
                flags += ["--scatter", s.grpc]
            router = self._spawn("router", free_port(), self.port, flags)
            self._wait_ready(router)
        except BaseException:
            self.stop()
            raise
        return self

    def role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]

    def stop(self) -> None:
        for s in reversed(self.services):
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for s in self.services:
            try:
                s.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                s.kill()
        if self._own_secret:
            (self.run_dir / "secret").unlink(missing_ok=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def up(args) -> int:
    from hybridcache.services.runtime.modelzoo import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    if not (model / "config.json").is_file():
        print(f"hybridcache: error: no model (config.json) in {model}", file=sys.stderr)
        return 2
    try:
        from hybridcache.services.devices import parse_gpus
        from hybridcache.services.router.router import served_max_model_len
        from hybridcache.services.runtime.config import ModelConfig

        # bad values: one line, exit 2, before anything starts
        config = config_from_args(args)
        served_max_model_len(ModelConfig.from_dir(model), config.max_model_len)
        gpus = parse_gpus(args.gpus)
        if config.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda given but no CUDA device is visible")
            if max(gpus) >= torch.cuda.device_count():
                raise ValueError(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
        if args.ready_timeout_s <= 0:
            raise ValueError(f"--ready-timeout-s must be positive, got {args.ready_timeout_s}")
        cluster = LocalCluster(model, port=args.port, scatter_workers=args.scatter_workers, etcd=args.etcd,
                               config=config, cache_tiers=args.cache_tiers, gpus=gpus,
                               ready_timeout_s=args.ready_timeout_s)
    except ValueError as e:
        print(f"hybridcache: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    where = "on the CPU"
    if cluster.config.device == "cuda":
        gpus_of = [f"combine: GPU {cluster.placement['combine'].gpu}"]
        gpus_of += [f"scatter {i}: GPU {p.gpu}" for i, p in enumerate(cluster.scatter_placement)]
        where = f"on CUDA ({', '.join(gpus_of)}; router and cache tier on the CPU)"
    print(f"hybridcache up: starting {args.cache_tiers} cache tier(s), {args.scatter_workers} scatter worker(s), "
          f"a combine worker and router for {model} {where}", file=sys.stderr, flush=True)
    try:
        cluster.start()
    except RuntimeError as e:
        print(f"hybridcache: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    print(json.dumps({"ready": True, "http": cluster.url, "services": [
        {"role": s.role, "grpc": s.grpc, "http": s.http, "pid": s.proc.pid} for s in cluster.services]}), flush=True)
    print(f"hybridcache up: ready at {cluster.url} (OpenAI /v1, SGLang /generate, /metrics); Ctrl-C stops",
          file=sys.stderr, flush=True)
    try:
        while not stop.wait(0.5):
            dead = [s for s in cluster.services if s.proc.poll() is not None]
            if dead:
                print(f"hybridcache up: {dead[0].role} exited with {dead[0].proc.returncode}; stopping",
                      file=sys.stderr, flush=True)
                return 1
    finally:
        cluster.stop()
        print("hybridcache up: stopped", file=sys.stderr, flush=True)
    return 0


def add_up_flags(p) -> None:
    p.add_argument("--gpus", help="with --device cuda: GPU indices the workers take round robin (default 0)")
    p.add_argument("--model", help="model directory (default: the embedded default model)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the router")
    p.add_argument("--scatter-workers", type=int, default=2)
    p.add_argument("--cache-tiers", type=int, default=1,
                   help="cache-tier processes (entries spread over them by consistent hashing)")
    p.add_argument("--etcd", help="etcd endpoint HOST:PORT (default: in-process directory)")
    p.add_argument("--ready-timeout-s", type=float, default=120.0,
                   help="how long each service may take to load its model (and warm up) and say ready")
    add_config_flags(p)  # each forwarded to the services that take it


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def demo_serve(args, sample: dict, question: str, expected: str) -> int:
    """`hybridcache demo --serve`: run `hybridcache up`, send the sample RAG request twice over HTTP
    (documents reordered the second time), then stop the services with SIGTERM."""
    from hybridcache.services.runtime.modelzoo import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    port = free_port()
    cmd = [sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model), "--port", str(port),
           *config_args(config_from_args(args))]
    print("$ hybridcache up --port", port, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if not line.startswith('{"ready"'):
            print("hybridcache: error: `hybridcache up` did not become ready", file=sys.stderr)
            return 1
        url = json.loads(line)["http"]
        print(f"{len(sample['segments'])} documents; question: {question!r} (expected answer {expected!r})")
        for attempt, segments in (("first", sample["segments"]),
                                  ("second, documents reordered", sample["segments"][::-1])):
            res = _post(f"{url}/generate", dict(sample, segments=segments))
            st = res["hybridcache"]
            hits = sum(s["hit"] for s in st["segments"])
            where = ", ".join(s["source"] for s in st["segments"])
            print(f"\n[{attempt}] POST {url}/generate -> {res['text']!r}")
            print(f"  prompt {st['prompt_tokens']} tokens: reused {st['reused_tokens']}, live {st['live_tokens']}, "
                  f"built {st['built_tokens']}; segments hit {hits}/{len(st['segments'])} ({where}); "
                  f"ttft {st['ttft_ms']:.1f} ms")
        print(flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0
