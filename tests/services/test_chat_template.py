"""Chat templates: prompt ids equal transformers' apply_chat_template for the same messages, each
text part stays one segment with the template's markup live around it, and the served
/v1/chat/completions renders them (official openai client, multi-turn, streaming)."""

import json
import shutil
from pathlib import Path

import pytest
from hybridcache.services.api.chat_template import ChatTemplate
from hybridcache.services.api.openai_compat import NO_TEMPLATE, chat_to_native
from hybridcache.services.runtime.llm import LLM
from hybridcache.services.runtime.modelzoo import SHIPPED_MODEL
from hybridcache.services.runtime.sampling import RequestError
from hybridcache.services.runtime.tokenizer import Tokenizer
from transformers import AutoTokenizer

TEMPLATE = (Path(__file__).parent / "data" / "chatml_tools.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a fact.",
          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}]
CONVERSATIONS = {
    "system-multi-turn": [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Alice lives in Paris. Bob lives in Rome."},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": "Where does Bob live?"},
    ],
    "no-system": [{"role": "user", "content": "Hello there."}],
    "content-parts": [
        {"role": "user", "content": [{"type": "text", "text": "Doc A: the sky is blue."},
                                     {"type": "text", "text": "Doc B: grass is green."},
                                     {"type": "text", "text": "What colour is grass?"}]},
    ],
    "tool-round-trip": [
        {"role": "user", "content": "Where is the Louvre?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "Louvre"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "The Louvre is in Paris."},
        {"role": "user", "content": "And so?"},
    ],
}


def _model_dir(tmp_path, template=TEMPLATE) -> Path:
    out = tmp_path / "tok"
    out.mkdir(exist_ok=True)
    shutil.copy(SHIPPED_MODEL / "tokenizer.json", out / "tokenizer.json")
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if template is not None:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _for_transformers(messages):
    # what the server hands the template: tool-call arguments as objects
    out = json.loads(json.dumps(messages))
    for m in out:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return out


def _flat(native):
    return native["system"] + [t for s in native["segments"] for t in s] + native["suffix"]


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_prompt_ids_equal_transformers_apply_chat_template(name, tmp_path):
    path = _model_dir(tmp_path)
    messages = CONVERSATIONS[name]
    tools = TOOLS if name.startswith("tool") else None
    reference = AutoTokenizer.from_pretrained(path).apply_chat_template(
        _for_transformers(messages), tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    body = {"messages": messages} | ({"tools": tools} if tools else {})
    native = chat_to_native(body, ChatTemplate.load(path), Tokenizer.from_dir(path))
    assert _flat(native) == list(reference)
    assert native["suffix"] and native["system"]


def test_each_text_part_is_one_segment_and_the_markup_runs_live(tmp_path):
    path = _model_dir(tmp_path)
    template, tok = ChatTemplate.load(path), Tokenizer.from_dir(path)
    docs = ["Alice lives in Paris.", "Bob lives in Rome.", "Carol lives in Oslo."]

    def native(order, question="Who lives in Rome?"):
        parts = [{"type": "text", "text": d} for d in order] + [{"type": "text", "text": question}]
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
        return chat_to_native({"messages": msgs}, template, tok)

    a = native(docs)
    texts = [tok.decode(s) for i, s in enumerate(a["segments"]) if i not in a["live_segments"]]
    assert texts == docs
    raw = lambda ids: tok.tok.decode(ids, skip_special_tokens=False)  # noqa: E731
    assert raw(a["system"]) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
    assert raw(a["suffix"]) == "Who lives in Rome?<|im_end|>\n<|im_start|>assistant\n"
    # documents reordered: the same segments (their entries hit), the prefix the same (its pages hit)
    b = native(docs[::-1])
    seg = lambda n: sorted(map(tuple, (s for i, s in enumerate(n["segments"]) if i not in n["live_segments"])))  # noqa: E731
    assert seg(a) == seg(b) and a["system"] == b["system"]
    # a second turn: every earlier text is a segment again and the new question the suffix
    turn2 = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": d} for d in docs] + [
                 {"type": "text", "text": "Who lives in Rome?"}]},
             {"role": "assistant", "content": "Bob."}, {"role": "user", "content": "And in Oslo?"}]
    c = chat_to_native({"messages": turn2}, template, tok)
    assert c["system"] == a["system"] and c["segments"][: len(a["segments"])] == a["segments"]
    markup = [tok.tok.decode(c["segments"][i], skip_special_tokens=False) for i in c["live_segments"]]
    assert "<|im_end|>\n<|im_start|>assistant\n" in markup


