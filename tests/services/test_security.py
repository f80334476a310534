"""Entry integrity: internal gRPC calls carry the deployment's token, entries are sealed by their
writer and checked by every reader (HMAC, then the model's entry layout at the combine worker);
the poisoning attack against a real `up`-style cluster on loopback does not change an answer."""

from __future__ import annotations

import random
import re
import time
from concurrent import futures

import grpc
import pytest
import torch
from hybridcache.services import security
from hybridcache.services.cache_tier.client import CacheTierClient
from hybridcache.services.cache_tier.server import CacheTierServicer
from hybridcache.services.cache_tier.store import TierStore
from hybridcache.services.launcher import LocalCluster, free_port
from hybridcache.services.observability import metrics
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.cache import EntryLayout, SegmentEntry
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.sequence import AttnSpan, SpanData
from hybridcache.services.transport import get_transport
from hybridcache.services.transport.codec import EntryAssembler, entry_chunks, read_entries
from serving_helpers import http

QUESTION = "Question: what is in the documents?\nAnswer:"


@pytest.fixture
def installed():
    """A deployment secret installed in this process for the test, uninstalled after."""
    secret = security.DeploymentSecret.generate()
    security.install(secret)
    yield secret
    security.install(None)


def _rejected(reason: str) -> float:
    return metrics.ENTRIES_REJECTED.labels(reason=reason)._value.get()


def _scraped(url: str, reason: str) -> float:
    status, text = http("GET", f"{url}/metrics")
    m = re.search(rf'hybridcache_entries_rejected_total{{reason="{reason}"}} ([0-9.e+]+)', text)
    return float(m.group(1)) if m else 0.0


