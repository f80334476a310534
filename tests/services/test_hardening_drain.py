"""Drain: when the router's drain grace ends, the requests still running get an answer before
their connections close: a streamed one an SSE error event (503) and [DONE], a non-streamed one
a 503 JSON error, a gRPC call UNAVAILABLE; the router then exits 0."""

from __future__ import annotations

import http.client as httpclient
import json
import signal
import threading
import time

import grpc
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.protocol import pb, rpc
from serving_helpers import http

LONG = {"text": "Tell me a long story", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}


def test_requests_still_running_at_the_end_of_the_drain_grace_get_an_error(model_dir):
    c = LocalCluster(model_dir, port=free_port(), scatter_workers=0, drain_grace_s=1).start()
    try:
        router = c.role("router")[0]
        conn = httpclient.HTTPConnection("127.0.0.1", c.port, timeout=60)
        conn.request("POST", "/generate", json.dumps(dict(LONG, stream=True)), {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200
        first = stream.readline()
        assert first.startswith(b"data: {")  # it runs
        plain: dict = {}
        threading.Thread(target=lambda: plain.update(res=http("POST", f"{c.url}/generate", LONG, timeout=60)),
                         daemon=True).start()
        call = rpc.InferenceStub(grpc.insecure_channel(router.grpc)).Generate(
            pb.GenerateRequest(request_json=json.dumps({"suffix": "Tell me", "sampling_params": {
                "max_new_tokens": 3000, "ignore_eos": True}})), timeout=60)
        assert next(call).token_id >= 0
        time.sleep(0.5)
        t0 = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)
        lines = [line.strip() for line in stream.read().split(b"\n") if line.strip()]
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert lines[-1] == b"data: [DONE]", lines[-3:]
        assert "error" in events[-1] and events[-1]["error"]["code"] == 503, events[-1]
        assert "shutting down" in events[-1]["error"]["message"]
        assert time.monotonic() - t0 < 8
        try:
            for _ in call:
                pass
            raise AssertionError("the gRPC call ended without a status")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.details(), e
        deadline = time.monotonic() + 15
        while "res" not in plain and time.monotonic() < deadline:
            time.sleep(0.05)
        status, res = plain["res"]
        assert status == 503 and "shutting down" in res["error"]["message"], res
        assert router.proc.wait(timeout=20) == 0
    finally:
        c.stop()
