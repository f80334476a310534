"""The request plan (services/runtime/plan.py): importable and usable without torch, and the same
keys, sizes and validation as the engine that runs the request."""

import dataclasses
import hashlib
import json
import random
import struct
import subprocess
import sys

import pytest
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.plan import CACHE_FORMAT, Planner, chain_key, segment_key
from hybridcache.services.runtime.sampling import RequestError

REQUEST = {"system": "You answer from the documents.", "segments": ["the first document " * 6, list(range(5, 45)),
                                                                    "a last one, not reused"],
           "suffix": "Question: which?", "sampling_params": {"max_new_tokens": 3}}

PLAN_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None  # any import of torch fails
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.runtime.models.registry import config_from_dir
from hybridcache.services.runtime.plan import CACHE_FORMAT, Planner, chain_key, segment_key
from hybridcache.services.runtime.tokenizer import Tokenizer

model_dir, fingerprint, request = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
planner = Planner(config_from_dir(model_dir), Tokenizer.from_dir(model_dir),
                  RuntimeConfig(seam_window=4, entry_state_dtype="bfloat16"), fingerprint)
req = planner.parse(request)
print(json.dumps({"prompt": req.prompt_ids, "chain": planner.chain_keys(req),
                  "segments": [[s.index, s.key, s.nbytes] for s in planner.reused_segments(req)]}))
