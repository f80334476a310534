"""Helpers of the serving tests (a module with its own name: tests/ has several conftest.py)."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request

from hybridcache.services.launcher import free_port


def stop_up(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """Stop a `hybridcache up` process: SIGTERM first, so that it stops the services it started
    (SIGKILL would leave them running), then SIGKILL if it has not exited within `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TIER_BYTES = 300_000  # two cache-tier members of ~5 tiny-model entries each: the load test evicts
MAX_MODEL_LEN = 3000  # the cluster's --max-model-len, under the tiny model's max_position_embeddings


def http(method: str, url: str, body=None, raw: bytes | None = None, timeout: float = 60.0):
    """(status, parsed JSON or text) without raising on 4xx/5xx."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


class Etcd:
    """A real etcd server on 127.0.0.1 with its own data dir; start() and stop() may repeat."""

    def __init__(self, data_dir):
        self.data_dir = data_dir
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> Etcd:
        c, p = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        self.proc = subprocess.Popen(
            ["etcd", "--name", "t", "--data-dir", str(self.data_dir), "--listen-client-urls", c,
             "--advertise-client-urls", c, "--listen-peer-urls", p, "--initial-advertise-peer-urls", p,
             "--initial-cluster", f"t={p}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{c}/health", timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return self
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("etcd did not become healthy")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None


_IPC_HANDLES = itertools.count()


class FakeCudaIpc:
    """CUDA IPC replaced by an in-process registry of CPU buffers: an export of a range of a packed
    buffer puts the buffer under a handle (one per buffer, as a CUDA allocation has one) with the
    range's offset; open returns the whole buffer (as a peer process maps the sender's allocation:
    the same bytes). Records the exports, the opens (by handle and by block index) and the released
    reference counters; the receiver's mappings (and arenas) start empty; `visible` are the GPUs
    this process can open."""

    def __init__(self, monkeypatch, device: str, visible: tuple[str, ...]):
        from hybridcache.services.transport import cuda_ipc, ipc_pool

        self.device = device
        self.shared: dict = {}
        self.exports: list[bytes] = []
        self.opened_handles: list[bytes] = []
        self.opened_indices: list[int] = []
        self.released: list[bytes] = []
        monkeypatch.setattr(cuda_ipc, "share", self.share)
        monkeypatch.setattr(cuda_ipc, "open_shared", self.open_shared)
        monkeypatch.setattr(cuda_ipc, "release_counter", lambda block, index: self.released.append(block.handle))
        monkeypatch.setattr(cuda_ipc, "visible_gpus", lambda: visible)
        monkeypatch.setattr(cuda_ipc, "MAPPINGS", cuda_ipc.DeviceMappings())
        monkeypatch.setattr(cuda_ipc, "ARENAS", ipc_pool.ArenaMappings())

    def share(self, buf, block) -> None:
        base = buf if buf._base is None else buf._base
        handle = next((h for h, t in self.shared.items() if t is base), None)
        if handle is None:
            handle = f"h{next(_IPC_HANDLES)}".encode()
            self.shared[handle] = base
        self.exports.append(handle)
        block.device_uuid, block.handle, block.storage_bytes = self.device, handle, base.numel()
        block.tensor_offset = buf.storage_offset() - base.storage_offset()

    def open_shared(self, block, index):
        self.opened_handles.append(block.handle)
        self.opened_indices.append(index)
        return self.shared[block.handle]
