"""A real Prometheus server on 127.0.0.1 (Debian's `prometheus`), started and stopped by a test."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hybridcache.services.launcher import free_port  # noqa: F401  (the operator tests import it from here)


@contextlib.contextmanager
def prometheus(workdir: Path, scrape_targets: list[tuple[str, dict[str, str]]],
               rule_files: list[Path] = ()) -> Iterator[str]:
    """Yield the base URL of a Prometheus scraping `targets` ("host:port", extra labels) every 1 s."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus is not installed (requirements/apt.txt lists it)")
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [{
            "job_name": "hybridcache",
            "static_configs": [{"targets": [target], "labels": labels} for target, labels in scrape_targets],
        }],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url + "/-/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("Prometheus did not start: " + (workdir / "prometheus.log").read_text()[-2000:])
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def query(url: str, expr: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})) as r:
        return json.load(r)
