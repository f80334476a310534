"""Where cold segments are built: a scatter worker on the combine worker's own GPU is not asked
(the combine worker compares the two Endpoints, the scatter worker's from its Describe), and the
router sends a cold segment out only when its entry moves back faster, at the scatter path's
measured bandwidth, than the combine worker would build it."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from hybridcache.services.protocol import pb, rpc, segment_ids
from hybridcache.services.router.cost import CostModel
from hybridcache.services.transport import Endpoint, get_transport
from hybridcache.services.transport.codec import entry_chunks

GPU_A, GPU_B = "GPU-aaaa", "GPU-bbbb"
NODE = dict(host="boot-1", ipc_ns="ipc:[1]", pid_ns="pid:[1]")


def test_build_here_follows_the_scatter_paths_measured_bandwidth():
    cm = CostModel(prefill_tokens_per_s=10_000.0)
    tokens, nbytes = 1000, 33_000_000  # 0.1 s to build; a 33 MB entry (the 9B shape, 8 layers)
    assert cm.build_here(tokens, nbytes, "grpc")  # 0.41 s at 0.08 GB/s
    assert not cm.build_here(tokens, nbytes, "cuda_ipc")  # 1.7 ms at the 20 GB/s default
    assert not cm.build_here(tokens, nbytes, "local") and not cm.build_here(tokens, nbytes, "")
    # combine workers report moves over CUDA IPC at 0.2 GB/s: 0.165 s a move, slower than the build
    for _ in range(30):
        cm.observe_scatter("cuda_ipc", 200_000_000, 1.0)
    assert cm.scatter_path == "cuda_ipc" and cm.build_here(tokens, nbytes, "cuda_ipc")
    # and at 100 GB/s again the scatter worker is worth asking
    for _ in range(30):
        cm.observe_scatter("cuda_ipc", 100_000_000_000, 1.0)
    assert not cm.build_here(tokens, nbytes, "cuda_ipc")


def test_router_plans_cold_segments_here_when_their_move_is_slower(engine, model_dir):
    from hybridcache.services.directory import InProcessDirectory
    from hybridcache.services.router.router import Router

    router = Router(model_dir, InProcessDirectory({"scatter": ["127.0.0.1:1"]}))
    router.adopt(pb.InfoReply(fingerprint=engine.fingerprint, seam_window=engine.config.seam_window, mode="pic"))
    req = router.parse({"segments": [[5 + i % 200 for i in range(60)], [9 + i % 180 for i in range(50)]],
                        "suffix": "q"})
    nbytes = router.planner.reused_segments(req)[0].nbytes
    router.cost.prefill_tokens_per_s = 2000.0  # 30 ms to build 60 tokens
    router.cost.observe_scatter("cuda_ipc", nbytes, 1e-4)  # the path the combine workers report
    plan, assigned, _ = router.plan(req)
    assert sorted(p.source for p in plan) == ["scatter", "scatter"] and router.cold_queue_depth == 2
    router._release(plan, assigned)
    # the same path measured at a rate that moves an entry slower than it is built here
    router.cost.bandwidth["cuda_ipc"] = nbytes / 0.05
    plan, assigned, _ = router.plan(req)
    assert sorted(p.source for p in plan) == ["local", "local"] and assigned == {} and router.cold_queue_depth == 0


class _Scatter(rpc.ScatterServicer):
    """A scatter worker that describes itself as `endpoint` (None: an older one without Describe)
    and streams the entries asked for (over gRPC)."""

    def __init__(self, engine, endpoint: Endpoint | None):
        self.engine, self.endpoint, self.prefills = engine, endpoint, 0

    def Describe(self, request, context):
        if self.endpoint is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "no Describe")
        return self.endpoint.to_msg()

    def Prefill(self, request, context):
        self.prefills += 1
        transport = get_transport("grpc")
        for seg in request.segments:
            yield from entry_chunks(self.engine.build_entry(segment_ids(seg)), seg.index, transport)


def _serve(scatter: _Scatter, address: str | None = None) -> tuple[grpc.Server, str]:
    """`scatter` served on `address` (default: a free loopback port): (the server, its address)."""
    from hybridcache.services.launcher import free_port

    server = grpc.server(futures.ThreadPoolExecutor(2))
    rpc.add_ScatterServicer_to_server(scatter, server)
    address = address or f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    return server, address


@pytest.mark.parametrize("scatter_endpoint, same_gpu_setting, asked", [
    (Endpoint(**NODE, device=GPU_A, gpus=(GPU_A,)), False, False),  # its GPU: built here
    (Endpoint(**NODE, device=GPU_A, gpus=(GPU_A,)), True, True),  # --scatter-same-gpu on: asked anyway
    (Endpoint(**NODE, device=GPU_B, gpus=(GPU_B,)), False, True),  # another GPU
    (Endpoint(**{**NODE, "host": "boot-2"}, device=GPU_A), False, True),  # another host's GPU of that UUID
    (Endpoint(**NODE), False, True),  # a CPU scatter worker
    (None, False, True),  # a worker that cannot describe itself
])
def test_combine_builds_here_what_a_scatter_worker_on_its_gpu_was_to_build(engine, scatter_endpoint,
                                                                            same_gpu_setting, asked):
    from hybridcache.services.combine.worker import CombineServicer

    scatter = _Scatter(engine, scatter_endpoint)
    server, address = _serve(scatter)
    combine = CombineServicer(engine)
    try:
        combine.endpoint = Endpoint(**NODE, device=GPU_A, gpus=(GPU_A, GPU_B))
        combine.scatter_same_gpu = same_gpu_setting
        segments = [list(range(20, 70)), list(range(30, 75))]
        request = pb.CombineRequest(scatter_workers=[address], plan=[
            pb.SegmentPlan(index=i, key=engine.entry_key(s), source="scatter", address=address)
            for i, s in enumerate(segments)])
        for _ in range(2):  # the second request asks Describe no more
            pinned, source, moved = combine._gather(request, segments)
            if asked:
                assert source == {0: "scatter", 1: "scatter"} and len(pinned) == 2
                assert moved["built_here_same_gpu"] == 0
            else:
                assert source == {} and pinned == {} and moved["built_here_same_gpu"] == 2
        assert scatter.prefills == (2 if asked else 0)
        # asked once, unless the setting makes the answer moot
        asked_for = combine._scatter_endpoints.known.get(address, "not asked")
        assert asked_for == ("not asked" if same_gpu_setting else scatter_endpoint)
    finally:
        combine.close()
        server.stop(0)


def test_a_scatter_worker_that_does_not_answer_describe_is_asked_again_later(engine):
    from hybridcache.services.combine.worker import CombineServicer
    from hybridcache.services.launcher import free_port
    from hybridcache.services.transport.peers import PEER_RETRY_S

    combine = CombineServicer(engine)
    try:
        combine.endpoint = Endpoint(**NODE, device=GPU_A, gpus=(GPU_A,))
        address = f"127.0.0.1:{free_port()}"  # nobody listens
        assert not combine._on_my_gpu(address)
        book = combine._scatter_endpoints
        assert address not in book.known and book.retry_at[address] > 0
        first = book.retry_at[address]
        assert combine.scatter_endpoint(address) is None and book.retry_at[address] == first  # not asked
        book.retry_at[address] -= PEER_RETRY_S + 1  # the retry time has come: asked, and failing again
        assert combine.scatter_endpoint(address) is None and book.retry_at[address] >= first
    finally:
        combine.close()


@pytest.mark.parametrize("scatter_endpoint, same_gpu_setting, path, sources", [
    # another GPU of the combine worker's host: CUDA IPC, fast enough to send the work out
    (Endpoint(**NODE, device=GPU_B, gpus=(GPU_B,)), False, "cuda_ipc", ["scatter", "scatter"]),
    # the combine worker's own GPU: it builds the work itself (the router's plan names the worker;
    # the combine worker keeps it, test above), or with --scatter-same-gpu on, CUDA IPC
    (Endpoint(**NODE, device=GPU_A, gpus=(GPU_A,)), False, "local", ["scatter", "scatter"]),
    (Endpoint(**NODE, device=GPU_A, gpus=(GPU_A,)), True, "cuda_ipc", ["scatter", "scatter"]),
    # a CPU scatter worker on another host: gRPC, slower than building here
    (Endpoint(host="boot-2", ipc_ns="ipc:[2]", pid_ns="pid:[2]"), False, "grpc", ["local", "local"]),
    # one that cannot describe itself: the path the combine workers last reported (none yet: gRPC)
    (None, False, "grpc", ["local", "local"]),
])
def test_router_charges_a_cold_build_with_the_path_of_the_two_endpoints(engine, model_dir, scatter_endpoint,
                                                                         same_gpu_setting, path, sources):
    """The router compares the combine worker's Endpoint (its Info) with the scatter worker's
    (Describe) before any entry has moved: a scatter worker that reaches the combine worker over
    CUDA IPC is sent cold segments from the first request on."""
    from hybridcache.services.directory import InProcessDirectory
    from hybridcache.services.router.router import Router

    scatter = _Scatter(engine, scatter_endpoint)
    server, address = _serve(scatter)
    try:
        router = Router(model_dir, InProcessDirectory({"scatter": [address]}))
        combine = Endpoint(**NODE, device=GPU_A, gpus=(GPU_A, GPU_B))
        router.adopt(pb.InfoReply(fingerprint=engine.fingerprint, seam_window=engine.config.seam_window, mode="pic",
                                  endpoint=combine.to_msg(), scatter_same_gpu=same_gpu_setting), "combine:1")
        assert router.cost.scatter_path == "grpc"  # nothing reported yet
        assert router.scatter_path(address, "combine:1") == path
        req = router.parse({"segments": [[5 + i % 200 for i in range(60)], [9 + i % 180 for i in range(50)]],
                            "suffix": "q"})
        nbytes = router.planner.reused_segments(req)[0].nbytes
        router.cost.prefill_tokens_per_s = 2000.0  # 30 ms to build 60 tokens:
        router.cost.bandwidth.update(cuda_ipc=nbytes / 1e-4, grpc=nbytes / 0.05)  # slower than a move, faster
        plan, assigned, _ = router.plan(req, "combine:1")
        assert sorted(p.source for p in plan) == sources
        # a combine worker the router knows no Endpoint of: the reported path
        assert router.scatter_path(address, "combine:2") == "grpc"
    finally:
        server.stop(0)


def test_scatter_endpoints_are_asked_as_workers_join(engine):
    """ScatterEndpoints.watch asks every listed scatter worker's Describe in the background (as
    `serve` starts it for the combine worker and the router), so no request pays for it; a
    worker listed later is asked on the next round, and the thread ends with its event."""
    import threading
    import time

    from hybridcache.services.transport.peers import ScatterEndpoints

    servers, addresses = [], []
    for gpu in (GPU_A, GPU_B):
        server, address = _serve(_Scatter(engine, Endpoint(**NODE, device=gpu, gpus=(gpu,))))
        servers.append(server)
        addresses.append(address)
    members = [addresses[0]]
    book, stop = ScatterEndpoints(), threading.Event()
    try:
        thread = book.watch(lambda: list(members), stop, every_s=0.05)

        def known(address, timeout_s=10.0):
            deadline = time.monotonic() + timeout_s
            while address not in book.known and time.monotonic() < deadline:
                time.sleep(0.02)
            return book.known.get(address)

        assert known(addresses[0]).device == GPU_A
        assert addresses[1] not in book.known
        members.append(addresses[1])  # a worker joins
        assert known(addresses[1]).device == GPU_B
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        stop.set()
        for server in servers:
            server.stop(0)


def test_a_scatter_worker_listed_before_it_serves_is_described_once_it_does(engine):
    """A scatter worker is listed (a static directory, `hybridcache up`) while it still warms up,
    before its server answers: the watch asks it again every unknown_every_s, not after
    PEER_RETRY_S, so that the first request after it starts serving finds its Endpoint known
    instead of asking on its path; a request's own lookup still waits PEER_RETRY_S."""
    import threading
    import time

    from hybridcache.services.launcher import free_port
    from hybridcache.services.transport import peers
    from hybridcache.services.transport.peers import ScatterEndpoints

    address = f"127.0.0.1:{free_port()}"
    book, stop = ScatterEndpoints(timeout_s=0.5), threading.Event()
    server = None
    try:
        thread = book.watch(lambda: [address], stop, every_s=60.0, unknown_every_s=0.05)
        deadline = time.monotonic() + 10
        while address not in book.retry_at and time.monotonic() < deadline:
            time.sleep(0.02)
        assert address in book.retry_at and address not in book.known  # asked, nobody answered
        assert book.get(address) is None  # a request's path: not asked again within PEER_RETRY_S
        server, _ = _serve(_Scatter(engine, Endpoint(**NODE, device=GPU_A, gpus=(GPU_A,))), address)
        started = time.monotonic()
        while address not in book.known and time.monotonic() - started < 10:
            time.sleep(0.02)
        assert book.known.get(address) is not None and book.known[address].device == GPU_A
        assert time.monotonic() - started < peers.PEER_RETRY_S
        stop.set()
        thread.join(timeout=5)
        assert not thread.is_alive()
    finally:
        stop.set()
        if server is not None:
            server.stop(0)
