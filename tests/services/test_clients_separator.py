"""The server-level segment separator (--segment-separator, `<<PIC_SEP>>` by default): every text of
every API is split on it and the marker removed before tokenizing, a chat template's prompt ids
equal those of the same messages without markers, and documents reordered between requests hit
their entries (HTTP completions, chat, /generate, gRPC)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import grpc
import pytest
from hybridcache.services.api.chat_template import ChatTemplate
from hybridcache.services.api.openai_compat import chat_to_native, completion_to_native, split_native
from hybridcache.services.config import RuntimeConfig
from hybridcache.services.protocol import pb, rpc
from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL
from hybridcache.services.runtime.sampling import RequestError
from hybridcache.services.runtime.tokenizer import Tokenizer
from serving_helpers import http

SEP = RuntimeConfig().segment_separator
QWEN_STYLE = Path(__file__).parent / "data" / "chatml_tools.jinja"
DOCS = [f"Document {c}: the {c} tower stands {i + 3} storeys tall beside the old mill of Harrow.\n"
        for i, c in enumerate("ABCD")]


def test_default_separator_is_hypic_marker_and_empty_turns_it_off_through_up():
    from hybridcache.services.cli import build_parser
    from hybridcache.services.config import config_args, config_from_args

    assert SEP == "<<PIC_SEP>>"
    off = config_from_args(build_parser().parse_args(["up", "--segment-separator", ""]))
    assert off.segment_separator == ""
    # `up` hands the router "" as an argument of its own, which parses back to ""
    args = config_args(off, "router")
    assert args[args.index("--segment-separator") + 1] == ""
    assert config_from_args(build_parser().parse_args(["serve", "router", *args])).segment_separator == ""


def test_split_native_splits_every_text_and_keeps_order():
    native = {"system": f"Rules.{SEP}d0", "segments": [f"a{SEP}b", [5, 6]], "suffix": f"c{SEP}q",
              "live_segments": [1], "sampling_params": {}}
    assert split_native(native, SEP) == {
        "system": "Rules.", "segments": ["d0", "a", "b", [5, 6], "c"], "suffix": "q", "live_segments": [3],
        "sampling_params": {}}
    # the request's own separator overrides the server's; "" turns splitting off
    assert split_native({"suffix": f"a|b{SEP}c", "separator": "|"}, SEP) == {"segments": ["a"], "suffix": f"b{SEP}c"}
    assert split_native({"suffix": f"a{SEP}b", "separator": ""}, SEP) == {"suffix": f"a{SEP}b"}
    # empty pieces go; a marker at the start of the system text leaves no system prompt
    assert split_native({"system": f"{SEP}d", "suffix": f"q{SEP}"}, SEP) == {"system": "", "segments": ["d"],
                                                                              "suffix": "q"}
    with pytest.raises(RequestError, match="separator must be a string"):
        split_native({"suffix": "q", "separator": 3}, SEP)


def test_completion_prompt_pieces_become_segments():
    prompt = "Use these:\n" + SEP + SEP.join(DOCS) + SEP + "Q: which tower is tallest?"
    native = completion_to_native({"prompt": prompt, "max_tokens": 2}, SEP)
    assert native["segments"] == ["Use these:\n", *DOCS] and native["suffix"] == "Q: which tower is tallest?"
    assert completion_to_native({"prompt": prompt}, "")["suffix"] == prompt


def _tokenizer_dir(tmp_path, template: Path | None) -> Path:
    out = tmp_path / "tok"
    out.mkdir(exist_ok=True)
    shutil.copy(SHIPPED_MODEL / "tokenizer.json", out / "tokenizer.json")
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if template is not None:
        cfg["chat_template"] = template.read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _marked_chat() -> list[dict]:
    return [
        {"role": "system", "content": "Answer from the context.\n" + SEP + SEP.join(DOCS) + SEP},
        {"role": "developer", "content": f"Be brief.\n{SEP}Prefer numbers.\n"},
        {"role": "user", "content": [{"type": "text", "text": f"Also: {DOCS[0]}{SEP}{DOCS[1]}"},
                                     {"type": "text", "text": "Which tower is tallest?"}]},
    ]


def _unmarked(messages: list[dict]) -> list[dict]:
    return json.loads(json.dumps(messages).replace(SEP, ""))


def _flat(native: dict, tok: Tokenizer) -> list[int]:
    parts = [native["system"], *native["segments"], native["suffix"]]
    return [t for p in parts for t in (tok.encode(p) if isinstance(p, str) else p)]


@pytest.mark.parametrize("which", ["shipped-model", "qwen-style"])
def test_chat_prompt_ids_equal_the_messages_without_markers(which, tmp_path):
    """Under a chat template (the shipped model's own, else its template-less chat; and a Qwen-style
    ChatML one) the markers are gone: the prompt ids equal those of the same messages without them,
    while each marked piece, system and developer pieces included, is a segment of its own."""
    if which == "shipped-model":
        template, tok = ChatTemplate.load(SHIPPED_MODEL), Tokenizer.from_dir(SHIPPED_MODEL)
    else:
        path = _tokenizer_dir(tmp_path, QWEN_STYLE)
        template, tok = ChatTemplate.load(path), Tokenizer.from_dir(path)
    marked = chat_to_native({"messages": _marked_chat()}, template, tok, SEP)
    plain = chat_to_native({"messages": _unmarked(_marked_chat())}, template, tok, SEP)
    assert SEP not in tok.tok.decode(_flat(marked, tok), skip_special_tokens=False)
    if template is not None:
        assert _flat(marked, tok) == _flat(plain, tok)
        rendered = template.render(_unmarked(_marked_chat()))
        assert _flat(marked, tok) == tok.encode(rendered)
    else:
        # without a template a chat is its texts concatenated, each piece tokenized by itself (as
        # content parts are): at these word boundaries the same ids as the whole text's
        texts = [m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])
                 for m in _unmarked(_marked_chat())]
        assert _flat(marked, tok) == tok.encode("".join(texts))
    segments = [s if isinstance(s, list) else tok.encode(s) for s in marked["segments"]]
    # every document of the system message is a segment of its own, as are the developer's and the
    # user's pieces; the text before the system's first marker is the prefix
    for doc in DOCS:
        assert tok.encode(doc) in segments
    rendered_developer = template is None or "Prefer numbers." in template.render(_unmarked(_marked_chat()))
    assert (tok.encode("Prefer numbers.\n") in segments) == rendered_developer  # a Qwen template drops developer
    question = tok.encode("Which tower is tallest?")
    suffix = marked["suffix"] if isinstance(marked["suffix"], list) else tok.encode(marked["suffix"])
    assert suffix[:len(question)] == question
    # off per request: the markers stay text
    off = chat_to_native({"messages": _marked_chat(), "separator": ""}, template, tok, SEP)
    assert SEP in tok.tok.decode(_flat(off, tok), skip_special_tokens=False)


def _stats(res: dict) -> dict:
    assert "hybridcache" in res, res
    return res["hybridcache"]


def test_served_texts_split_on_the_default_separator(clients_cluster):
    """Reordered documents marked only by the default separator hit their entries on every API."""
    url = clients_cluster.url
    docs = [f"Marker document {i}: " + "the harbour lights of Ostvik burn all night long. " * 3 + "\n"
            for i in range(3)]

    def prompt(order):
        return "Context:\n" + SEP + SEP.join(docs[i] for i in order) + SEP + "Question: what burns?\nAnswer:"

    status, first = http("POST", f"{url}/v1/completions", {"prompt": prompt([0, 1, 2]), "max_tokens": 2})
    assert status == 200, first
    st = _stats(first)
    assert len(st["segments"]) == 4  # "Context:\n" and the three documents
    status, plain = http("POST", f"{url}/v1/completions", {"prompt": prompt([0, 1, 2]).replace(SEP, ""),
                                                           "max_tokens": 2})
    assert first["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]  # the markers are not tokens

    status, second = http("POST", f"{url}/v1/completions", {"prompt": prompt([2, 0, 1]), "max_tokens": 2})
    st = _stats(second)
    assert st["reused_segments"] == 4 and all(s["hit"] for s in st["segments"])
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    # chat: the documents in the system message (the tiny model has no chat template)
    chat = {"messages": [{"role": "system", "content": prompt([1, 2, 0]).split("Question")[0]},
                         {"role": "user", "content": "Question: what burns?"}], "max_tokens": 2}
    status, res = http("POST", f"{url}/v1/chat/completions", chat)
    assert status == 200 and _stats(res)["reused_segments"] == 3, res
    # SGLang's /generate
    status, res = http("POST", f"{url}/generate", {"text": prompt([1, 0, 2]), "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and _stats(res)["reused_segments"] == 4, res
    # off for one request: one live prompt
    status, res = http("POST", f"{url}/v1/completions", {"prompt": prompt([0, 1, 2]), "separator": "", "max_tokens": 2})
    assert status == 200 and _stats(res)["segments"] == [] and res["usage"]["prompt_tokens"] > \
        first["usage"]["prompt_tokens"]

    # gRPC Inference/Generate: a native request's texts split the same way
    stub = rpc.InferenceStub(grpc.insecure_channel(clients_cluster.role("router")[0].grpc))
    req = {"suffix": prompt([2, 1, 0]), "sampling_params": {"max_new_tokens": 2}}
    chunks = list(stub.Generate(pb.GenerateRequest(request_json=json.dumps(req)), timeout=60))
    st = json.loads(chunks[-1].stats_json)
    assert st["reused_segments"] == 4 and st["prompt_tokens"] == first["usage"]["prompt_tokens"]
