"""Alert rules pass promtool; every dashboard query parses (as promtool sees it) and names only
metrics the services export (services/contract.py)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import yaml
from hybridcache.services import contract

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "manifests" / "dashboards" / "hybridcache.json"
RULES = REPO / "manifests" / "alerts" / "hybridcache-rules.yaml"
HISTOGRAMS = (contract.METRIC_TTFT_SECONDS, contract.METRIC_INTER_TOKEN_SECONDS, contract.METRIC_ENTRY_BUILD_SECONDS,
              contract.METRIC_GC_PAUSE_SECONDS, contract.METRIC_E2E_SECONDS)
ALLOWED = set(contract.ALL_METRICS) | {f"{h}_{s}" for h in HISTOGRAMS for s in ("bucket", "sum", "count")}
METRIC = re.compile(r"\bhybridcache_[a-z0-9_]+\b")


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (its label names, as in {...} and by (...), left out)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    return set(METRIC.findall(re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", expr)))


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool missing: requirements/apt.txt lists prometheus"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60)


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in board["panels"] for t in p["targets"]]
    queries += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return queries


def test_alert_rules_pass_promtool():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 4 rules found" in result.stdout


def test_alert_rules_name_only_exported_metrics():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    for rule in rules:
        names = metric_names(rule["expr"])
        assert names and names <= ALLOWED, (rule["alert"], names - ALLOWED)


def test_backlog_alert_fires_after_ten_minutes(tmp_path):
    test = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": [{
                "series": f'{contract.METRIC_COLD_QUEUE_DEPTH}{{namespace="ns",service="demo-router"}}',
                "values": "100x20",
            }],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "HybridCacheColdQueueBacklog", "exp_alerts": []},
                {"eval_time": "15m", "alertname": "HybridCacheColdQueueBacklog", "exp_alerts": [{
                    "exp_labels": {"severity": "warning", "namespace": "ns", "service": "demo-router"},
                    "exp_annotations": {
                        "summary": "Cold segments are piling up at ns/demo-router",
                        "description": "100 cold segments have waited for scatter workers for 10 minutes. Raise "
                                       "scatter.autoscaling.maxReplicas or check the scatter workers.",
                    },
                }]},
            ],
        }],
    }
    path = tmp_path / "backlog_test.yaml"
    path.write_text(yaml.safe_dump(test))
    result = promtool("test", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_queries_parse(tmp_path):
    """promtool parses each query as the expression of a recording rule; Grafana's $variables are
    replaced the way Grafana would before sending the query."""
    queries = [q.replace("$namespace", ".*").replace("label_values(hybridcache_requests_total, namespace)",
                                                     "count by (namespace) (hybridcache_requests_total)")
               for q in dashboard_queries()]
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": q} for i, q in enumerate(queries)]}]}
    path = tmp_path / "dashboard_rules.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout


def test_promtool_rejects_a_broken_query(tmp_path):
    path = tmp_path / "broken.yaml"
    broken = {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(x[5m])"}]}]}
    path.write_text(yaml.safe_dump(broken))
    assert promtool("check", "rules", str(path)).returncode != 0


def test_dashboard_names_only_exported_metrics_and_covers_the_issue_panels():
    used = set()
    for query in dashboard_queries():
        names = metric_names(query)
        assert names and names <= ALLOWED, (query, names - ALLOWED)
        used |= names
    for needed in (contract.METRIC_TTFT_SECONDS + "_bucket", contract.METRIC_COLD_QUEUE_DEPTH,
                   contract.METRIC_CACHE_HITS, contract.METRIC_CACHE_QUERIES, contract.METRIC_SCATTER_REPLICAS,
                   contract.METRIC_BYTES_MOVED, contract.METRIC_ENTRY_BUILD_SECONDS + "_bucket"):
        assert needed in used, needed
    titles = {p["title"] for p in json.loads(DASHBOARD.read_text())["panels"]}
    assert {"Time to first token", "Cold-segment queue depth", "Cache hit ratio by tier", "Scatter workers",
            "Bytes moved by path", "Cache entry build time"} <= titles


def test_operator_exports_the_scatter_replicas_gauge():
    import hybridcache.operator.main as operator_main
    import prometheus_client

    operator_main.SCATTER_REPLICAS.labels("ns", "demo").set(3)
    text = prometheus_client.generate_latest().decode()
    assert f'{contract.METRIC_SCATTER_REPLICAS}{{hybridcache="demo",hybridcache_namespace="ns"}} 3.0' in text
