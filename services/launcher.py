"""`hybridcache up`: router, N scatter workers, a combine worker and a cache tier as local
processes on 127.0.0.1, the same services the operator runs as pods; with --device cuda the
workers on GPUs (services/devices.py), the router and the cache tier on the CPU."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from hybridcache.services.config import RuntimeConfig, add_config_flags, config_args, config_env, config_from_args
from hybridcache.services.devices import place_services, utilization_per_worker
from hybridcache.services.observability.stats import FORWARDED
from hybridcache.services.security import DeploymentSecret

_HANDED_OUT: set[int] = set()
_PORT_FLOOR = 20000


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux: 32768 unless configured)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def reserve_port(port: int) -> None:
    """Never hand out `port` from free_port() in this process (a port the caller chose)."""
    _HANDED_OUT.add(port)


def free_port() -> int:
    """A port free on 127.0.0.1 now and not handed out before by this process: the services bind
    their ports only after all are chosen, so the OS could otherwise give one port twice. Chosen
    below the kernel's ephemeral range where there is room, so that an outgoing connection made
    between choosing and binding (the services connect to each other while the later ones start)
    cannot take it; the ephemeral range itself is the fallback."""
    width = _ephemeral_low() - _PORT_FLOOR
    if width >= 1000:
        # from a random start (processes choosing at once rarely meet), every port of the window once
        start = random.randrange(width)
        for i in range(width):
            port = _PORT_FLOOR + (start + i) % width
            if port not in _HANDED_OUT and _bindable(port):
                _HANDED_OUT.add(port)
                return port
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise RuntimeError("no free local port found")


def connectable(host: str) -> str:
    """The address a local client reaches a server listening on `host` at (a wildcard: loopback)."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def ready_timeout(device: str, model_dir: str | Path) -> tuple[float, str]:
    """(seconds, why) a service may take to load its model, warm up and say ready: 120 s on the CPU
    and 600 s on CUDA (kernels compile and autotune, CUDA graphs are captured: a 9B model's
    warm-up on an H100 takes minutes), plus 30 s per GB of weights (read from disk, copied to the
    device, and on CUDA warmed up at that size)."""
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    base = 600.0 if device == "cuda" else 120.0
    seconds = base + 30.0 * weights / 1e9
    where = "CUDA" if device == "cuda" else "the CPU"
    return round(seconds), (f"{base:.0f} s on {where} plus 30 s per GB of the model's {weights / 1e9:.2f} GB of "
                            f"weights; --ready-timeout-s sets it")


@dataclass
class Service:
    """One child: its role, addresses and log file; `proc` is replaced when it is restarted."""

    role: str
    grpc: str
    http: str
    proc: subprocess.Popen
    cmd: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    log_path: Path | None = None
    log_offset: int = 0  # where the current process's output starts in the log file
    shown: int = 0  # how far in the log file LocalCluster.forward has read
    last_progress: str = ""  # the current process's latest progress line (its start-up stage)
    started_at: float = 0.0
    restarts: int = 0
    backoff_s: float = 0.0
    restart_at: float | None = None  # when a dead child is started again
    ready: bool = False

    @property
    def name(self) -> str:
        """The role and its index among the services of that role (its log file's name)."""
        return self.log_path.stem if self.log_path is not None else self.role

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def output(self) -> str:
        """What the current process has written to its log so far."""
        if self.log_path is None:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self.log_offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def tail(self, n: int = 15) -> str:
        return "\n".join(self.output().splitlines()[-n:])