"""


@pytest.fixture(scope="module")
def engine(qwen35_dir):
    from hybridcache.services.runtime.engine import Engine

    return Engine.from_dir(qwen35_dir, config=RuntimeConfig(seam_window=4, entry_state_dtype="bfloat16"))


def test_a_request_is_planned_without_torch_as_the_engine_plans_it(engine, qwen35_dir):
    out = subprocess.run([sys.executable, "-c", PLAN_WITHOUT_TORCH, str(qwen35_dir), engine.fingerprint,
                          json.dumps(REQUEST)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    req = engine.parse_request(REQUEST)
    assert plan["prompt"] == req.prompt_ids
    assert plan["chain"] == engine.planner.chain_keys(req)
    # the last segment (followed by the suffix) is reused too; the engine keys and builds the same
    assert [i for i, _, _ in plan["segments"]] == [0, 1, 2]
    for i, key, nbytes in plan["segments"]:
        ids = req.segment_ids[i]
        entry = engine.build_entry(ids)
        assert key == engine.entry_key(ids) == entry.key
        assert nbytes == entry.nbytes  # bf16 T and S, fp32 model: what the engine stores


@pytest.mark.parametrize("settings", [dict(mode="naive"), dict(entry_policy="single_state"), dict(mode="prefix"),
                                      dict(seam_window=0)])
def test_keys_follow_the_settings_that_change_an_entry(engine, settings):
    base = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    other = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(**settings), engine.fingerprint)
    req = base.parse(REQUEST)
    changes_entries = settings.get("mode") != "prefix" and settings.get("mode") != "naive"
    assert (base.entry_key(req.segment_ids[0]) != other.entry_key(req.segment_ids[0])) == changes_entries
    assert base.chain_keys(req) != other.chain_keys(req)
    if settings.get("mode") == "prefix":
        assert other.reused_segments(req) == []


def test_the_last_part_and_short_segments_are_not_reused(engine):
    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(seam_window=8), engine.fingerprint)
    req = planner.parse({"segments": [list(range(5, 50)), list(range(60, 70)), list(range(80, 120))]})
    # the 10-token segment leaves a 2-token body (< conv width - 1); the last segment is the last part
    assert [s.index for s in planner.reused_segments(req)] == [0]


@pytest.mark.parametrize("bad, message", [
    ({"segments": "x"}, "segments must be a list"),
    ({"segments": [[]], "suffix": "q"}, "segment 0 is empty"),
    ({"suffix": [1, 10**9]}, "outside the vocabulary"),
    ({"suffix": [1, -1]}, "token id -1 outside the vocabulary"),
    ({"suffix": [1, True]}, "must be a string or a list of token ids"),
    ({"suffix": [1, 2.0]}, "must be a string or a list of token ids"),
    ({"suffix": [1, [2]]}, "must be a string or a list of token ids"),
    ({"suffix": "q", "colour": 1}, "unknown request field"),
    ({}, "nothing to run"),
    ({"segments": ["a"] * 65}, "too many segments"),
    ({"suffix": "q", "sampling_params": {"max_new_tokens": 10**9}}, "max_new_tokens"),
])
def test_bad_requests_are_refused_alike(engine, bad, message):
    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    with pytest.raises(RequestError, match=message):
        planner.parse(bad)
    with pytest.raises(RequestError, match=message):
        engine.parse_request(bad)


def test_keys_hash_the_ids_as_little_endian_int64():
    """Keys must not change with how the ids are packed: entries in a shared tier outlive a release."""
    ids = [0, 1, 250, 2**31 + 7, 151_000]
    packed = struct.pack(f"<{len(ids)}q", *ids)
    assert segment_key("fp", 8, ids) == hashlib.sha256(f"fp|{CACHE_FORMAT}|w=8|".encode() + packed).hexdigest()
    assert chain_key("root", "segment", ids) == hashlib.sha256(b"root|segment|" + packed).hexdigest()


def _python_calls(fn) -> int:
    """Python-level function calls (generator steps included) while fn() runs."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_planning_does_no_python_work_per_token_id(engine):
    """Parsing a request of token ids and keying its segments (what the router does per request and
    the combine worker again) runs per segment in Python and per token id in C: 32 documents of 1,024
    ids take no more Python calls than 32 documents of 16 (a per-id Python check or key loop would
    add tens of thousands)."""
    # the tiny model's 4,096 positions raised to hold 32 x 1,024
    cfg = dataclasses.replace(engine.cfg, max_position_embeddings=65_536)
    planner = Planner(cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    rng = random.Random(0)

    def request(tokens):
        return {"system": [rng.randrange(5, 250) for _ in range(16)],
                "segments": [[rng.randrange(5, 250) for _ in range(tokens)] for _ in range(32)],
                "suffix": [rng.randrange(5, 250) for _ in range(64)], "sampling_params": {"max_new_tokens": 1}}

    def plan(obj):
        req = planner.parse(obj)
        keys = [s.key for s in planner.reused_segments(req)]
        assert len(keys) == 32
        assert [planner.entry_key(s) for s in req.segment_ids] == keys

    small, large = request(16), request(1024)
    plan(small)
    assert _python_calls(lambda: plan(large)) <= _python_calls(lambda: plan(small)) + 100


def test_ids_unpacked_from_the_wire_parse_as_the_same_ids(engine):
    """The combine worker parses a segment's ids as an int32 array over its packed bytes: the same
    request, keys and chain keys as the lists, and the same refusals for ids outside the vocabulary."""
    import numpy as np
    from hybridcache.services.protocol import narrow_ids, segment, segment_array
    from hybridcache.services.runtime.plan import packed_ids

    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(seam_window=4), engine.fingerprint)
    docs = [list(range(5, 45)), [7, 9, 11] * 20]
    lists = planner.parse({"segments": docs, "suffix": [3, 4]})
    wire = planner.parse({"segments": [segment_array(segment(i, d)) for i, d in enumerate(docs)], "suffix": [3, 4]})
    assert wire.segment_ids == lists.segment_ids == docs and all(type(t) is int for t in wire.segment_ids[0])
    assert wire.packed == lists.packed == {i: packed_ids(d) for i, d in enumerate(docs)}
    assert [narrow_ids(wire.packed[i]) for i in range(2)] == [segment(i, d).ids for i, d in enumerate(docs)]
    keys = [planner.entry_key(d) for d in docs]
    assert [s.key for s in planner.reused_segments(wire)] == [s.key for s in planner.reused_segments(lists)] == keys
    assert planner.chain_keys(wire) == planner.chain_keys(lists)
    # the key memo belongs to the served model's settings: another seam window keys anew
    other = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(seam_window=2), engine.fingerprint)
    assert other.segment_key(wire, 0) == other.entry_key(docs[0]) != keys[0] == planner.segment_key(wire, 0)
    vocab = engine.cfg.vocab_size
    for bad in ([1, vocab], [-1, 2]):
        with pytest.raises(RequestError, match=f"segment 0 has token id {bad[1] if bad[0] == 1 else -1} outside"):
            planner.parse({"segments": [segment_array(segment(0, bad))], "suffix": [3]})
    for bad in (np.zeros((2, 2), dtype=np.int32), np.array([1.0, 2.0])):
        with pytest.raises(RequestError, match="must be a string or a list of token ids"):
            planner.parse({"segments": [bad], "suffix": [3]})
    with pytest.raises(RequestError, match="segment 0 is empty"):
        planner.parse({"segments": [segment_array(segment(0, []))], "suffix": [3]})


