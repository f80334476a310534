"""Secrets and files: the API key reaches the router alone (never an argument list, never another
child's environment; --api-key-file hands it over as a path), --api-key on a command line is
warned about; shared-memory entry blocks, the deployment secret and spilled entries are readable
by their owner alone; the combine and scatter workers dial only members of their deployment (a
plan or a Prefill naming another address is not followed)."""

from __future__ import annotations

import json
import os
import socket
import stat
from pathlib import Path

import grpc
import pytest
import torch
from hybridcache.services import security
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.protocol import pb, rpc, segment
from hybridcache.services.runtime.plan import segment_key
from serving_helpers import http

KEY = "sk-secret-5e0c9a71"


def _proc(pid: int, what: str) -> bytes:
    with open(f"/proc/{pid}/{what}", "rb") as f:
        return f.read()


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_an_api_key_in_the_environment_reaches_the_router_alone(model_dir, monkeypatch):
    """`up` with HYBRIDCACHE_API_KEY set: the audit found the key in all five children's environments."""
    monkeypatch.setenv("HYBRIDCACHE_API_KEY", KEY)
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1, api_key=KEY) as c:
        for svc in c.services:
            assert KEY.encode() not in _proc(svc.proc.pid, "cmdline"), svc.role
            has = KEY.encode() in _proc(svc.proc.pid, "environ")
            assert has == (svc.role == "router"), svc.role
        assert http("POST", f"{c.url}/generate", {"text": "hi"})[0] == 401


def test_an_api_key_file_hands_the_key_over_as_a_path(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("HYBRIDCACHE_API_KEY", raising=False)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    keys.chmod(0o600)
    with LocalCluster(model_dir, port=free_port(), scatter_workers=0, api_key_file=str(keys)) as c:
        for svc in c.services:
            assert KEY.encode() not in _proc(svc.proc.pid, "cmdline") + _proc(svc.proc.pid, "environ"), svc.role
        assert str(keys).encode() in _proc(c.role("router")[0].proc.pid, "cmdline")
        import urllib.request

        req = urllib.request.Request(f"{c.url}/generate", data=json.dumps({"text": "hi", "sampling_params": {
            "max_new_tokens": 1}}).encode(), headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200


def test_an_api_key_on_the_command_line_is_warned_about(capsys, tmp_path):
    from hybridcache.services import cli

    assert cli.main(["serve", "router", "--api-key", KEY, "--secret-file", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "warning: --api-key on the command line shows in `ps`" in err and "--api-key-file" in err
    assert cli.main(["serve", "router", "--api-key-file", str(tmp_path / "none"),
                     "--secret-file", str(tmp_path / "none")]) == 2
    assert "warning" not in capsys.readouterr().err


def test_shared_memory_blocks_the_secret_and_spilled_entries_are_private(tmp_path, monkeypatch):
    before = os.umask(0o022)  # what a service typically runs with: files 0644 unless made otherwise
    try:
        _private_files(tmp_path, monkeypatch)
    finally:
        os.umask(before)


def _private_files(tmp_path, monkeypatch):
    from hybridcache.services.cache_tier.store import write_entry_file
    from hybridcache.services.runtime.cache import SegmentEntry
    from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData
    from hybridcache.services.transport import shm

    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    chunk = type("Chunk", (), {})()
    shm.ShmTransport().write(chunk, torch.arange(64, dtype=torch.float32))
    assert _mode(tmp_path / chunk.shm_name) == 0o600
    # a secret written over a file that was there, world-readable
    path = tmp_path / "secret"
    path.write_bytes(b"old")
    path.chmod(0o644)
    security.DeploymentSecret.generate().write(path)
    assert _mode(path) == 0o600
    data = SpanData(4, 0, {0: LinearSpan(torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 2, 1))},
                    {1: AttnSpan(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))})
    write_entry_file(tmp_path / "e.entry", SegmentEntry("k", 4, data, 0.0))
    assert _mode(tmp_path / "e.entry") == 0o600


@pytest.fixture(scope="module")
def deployment(model_dir):
    with LocalCluster(model_dir, port=free_port(), scatter_workers=1) as c:
        security.install(c.secret)
        try:
            yield c
        finally:
            security.install(None)


class Rogue:
    """An address outside the deployment, listening: whether anything connected to it."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def dialled(self) -> bool:
        self.sock.settimeout(0.5)
        try:
            conn, _ = self.sock.accept()
            conn.close()
            return True
        except TimeoutError:
            return False
        finally:
            self.sock.close()


def test_the_combine_worker_dials_only_members(deployment):
    assert _mode(Path(deployment.config.secret_file)) == 0o600  # the secret `up` wrote
    combine = deployment.role("combine")[0].grpc
    stub = rpc.CombineStub(security.internal_channel(combine))
    info = stub.Info(pb.InfoRequest(), timeout=30)
    for n, source in enumerate(("tier", "scatter")):
        ids = list(range(20 + n, 120 + n))
        key = segment_key(info.fingerprint, info.seam_window, ids)
        rogue = Rogue()
        creq = pb.CombineRequest(
            request_id=f"rogue-{source}", segments=[segment(0, ids)], suffix_ids=[5, 6, 7],
            sampling_json=json.dumps({"max_new_tokens": 2}),
            plan=[pb.SegmentPlan(index=0, key=key, source=source, address=rogue.address, cache_tier=rogue.address)],
            scatter_workers=[rogue.address], cache_tier=rogue.address)
        chunks = list(stub.Generate(creq, timeout=60))
        assert chunks[-1].done and not chunks[-1].error, chunks[-1]
        stats = json.loads(chunks[-1].stats_json)
        assert stats["segments"][0]["source"] == "built", stats["segments"]
        assert not rogue.dialled(), source


def test_the_scatter_worker_refuses_a_prefill_naming_another_tier(deployment):
    scatter = deployment.role("scatter")[0].grpc
    stub = rpc.ScatterStub(security.internal_channel(scatter))
    rogue = Rogue()
    req = pb.PrefillRequest(segments=[segment(0, list(range(30, 90)), cache_tier=rogue.address)],
                            cache_tier=rogue.address, transport="grpc")
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Prefill(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "not a member" in e.value.details()
    assert not rogue.dialled()
    # a member tier is fine
    tier = deployment.role("cache-tier")[0].grpc
    req = pb.PrefillRequest(segments=[segment(0, list(range(30, 90)), cache_tier=tier)], transport="grpc")
    assert any(c.HasField("header") for c in stub.Prefill(req, timeout=60))