class LocalCluster:
    """Start, watch and stop the local services. Every child is stopped on stop() or on error; each
    one writes its output to its own file in `log_dir` (default: `logs/` in the run's temporary
    directory); supervise() restarts those that died."""

    RESTART_BACKOFF_S = (1.0, 30.0)  # first and longest wait before a restart (doubling)
    STABLE_S = 60.0  # a child that ran this long starts its backoff again from the first wait

    def __init__(self, model_dir: str | Path, port: int = 8000, scatter_workers: int = 2, etcd: str | None = None,
                 config: RuntimeConfig | None = None, env: dict | None = None,
                 extra: dict[str, list[str]] | None = None, ready_timeout_s: float | None = None,
                 cache_tiers: int = 1, gpus: tuple[int, ...] = (0,), log_dir: str | Path | None = None,
                 host: str = "127.0.0.1", **settings):
        """`config` (with `settings`: RuntimeConfig fields set over it) goes to every service, each
        role getting the fields it takes; `extra` adds flags per role. With device cuda the workers
        take the `gpus` round robin (services/devices.py). The router listens on `host` (both
        doors), the other services on 127.0.0.1. `ready_timeout_s`: how long each service may take
        to say ready (default: ready_timeout for the device and the model's size)."""
        if scatter_workers < 0:
            raise ValueError("scatter_workers must be >= 0")
        if cache_tiers < 1:
            raise ValueError("cache_tiers must be >= 1")
        self.n_tiers = cache_tiers
        self.model_dir = str(model_dir)
        self.run_dir = Path(tempfile.mkdtemp(prefix="hybridcache-up-"))
        self.log_dir = Path(log_dir) if log_dir else self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.host = host
        reserve_port(port)
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
        # The variables that carry a secret setting (the API key) are left out: a child gets those of
        # the settings it takes alone (config_env), so the key reaches the router and no other child.
        secret_vars = {f.metadata["env"] for f in fields(RuntimeConfig) if f.metadata.get("env")}
        self.env = {k: v for k, v in os.environ.items() if k not in secret_vars}
        self.env.update(OMP_NUM_THREADS="1", **(env or {}))
        self.extra = extra or {}
        self.say = None  # where forward() shows the services' progress and stats lines (`up`: stderr)
        self.timeout, self.timeout_basis = ready_timeout(self.config.device, model_dir)
        if ready_timeout_s is not None:
            self.timeout, self.timeout_basis = ready_timeout_s, "as --ready-timeout-s set it"
        self.services: list[Service] = []
        # start order of the workers: the combine worker takes the first GPU
        placed = place_services(["cache-tier", "router", "combine"] + ["scatter"] * scatter_workers,
                                self.config.device, gpus)
        self.placement = {"cache-tier": placed[0], "router": placed[1], "combine": placed[2]}
        self.scatter_placement = placed[3:]
        # workers on one GPU split its --gpu-memory-utilization: each sizes its caches from its own
        # part, so their pools cannot overlap whichever loads first
        self.utilization = utilization_per_worker(placed, self.config.gpu_memory_utilization,
                                                  self.config.tensor_parallel_size)

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls_certfile else "http"
        return f"{scheme}://{connectable(self.host)}:{self.port}"

    def _spawn(self, role: str, grpc_port: int, http_port: int, flags: list[str], env: dict | None = None,
               placement=None) -> Service:
        placement = placement or self.placement[role]
        env = dict(placement.env, **(env or {}))
        config = self.config
        if placement.gpu is not None:
            config = replace(config, gpu_memory_utilization=round(self.utilization[placement.gpu], 6))
        host = self.host if role == "router" else "127.0.0.1"
        cmd = [sys.executable, "-m", "hybridcache.services.cli", "serve", role, "--host", host,
               "--grpc-port", str(grpc_port), "--http-port", str(http_port), "--die-with-parent", str(os.getpid()),
               *config_args(config, role)]
        if role != "cache-tier":
            cmd += ["--model", self.model_dir]
        if self.etcd:
            cmd += ["--etcd", self.etcd]
        cmd += flags + self.extra.get(role, [])
        n = sum(s.role == role for s in self.services)
        svc = Service(role, f"{connectable(host)}:{grpc_port}", f"{connectable(host)}:{http_port}", None, cmd=cmd,
                      env=dict(self.env, **config_env(self.config, role), **env),
                      log_path=self.log_dir / f"{role}-{n}.log")
        self._launch(svc)
        self.services.append(svc)
        return svc

    def _launch(self, svc: Service) -> None:
        """Start (or start again) the child's process, its output appended to its log file."""
        with open(svc.log_path, "ab") as log:
            svc.log_offset = svc.shown = log.tell()
            svc.last_progress = ""
            # The child's parent-death signal follows this thread: children are started from the
            # thread that runs start() and supervise() (up's main thread).
            svc.proc = subprocess.Popen(svc.cmd, stdout=log, stderr=subprocess.STDOUT, env=svc.env,
                                        start_new_session=True)
        svc.started_at, svc.ready, svc.restart_at = time.monotonic(), False, None

    def _is_ready(self, svc: Service) -> bool:
        if not svc.ready:
            svc.ready = any(line.startswith('{"ready"') for line in svc.output().splitlines())
        return svc.ready

    def _wait_ready(self, svc: Service, deadline: float) -> None:
        while not self._is_ready(svc):
            self.forward()
            if svc.proc.poll() is not None:
                raise RuntimeError(f"{svc.role} did not become ready (exit {svc.proc.poll()}; log {svc.log_path}):\n"
                                   f"{svc.tail()}")
            if time.monotonic() > deadline:
                stage = f"; its last progress: {svc.last_progress}" if svc.last_progress else ""
                raise RuntimeError(f"{svc.name} did not become ready within {self.timeout:g} s "
                                   f"({self.timeout_basis}){stage}; log {svc.log_path}:\n{svc.tail()}")
            time.sleep(0.05)
        self.forward()

    def forward(self) -> None:
        """Show the services' progress, stats and request-log lines (observability/stats.py) that
        their logs gained since the last call, each as `self.say("ROLE-N: LINE")` (nothing is read
        while `say` is None)."""
        say = self.say
        if say is None:
            return
        for svc in self.services:
            if svc.log_path is None:
                continue
            try:
                with open(svc.log_path, "rb") as f:
                    f.seek(svc.shown)
                    data = f.read()
            except FileNotFoundError:
                continue
            whole = data.rfind(b"\n") + 1  # a line still being written waits for the next call
            svc.shown += whole
            for line in data[:whole].decode(errors="replace").splitlines():
                m = FORWARDED.match(line)
                if m is None:
                    continue
                if m.group(1).startswith("progress: "):
                    svc.last_progress = m.group(1).removeprefix("progress: ")
                say(f"{svc.name}: {m.group(1)}")

    def start(self, scatter_env: list[dict] | None = None) -> LocalCluster:
        try:
            tiers = [self._spawn("cache-tier", free_port(), free_port(), []) for _ in range(self.n_tiers)]
            # workers dial only members of the deployment: they are told the tiers (and the combine
            # worker the scatter workers) as the router is
            tier_flags = [f for t in tiers for f in ("--cache-tier", t.grpc)]
            scatters = [self._spawn("scatter", free_port(), free_port(), tier_flags,
                                    env=(scatter_env or [{}] * self.n_scatter)[i] if scatter_env else None,
                                    placement=self.scatter_placement[i])
                        for i in range(self.n_scatter)]
            # the combine worker is told the scatter workers too: it asks each one's Describe in the
            # background as they come up (ScatterEndpoints.watch), not on its first request's path
            combine = self._spawn("combine", free_port(), free_port(),
                                  [f for s in scatters for f in ("--scatter", s.grpc)] + tier_flags)
            # the router starts with the workers (it asks the combine worker's Info in the
            # background until it answers), so its start-up overlaps their model loading
            flags = ["--combine", combine.grpc]
            for t in tiers:
                flags += ["--cache-tier", t.grpc]
            for s in scatters:
                flags += ["--scatter", s.grpc]
            router = self._spawn("router", free_port(), self.port, flags)
            deadline = time.monotonic() + self.timeout  # the services start at once: one deadline
            for s in [*tiers, *scatters, combine, router]:
                self._wait_ready(s, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def supervise(self, say=print) -> list[Service]:
        """One round of supervision (call it every fraction of a second): a child that exited is
        started again on its own ports after a backoff (1 s, doubling to 30 s; back to 1 s once it
        has run a minute), with `say` telling what happened and where its log is. Returns the
        children that became ready again in this round. Meanwhile the others serve: a dead scatter
        worker's segments are built by the combine worker, a dead tier is a miss, and without a
        combine worker the router answers 503."""
        back = []
        now = time.monotonic()
        for svc in self.services:
            code = svc.proc.poll()
            if code is None:
                if not svc.ready and self._is_ready(svc):
                    say(f"hybridcache up: {svc.role} is back (pid {svc.proc.pid}, restart {svc.restarts})")
                    back.append(svc)
                continue
            if svc.restart_at is None:
                first, longest = self.RESTART_BACKOFF_S
                ran = now - svc.started_at
                svc.backoff_s = first if ran >= self.STABLE_S or not svc.backoff_s else min(longest, 2 * svc.backoff_s)
                svc.restart_at = now + svc.backoff_s
                say(f"hybridcache up: {svc.role} (pid {svc.proc.pid}) exited with {code} after {ran:.0f} s; "
                    f"restarting in {svc.backoff_s:.0f} s; its log: {svc.log_path}\n{svc.tail(5)}")
            elif now >= svc.restart_at:
                svc.restarts += 1
                self._launch(svc)
        return back

    def role(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]

    def stop(self) -> None:
        """The router first, given the drain grace to finish the requests it has (the workers
        serve them meanwhile), then every other child."""
        routers = [s for s in self.services if s.role == "router"]
        others = [s for s in reversed(self.services) if s.role != "router"]
        for group, grace in ((routers, self.config.drain_grace_s + 10), (others, 10)):
            for s in group:
                if s.proc is not None and s.proc.poll() is None:
                    s.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for s in group:
                if s.proc is None:
                    continue
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
        from hybridcache.services.devices import default_scatter_workers, idle_scatter_workers, parse_gpus
        from hybridcache.services.router.router import served_max_model_len
        from hybridcache.services.runtime.models.registry import config_from_dir

        # bad values: one line, exit 2, before anything starts
        config = config_from_args(args)
        served_max_model_len(config_from_dir(model), config.max_model_len)
        gpus = parse_gpus(args.gpus)
        if config.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda given but no CUDA device is visible")
            if max(gpus) >= torch.cuda.device_count():
                raise ValueError(f"--gpus {args.gpus}: this machine has {torch.cuda.device_count()} GPU(s)")
            if config.tensor_parallel_size > len(gpus):
                # a worker's ranks take its own GPU and the next ones of its visible list, one each
                raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} needs that many GPUs "
                                 f"in --gpus (given: {args.gpus or '0'})")
        if args.ready_timeout_s is not None and args.ready_timeout_s <= 0:
            raise ValueError(f"--ready-timeout-s must be positive, got {args.ready_timeout_s}")
        n_scatter = args.scatter_workers
        if n_scatter is None:
            n_scatter = default_scatter_workers(config.device, gpus, config.tensor_parallel_size)
        cluster = LocalCluster(model, port=args.port, scatter_workers=n_scatter, etcd=args.etcd,
                               config=config, cache_tiers=args.cache_tiers, gpus=gpus,
                               ready_timeout_s=args.ready_timeout_s, log_dir=args.log_dir, host=args.host)
    except ValueError as e:
        print(f"hybridcache: error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    where = "on the CPU"
    if cluster.config.device == "cuda":
        def on(p) -> str:
            return f"GPU {p.gpu} ({cluster.utilization[p.gpu]:.3g} of its memory)"

        gpus_of = [f"combine: {on(cluster.placement['combine'])}"]
        gpus_of += [f"scatter {i}: {on(p)}" for i, p in enumerate(cluster.scatter_placement)]
        where = f"on CUDA ({', '.join(gpus_of)}; router and cache tier on the CPU)"
    print(f"hybridcache up: starting {args.cache_tiers} cache tier(s), {n_scatter} scatter worker(s), "
          f"a combine worker and router for {model} {where}; logs in {cluster.log_dir}", file=sys.stderr, flush=True)
    idle = idle_scatter_workers(cluster.placement["combine"], cluster.scatter_placement, config.scatter_same_gpu,
                                config.tensor_parallel_size)
    if idle:
        print(f"hybridcache up: note: scatter {', '.join(map(str, idle))} on the combine worker's GPU: it builds the "
              f"cold segments itself there (--scatter-same-gpu off), so these take a part of that GPU's memory for "
              f"no build; --scatter-workers {n_scatter - len(idle)} or more GPUs in --gpus avoid it",
              file=sys.stderr, flush=True)
    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # the services' start-up stages, then their stats and request-log lines, on this output
    cluster.say = lambda line: say(f"hybridcache up: {line}")
    try:
        cluster.start()
    except RuntimeError as e:
        # with the failed service's last log lines: they say why (a missing package, a CUDA error)
        print(f"hybridcache: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"ready": True, "http": cluster.url, "services": [
        {"role": s.role, "grpc": s.grpc, "http": s.http, "pid": s.proc.pid} for s in cluster.services]}), flush=True)
    listening = "" if connectable(cluster.host) == cluster.host else f", listening on {cluster.host}"
    say(f"hybridcache up: ready at {cluster.url}{listening} (OpenAI /v1, SGLang /generate, /metrics); Ctrl-C stops")
    try:
        while not stop.wait(0.25):
            cluster.forward()
            for svc in cluster.supervise(say):
                # one line per restarted child on stdout, like the ready line
                print(json.dumps({"restarted": svc.role, "grpc": svc.grpc, "pid": svc.proc.pid,
                                  "restarts": svc.restarts}), flush=True)
    finally:
        say(f"hybridcache up: stopping (the router drains for up to {cluster.config.drain_grace_s} s)")
        cluster.stop()
        say("hybridcache up: stopped")
    return 0


