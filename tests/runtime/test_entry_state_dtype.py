"""Entries with T and S kept in bf16 (EngineConfig.entry_state_dtype): bytes, keys, pic answers,
segment parallelism's wire specs, and the config and flag checks."""

import random

import pytest
import torch
import torch.nn.functional as F
from hybridcache.services.runtime.cache import expected_entry_nbytes
from hybridcache.services.runtime.engine import Engine, EngineConfig
from hybridcache.services.runtime.llm import LLM


def rag_request(seed, n_docs=4, lo=90, hi=140):
    rng = random.Random(seed)
    return {
        "system": [rng.randrange(0, 256) for _ in range(10)],
        "segments": [[rng.randrange(0, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n_docs)],
        "suffix": [rng.randrange(0, 256) for _ in range(16)],
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
    }


def kl(p_logits, q_logits):
    p, q = F.log_softmax(p_logits, -1), F.log_softmax(q_logits, -1)
    return (p.exp() * (p - q)).sum().item()


def test_bad_state_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="entry_state_dtype must be one of float32, bfloat16"):
        EngineConfig(entry_state_dtype="float16")


def test_bf16_entries_halve_the_states_and_answer_like_fp32(qwen35_dir):
    """The same request reused after another prefix: with bf16 states every hit entry's T and S are
    bf16, its bytes are what expected_entry_nbytes says before the build (smaller than fp32's), and
    the next-token distribution stays as close to fp32 entries' as the rounding allows."""
    fp32 = Engine.from_dir(qwen35_dir, config=EngineConfig(mode="pic"))
    bf16 = Engine.from_dir(qwen35_dir, config=EngineConfig(mode="pic", entry_state_dtype="bfloat16"))
    assert fp32.entry_key([1, 2, 3] * 30) != bf16.entry_key([1, 2, 3] * 30)  # never mixed in a shared tier
    kls = []
    for seed in range(2):
        req = rag_request(seed)
        logits = []
        for eng in (fp32, bf16):
            LLM(eng).generate(dict(req, system=[5, 6, 7], segments=req["segments"][::-1]))
            pre = eng.prefill(eng.parse_request(req))
            assert all(s.hit for s in pre.stats.segments)
            logits.append(pre.logits)
        kls.append(kl(logits[0], logits[1]))
        assert logits[0].argmax() == logits[1].argmax()
    print("KL(fp32 entries || bf16 entries):", kls)
    assert max(kls) < 1e-3, kls
    w = bf16.config.seam_window
    for seg in rag_request(0)["segments"]:
        e32, e16 = fp32.entries.get(fp32.entry_key(seg)), bf16.entries.get(bf16.entry_key(seg))
        assert {s.T.dtype for s in e16.data.linear.values()} == {torch.bfloat16}
        assert {s.S.dtype for s in e16.data.linear.values()} == {torch.bfloat16}
        assert {s.S.dtype for s in e32.data.linear.values()} == {torch.float32}
        assert e16.nbytes == expected_entry_nbytes(bf16.cfg, len(seg) - w, bf16.model.dtype, torch.bfloat16)
        assert e32.nbytes == expected_entry_nbytes(fp32.cfg, len(seg) - w, fp32.model.dtype)
        assert e16.nbytes < e32.nbytes
        assert e16.meta["entry_state_dtype"] == "bfloat16"


def test_flag_reaches_the_engine_config():
    import argparse

    from hybridcache.services.config import add_config_flags, config_args, config_from_args

    ap = argparse.ArgumentParser()
    add_config_flags(ap)
    args = ap.parse_args(["--entry-state-dtype", "bfloat16"])
    assert config_from_args(args).state_dtype == torch.bfloat16
    forwarded = config_args(config_from_args(args), "combine")
    assert forwarded[forwarded.index("--entry-state-dtype") + 1] == "bfloat16"
    with pytest.raises(SystemExit):
        ap.parse_args(["--entry-state-dtype", "int8"])


def test_bf16_state_entries_answer_the_same_from_the_host_tier(qwen35_dir):
    """bf16 T and S survive the host tier's packing and staging: the same logits as from the device."""
    cfg = dict(mode="pic", entry_state_dtype="bfloat16")
    plain = Engine.from_dir(qwen35_dir, config=EngineConfig(**cfg))
    tiered = Engine.from_dir(qwen35_dir, config=EngineConfig(host_cache_bytes=1 << 30, **cfg))
    req = rag_request(7, n_docs=3)
    for e in (plain, tiered):
        LLM(e).generate(req)
    tiered.entries.demote_all()
    assert len(tiered.entries.host) == 3
    pre = [e.prefill(e.parse_request(dict(req, segments=req["segments"][::-1]))) for e in (plain, tiered)]
    assert [s.source for s in pre[1].stats.segments] == ["host"] * 3
    assert torch.equal(pre[0].logits, pre[1].logits)