def test_a_template_that_rewrites_the_texts_gives_one_live_prompt(tmp_path):
    path = _model_dir(tmp_path, template="{% for m in messages %}{{ m.role }}: {{ m.content | upper }}\n{% endfor %}")
    tok = Tokenizer.from_dir(path)
    native = chat_to_native({"messages": [{"role": "user", "content": "hi"}]}, ChatTemplate.load(path), tok)
    assert native["segments"] == [] and native["system"] == [] and tok.decode(native["suffix"]) == "user: HI\n"


def test_template_sources_and_errors(tmp_path):
    path = _model_dir(tmp_path, template=None)
    assert ChatTemplate.load(path) is None
    (path / "chat_template.jinja").write_text(TEMPLATE)
    assert ChatTemplate.load(path).source == "chat_template.jinja"
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": TEMPLATE}]
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert ChatTemplate.load(path).source == "tokenizer_config.json" and ChatTemplate.load(path).text == TEMPLATE
    override = tmp_path / "mine.jinja"
    override.write_text("{{ messages[-1].content }}")
    assert ChatTemplate.load(path, str(override)).source == str(override)
    with pytest.raises(ValueError, match="no such file"):
        ChatTemplate.load(path, str(tmp_path / "absent.jinja"))
    override.write_text("{% for %}")
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate.load(path, str(override))
    # the sandbox: no attribute escapes from a template
    override.write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestError, match="chat template"):
        ChatTemplate.load(path, str(override)).render([{"role": "user", "content": "x"}])


def test_without_a_template_texts_are_concatenated_and_tools_refused():
    body = {"messages": [{"role": "system", "content": "S."}, {"role": "user", "content": "Q?"}]}
    assert chat_to_native(body) == {"system": "S.", "segments": [], "suffix": "Q?", "sampling_params": {}}
    with pytest.raises(RequestError, match="tools need a chat template"):
        chat_to_native(dict(body, tools=TOOLS))
    assert NO_TEMPLATE.startswith("none")


@pytest.fixture(scope="module")
def chat_cluster(tmp_path_factory):
    from hybridcache.services import security
    from hybridcache.services.launcher import LocalCluster, free_port
    from hybridcache.services.runtime.modelzoo import init_model_dir

    path = init_model_dir("qwen3_5_text", "tiny", tmp_path_factory.mktemp("chat") / "m", seed=0, std=0.08)
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))
    with LocalCluster(path, port=free_port(), scatter_workers=0, served_model_name="tiny-chat") as c:
        security.install(c.secret)
        try:
            yield c, path
        finally:
            security.install(None)


def test_served_chat_renders_the_template_multi_turn_and_streaming(chat_cluster):
    import openai
    from hybridcache.services.runtime.engine import Engine, EngineConfig

    cluster, path = chat_cluster
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Alice lives in Paris. " * 4},
                                             {"type": "text", "text": "Bob lives in Rome. " * 4},
                                             {"type": "text", "text": "Who lives in Rome?"}]}]
    first = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=6, temperature=0)
    stats = first.model_extra["hybridcache"]
    assert stats["chat_template"] == "tokenizer_config.json"
    template, tok = ChatTemplate.load(path), Tokenizer.from_dir(path)
    reference = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert first.usage.prompt_tokens == len(reference)
    # the served answer is the engine's on the rendered prompt
    engine = Engine.from_dir(path, config=EngineConfig(mode="pic"))
    native = chat_to_native({"messages": messages, "max_tokens": 6, "temperature": 0}, template, tok)
    assert first.choices[0].message.content == LLM(engine).generate(native).text
    assert [s["source"] for s in stats["segments"]][:2] == ["built", "built"]

    # the next turn: the earlier documents hit, its prompt is the template's for the whole history
    turn2 = messages + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And Alice?"}]
    pieces, final = [], None
    for chunk in client.chat.completions.create(model="tiny-chat", messages=turn2, max_tokens=6, temperature=0,
                                                stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            final = chunk
    assert final is not None and final.model_extra["hybridcache"]["chat_template"] == "tokenizer_config.json"
    assert final.usage.prompt_tokens_details.cached_tokens > 0
    again = client.chat.completions.create(model="tiny-chat", messages=turn2, max_tokens=6, temperature=0)
    assert "".join(pieces) == again.choices[0].message.content


def test_served_name_tokenize_detokenize_and_models(chat_cluster):
    from serving_helpers import http

    cluster, path = chat_cluster
    status, models = http("GET", f"{cluster.url}/v1/models")
    (entry,) = models["data"]
    assert status == 200 and entry["id"] == "tiny-chat" and entry["max_model_len"] == 4096
    status, res = http("POST", f"{cluster.url}/v1/chat/completions",
                       {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert status == 404 and "tiny-chat" in res["error"]["message"]
    messages = CONVERSATIONS["system-multi-turn"]
    reference = AutoTokenizer.from_pretrained(path).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    status, res = http("POST", f"{cluster.url}/tokenize", {"model": "tiny-chat", "messages": messages})
    assert status == 200 and res["tokens"] == list(reference) and res["count"] == len(reference)
    assert res["max_model_len"] == 4096
    status, res = http("POST", f"{cluster.url}/tokenize", {"prompt": "hello <|im_end|>"})
    assert status == 200 and res["tokens"] == Tokenizer.from_dir(path).encode("hello <|im_end|>")
    status, back = http("POST", f"{cluster.url}/detokenize", {"tokens": res["tokens"]})
    assert status == 200 and back["prompt"] == "hello <|im_end|>"
    assert http("POST", f"{cluster.url}/detokenize", {"tokens": [10**9]})[0] == 400
    assert http("POST", f"{cluster.url}/tokenize", {"prompt": 3})[0] == 400
    # tools go through the template (the tiny model answers whatever it answers)
    status, res = http("POST", f"{cluster.url}/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Where is the Louvre?"}], "tools": TOOLS,
                        "max_tokens": 2})
    assert status == 200 and res["usage"]["prompt_tokens"] > 100, res


