"""Monitoring checked against a live `hybridcache up` (shipped model, CPU): after HTTP and gRPC
requests, and errors provoked by killing the combine worker, every series that a dashboard panel
or an alert rule selects (manifests/) is in the scrapes of the roles, labelled as a Prometheus
scrape of the pods labels it; the request-error alert fires on the series the router exports; the
token counters equal what the responses reported; the vLLM-named series are where a vLLM
dashboard looks; `up` shows the workers' progress, stats lines and the request log."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from hybridcache.services import contract
from hybridcache.services.launcher import free_port
from hybridcache.services.protocol import pb, rpc
from prometheus_client.parser import text_string_to_metric_families
from serving_helpers import http

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "manifests" / "dashboards" / "hybridcache.json"
RULES = REPO / "manifests" / "alerts" / "hybridcache-rules.yaml"
NAMESPACE = "ci"  # the HybridCache's namespace: what the dashboards' $namespace selects
MODEL_NAME = "default"  # the shipped model's directory name, the served model's name


# -- PromQL, as far as the dashboards and rules use it ------------------------------------------------

_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_NOT_METRICS = {"by", "without", "and", "or", "unless", "bool", "on", "ignoring", "group_left", "group_right",
                "offset", "inf", "nan"}


def parse_query(expr: str) -> tuple[list[tuple[str, list[tuple[str, str, str]]]], set[str]]:
    """(selectors, grouping labels) of a PromQL expression: each selector's metric name and label
    matchers (label, op, value), and the labels of its by, without, on and ignoring clauses. Grafana's
    label_values(METRIC, LABEL) is the selector METRIC grouped by LABEL."""
    m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)\s*", expr)
    if m:
        return [(m.group(1), [])], {m.group(2)}
    labels = {lbl.strip() for g in _GROUPING.findall(expr) for lbl in g.split(",") if lbl.strip()}
    expr = _GROUPING.sub(" ", re.sub(r"\[[^\]]*\]", "", expr))
    selectors = []
    for sel in _SELECTOR.finditer(expr):
        name, braces = sel.group(1), sel.group(2)
        before = expr[sel.start() - 1] if sel.start() else " "
        if name in _NOT_METRICS or before.isdigit() or before == ".":
            continue  # a keyword, or the exponent or unit of a number
        if not braces and expr[sel.end():].lstrip().startswith("("):
            continue  # a function
        selectors.append((name, _MATCHER.findall(braces or "")))
    return selectors, labels


def test_parse_query_reads_selectors_matchers_and_groupings():
    sels, labels = parse_query('histogram_quantile(0.95, sum by (le, service) (rate(a_bucket{ns=~"x.*",s!="1"}[5m])))'
                               ' / on (pod) sum without (le) (b) > 0.5 and c{z="q"}')
    assert sels == [("a_bucket", [("ns", "=~", "x.*"), ("s", "!=", "1")]), ("b", []), ("c", [("z", "=", "q")])]
    assert labels == {"le", "service", "pod"}
    assert parse_query("label_values(m_total, namespace)") == ([("m_total", [])], {"namespace"})


def matches(labels: dict[str, str], matchers) -> bool:
    for label, op, value in matchers:
        have = labels.get(label, "")
        ok = {"=": have == value, "!=": have != value, "=~": re.fullmatch(value, have) is not None,
              "!~": re.fullmatch(value, have) is None}[op]
        if not ok:
            return False
    return True


def scraped_series(text: str, target: dict[str, str]) -> list[tuple[str, dict[str, str]]]:
    """The series of one /metrics scrape as Prometheus stores them: the target's labels added, a
    label of the series that a target label also names renamed exported_LABEL (honor_labels off)."""
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {(f"exported_{k}" if k in target else k): v for k, v in s.labels.items()}
            out.append((s.name, {**labels, **target}))
    return out


def queries() -> list[tuple[str, str]]:
    """(where, expression) of every query of the dashboard (panels and variables) and the rules."""
    board = json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in board["panels"] for t in p["targets"]]
    out += [(f"variable {v['name']}", v["query"]) for v in board["templating"]["list"] if v["type"] == "query"]
    out += [(f"alert {r['alert']}", r["expr"]) for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    return out


# -- the live stack ----------------------------------------------------------------------------------

def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as r:
        return r.read().decode()


def _operator_scrape() -> str:
    """The operator's /metrics as its reconcile sets the scatter-replicas gauge (operator/main.py)
    for a HybridCache `demo` in NAMESPACE."""
    import hybridcache.operator.main as operator_main
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(operator_main.SCATTER_REPLICAS)
    operator_main.SCATTER_REPLICAS.labels(NAMESPACE, "demo").set(2)
    return generate_latest(registry).decode()


def _grpc_generate(address: str, body: dict) -> list:
    with grpc.insecure_channel(address) as channel:
        return list(rpc.InferenceStub(channel).Generate(pb.GenerateRequest(request_json=json.dumps(body)), timeout=60))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """`up` on 0.0.0.0 with the request log and a 1 s stats line; its requests' answers, the
    scrapes of every role (before and after the combine worker is killed) and up's stderr."""
    from hybridcache.services.cli import sample_rag_request

    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDCACHE_MODEL"}
    proc = subprocess.Popen([sys.executable, "-m", "hybridcache.services.cli", "up", "--host", "0.0.0.0", "--port",
                             str(port), "--scatter-workers", "1", "--log-requests", "--stats-interval-s", "1",
                             "--log-dir", str(tmp_path_factory.mktemp("logs"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stderr: list[str] = []
    reader = threading.Thread(target=lambda: stderr.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("ready"), "".join(stderr)
        ready_at = len(stderr)
        services = {s["role"]: s for s in ready["services"]}
        url = ready["http"]
        req, _, _ = sample_rag_request()
        answers = [http("POST", f"{url}/generate", req),  # cold: the scatter worker builds the documents
                   http("POST", f"{url}/generate", dict(req, segments=req["segments"][::-1])),  # warm
                   http("POST", f"{url}/v1/completions", {"prompt": "Hello", "max_tokens": 3}),
                   http("POST", f"{url}/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})]
        assert all(status == 200 for status, _ in answers), answers
        chunks = _grpc_generate(services["router"]["grpc"], dict(req, sampling_params={"max_new_tokens": 3}))
        time.sleep(1.5)  # a stats line covers the requests
        scrapes = {role: _scrape(s["http"]) for role, s in services.items()}
        # a fault: with no combine worker the router answers 503 / UNAVAILABLE on both doors. `up`
        # is held stopped meanwhile, so that its supervisor cannot restart the worker (after 1 s)
        # before both requests are answered on a slow machine
        proc.send_signal(signal.SIGSTOP)
        try:
            os.kill(services["combine"]["pid"], signal.SIGKILL)
            failed = http("POST", f"{url}/v1/completions", {"prompt": "Hello", "max_tokens": 3})
            with pytest.raises(grpc.RpcError) as grpc_failed:
                _grpc_generate(services["router"]["grpc"],
                               {"suffix": "Hello", "sampling_params": {"max_new_tokens": 3}})
            router_after = _scrape(services["router"]["http"])
        finally:
            proc.send_signal(signal.SIGCONT)
        # the router listens on every interface: 127.0.0.2 reaches it, not the workers (127.0.0.1 only)
        host_check = {"router": http("GET", f"http://127.0.0.2:{port}/livez")[0]}
        try:
            urllib.request.urlopen(f"http://127.0.0.2:{services['scatter']['http'].rsplit(':', 1)[1]}/livez", timeout=5)
            host_check["scatter"] = "reached"
        except OSError:
            host_check["scatter"] = "refused"
        yield {"proc": proc, "answers": answers, "grpc": chunks, "scrapes": scrapes, "router_after": router_after,
               "failed": failed, "grpc_failed": grpc_failed.value, "stderr": stderr, "ready_at": ready_at,
               "services": services, "host_check": host_check}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        reader.join(timeout=10)


def _all_series(live) -> list[tuple[str, dict[str, str]]]:
    """Every role's series as a Prometheus scraping the pods (ServiceMonitor / PodMonitor) holds
    them, the operator's included; the router's after the errors."""
    series = []
    for role, text in {**live["scrapes"], "router": live["router_after"]}.items():
        target = {"namespace": NAMESPACE, "service": f"demo-{role}", "pod": f"demo-{role}-0", "job": f"demo-{role}",
                  "instance": live["services"][role]["http"], "endpoint": "metrics"}
        series += scraped_series(text, target)
    series += scraped_series(_operator_scrape(), {"namespace": "hybridcache-system", "pod": "hybridcache-operator-0",
                                                  "job": "hybridcache-system/hybridcache", "instance": "10.0.0.1:9090"})
    return series


def test_every_dashboard_and_alert_query_selects_live_series(live):
    series = _all_series(live)
    checked = 0
    for where, expr in queries():
        selectors, grouping = parse_query(expr.replace("$namespace", NAMESPACE))
        assert selectors, (where, expr)
        selected = []
        for name, matchers in selectors:
            found = [labels for n, labels in series if n == name and matches(labels, matchers)]
            assert found, f"{where}: no live series for {name}{matchers} in {expr}"
            selected += found
            checked += 1
        missing = {label for label in grouping if not any(label in labels for labels in selected)}
        assert not missing, f"{where}: grouping by {missing}, which no selected series has: {expr}"
    assert checked >= 30


def test_the_old_queries_fail_the_check(live):
    """What the check catches: the error alert on status="error" and the scatter-replicas panel on
    the operator's namespace label (a scrape of the operator's pod renames it exported_namespace)."""
    series = _all_series(live)
    for expr in ('rate(hybridcache_requests_total{status="error"}[5m])',
                 'hybridcache_scatter_replicas{namespace=~"ci"}'):
        (name, matchers), = parse_query(expr)[0]
        assert not [labels for n, labels in series if n == name and matches(labels, matchers)], expr


def test_request_error_alert_fires_on_the_routers_series(live, tmp_path):
    """promtool runs the alert rules over input series with the label sets the router exported in
    the live run: the 5xx answers of both doors at the rate of the 200s fire the alert after its 5
    minutes; the 200s alone do not."""
    if shutil.which("promtool") is None:
        pytest.fail("promtool missing: requirements/apt.txt lists prometheus")
    exported = [labels for name, labels in scraped_series(live["router_after"], {"namespace": NAMESPACE})
                if name == contract.METRIC_REQUESTS]
    errors = [labels for labels in exported if labels["status"].startswith("5")]
    fine = [labels for labels in exported if labels["status"] == "200"]
    assert {labels["door"] for labels in errors} == {"http", "grpc"} == {labels["door"] for labels in fine}

    def series(label_sets):
        return [{"series": contract.METRIC_REQUESTS + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(ls.items()))
                 + "}", "values": "0+10x30"} for ls in label_sets]

    def test(label_sets, expected):
        return {"interval": "1m", "input_series": series(label_sets), "alert_rule_test": [
            {"eval_time": "3m", "alertname": "HybridCacheRequestErrors", "exp_alerts": []},
            {"eval_time": "15m", "alertname": "HybridCacheRequestErrors", "exp_alerts": expected}]}

    firing = [{"exp_labels": {"severity": "critical", "namespace": NAMESPACE},
               "exp_annotations": {"summary": f"More than 5 % of requests fail in {NAMESPACE}",
                                   "description": "The router answered 50% of its requests (HTTP and gRPC) with a 5xx "
                                                  "status over the last 5 minutes; its log and the combine workers' "
                                                  "say why."}}]
    path = tmp_path / "errors_test.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [str(RULES)], "evaluation_interval": "1m",
                                    "tests": [test(errors + fine, firing), test(fine, [])]}))
    result = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_router_counts_what_the_responses_reported(live):
    router = _samples(live["scrapes"]["router"])
    usages = []
    for _, res in live["answers"]:
        st = res.get("hybridcache") or res.get("meta_info", {}).get("hybridcache") or {}
        usage = res.get("usage") or {"prompt_tokens": st["prompt_tokens"], "completion_tokens": st["generated_tokens"],
                                     "prompt_tokens_details": {"cached_tokens": st["cached_tokens"]}}
        usages.append(usage)
    done = json.loads(next(c for c in live["grpc"] if c.done).stats_json)
    usages.append({"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["generated_tokens"],
                   "prompt_tokens_details": {"cached_tokens": done["cached_tokens"]}})
    prompt = sum(u["prompt_tokens"] for u in usages)
    generated = sum(u["completion_tokens"] for u in usages)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert cached > 0
    assert router[(contract.METRIC_PROMPT_TOKENS, ())] == prompt
    assert router[(contract.METRIC_GENERATION_TOKENS, ())] == generated
    assert sum(v for (n, _), v in router.items() if n == contract.METRIC_CACHED_TOKENS) == cached
    model = (("model_name", MODEL_NAME),)
    assert router[(contract.VLLM_PROMPT_TOKENS, model)] == prompt
    assert router[(contract.VLLM_GENERATION_TOKENS, model)] == generated
    for hist in (contract.VLLM_TTFT_SECONDS, contract.VLLM_E2E_SECONDS):
        assert router[(hist + "_count", model)] == len(usages)
    assert router[(contract.METRIC_E2E_SECONDS + "_count", ())] == len(usages)
    assert router[(contract.METRIC_REQUESTS, (("door", "http"), ("status", "200")))] == 4
    assert router[(contract.METRIC_REQUESTS, (("door", "grpc"), ("status", "200")))] == 1
    # every request of the pic mode looks its prompt up in the prefix page tree
    assert router[("hybridcache_cache_queries_total", (("tier", "prefix"),))] == len(usages)


def test_errors_are_counted_by_door(live):
    assert live["failed"][0] == 503 and live["grpc_failed"].code() == grpc.StatusCode.UNAVAILABLE
    router = _samples(live["router_after"])
    assert router[(contract.METRIC_REQUESTS, (("door", "http"), ("status", "503")))] == 1
    assert router[(contract.METRIC_REQUESTS, (("door", "grpc"), ("status", "503")))] == 1


def test_combine_exports_its_scheduler_and_memory_gauges(live):
    combine = _samples(live["scrapes"]["combine"])
    model = (("model_name", MODEL_NAME),)
    for name in (contract.VLLM_NUM_REQUESTS_RUNNING, contract.VLLM_NUM_REQUESTS_WAITING):
        assert combine[(name, model)] == 0  # idle between requests
    assert combine[(contract.VLLM_KV_CACHE_USAGE, model)] == combine[(contract.METRIC_KV_CACHE_USAGE, ())] == 0
    assert combine[(contract.VLLM_GPU_CACHE_USAGE, model)] == 0
    # the documents' entries stay in the worker's own cache
    assert 0 < combine[(contract.METRIC_ENTRY_CACHE_USAGE, ())] < 1
    assert combine[(contract.METRIC_SCHEDULER_REQUESTS, (("state", "waiting"),))] == 0


def test_up_listens_on_its_host_and_shows_progress_stats_and_requests(live):
    assert live["host_check"] == {"router": 200, "scatter": "refused"}
    lines = [line.rstrip("\n") for line in live["stderr"]]
    before_ready = lines[:live["ready_at"]]
    for worker in ("combine-0", "scatter-0"):
        stages = [line for line in before_ready if line.startswith(f"hybridcache up: {worker}: progress: ")]
        assert any("loading the model" in s and "done in" in s for s in stages), before_ready
    stats = [line for line in lines if line.startswith("hybridcache up: combine-0: Avg prompt throughput: ")]
    assert stats and re.search(r"Running: \d+ reqs, Waiting: \d+ reqs, K/V cache usage: [\d.]+%, "
                               r"Entry cache usage: [\d.]+% \([\d.]+ MiB\), Prefix cache hit rate: ", stats[0])
    logged = [line for line in lines if line.startswith("hybridcache up: router-0: request ")]
    assert len([line for line in logged if ": status 200 " in line]) == 5, logged
    warm = live["answers"][1][1]["hybridcache"]
    assert any(f"prompt {warm['prompt_tokens']} tokens (cached {warm['cached_tokens']})" in line for line in logged)
    assert any(": status 503" in line for line in logged)
