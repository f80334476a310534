"""Every streamed request a role may hold streams at once (serve.grpc_threads).

A streamed Generate keeps its server thread to the end of its request, and a call that finds no
free thread waits, unseen by the scheduler and its client alike. With a fixed pool of 32 a combine
worker of --max-num-seqs 128 ran 32 requests at a time, the rest waiting in gRPC for a thread: 128
streams sent at once got their first tokens in four waves, one per 32 that finished.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from hybridcache.services.api.serve import ROUTER_DOOR_COMBINES, grpc_threads
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.protocol import pb, rpc


class _Held:
    """Generate that holds every call until released, counting the calls inside it."""

    def __init__(self, want: int):
        self.want, self.inside = want, 0
        self._lock = threading.Lock()
        self.all_in, self.release = threading.Event(), threading.Event()

    def Generate(self, request, context):
        with self._lock:
            self.inside += 1
            if self.inside == self.want:
                self.all_in.set()
        self.release.wait(20)
        yield pb.TokenChunk(token_id=7)
        yield pb.TokenChunk(token_id=-1, done=True, finish_reason="length")


class _Combine(_Held, rpc.CombineServicer):
    pass


class _Inference(_Held, rpc.InferenceServicer):
    pass


@pytest.mark.parametrize("role", ["combine", "router"])
def test_every_request_a_role_may_hold_is_in_its_handler_at_once(role):
    config = RuntimeConfig(max_num_seqs=128, max_waiting=64)
    # a combine worker holds its seats and queue; the router's door that much for each of its combine workers
    want = (config.max_num_seqs + config.max_waiting) * (ROUTER_DOOR_COMBINES if role == "router" else 1)
    held = _Combine(want) if role == "combine" else _Inference(want)
    server = grpc.server(ThreadPoolExecutor(max_workers=grpc_threads(role, config)))
    if role == "combine":
        rpc.add_CombineServicer_to_server(held, server)
    else:
        rpc.add_InferenceServicer_to_server(held, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        if role == "combine":
            stub, request = rpc.CombineStub(channel), pb.CombineRequest()
        else:
            stub, request = rpc.InferenceStub(channel), pb.GenerateRequest()
        calls = [stub.Generate(request, timeout=60) for _ in range(want)]
        assert held.all_in.wait(15), f"{held.inside} of {want} streamed calls reached their handler"
        held.release.set()
        assert all([c.token_id for c in call] == [7, -1] for call in calls)
    finally:
        held.release.set()
        channel.close()
        server.stop(grace=None)


def test_short_call_roles_keep_a_small_pool():
    config = RuntimeConfig(max_num_seqs=128, max_waiting=64)
    assert grpc_threads("cache-tier", config) == grpc_threads("scatter", config) == 32
    assert grpc_threads("combine", RuntimeConfig(max_num_seqs=4, max_waiting=4)) == 32