def test_internal_calls_without_the_token_are_unauthenticated(installed):
    store = TierStore(1 << 24)
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=[security.TokenInterceptor(installed.token)])
    rpc.add_CacheTierServicer_to_server(CacheTierServicer(store), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    server.start()
    try:
        bare = rpc.CacheTierStub(grpc.insecure_channel(address))
        other = security.TokenClientInterceptor(security.DeploymentSecret.generate().token)
        wrong = rpc.CacheTierStub(grpc.intercept_channel(grpc.insecure_channel(address), other))
        for stub in (bare, wrong):
            calls = (lambda s=stub: s.Stat(pb.StatRequest(keys=["k"]), timeout=5),
                     lambda s=stub: list(s.Get(pb.GetRequest(keys=["k"]), timeout=5)),
                     lambda s=stub: s.Put(iter([pb.EntryChunk(error="x")]), timeout=5))
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "token" in err.value.details()
        # A member's channel (the installed secret's token) gets through.
        client = CacheTierClient(address)
        assert client.stat(["k"]).present == [False]
    finally:
        server.stop(0)


def test_seal_binds_key_and_bytes_to_the_deployment(engine, installed):
    entry = engine.build_entry([random.Random(3).randrange(256) for _ in range(40)]).seal()
    assert entry.checksum.startswith("hmac-sha256:") and entry.verify()
    chunks = list(entry_chunks(entry, 0, get_transport("grpc")))
    (_, got, err), = read_entries(chunks)
    assert got is not None and got.key == entry.key, err

    before = _rejected("seal")
    # The same bytes under another key (the poisoner's copy of a real entry) do not verify.
    moved = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    moved[0].header.key = "f" * 64
    (_, got, err), = read_entries(moved)
    assert got is None and "seal" in err
    # Nor does an entry sealed by another deployment, nor one whose header claims another transport
    # (what a header says is not trusted), nor an unsealed one.
    security.install(security.DeploymentSecret.generate())
    foreign = list(entry_chunks(SegmentEntry(entry.key, entry.segment_tokens, entry.data, 0.0), 0,
                                get_transport("grpc")))
    security.install(installed)
    spoofed = [pb.EntryChunk.FromString(c.SerializeToString()) for c in foreign]
    spoofed[0].header.transport = "collective"
    unsealed = [pb.EntryChunk.FromString(c.SerializeToString()) for c in chunks]
    unsealed[0].header.checksum = ""
    for forged in (foreign, spoofed, unsealed):
        (_, got, err), = read_entries(forged)
        assert got is None and "seal" in err
    assert _rejected("seal") == before + 4


def test_entry_layout_refuses_mis_shaped_entries(engine):
    w = engine.config.seam_window
    good = engine.build_entry(list(range(10, 50)))
    layout = EntryLayout.of(engine.build_entry(list(range(w + 4))))
    assert layout.check(good, 40) is None
    assert "segment of 41" in layout.check(good, 41)
    d = good.data
    i = next(iter(d.attn))
    for k in (d.attn[i].k[:, :-1], d.attn[i].k[..., :-1], d.attn[i].k.to(torch.float64),
              d.attn[i].k[:, :, :-1]):
        attn = {**d.attn, i: AttnSpan(k, d.attn[i].v)}
        bad = SegmentEntry(good.key, 40, SpanData(d.num_tokens, d.local_start, dict(d.linear), attn), 0.0)
        assert layout.check(bad, 40) is not None
    no_layer = SegmentEntry(good.key, 40, SpanData(d.num_tokens, d.local_start, dict(d.linear), {}), 0.0)
    assert "layers" in layout.check(no_layer, 40)


def _noise_like(entry: SegmentEntry, gen: torch.Generator) -> SpanData:
    d = entry.data
    noise = {}
    for i, s in d.linear.items():
        noise[i] = type(s)(*(torch.randn(t.shape, generator=gen).to(t.dtype) for t in (s.T, s.S, s.conv_tail)))
    attn = {i: AttnSpan(torch.randn(a.k.shape, generator=gen), torch.randn(a.v.shape, generator=gen))
            for i, a in d.attn.items()}
    return SpanData(d.num_tokens, d.local_start, noise, attn)


def _put_raw(address: str, entry: SegmentEntry, token: str | None) -> pb.PutReply:
    channel = grpc.insecure_channel(address)
    if token is not None:
        channel = grpc.intercept_channel(channel, security.TokenClientInterceptor(token))
    chunks = list(entry_chunks(entry, 0, get_transport("grpc")))
    return rpc.CacheTierStub(channel).Put(iter(chunks), timeout=30)


def test_poisoning_the_cache_tier_does_not_change_the_answer(model_dir, engine):
    """The attack of the issue: noise stored under a victim's entry keys in the tier, by a caller
    without the token (refused at the door), by one holding the token but not the secret (the tier
    refuses the seal), and a correctly sealed entry of the wrong shapes (a faulty member: the tier
    stores it, the combine worker refuses its layout). The victim's answer is the reference's."""
    docs = [f"victim document {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i) for i in range(3)]
    ids = [engine.tokenizer.encode(d) for d in docs]
    gen = torch.Generator().manual_seed(0)
    c = LocalCluster(model_dir, port=free_port(), scatter_workers=1, cache_tiers=1)
    with c:
        tier, combine = c.role("cache-tier")[0], c.role("combine")[0]
        seal_before = _scraped(f"http://{tier.http}", "seal")
        layout_before = _scraped(f"http://{combine.http}", "layout")
        real = [engine.build_entry(s) for s in ids]
        # 1. no token: the call never reaches the store
        with pytest.raises(grpc.RpcError) as err:
            _put_raw(tier.grpc, SegmentEntry(real[0].key, real[0].segment_tokens, _noise_like(real[0], gen), 0.0), None)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # 2. the token but another key to seal with: refused by the tier
        security.install(security.DeploymentSecret.generate())
        try:
            noise = SegmentEntry(real[1].key, real[1].segment_tokens, _noise_like(real[1], gen), 0.0)
            reply = _put_raw(tier.grpc, noise, c.secret.token)
        finally:
            security.install(None)
        assert (reply.stored, reply.rejected) == (0, 1)
        # 3. sealed with the deployment's key but mis-shaped (K/V of one head fewer): stored, refused on use
        security.install(c.secret)
        try:
            d = real[2].data
            attn = {i: AttnSpan(a.k[:, 1:].contiguous(), a.v[:, 1:].contiguous()) for i, a in d.attn.items()}
            bad = SegmentEntry(real[2].key, real[2].segment_tokens,
                               SpanData(d.num_tokens, d.local_start, dict(d.linear), attn), 0.0)
            assert (_put_raw(tier.grpc, bad, c.secret.token).stored) == 1
        finally:
            security.install(None)
        assert _scraped(f"http://{tier.http}", "seal") >= seal_before + 1

        body = {"segments": docs, "text": QUESTION, "sampling_params": {"max_new_tokens": 6}}
        status, res = http("POST", f"{c.url}/generate", body, timeout=120)
        assert status == 200, res
        native = {"segments": docs, "suffix": QUESTION, "sampling_params": {"max_new_tokens": 6}}
        want = LLM(engine).generate(native)
        assert res["text"] == want.text
        assert "tier" not in [s["source"] for s in res["hybridcache"]["segments"]]
        assert _scraped(f"http://{combine.http}", "layout") >= layout_before + 1
        # Afterwards the tier holds the real entries the scatter worker wrote: they are served from there.
        time.sleep(1.0)
        status, res = http("POST", f"{c.url}/generate", dict(body, segments=docs[::-1]), timeout=120)
        want = LLM(engine).generate(dict(native, segments=docs[::-1]))
        assert status == 200 and res["text"] == want.text


def test_serve_without_a_secret_is_refused(model_dir):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "hybridcache.services.cli", "serve", "cache-tier", "--grpc-port",
                        str(free_port()), "--http-port", str(free_port())], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "deployment secret" in r.stderr and "Traceback" not in r.stderr


def test_assembler_counts_a_corrupt_tensor(engine, installed):
    entry = engine.build_entry(list(range(5, 45))).seal()
    chunks = list(entry_chunks(entry, 0, get_transport("grpc")))
    t = next(c for c in chunks if c.WhichOneof("body") == "tensor" and len(c.tensor.data) > 8)
    t.tensor.data = bytes(len(t.tensor.data))
    before = _rejected("checksum")
    asm = EntryAssembler()
    out = [r for c in chunks if (r := asm.feed(c)) is not None]
    assert out[0][1] is None and _rejected("checksum") == before + 1
