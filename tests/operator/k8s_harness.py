"""Runs the strict emulator and the operator (kopf) each in its own thread, and gives tests a
plain synchronous client, so a test reads like a kubectl session against a cluster."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import kmock
import kubernetes
import yaml
from hybridcache.operator import kube
from k8s_emulator import ResourceType, StrictEmulator

T = TypeVar("T")


def write_kubeconfig(path: Path, server: str) -> None:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": server}}],
        "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
        "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}],
        "current-context": "emulator",
    }))


def client_from(kubeconfig: Path) -> kube.Kube:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
    return kube.Kube(kubernetes.client.ApiClient(configuration))


class EmulatorThread:
    """The emulator served on 127.0.0.1 from a thread with its own event loop."""

    def __init__(self, types: dict[str, ResourceType]):
        self.types = types
        self.emulator: StrictEmulator | None = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        async with StrictEmulator() as emulator, kmock.Server(emulator) as server:
            for resource, rtype in self.types.items():
                emulator.declare(resource, rtype)
            self.emulator, self.url = emulator, str(server.url).rstrip("/")
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            self._ready.set()
            await self._stop.wait()
            await emulator.close_watches()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the emulator did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the emulator's loop (its state is only touched there)."""
        assert self._loop is not None

        async def run() -> T:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def objects(self, resource: str) -> list[dict[str, Any]]:
        assert self.emulator is not None
        return self.call(self.emulator.objects, resource)

    def requests(self, *criteria: Any) -> list[kmock.Request]:
        assert self.emulator is not None
        return self.call(lambda: list(self.emulator[criteria]))

    def inject(self, status: int, *criteria: Any, times: int = 1, reason: str = "Injected") -> None:
        assert self.emulator is not None
        self.call(self.emulator.inject, status, *criteria, times=times, reason=reason)


@contextlib.contextmanager
def running_operator(timeout: float = 15.0) -> Iterator[None]:
    """kopf in its own thread (it cancels every task of its loop on exit), cluster-wide."""
    import hybridcache.operator.main  # noqa: F401  (registers the handlers)
    import kopf

    stop, ready = threading.Event(), threading.Event()
    settings = kopf.OperatorSettings()
    # Exit promptly: a test stops the operator several times; nothing is left to flush.
    settings.queueing.exit_timeout = 0.1
    settings.watching.reconnect_backoff = 0.1
    # A status patch caught by the stop would otherwise retry for seconds on a closed connector.
    settings.networking.error_backoffs = [0.1, 0.1]
    thread = threading.Thread(
        target=kopf.run,
        kwargs={"clusterwide": True, "standalone": True, "stop_flag": stop, "ready_flag": ready,
                "settings": settings},
        daemon=True,
    )
    thread.start()
    if not ready.wait(timeout):
        raise RuntimeError("kopf did not start")
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout)
        assert not thread.is_alive(), "kopf did not stop"


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition") -> T:
    """Poll until predicate() is truthy; no fixed sleeps in tests."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
        except (KeyError, IndexError, TypeError, kube.ApiError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last result: {last!r}")
