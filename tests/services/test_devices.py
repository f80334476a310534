"""Device placement of `hybridcache up` (which child gets which GPU and environment), the flags it
forwards to each role, and the cache budgets sized from free device memory."""

from __future__ import annotations

import itertools

import pytest
from hybridcache.services import launcher
from hybridcache.services.cli import build_parser
from hybridcache.services.config import config_args, config_from_args
from hybridcache.services.devices import (
    CPU_CACHE_BYTES,
    DeviceMemoryError,
    cache_budgets,
    default_scatter_workers,
    idle_scatter_workers,
    out_of_memory_message,
    parse_gpus,
    peak_over_share,
    place_services,
    pool_bytes,
    starting,
    utilization_per_worker,
)

GiB = 1 << 30


def test_workers_take_the_gpus_round_robin_with_their_own_first():
    roles = ["cache-tier", "router", "combine", "scatter", "scatter", "scatter"]
    placed = place_services(roles, "cuda", (2, 5))
    assert [p.gpu for p in placed] == [None, None, 2, 5, 2, 5]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in placed] == ["", "", "2,5", "5,2", "2,5", "5,2"]
    assert [p.device for p in placed] == ["cpu", "cpu", "cuda", "cuda", "cuda", "cuda"]


def test_one_gpu_holds_every_worker_and_cpu_hides_the_gpus():
    placed = place_services(["combine", "scatter", "router"], "cuda", (0,))
    assert [(p.device, p.env["CUDA_VISIBLE_DEVICES"]) for p in placed] == [("cuda", "0"), ("cuda", "0"), ("cpu", "")]
    cpu = place_services(["combine", "scatter", "cache-tier"], "cpu", (0, 1))
    assert {(p.device, p.gpu, p.env["CUDA_VISIBLE_DEVICES"]) for p in cpu} == {("cpu", None, "")}


@pytest.mark.parametrize("text, want", [(None, (0,)), ("", (0,)), ("3", (3,)), ("0,1,2", (0, 1, 2))])
def test_parse_gpus(text, want):
    assert parse_gpus(text) == want


@pytest.mark.parametrize("text", ["0,x", "-1", "1,1", "0,,1"])
def test_bad_gpu_lists_are_rejected(text):
    with pytest.raises(ValueError, match="--gpus"):
        parse_gpus(text)


def test_cache_budgets_cpu_defaults_cuda_shares_and_given_values():
    assert cache_budgets("cpu", None)[:2] == (CPU_CACHE_BYTES, CPU_CACHE_BYTES)
    entry, prefix, why = cache_budgets("cuda", 120 * GiB, pool_how="0.9 of 140 GiB less 6 GiB held")
    assert entry + prefix == 60 * GiB and entry == 3 * prefix
    assert "120.0 GiB pool" in why and "less 6 GiB held" in why
    # a 32 x 1k working set of Qwen3.5-9B entries (~80 MB each) fits the sized default on an H200
    assert entry > 32 * 80e6 * 10
    entry, prefix, why = cache_budgets("cuda", 120 * GiB, entry_bytes=5 * GiB)
    assert entry == 5 * GiB and prefix == 15 * GiB and "entry as given" in why
    with pytest.raises(ValueError, match="positive"):
        cache_budgets("cuda", GiB, prefix_bytes=0)


def test_memory_pool_is_the_utilization_of_total_less_what_the_process_holds_capped_by_free():
    # an H200 (~140 GiB) with 18 GiB of weights loaded by this worker
    pool, how = pool_bytes(140 * GiB, 120 * GiB, 18 * GiB, 0.9)
    assert pool == int(0.9 * 140 * GiB) - 18 * GiB and "less 18.0 GiB held" in how
    # two workers on one GPU, each at half of 0.9, whichever loads first: their pools do not
    # overlap (sized from free memory, each would have taken a share of ~the same 100+ GiB)
    first, _ = pool_bytes(140 * GiB, 122 * GiB, 18 * GiB, 0.45)
    second, _ = pool_bytes(140 * GiB, 104 * GiB, 18 * GiB, 0.45)
    assert first == second and first + second + 2 * 18 * GiB <= 0.9 * 140 * GiB + 1
    # another process holding more than its part: never more than is free now
    pool, how = pool_bytes(140 * GiB, 30 * GiB, 18 * GiB, 0.9)
    assert pool == 30 * GiB and "cut to the 30.0 GiB free" in how
    # weights over the utilization: no pool (the budgets then refuse entries, not the allocator)
    assert pool_bytes(80 * GiB, 60 * GiB, 20 * GiB, 0.2)[0] == 0
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        pool_bytes(80 * GiB, 60 * GiB, 0, 1.5)


