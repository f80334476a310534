"""One request's failure inside a scheduler step never fails another: with 8 requests running, a
fault injected into one request's own work (its cold build, its prefill or assembly, a bad entry,
its sampling, its stop-string check, its logprobs) finishes that request alone with its error, and
the 7 others give the answers they give alone. Only the step's shared forward may fail several.
Sampling parameters: no accepted finite value makes a step raise."""

from __future__ import annotations

import pytest
import torch
from hybridcache.services.runtime import scheduler as scheduler_mod
from hybridcache.services.runtime.cache import SegmentEntry
from hybridcache.services.runtime.engine import Engine
from hybridcache.services.runtime.sampling import (
    MIN_TEMPERATURE,
    RequestError,
    SamplingParams,
    sample_token,
    sampling_probs,
)
from hybridcache.services.runtime.scheduler import Scheduler, SchedulerConfig
from hybridcache.services.runtime.sequence import AttnSpan, LinearSpan, SpanData

N = 8
VICTIM = 3
MARK = 424242  # the victim's seed: how an injected fault knows its request (greedy requests ignore it)
MAX_NEW = 6


def _ids(gen, n):
    return torch.randint(5, 250, (n,), generator=gen).tolist()


def _requests(plain_victim: bool = False) -> list[dict]:
    """8 requests with own segments (cold builds) and a shared one; the victim marked by its seed."""
    gen = torch.Generator().manual_seed(7)
    shared = _ids(gen, 30)
    out = []
    for i in range(N):
        req = {"segments": [shared, _ids(gen, 20 + 3 * i)], "suffix": _ids(gen, 4 + i),
               "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True}}
        if i == VICTIM:
            req["sampling_params"]["seed"] = MARK
        if plain_victim and VICTIM - 1 <= i <= VICTIM + 1:
            # prompts that run all live, prefilled together in one batched plain prefill
            req = {"suffix": _ids(gen, 9 + i), "sampling_params": req["sampling_params"]}
        out.append(req)
    return out


def _victim(params) -> bool:
    return params.seed == MARK


@pytest.fixture(scope="module")
def fresh(model_dir):
    def make():
        return Engine.from_dir(model_dir)

    return make


@pytest.fixture(scope="module")
def alone(fresh):
    """Each request's output when it runs alone (a scheduler of its own, one request at a time)."""
    cache = {}

    def get(reqs):
        key = repr(reqs)
        if key not in cache:
            eng = fresh()
            out = []
            for r in reqs:
                sched = Scheduler(eng, SchedulerConfig(max_num_seqs=N))
                try:
                    out.append(sched.add_request(eng.parse_request(r)).result().output_ids)
                finally:
                    sched.stop()
            cache[key] = out
        return cache[key]

    return get


def _after(n: int):
    """True from the (n+1)-th call on: a fault that comes once the victim is running."""
    calls = {"n": 0}

    def hit() -> bool:
        calls["n"] += 1
        return calls["n"] > n

    return hit


def _bad_entry(eng: Engine, ids: list[int]) -> SegmentEntry:
    """An entry under the key of `ids` whose tensors have the wrong shapes (a sealed but mis-shaped entry)."""
    d = 3
    linear = {i: LinearSpan(torch.zeros(1, 1, d, d), torch.zeros(1, 1, d, d), torch.zeros(1, 2, 1))
              for i in eng.cfg.linear_layers}
    attn = {i: AttnSpan(torch.zeros(1, 1, 2, d), torch.zeros(1, 1, 2, d)) for i in eng.cfg.attention_layers}
    return SegmentEntry(key=eng.entry_key(ids), segment_tokens=len(ids), data=SpanData(len(ids), 0, linear, attn),
                        build_seconds=0.0)


def _inject(stage: str, monkeypatch, eng: Engine, reqs: list[dict]):
    """Make the victim's `stage` fail (RuntimeError, or RequestError where its parameters would be the
    cause); returns (pinned entries per request index, the error expected)."""
    boom = RuntimeError(f"injected fault in {stage}")
    pinned = {}
    if stage == "cold build":
        own = reqs[VICTIM]["segments"][1]
        real = eng.build_entries

        def build(segments, *a, **k):
            if own in segments:
                raise boom
            return real(segments, *a, **k)

        monkeypatch.setattr(eng, "build_entries", build)
    elif stage in ("assembly", "plain prefill"):
        # an assembly's prefill starts in start_prefill (the scheduler runs it in chunks after)
        name = "start_prefill" if stage == "assembly" else "prefill_plain"
        real = getattr(eng, name)

        def prefill(arg, *a, **k):
            reqs_of = arg if isinstance(arg, list) else [arg]
            if any(_victim(r.sampling) for r in reqs_of):
                raise boom
            return real(arg, *a, **k)

        monkeypatch.setattr(eng, name, prefill)
    elif stage == "bad entry":
        own = reqs[VICTIM]["segments"][1]
        pinned[VICTIM] = {eng.entry_key(own): _bad_entry(eng, own)}
        boom = None  # whatever the engine raises on it
    elif stage == "logits":
        # its penalties: the per-request adjustment of its row of the step's logits
        reqs[VICTIM]["sampling_params"]["repetition_penalty"] = 1.1
        hit = _after(2)

        class Failing(scheduler_mod.LogitsAdjuster):
            def __call__(self, logits, output_ids):
                if hit():
                    raise boom
                return super().__call__(logits, output_ids)

        monkeypatch.setattr(scheduler_mod, "LogitsAdjuster", Failing)
    elif stage == "stop strings":
        real = scheduler_mod.TextStream.push
        hit = _after(2)

        def push(self, tok, logprobs=None):
            if _victim(self.params) and hit():
                raise boom
            return real(self, tok, logprobs)

        monkeypatch.setattr(scheduler_mod.TextStream, "push", push)
    elif stage == "logprobs":
        reqs[VICTIM]["sampling_params"]["logprobs"] = 2
        boom = RequestError("injected: logprobs refused")
        real = scheduler_mod.token_logprobs
        hit = _after(2)

        def logprobs(logits, tok, top):
            if top == 2 and hit():
                raise boom
            return real(logits, tok, top)

        monkeypatch.setattr(scheduler_mod, "token_logprobs", logprobs)
    else:
        raise AssertionError(stage)
    return pinned, boom


STAGES = ["cold build", "plain prefill", "assembly", "bad entry", "logits", "stop strings", "logprobs"]


@pytest.mark.parametrize("stage", STAGES)
def test_a_fault_in_one_requests_work_fails_it_alone(stage, fresh, alone, monkeypatch):
    reqs = _requests(plain_victim=stage == "plain prefill")
    want = alone(reqs)
    eng = fresh()
    pinned, boom = _inject(stage, monkeypatch, eng, reqs)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=N, max_num_batched_tokens=4096))
    try:
        with sched._cv:  # all 8 queued before the first step: they run together
            handles = [sched.add_request(eng.parse_request(r), pinned.get(i)) for i, r in enumerate(reqs)]
        for h in handles:
            h.done.wait(120)
        # every request ran in one batch: 8 decoding at once
        assert max(sched.batch_sizes) >= N - 1, sched.batch_sizes
        for i, h in enumerate(handles):
            if i == VICTIM:
                assert h.finish_reason == "error", (stage, h.finish_reason)
                assert h.error is not None and (boom is None or h.error is boom), h.error
                with pytest.raises(type(h.error)):
                    h.result()
            else:
                assert h.error is None, (stage, i, h.error)
                assert h.finish_reason == "length" and h.output_ids == want[i], (stage, i)
        # what the victim held is back: no reservation, no slot
        assert sched._kv_reserved == 0 and sorted(sched.pool.free) == list(range(N))
    finally:
        sched.stop()


