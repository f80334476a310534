"""The image recipe, the operator manifests and the shell scripts, checked without Docker or a cluster."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ["scripts/e2e-real-cluster.sh", "scripts/sync-chart-crd.sh", "scripts/bootstrap.d/k8s-tools.sh"]


def dockerfile_instructions():
    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_dockerfile_runs_as_non_root_with_the_cli_entrypoint():
    lines = dockerfile_instructions()
    final_stage = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM")):]
    users = [line for line in final_stage if line.startswith("USER ")]
    assert users and users[-1].split()[1].split(":")[0] not in ("0", "root")
    assert 'ENTRYPOINT ["hybridcache"]' in final_stage
    # the uid the manifests run as exists in the image
    assert any("useradd --uid 10001" in line for line in final_stage)
    for path in ("pyproject.toml", "kernels/", "services/", "operator/"):
        assert any(line.startswith("COPY") and path in line for line in lines), path
        assert (REPO / path).exists(), path
    # every command the manifests run is installed by the image: kopf with the operator extra
    # (tests/test_requirements.py checks that the extra holds it)
    installs = " ".join(line for line in lines if line.startswith("RUN"))
    assert '".[gpu,operator]"' in installs


def test_cpu_example_model_path_is_built_into_the_image():
    example = yaml.safe_load((REPO / "manifests/examples/cpu-demo.yaml").read_text())
    path = example["spec"]["model"]["path"].rstrip("/")
    lines = dockerfile_instructions()
    generated = re.search(rf"--out {re.escape(path)}\b", " ".join(lines))
    copied = [line.split()[1] for line in lines if line.startswith("COPY") and line.split()[-1].rstrip("/") == path]
    assert generated or copied, f"{path} is neither generated nor copied into the image"
    for src in copied:  # a copied model must be in the repository, whole
        assert (REPO / src / "config.json").is_file() and (REPO / src / "model.safetensors").is_file(), src


def test_operator_manifests_validate_and_are_locked_down():
    docs = [d for f in ("rbac/operator-rbac.yaml", "operator/operator.yaml")
            for d in yaml.safe_load_all((REPO / "manifests" / f).read_text()) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = pod["containers"][0]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["args"][-2:] == ["-m", "hybridcache.operator.main"]
    assert deployment["spec"]["replicas"] == 1, "kopf runs --standalone"
    (role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    verbs = {v for rule in role["rules"] for v in rule["verbs"]}
    assert "delete" not in verbs and "*" not in verbs, "children go by garbage collection"
    assert all("*" not in rule["resources"] for rule in role["rules"])


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(REPO / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is in requirements/apt.txt")
@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_pass_shellcheck(script):
    result = subprocess.run(["shellcheck", str(REPO / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_e2e_script_checks_what_only_a_real_server_can():
    text = (REPO / "scripts/e2e-real-cluster.sh").read_text()
    for needle in ("--dry-run=server", "COLD-QUEUE", "scale hc/demo", "garbage-collected", "helm", "kind"):
        assert needle in text, needle