@pytest.mark.parametrize("bad, message", [
    ([5, 6, True], "must be a string or a list of token ids"),
    ([0, 1, False] + [7] * 100, "must be a string or a list of token ids"),
    ([False] * 100, "must be a string or a list of token ids"),
    ([5, 2.0], "must be a string or a list of token ids"),
    ([5, "6"], "must be a string or a list of token ids"),
    ([5, [6]], "must be a string or a list of token ids"),
    ([5, None], "must be a string or a list of token ids"),
    ([5, 2**63], "token id 9223372036854775808 outside the vocabulary"),
    ([5, 10**9], "token id 1000000000 outside the vocabulary"),
    ([5, -3], "token id -3 outside the vocabulary"),
])
def test_a_segment_of_ids_is_refused_as_any_ids_are(engine, bad, message):
    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    with pytest.raises(RequestError, match=f"segment 1 .*{message}" if "outside" in message else message):
        planner.parse({"segments": [[5, 6, 7], bad], "suffix": [3]})


def test_a_segment_of_ids_with_0_and_1_and_integer_types_parses_as_plain_ints(engine):
    import numpy as np

    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    ids = [0, 1, 5, 1, 0] * 30  # more 0s and 1s than are looked at one by one
    req = planner.parse({"segments": [ids, [np.int64(7), 8, 0]], "suffix": [3]})
    assert req.segment_ids == [ids, [7, 8, 0]] and all(type(t) is int for s in req.segment_ids for t in s)
    assert req.packed[0] == struct.pack(f"<{len(ids)}q", *ids)


