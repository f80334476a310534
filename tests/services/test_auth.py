"""Authentication of users on a real router: --api-key (given to `up` in HYBRIDCACHE_API_KEY,
handed to the router in its environment, never its arguments), 401 / UNAUTHENTICATED without it,
/health and /livez open, /metrics behind the key; HTTPS and gRPC over TLS with --tls-certfile/--tls-keyfile."""

from __future__ import annotations

import json
import ssl
import subprocess
import urllib.request

import grpc
import pytest
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.protocol import pb, rpc
from serving_helpers import http

KEY = "sk-test-6f1c0b"
BODY = {"text": "Hello there", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem"), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture(scope="module")
def guarded(model_dir, cert):
    with LocalCluster(model_dir, port=free_port(), scatter_workers=0, api_key=KEY, tls_certfile=str(cert[0]),
                      tls_keyfile=str(cert[1])) as c:
        yield c


def https(cluster, cert, method, path, body=None, headers=None):
    ctx = ssl.create_default_context(cafile=str(cert[0]))
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"https://127.0.0.1:{cluster.port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def test_key_is_in_the_environment_not_the_arguments(guarded):
    router = guarded.role("router")[0]
    with open(f"/proc/{router.proc.pid}/cmdline", "rb") as f:
        assert KEY.encode() not in f.read()
    with open(f"/proc/{router.proc.pid}/environ", "rb") as f:
        assert f"HYBRIDCACHE_API_KEY={KEY}".encode() in f.read().split(b"\0")


def test_http_needs_the_key_but_health_is_open(guarded, cert):
    for path, body in (("/generate", BODY), ("/v1/models", None), ("/v1/completions", {"prompt": "Hi"})):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            status, res, h = https(guarded, cert, "POST" if body else "GET", path, body, headers)
            assert status == 401 and res["error"]["type"] == "authentication_error", (path, headers, res)
            assert h["WWW-Authenticate"] == "Bearer"
    status, res, _ = https(guarded, cert, "POST", "/generate", BODY, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and res["meta_info"]["completion_tokens"] >= 1, res
    for path in ("/health", "/livez"):
        ctx = ssl.create_default_context(cafile=str(cert[0]))
        with urllib.request.urlopen(f"https://127.0.0.1:{guarded.port}{path}", timeout=30, context=ctx) as r:
            assert r.status == 200
    # /metrics (cache hit counters: what other clients' requests found) needs the key without --metrics-open
    status, _, _ = https(guarded, cert, "GET", "/metrics")
    assert status == 401
    ctx = ssl.create_default_context(cafile=str(cert[0]))
    req = urllib.request.Request(f"https://127.0.0.1:{guarded.port}/metrics",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30, context=ctx) as r:
        assert r.status == 200 and b'hybridcache_unauthenticated_requests_total{door="http"}' in r.read()


def test_plain_http_is_not_served_with_tls(guarded):
    with pytest.raises(OSError):
        http("GET", f"http://127.0.0.1:{guarded.port}/health", timeout=10)


def test_grpc_needs_the_key_over_tls(guarded, cert):
    address = guarded.role("router")[0].grpc
    creds = grpc.ssl_channel_credentials(root_certificates=cert[0].read_bytes())
    stub = rpc.InferenceStub(grpc.secure_channel(address, creds))
    req = pb.GenerateRequest(request_json=json.dumps({"suffix": "Hi", "sampling_params": {"max_new_tokens": 2}}))
    for metadata in ((), (("authorization", "Bearer nope"),)):
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30, metadata=metadata))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.value.details()
    chunks = list(stub.Generate(req, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),)))
    assert chunks[-1].done and not chunks[-1].error
    # not served in the clear
    with pytest.raises(grpc.RpcError):
        list(rpc.InferenceStub(grpc.insecure_channel(address)).Generate(
            req, timeout=10, metadata=(("authorization", f"Bearer {KEY}"),)))


def test_bad_tls_flags_are_one_error_line(model_dir, tmp_path):
    import sys

    for extra in (["--tls-certfile", str(tmp_path / "missing.pem")],
                  ["--tls-certfile", str(tmp_path / "c.pem"), "--tls-keyfile", str(tmp_path / "k.pem")]):
        r = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir),
                            "--port", str(free_port()), "--scatter-workers", "0", *extra],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode in (1, 2) and "hybridcache: error:" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_demo_serve_with_an_api_key(model_dir):
    """`hybridcache demo --serve --api-key KEY` hands the key to `up` in its environment and sends it."""
    import sys

    r = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", "demo", "--serve", "--model", str(model_dir),
                        "--api-key", KEY], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("POST http://") == 2 and "--api-key" not in r.stdout