def add_up_flags(p) -> None:
    p.add_argument("--gpus", help="with --device cuda: GPU indices the workers take round robin (default 0)")
    p.add_argument("--model", help="model directory (default: the embedded default model)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port of the router")
    p.add_argument("--scatter-workers", type=int, default=None,
                   help="scatter worker processes (default: 2 on the CPU; with --device cuda one on each GPU of "
                        "--gpus besides the combine worker's, none with --tensor-parallel-size > 1)")
    p.add_argument("--cache-tiers", type=int, default=1,
                   help="cache-tier processes (entries spread over them by consistent hashing)")
    p.add_argument("--etcd", help="etcd endpoint HOST:PORT (default: in-process directory)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the router listens on, its HTTP API and gRPC Inference (0.0.0.0: every interface, "
                   "as a container's published port needs); the other services listen on 127.0.0.1")
    p.add_argument("--ready-timeout-s", type=float, default=None,
                   help="how long the services may take to load the model, warm up and say ready (default: 120 s on "
                   "the CPU, 600 s with --device cuda, plus 30 s per GB of the model's weights)")
    p.add_argument("--log-dir", help="directory of the services' log files, one per service (default: logs/ in "
                   "the run's temporary directory, named at start-up)")
    add_config_flags(p)  # each forwarded to the services that take it


