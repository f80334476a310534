"""`hybridcache up` as a user runs it: ready line, a request, SIGTERM stops every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from hybridcache.services.launcher import free_port
from serving_helpers import http, stop_up


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_up_serves_and_stops_everything_on_sigterm(model_dir):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir),
                             "--port", str(port), "--scatter-workers", "1"], stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["ready"] and ready["http"] == f"http://127.0.0.1:{port}"
        pids = [s["pid"] for s in ready["services"]]
        assert sorted(s["role"] for s in ready["services"]) == ["cache-tier", "combine", "router", "scatter"]
        status, res = http("POST", f"{ready['http']}/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert status == 200 and res["usage"]["completion_tokens"] >= 1
        assert http("GET", f"{ready['http']}/v1/models")[1]["data"][0]["id"] == model_dir.name
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not any(alive(p) for p in pids)
    finally:
        stop_up(proc)


def test_up_and_serve_reject_bad_flags_in_one_line(tmp_path, model_dir):
    for args in (["up", "--model", str(tmp_path)], ["serve", "scatter", "--model", str(tmp_path / "missing"),
                                                     "--grpc-port", str(free_port()), "--http-port", str(free_port())],
                 ["up", "--model", str(model_dir), "--ready-timeout-s", "0"],
                 ["up", "--model", str(model_dir), "--max-num-seqs", "0"]):
        r = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", *args], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2
        assert r.stderr.startswith("hybridcache: error:") and len(r.stderr.strip().splitlines()) == 1


def test_up_says_why_a_service_did_not_start(tmp_path, model_dir):
    """A service that dies at start-up (here every service: a package they import is broken) makes
    `up` exit 1 with that service's last log lines, not only the path of a log."""
    (tmp_path / "orjson.py").write_text("raise ImportError('orjson is broken in this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir),
                        "--port", str(free_port()), "--scatter-workers", "0", "--ready-timeout-s", "120"],
                       capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 1, r.stderr
    assert "did not become ready" in r.stderr
    assert "ImportError: orjson is broken in this test" in r.stderr


def test_up_forwards_the_cache_policies_to_its_services(model_dir):
    """`hybridcache up --prefix-policy ... --entry-policy ...`: the combine worker's engine runs them
    (the request's stats name the prefix policy) and a bad value is one error line before anything starts."""
    bad = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir),
                          "--anchor-dtype", "float4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("hybridcache: error:")
    assert len(bad.stderr.strip().splitlines()) == 1

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir),
                             "--port", str(port), "--scatter-workers", "1", "--prefix-policy", "checkpoint",
                             "--checkpoint-every", "2", "--entry-policy", "single_state"],
                            stdout=subprocess.PIPE, text=True)
    try:
        ready = json.loads(proc.stdout.readline())
        body = {"text": "Hello there, a prompt of a few tokens", "sampling_params": {"max_new_tokens": 1}}
        status, res = http("POST", f"{ready['http']}/generate", body)
        assert status == 200, res
        assert res["hybridcache"]["prefix_policy"] == "checkpoint"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        stop_up(proc)