def test_tool_calls_in_the_output_become_tool_calls():
    from hybridcache.services.api.openai_compat import parse_tool_calls, streamable_prefix

    text = 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"q": "Louvre"}}\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["function"]["name"] == "lookup"
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "Louvre"}
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("plain") == ("plain", [])
    # while streaming, content stops where a tool call starts or may start
    assert streamable_prefix("abc <tool") == 4 and streamable_prefix("abc <tool_call>{") == 4
    assert streamable_prefix("a < b") == 5


@pytest.mark.parametrize("field,value", [
    ("echo", True), ("logit_bias", {"5": 1}), ("response_format", {"type": "json_object"}), ("best_of", 2),
])
def test_unimplemented_fields_are_refused_by_name(field, value):
    body = {"messages": [{"role": "user", "content": "x"}], field: value}
    with pytest.raises(RequestError, match=f"^{field}="):
        chat_to_native(body)
    # their neutral values are accepted
    neutral = {"echo": False, "logit_bias": {}, "response_format": {"type": "text"}, "best_of": 1}
    chat_to_native(dict(body, **{field: neutral[field]}))


def test_trust_remote_code_is_refused(capsys):
    from hybridcache.services import cli

    for argv in (["serve", "router", "--trust-remote-code"], ["up", "--trust-remote-code"]):
        assert cli.main(argv) == 2
        assert "--trust-remote-code is not supported" in capsys.readouterr().err


def test_served_logprobs_chat_completions_and_generate(chat_cluster):
    import openai
    from hybridcache.services.runtime.engine import Engine, EngineConfig
    from serving_helpers import http

    cluster, path = chat_cluster
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused")
    engine = Engine.from_dir(path, config=EngineConfig(mode="full"))
    template, tok = ChatTemplate.load(path), Tokenizer.from_dir(path)
    messages = [{"role": "user", "content": "Name a colour."}]
    res = client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4, temperature=0,
                                         logprobs=True, top_logprobs=2)
    native = chat_to_native({"messages": messages, "max_tokens": 4, "temperature": 0, "logprobs": True,
                             "top_logprobs": 2}, template, tok)
    want = LLM(engine).generate(native)
    content = res.choices[0].logprobs.content
    assert len(content) == len(want.output_ids) == 4
    for entry, tid, (lp, top) in zip(content, want.output_ids, want.logprobs):
        assert abs(entry.logprob - lp) <= 1e-4 and entry.token == tok.tok.decode([tid], skip_special_tokens=False)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert len(entry.top_logprobs) == 2 and abs(entry.top_logprobs[0].logprob - top[0][1]) <= 1e-4
    # streamed: one logprobs entry per token chunk
    streamed = [c.choices[0].logprobs.content[0].logprob
                for c in client.chat.completions.create(model="tiny-chat", messages=messages, max_tokens=4,
                                                        temperature=0, logprobs=True, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert len(streamed) == 4 and all(abs(a - e.logprob) <= 1e-4 for a, e in zip(streamed, content))

    comp = client.completions.create(model="tiny-chat", prompt="Name a colour.", max_tokens=3, temperature=0,
                                     logprobs=1)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3 and lp.text_offset[0] == 0
    status, gen = http("POST", f"{cluster.url}/generate", {"text": "Name a colour.", "return_logprob": True,
                                                           "top_logprobs_num": 2,
                                                           "sampling_params": {"max_new_tokens": 3}})
    assert status == 200 and len(gen["meta_info"]["output_token_logprobs"]) == 3
    assert [row[1] for row in gen["meta_info"]["output_token_logprobs"]] == gen["output_ids"]
    assert abs(gen["meta_info"]["output_token_logprobs"][0][0] - lp.token_logprobs[0]) <= 1e-4