def test_the_shared_decode_forward_fails_its_batch_and_the_scheduler_goes_on(fresh, alone, monkeypatch):
    reqs = _requests()
    want = alone(reqs)
    eng = fresh()
    real = eng.decode_batch
    calls = {"n": 0}

    def decode(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected: the device failed")
        return real(*a, **k)

    monkeypatch.setattr(eng, "decode_batch", decode)
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=N))
    try:
        with sched._cv:
            handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        failed = [h for h in handles if (h.done.wait(120), h.finish_reason)[1] == "error"]
        assert failed and all("device failed" in str(h.error) for h in failed)
        # a request after the fault is served as alone
        again = sched.add_request(eng.parse_request(reqs[0])).result()
        assert again.output_ids == want[0]
    finally:
        sched.stop()


@pytest.mark.parametrize("temperature", [1e-45, 1e-39, 1e-30, 1e-8, 0.005])
def test_no_accepted_temperature_makes_a_step_raise(temperature, fresh, alone):
    """The audit's case: a temperature in (0, ~1e-38] passed validation and raised in the step, failing
    every request running. Raised to MIN_TEMPERATURE as vLLM does, it samples."""
    params = SamplingParams.from_dict({"temperature": temperature, "seed": 1})
    assert params.temperature == MIN_TEMPERATURE
    reqs = _requests()
    reqs[VICTIM]["sampling_params"]["temperature"] = temperature
    want = alone(_requests())
    eng = fresh()
    sched = Scheduler(eng, SchedulerConfig(max_num_seqs=N))
    try:
        with sched._cv:
            handles = [sched.add_request(eng.parse_request(r)) for r in reqs]
        outs = [h.result() for h in handles]
    finally:
        sched.stop()
    assert all(o.finish_reason == "length" for o in outs)
    assert [o.output_ids for i, o in enumerate(outs) if i != VICTIM] == [w for i, w in enumerate(want) if i != VICTIM]


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-20, MIN_TEMPERATURE, 1.0, 100.0])
def test_sampling_is_finite_for_any_finite_logits(temperature):
    """Directly constructed parameters too: large logits of both signs, any temperature; the largest
    logit wins by 1e37, whatever the temperature."""
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([3.0e38, -3.0e38, 1.0, 2.9e38, 0.0])
    for top_p, top_k in ((1.0, -1), (1e-300, -1), (0.5, 2), (1.0, 1 << 62)):
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        assert sample_token(logits, params, g) == 0
        probs = sampling_probs(logits[None], [params])
        assert bool(torch.isfinite(probs).all()) and probs[0, 0] == 1.0


def test_penalties_are_bounded():
    for bad in (1e-39, 0.0, 2.5):
        with pytest.raises(RequestError, match="repetition_penalty"):
            SamplingParams.from_dict({"repetition_penalty": bad})
    for bad in (-2.5, 3.0):
        with pytest.raises(RequestError, match="frequency_penalty"):
            SamplingParams.from_dict({"frequency_penalty": bad})