def test_workers_sharing_a_gpu_split_its_utilization():
    placed = place_services(["cache-tier", "router", "combine", "scatter", "scatter"], "cuda", (0, 1))
    assert utilization_per_worker(placed, 0.9) == {0: 0.45, 1: 0.9}
    assert utilization_per_worker(place_services(["router", "combine"], "cpu"), 0.9) == {}
    # tensor parallel: a worker's ranks take its first visible GPUs (its own first), so with 2
    # ranks each on 2 GPUs both GPUs hold a combine and a scatter rank; a combine worker alone
    # keeps the whole share on each of its GPUs
    both = place_services(["combine", "scatter"], "cuda", (0, 1))
    assert utilization_per_worker(both, 0.9, 2) == {0: 0.45, 1: 0.45}
    assert utilization_per_worker(both, 0.9, 1) == {0: 0.9, 1: 0.9}
    assert utilization_per_worker(place_services(["combine"], "cuda", (0, 1, 2, 3)), 0.9, 2) == {0: 0.9}
    with pytest.raises(ValueError, match="gpu-memory-utilization"):
        utilization_per_worker(placed, 0.0)


def _up_args(*flags):
    return build_parser().parse_args(["up", *flags])


def test_engine_flags_reach_the_roles_that_take_them():
    args = _up_args("--device", "cuda", "--gpus", "0,1", "--dtype", "bfloat16", "--mode", "prefix",
                    "--max-model-len", "2048", "--entry-cache-bytes", "123", "--prefix-cache-bytes", "45",
                    "--max-num-seqs", "7", "--max-waiting", "3", "--max-num-batched-tokens", "512",
                    "--kv-cache-bytes", "999")
    config = config_from_args(args)

    def flags(role):
        out = config_args(config, role)
        return dict(zip(out[::2], out[1::2]))

    assert {k: flags("combine").get(k) for k in ("--device", "--dtype", "--mode", "--entry-cache-bytes",
                                                 "--prefix-cache-bytes", "--max-model-len")} == {
        "--device": "cuda", "--dtype": "bfloat16", "--mode": "prefix", "--entry-cache-bytes": "123",
        "--prefix-cache-bytes": "45", "--max-model-len": None}
    # the scheduler's limits go to the combine worker, which runs it; its token budget also to the
    # scatter workers, which batch cold segments by it; the rest to both alike
    scheduling = {"--max-num-seqs": "7", "--max-waiting": "3", "--kv-cache-bytes": "999"}
    assert {k: flags("combine").get(k) for k in scheduling} == scheduling
    assert flags("combine")["--max-num-batched-tokens"] == flags("scatter")["--max-num-batched-tokens"] == "512"
    # and each end of the entry transport its own: the sender's arena, the receiver's same-GPU choice
    assert "--ipc-arena-bytes" not in flags("combine") and "--scatter-same-gpu" not in flags("scatter")
    scatter = {k: v for k, v in flags("scatter").items() if k != "--ipc-arena-bytes"}
    combine_only = {*scheduling, "--scatter-same-gpu", "--stats-interval-s", "--chunk-layer-parts"}
    assert scatter == {k: v for k, v in flags("combine").items() if k not in combine_only}
    # the router's admission (services/router/admission.py) estimates a request's wait from the
    # combine workers' seats and queue, so it takes those two limits; the K/V budget stays the worker's
    assert {k: flags("router").get(k) for k in scheduling} == {**scheduling, "--kv-cache-bytes": None}
    assert not set(scheduling) & set(flags("cache-tier"))
    assert flags("router")["--max-model-len"] == "2048" and "--device" not in flags("router")
    assert "--device" not in flags("cache-tier") and "--entry-cache-bytes" not in flags("cache-tier")
    # unset budgets and limits are not forwarded: each process sizes its own
    assert "--entry-cache-bytes" not in config_args(config_from_args(_up_args()), "combine")
    # what up forwards, serve parses
    serve = build_parser().parse_args(["serve", "combine", *config_args(config, "combine")])
    assert (serve.dtype, serve.mode, serve.entry_cache_bytes, serve.device) == ("bfloat16", "prefix", 123, "cuda")


class _FakeProc:
    _pids = itertools.count(1000)

    def __init__(self, cmd, stdout=None, stderr=None, text=None, env=None, start_new_session=None):
        self.cmd, self.env = cmd, env
        self.pid = next(self._pids)
        stdout.write(b'{"ready": "x"}\n')  # the child's log file
        self.returncode = None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = 0

    def wait(self, timeout=None):
        return self.returncode

    def kill(self):
        self.returncode = -9


