"""Fixtures for the operator tests. KUBECONFIG and the operator's timings are set here, at
import, because kopf and hybridcache.operator.main read them when they are imported."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_KUBECONFIG = Path(tempfile.mkdtemp(prefix="hc-operator-tests-")) / "kubeconfig"
os.environ["KUBECONFIG"] = str(_KUBECONFIG)
os.environ["HYBRIDCACHE_TIMER_INTERVAL"] = "0.2"
os.environ["HYBRIDCACHE_RETRY_DELAY"] = "0.2"
os.environ["HYBRIDCACHE_OPERATOR_METRICS_PORT"] = "0"

import crd_validation  # noqa: E402
from hybridcache.operator import kube  # noqa: E402
from k8s_emulator import standard_types  # noqa: E402
from k8s_harness import EmulatorThread, client_from, running_operator, write_kubeconfig  # noqa: E402


@pytest.fixture
def emulator() -> Iterator[EmulatorThread]:
    with EmulatorThread(standard_types(admit_hybridcache=crd_validation.admit)) as emu:
        write_kubeconfig(_KUBECONFIG, emu.url)
        yield emu


@pytest.fixture
def client(emulator: EmulatorThread) -> kube.Kube:
    return client_from(_KUBECONFIG)


@pytest.fixture
def operator(emulator: EmulatorThread) -> Iterator[None]:
    with running_operator():
        yield
