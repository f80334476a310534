"""The chart with a real helm: lint, render, golden files, values that must fail, copies in sync.

Regenerate the golden renders after an intended change:
    HYBRIDCACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/operator/test_chart_helm.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "hybridcache"
HELM = shutil.which("helm", path=str(Path(sys.executable).parent)) or shutil.which("helm")
RENDERS = {"default": [], "full": ["-f", str(CHART / "ci" / "full-values.yaml")]}


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    assert HELM is not None, "helm missing: scripts/bootstrap.d/k8s-tools.sh installs it into .venv/bin"
    return subprocess.run([HELM, *args], capture_output=True, text=True, check=check, timeout=60)


def render(*extra: str) -> str:
    return helm("template", "hc", str(CHART), "--namespace", "hybridcache-system", *extra).stdout


@pytest.mark.parametrize("values", list(RENDERS))
def test_helm_lint_strict(values):
    result = helm("lint", "--strict", str(CHART), *RENDERS[values])
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize("values", list(RENDERS))
def test_golden_render(values):
    rendered = render(*RENDERS[values])
    golden = CHART / "golden" / f"{values}.yaml"
    if os.environ.get("HYBRIDCACHE_UPDATE_GOLDEN"):
        golden.write_text(rendered)
    assert golden.read_text() == rendered, f"render differs from {golden}; see this file's docstring"


@pytest.mark.parametrize("values", list(RENDERS))
def test_rendered_objects_validate_strictly(values):
    docs = [d for d in yaml.safe_load_all(render("--include-crds", *RENDERS[values])) if d]
    builtin = [d for d in docs if not d["apiVersion"].startswith(("monitoring.coreos.com", "serving."))]
    assert {d["kind"] for d in builtin} >= {"Deployment", "ClusterRole", "ClusterRoleBinding", "ServiceAccount",
                                            "CustomResourceDefinition", "Service"}
    for doc in builtin:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("setting, message", [
    (["--set", "operator.replicas=2"], "standalone"),
    (["-f", str(CHART / "ci" / "full-values.yaml"),
      "--set", "instance.spec.scatter.autoscaling.minReplicas=5"], "minReplicas must not exceed"),
    (["-f", str(CHART / "ci" / "full-values.yaml"), "--set", "instance.spec.cacheTier.replicas=2"], "etcd"),
    (["--set", "operator.unknown=1"], "additional properties"),
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
])
def test_contradictory_or_invalid_values_fail(setting, message):
    result = helm("template", "hc", str(CHART), *setting, check=False)
    assert result.returncode != 0
    assert message in result.stderr


def test_chart_copies_equal_their_sources():
    """scripts/sync-chart-crd.sh makes these copies; edit manifests/, then run it."""
    pairs = {
        "manifests/crd/hybridcache.yaml": "charts/hybridcache/crds/hybridcache.yaml",
        "manifests/dashboards/hybridcache.json": "charts/hybridcache/files/hybridcache.json",
        "manifests/alerts/hybridcache-rules.yaml": "charts/hybridcache/files/hybridcache-rules.yaml",
    }
    for source, copy in pairs.items():
        assert (REPO / source).read_bytes() == (REPO / copy).read_bytes(), f"{copy} is stale: run the sync script"


def _kinds(docs):
    return {d["kind"]: d for d in docs if d}


def test_chart_and_manifests_install_the_same_operator():
    chart = _kinds(yaml.safe_load_all(render()))
    manifests = _kinds([*yaml.safe_load_all((REPO / "manifests/rbac/operator-rbac.yaml").read_text()),
                        *yaml.safe_load_all((REPO / "manifests/operator/operator.yaml").read_text())])
    assert chart["ClusterRole"]["rules"] == manifests["ClusterRole"]["rules"]
    ours, theirs = (k["Deployment"]["spec"]["template"]["spec"] for k in (chart, manifests))
    assert ours["securityContext"] == theirs["securityContext"]
    for field in ("command", "args", "securityContext", "livenessProbe", "volumeMounts"):
        assert ours["containers"][0][field] == theirs["containers"][0][field], field
    assert ours["containers"][0]["image"] == theirs["containers"][0]["image"]


def test_kubectl_kustomize_renders_the_plain_manifests():
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    assert kubectl is not None
    out = subprocess.run([kubectl, "kustomize", str(REPO / "manifests")], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert kinds == sorted(["CustomResourceDefinition", "Namespace", "Deployment", "Service", "ServiceAccount",
                            "ClusterRole", "ClusterRoleBinding"])
