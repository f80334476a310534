"""The project as a user installs it: a wheel built from the sources the image copies, installed
into a fresh virtual environment, serves the shipped QA model with `hybridcache up` (no --model),
and refuses in one line when that model is missing."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from hybridcache.services.launcher import free_port
from serving_helpers import http

REPO = Path(__file__).resolve().parents[2]
DIST = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["name"]
# what the Dockerfile copies into its build stage, and nothing else
SOURCES = ("pyproject.toml", "README.md", "kernels", "services", "operator", "models")


def _site_packages_of(*modules: str) -> list[str]:
    """The directories the test environment imports these modules from (its installed packages)."""
    import importlib

    return sorted({str(Path(importlib.import_module(m).__file__).resolve().parents[1]) for m in modules})


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(bin dir, site-packages) of a venv holding the wheel alone; the project's dependencies
    come from the test environment's own site-packages through a .pth file."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(REPO / name, src / name)
    wheels = root / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(wheels)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.startswith(DIST.replace("-", "_") + "-")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {f"hybridcache/models/default/{f}" for f in ("config.json", "model.safetensors", "tokenizer.json")} <= names

    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "deps.pth").write_text("\n".join(_site_packages_of("torch", "grpc", "aiohttp", "pip")) + "\n")
    install = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q", str(wheel)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stdout + install.stderr
    return venv / "bin", site


def test_installed_wheel_serves_the_shipped_model(installed, tmp_path):
    from hybridcache.services.cli import sample_rag_request

    bin_dir, site = installed
    where = subprocess.run([str(bin_dir / "python"), "-P", "-c",
                            "import hybridcache.services, hybridcache.services.runtime.modelzoo as z; "
                            "print(hybridcache.services.__file__); print(z.default_model_dir())"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=120)
    code_file, model = where.stdout.split()
    assert Path(code_file).is_relative_to(site) and Path(model) == site / "hybridcache" / "models" / "default"

    port = free_port()
    proc = subprocess.Popen([str(bin_dir / "hybridcache"), "up", "--port", str(port), "--scatter-workers", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        ready = json.loads(proc.stdout.readline() or "{}")
        assert ready.get("ready"), proc.stderr.read() if proc.poll() is not None else "no ready line"
        # the trained model answers the demo's question (a random one would not)
        req, _, expected = sample_rag_request()
        status, res = http("POST", f"{ready['http']}/generate", req)
        assert status == 200 and res["text"].strip() == expected, res
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert f"for {site / 'hybridcache' / 'models' / 'default'} " in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_installation_without_the_shipped_model_refuses_in_one_line(installed, tmp_path):
    bin_dir, site = installed
    shipped = site / "hybridcache" / "models" / "default"
    hidden = site / "hybridcache" / "models" / "default.hidden"
    shipped.rename(hidden)
    try:
        run = subprocess.run([str(bin_dir / "hybridcache"), "up", "--port", str(free_port())],
                             capture_output=True, text=True, cwd=tmp_path, timeout=120)
    finally:
        hidden.rename(shipped)
    assert run.returncode == 2 and run.stdout == ""
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("hybridcache: error: no --model given") and "HYBRIDCACHE_MODEL" in line


def test_the_image_builds_the_wheel_from_the_same_sources():
    """The Dockerfile copies every source tree the wheel above is built from (the model included)
    before its pip install, so the image's installation carries the shipped model too."""
    lines = [line.split() for line in (REPO / "Dockerfile").read_text().replace("\\\n", " ").splitlines()]
    install = next(i for i, words in enumerate(lines) if words[:3] == ["RUN", "pip", "install"])
    copied = {w.rstrip("/") for words in lines[:install] if words[:1] == ["COPY"] for w in words[1:-1]}
    assert set(SOURCES) <= copied, set(SOURCES) - copied