def test_local_cluster_spawns_each_child_on_its_device(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.subprocess, "Popen", _FakeProc)
    cluster = launcher.LocalCluster(tmp_path, port=18000, scatter_workers=3, device="cuda", gpus=(0, 1),
                                    dtype="bfloat16")
    cluster.start()
    try:
        got = {}
        for s in cluster.services:
            cmd = s.proc.cmd
            device = cmd[cmd.index("--device") + 1] if "--device" in cmd else None
            got.setdefault(s.role, []).append((device, s.proc.env["CUDA_VISIBLE_DEVICES"]))
            assert ("--cache-bytes" in cmd) == (s.role == "cache-tier")
            assert "--entry-cache-bytes" not in cmd  # workers size their own on CUDA
        assert got == {"cache-tier": [(None, "")], "router": [(None, "")], "combine": [("cuda", "0,1")],
                       "scatter": [("cuda", "1,0"), ("cuda", "0,1"), ("cuda", "1,0")]}
        # two workers on each GPU: each is told half of the GPU's utilization
        for s in cluster.role("combine") + cluster.role("scatter"):
            assert s.proc.cmd[s.proc.cmd.index("--gpu-memory-utilization") + 1] == "0.45"
        assert all("--gpu-memory-utilization" not in s.proc.cmd for s in cluster.role("router"))
        combine = cluster.role("combine")[0].proc.cmd
        assert combine[combine.index("--dtype") + 1] == "bfloat16"
        # the combine worker knows the scatter workers from the start (it asks their Describe in
        # the background, not on its first request's path), as the router does
        told = [combine[i + 1] for i, a in enumerate(combine) if a == "--scatter"]
        assert told == [s.grpc for s in cluster.role("scatter")] and len(told) == 3
        router = cluster.role("router")[0].proc.cmd
        assert [router[i + 1] for i, a in enumerate(router) if a == "--scatter"] == told
    finally:
        cluster.stop()


def test_out_of_memory_message_says_where_the_gpus_memory_went():
    m = out_of_memory_message("warming up", "cuda:0", total=80 * GiB, free=GiB // 2, held=29 * GiB, utilization=0.45)
    assert m.startswith("out of GPU memory on cuda:0 while warming up: the GPU has 80.0 GiB")
    assert "this process holds 29.0 GiB (--gpu-memory-utilization 0.45), other processes 50.5 GiB, 0.50 GiB free" in m
    assert "--gpus" in m and "\n" not in m


def test_starting_turns_torchs_out_of_memory_into_one_error_and_passes_other_errors():
    import torch

    def oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    with pytest.raises(DeviceMemoryError, match="^out of device memory on cpu while loading the model$"):
        starting("loading the model", "cpu", 0.9, oom)
    with pytest.raises(KeyError):
        starting("loading the model", "cpu", 0.9, lambda: {}["x"])
    assert starting("warming up", "cpu", 0.9, lambda: 7) == 7


def test_a_worker_out_of_memory_in_its_warmup_exits_2_with_one_error_line(monkeypatch, tmp_path, capsys, model_dir):
    """The served process (cli serve --role combine): an out-of-memory error in the warm-up is one
    error line and exit status 2, which `up` shows with the log's tail, not a traceback."""
    import torch
    from hybridcache.services import security
    from hybridcache.services.cli import main
    from hybridcache.services.combine.worker import CombineServicer

    def warmup(self):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 MiB")

    monkeypatch.setattr(CombineServicer, "warmup", warmup)
    secret = security.DeploymentSecret.generate().write(tmp_path / "secret")
    rc = main(["serve", "combine", "--model", str(model_dir), "--secret-file", str(secret), "--warmup", "on",
               "--grpc-port", str(launcher.free_port()), "--http-port", str(launcher.free_port())])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1] == "hybridcache: error: out of device memory on cpu while warming up", err
    assert not any("Traceback" in line for line in err)


def test_a_warmup_peak_over_the_workers_share_is_a_warning():
    assert peak_over_share(40 * GiB, 80 * GiB, 0.5) is None
    w = peak_over_share(49 * GiB, 80 * GiB, 0.45)
    assert w.startswith("the warm-up peaked at 49.0 GiB of this GPU's 80.0 GiB, over this worker's 36.0 GiB share")


def test_up_starts_scatter_workers_on_the_gpus_the_combine_worker_does_not_take():
    assert build_parser().parse_args(["up"]).scatter_workers is None
    assert default_scatter_workers("cpu", (0,)) == 2
    assert default_scatter_workers("cuda", (0,)) == 0
    assert default_scatter_workers("cuda", (0, 1, 2, 3)) == 3
    assert default_scatter_workers("cuda", (0, 1, 2, 3), tensor_parallel_size=2) == 0
    placed = place_services(["combine"] + ["scatter"] * default_scatter_workers("cuda", (4, 5, 6)), "cuda", (4, 5, 6))
    assert [p.gpu for p in placed] == [4, 5, 6]
    assert idle_scatter_workers(placed[0], placed[1:], scatter_same_gpu=False) == []


def test_scatter_workers_on_the_combine_workers_gpu_are_idle_unless_asked():
    placed = place_services(["combine"] + ["scatter"] * 3, "cuda", (0, 1))  # scatter GPUs: 1, 0, 1
    assert idle_scatter_workers(placed[0], placed[1:], scatter_same_gpu=False) == [1]
    assert idle_scatter_workers(placed[0], placed[1:], scatter_same_gpu=True) == []
    # the combine worker's two ranks take GPUs 0 and 1: every scatter worker shares one of them
    assert idle_scatter_workers(placed[0], placed[1:], False, tensor_parallel_size=2) == [0, 1, 2]
    cpu = place_services(["combine", "scatter"], "cpu")
    assert idle_scatter_workers(cpu[0], cpu[1:], scatter_same_gpu=False) == []