def test_segments_checked_together_parse_and_refuse_as_one_by_one(engine):
    """A request's segments of ids are packed and checked together (bools, range): the same ids,
    packed bytes and refusals, naming the segment, as each segment checked on its own."""
    import numpy as np
    from hybridcache.services.protocol import segment, segment_array

    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    rng = random.Random(1)
    docs = [[rng.choice([0, 1, 5, 200]) for _ in range(rng.randrange(1, 90))] for _ in range(7)]
    req = planner.parse({"segments": docs, "suffix": [3]})
    one_by_one = [planner._segment_ids(d, f"segment {i}") for i, d in enumerate(docs)]
    assert req.segment_ids == [ids for ids, _ in one_by_one] == docs
    assert req.packed == {i: p for i, (_, p) in enumerate(one_by_one)}
    assert all(type(t) is int for s in req.segment_ids for t in s)
    wire = planner.parse({"segments": [segment_array(segment(i, d)) for i, d in enumerate(docs)], "suffix": [3]})
    assert wire.segment_ids == docs and wire.packed == req.packed
    vocab = engine.cfg.vocab_size
    # a bool in a later segment, after segments holding 0s and 1s, and in a segment's first place
    for bad in ([5, True, 0], [False, 7]):
        with pytest.raises(RequestError, match="must be a string or a list of token ids"):
            planner.parse({"segments": [[0, 1, 5], [1] * 70, bad], "suffix": [3]})
    assert planner.parse({"segments": [[0, 1, 5], [1] * 70, [5, 1, 0]], "suffix": [3]}).segment_ids[2] == [5, 1, 0]
    for bad, tid in (([5, vocab], vocab), ([-2, 5], -2)):
        with pytest.raises(RequestError, match=f"segment 2 has token id {tid} outside"):
            planner.parse({"segments": [[0, 1], [5], bad], "suffix": [3]})
        arrays = [segment_array(segment(i, d)) for i, d in enumerate([[0, 1], [5], bad])]
        with pytest.raises(RequestError, match=f"segment 2 has token id {tid} outside"):
            planner.parse({"segments": arrays, "suffix": [3]})
    # a mix of arrays, lists and text goes one by one
    mixed = planner.parse({"segments": [np.array([5, 6], dtype=np.int32), [7, 8], "a text"], "suffix": [3]})
    assert mixed.segment_ids[:2] == [[5, 6], [7, 8]] and mixed.segment_ids[2] == engine.tokenizer.encode("a text")
    with pytest.raises(RequestError, match="segment 1 is empty"):
        planner.parse({"segments": [[5], [], [6]], "suffix": [3]})


def test_entry_sizes_are_worked_out_once_per_length_as_the_plan_says(engine):
    from hybridcache.services.runtime.plan import expected_entry_nbytes

    for config in (RuntimeConfig(seam_window=4), RuntimeConfig(seam_window=0, entry_state_dtype="bfloat16")):
        planner = Planner(engine.cfg, engine.tokenizer, config, engine.fingerprint)
        for n in (40, 1024, 40, 7, 1024):
            assert planner.entry_nbytes(n) == expected_entry_nbytes(
                engine.cfg, n - config.seam_window, config.dtype, config.entry_state_dtype)
        assert len(planner._nbytes) == 3


def test_a_json_body_s_lists_of_ids_are_kept_with_the_same_checks(engine):
    """json_ids: a JSON body's id lists (ints already) are kept, not copied; the request is the
    one parsed without it, and every refusal stays."""
    planner = Planner(engine.cfg, engine.tokenizer, RuntimeConfig(), engine.fingerprint)
    body = json.loads(json.dumps({"segments": [[0, 1, 5] * 30, [7, 8]], "suffix": [3, 4], "system": [9]}))
    kept, copied = planner.parse(body, json_ids=True), planner.parse(body)
    assert kept == copied and kept.packed == copied.packed
    assert kept.segment_ids[0] is body["segments"][0] and copied.segment_ids[0] is not body["segments"][0]
    vocab = engine.cfg.vocab_size
    for bad, message in (([5, True], "must be a string or a list of token ids"), ([5, 2.0], "must be a string"),
                         ([5, vocab], f"segment 1 has token id {vocab} outside"), ([-1], "segment 1 has token id -1")):
        with pytest.raises(RequestError, match=message):
            planner.parse(json.loads(json.dumps({"segments": [[5, 0], bad], "suffix": [3]})), json_ids=True)


def test_the_prompt_s_head_is_the_first_ids_of_the_prompt():
    from hybridcache.services.runtime.plan import Request
    from hybridcache.services.runtime.sampling import SamplingParams

    for system, segments, suffix in [([1, 2, 3], [[4, 5], [6, 7, 8]], [9, 10]), ([], [[4, 5], [6]], []),
                                     ([1], [], [2, 3])]:
        req = Request(system, segments, suffix, SamplingParams())
        for n in range(req.prompt_len + 3):
            assert req.prompt_head(n) == req.prompt_ids[:n]
