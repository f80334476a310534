"""The stats line, the request log, the progress lines `up` forwards and the ready timeout, without
a served model (tests/services/test_monitoring.py has them in a live `up`)."""

from __future__ import annotations

import os
import re

import pytest
from hybridcache.services import launcher
from hybridcache.services.observability.stats import FORWARDED, RequestRecord, StatsLog


def _stats(prompt, prefix, segments):
    return {"prompt_tokens": prompt, "prefix_reused_tokens": prefix,
            "segments": [{"tokens": t, "hit": hit, "source": src} for t, hit, src in segments]}


def test_stats_line_rates_and_hit_rates_over_its_interval():
    gauges = {"running": 2, "waiting": 1, "kv_usage": 0.25, "entry_usage": 0.5, "entry_bytes": 3 << 20}
    log = StatsLog(10, lambda: gauges)
    log._since = 100.0
    log.request_done(_stats(400, 100, [(100, True, "prefix"), (200, True, "worker"), (100, False, "scatter"),
                                       (20, False, "live")]))
    log.request_done(_stats(200, 0, [(100, True, "tier"), (100, False, "built")]))
    log.generated(30)
    line = log.line(now=110.0)
    assert line == ("Avg prompt throughput: 60.0 tokens/s, Avg generation throughput: 3.0 tokens/s, Running: 2 reqs, "
                    "Waiting: 1 reqs, K/V cache usage: 25.0%, Entry cache usage: 50.0% (3.0 MiB), "
                    "Prefix cache hit rate: 16.7%, Entry cache hit rate: 60.0%")
    # the counts start again: the next interval's rates are its own
    gauges.update(running=0, waiting=0)
    assert log.line(now=120.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0")
    assert log.line(now=130.0) is None  # idle twice: quiet
    log.generated(5)
    assert log.line(now=135.0).startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 1.0")


def test_request_record_line():
    rec = RequestRecord("abc", prompt_tokens=10)
    assert rec.line(0.5) == ("request abc: status 499, prompt 10 tokens (cached 0), generated 0 tokens, TTFT -, "
                             "total 500.0 ms")
    rec.finished({"prompt_tokens": 12, "cached_tokens": 8, "generated_tokens": 3, "ttft_ms": 42.25}, "stop")
    assert rec.line(0.1) == ("request abc: status 200 (stop), prompt 12 tokens (cached 8), generated 3 tokens, "
                             "TTFT 42.2 ms, total 100.0 ms")


def test_forwarded_lines_are_those_of_progress_stats_and_requests():
    def fwd(message, level="INFO"):
        m = FORWARDED.match(f"2026-12-06 05:12:34,993 combine {level} {message}")
        return m and m.group(1)

    assert fwd("progress: loading the model m on cpu ...") == "progress: loading the model m on cpu ..."
    assert fwd("Avg prompt throughput: 1.0 tokens/s, ...") == "Avg prompt throughput: 1.0 tokens/s, ..."
    assert fwd("request 1e5d: status 200 (stop), ...") == "request 1e5d: status 200 (stop), ..."
    assert not fwd("cache budgets on cpu: entries 1.00 GiB") and not fwd("progress: x", level="DEBUG")
    assert not FORWARDED.match('{"ready": "combine", "grpc": "127.0.0.1:1"}')


def test_ready_timeout_is_sized_by_device_and_model(tmp_path):
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    os.truncate(tmp_path / "model-00001-of-00002.safetensors", 10**9 - 1000)  # sparse: 1 GB on paper
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 1000)
    cpu, why = launcher.ready_timeout("cpu", tmp_path)
    cuda, _ = launcher.ready_timeout("cuda", tmp_path)
    assert cpu == 150 and cuda == 630 and "1.00 GB" in why and "--ready-timeout-s" in why
    assert launcher.ready_timeout("cpu", tmp_path / "missing")[0] == 120


class _StuckProc:
    """A child that logs its first start-up stage and then never says ready."""

    def __init__(self, cmd, env=None, stdout=None, **_):
        self.pid, self.returncode = 0, None
        stdout.write(b"2026-12-06 05:12:34,993 combine INFO progress: loading the model m on cpu ...\n"
                     b"2026-12-06 05:12:35,001 combine INFO something else\n")

    def poll(self):
        return self.returncode

    def send_signal(self, _sig):
        self.returncode = 0

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode


def test_ready_timeout_names_the_service_and_its_last_stage(monkeypatch, tmp_path):
    monkeypatch.setattr(launcher.subprocess, "Popen", _StuckProc)
    cluster = launcher.LocalCluster(tmp_path, port=launcher.free_port(), scatter_workers=0, ready_timeout_s=0.2,
                                    log_dir=tmp_path / "logs")
    shown = []
    cluster.say = shown.append
    with pytest.raises(RuntimeError) as e:
        cluster.start()
    first = str(e.value).splitlines()[0]
    assert first.startswith("cache-tier-0 did not become ready within 0.2 s (as --ready-timeout-s set it); "
                            "its last progress: loading the model m on cpu ...; log ")
    assert "cache-tier-0: progress: loading the model m on cpu ..." in shown
    assert not any("something else" in line for line in shown)


def test_a_worker_logs_each_start_up_stage(model_dir, tmp_path):
    """A combine worker warming up says each stage as it passes, in order: loading the model, the
    warm-up, each of its requests, the decode graphs; `up` forwards exactly these lines."""
    import subprocess
    import sys

    from hybridcache.services.security import DeploymentSecret

    secret = DeploymentSecret.generate().write(tmp_path / "secret")
    cmd = [sys.executable, "-m", "hybridcache.services.cli", "serve", "combine", "--model", str(model_dir),
           "--grpc-port", str(launcher.free_port()), "--http-port", str(launcher.free_port()), "--warmup", "on",
           "--warmup-shape", "none", "--secret-file", str(secret)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith('{"ready"'):
                break
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    stages = [m.group(1).removeprefix("progress: ") for m in map(FORWARDED.match, lines)
              if m and m.group(1).startswith("progress: ")]
    report = next(line for line in lines if "warm-up done: " in line)
    n = int(re.search(r"'requests': (\d+)", report).group(1))
    heads = [re.sub(r" \(\d+ segments, \d+ prompt tokens\)", "", s.split(" ...")[0].split(":")[0]) for s in stages]
    assert heads == [f"loading the model {model_dir} on cpu"] * 2 + ["warm-up"] + [
        f"warm-up request {i}" for i in range(1, n + 1)] + ["decode graphs of batch sizes up to 16"] * 2 + [
        "warm-up"], "".join(lines)
    # every stage that does not begin one ends with its time
    assert all(re.search(r": done in [\d.]+ s$", s) for s in stages if not s.endswith(" ..."))
    assert n >= 1 and stages[-1].startswith("warm-up: done in ")
