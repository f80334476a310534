"""The scatter worker batches cold segments across Prefill calls: segments of calls that arrive
while a build runs go into the next build together, under the token budget, and each call gets
the entries it asked for, equal to ones built alone."""

from __future__ import annotations

import threading

import torch
from hybridcache.services.protocol import pb, segment
from hybridcache.services.scatter.worker import ScatterServicer
from hybridcache.services.transport.codec import EntryAssembler


class _Context:
    def __init__(self):
        self.callbacks = []

    def invocation_metadata(self):
        return ()

    def add_callback(self, fn):
        self.callbacks.append(fn)
        return True


def _segments(ids_list, start=0):
    return [segment(start + i, ids) for i, ids in enumerate(ids_list)]


def _call(servicer, segments, results, name):
    asm, got = EntryAssembler(), {}
    ctx = _Context()
    for chunk in servicer.Prefill(pb.PrefillRequest(segments=segments, transport="grpc"), ctx):
        out = asm.feed(chunk)
        if out is not None:
            got[out[0]] = out[1]
    for fn in ctx.callbacks:
        fn()
    results[name] = got


def test_segments_of_calls_arriving_together_are_built_in_one_batch(engine):
    servicer = ScatterServicer(engine, max_batch_tokens=100)
    calls, gate, first = [], threading.Event(), threading.Event()
    build = engine.build_entries

    def recording(segments):
        calls.append([len(s) for s in segments])
        if len(calls) == 1:
            first.set()
            assert gate.wait(30)
        return build(segments)

    engine.build_entries = recording
    try:
        gen = torch.Generator().manual_seed(3)

        def ids(n):
            return torch.randint(5, 250, (n,), generator=gen).tolist()

        blocker, a, b, c = ids(20), [ids(30), ids(25)], [ids(40)], [ids(30)]
        shared = a[0]
        results = {}
        threads = [threading.Thread(target=_call, args=(servicer, _segments([blocker]), results, "blocker"))]
        threads[0].start()
        assert first.wait(30)  # the builder is busy: the next calls queue behind it
        queued = 0
        for name, segs in (("a", a), ("b", b + [shared]), ("c", c)):
            threads.append(threading.Thread(target=_call, args=(servicer, _segments(segs), results, name)))
            threads[-1].start()
            # each call's segments are pending before the next call starts, so the queue's order is a, b, c
            queued += len(segs)
            deadline = 500
            while len(servicer._pending) < queued and deadline:
                threading.Event().wait(0.02)
                deadline -= 1
            assert len(servicer._pending) == queued
        gate.set()
        for t in threads:
            t.join(60)
    finally:
        engine.build_entries = build
    # a's two, b's own and (the shared one already taken) in one build of 95 tokens under 100;
    # c's in the next
    assert calls == [[20], [30, 25, 40], [30]]
    assert servicer.builds == [1, 3, 1]
    assert set(results["b"]) == {0, 1} and set(results["a"]) == {0, 1} and set(results["c"]) == {0}
    assert results["b"][1].key == results["a"][0].key
    for name, segs in (("a", a), ("b", b + [shared]), ("c", c)):
        for i, s in enumerate(segs):
            alone = engine.build_entry(s)
            entry = results[name][i]
            assert entry.key == alone.key
            for x, y in zip(entry.data.linear.values(), alone.data.linear.values()):
                assert torch.allclose(x.S, y.S, atol=1e-5)


def test_scatter_worker_warms_up_without_cuda_graphs(model_dir, monkeypatch):
    """A scatter worker only builds entries: its warm-up's assemblies must not leave CUDA graphs
    (GPU memory it would hold for nothing). The scatter role's engine runs with graphs off
    (serve.role_config): its runner holds none of either kind where a combine worker's holds both;
    its warm-up runs its requests through a scheduler of its own."""
    from hybridcache.services.api.serve import role_config
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
    from hybridcache.services.runtime.runner import ModelRunner

    config = EngineConfig(warmup_shape="4+2x64+8")
    assert role_config(config, "combine") == config
    scatter_config = role_config(config, "scatter")
    report = ScatterServicer(Engine.from_dir(model_dir, config=scatter_config), max_batch_tokens=256).warmup()
    assert report["requests"] > 0 and report["builds"]
    # as on a GPU (the device stands in)
    monkeypatch.setattr(HybridLM, "device", property(lambda self: torch.device("cuda")))
    model = load_model(model_dir)
    combine, scatter = ModelRunner(model, config), ModelRunner(model, scatter_config)
    assert combine.layout_graphs is not None and combine.decode_graphs_on and combine.assembly_graphs is not None
    assert scatter.layout_graphs is None and not scatter.decode_graphs_on and scatter.assembly_graphs is None