def _post(url: str, body: dict, timeout: float = 120.0, api_key: str | None = None) -> dict:
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def demo_serve(args, sample: dict, question: str, expected: str) -> int:
    """`hybridcache demo --serve`: run `hybridcache up`, send the sample RAG request twice over HTTP
    (documents reordered the second time), then stop the services with SIGTERM."""
    from hybridcache.services.runtime.modelzoo import default_model_dir

    model = Path(args.model) if args.model else default_model_dir()
    port = free_port()
    config = config_from_args(args)
    # `up` takes fields with an environment variable (the API key) from there, not its arguments
    cmd = [sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model), "--port", str(port),
           *config_args(replace(config, api_key=None))]
    print("$ hybridcache up --port", port, flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **config_env(config, "router")))
    try:
        line = proc.stdout.readline()
        if not line.startswith('{"ready"'):
            print("hybridcache: error: `hybridcache up` did not become ready", file=sys.stderr)
            return 1
        url = json.loads(line)["http"]
        print(f"{len(sample['segments'])} documents; question: {question!r} (expected answer {expected!r})")
        for attempt, segments in (("first", sample["segments"]),
                                  ("second, documents reordered", sample["segments"][::-1])):
            res = _post(f"{url}/generate", dict(sample, segments=segments), api_key=config.api_key)
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
