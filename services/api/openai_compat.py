"""Request and response shapes of the HTTP API: OpenAI chat/completions and SGLang's native /generate,
mapped onto the engine's native request ({"system", "segments", "suffix", "sampling_params"}).

Segmentation: each text part of a message's content list is one segment; a message whose content
is a string is one segment; the last part of the last message is the suffix (the question). The
segment separator (the server's --segment-separator, `<<PIC_SEP>>` by default; a request's
`separator` field overrides it, "" turns it off) splits every text further and is removed before
tokenizing: completion prompts, /generate text, native `system`, `segments` and `suffix` strings,
and every message's content, system and developer messages included (their text before the first
separator stays the prefix, each piece after one is a segment). `segments` may also be given
directly. A chat with the model's chat template keeps those segments and puts the template's
markup around them (api/chat_template.py); its prompt ids are those of the same messages without
separators.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from hybridcache.services.api.chat_template import ChatLimits, ChatTemplate, mark
from hybridcache.services.runtime.sampling import MAX_TOP_LOGPROBS, RequestError

# Fields clients send that this server does not implement. Each is accepted only when absent, null
# or at a value listed here (of that type: `true` is not 1), the one that asks for nothing; any
# other value is refused, never silently ignored. Fields listed with no value must be null.
_OFF = {
    "logit_bias": ({},),
    "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
    "suffix_text": ("",), "reasoning_effort": (), "modalities": (["text"],),
    "token_ids_logprob": (),
    "return_text_in_logprobs": (False, True), "image_data": (), "video_data": (), "audio_data": (), "lora_path": (),
    "custom_logit_processor": (), "return_hidden_states": (False,), "bootstrap_host": (), "bootstrap_port": (),
    "bootstrap_room": (), "session_params": (), "data_parallel_rank": (), "return_routed_experts": (False,),
}
# Fields that change nothing in the answer (identifiers, storage and routing hints): accepted.
_OPENAI_IGNORED = {"user", "stream_options", "service_tier", "store", "metadata", "parallel_tool_calls",
                   "logit_bias", "logprobs", "top_logprobs",
                   "response_format", "echo", "best_of", "suffix_text", "reasoning_effort", "modalities"}
# Sampling fields of OpenAI requests (vLLM's extensions included) this server implements.
_OPENAI_SAMPLING = {"frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens", "ignore_eos"}
_SGLANG_IGNORED = {"rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                   "return_text_in_logprobs", "image_data", "video_data", "audio_data", "lora_path", "modalities",
                   "custom_logit_processor", "return_hidden_states", "bootstrap_host", "bootstrap_port",
                   "bootstrap_room", "session_params", "log_metrics", "data_parallel_rank", "return_routed_experts"}


def _is_off(value, offs: tuple) -> bool:
    return value is None or any(type(value) is type(o) and value == o for o in offs)


def _check_fields(body: dict, known: set[str], what: str, implemented: frozenset = frozenset()) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field(s) in {what}: {', '.join(unknown)}")
    for name in sorted(set(body) & set(_OFF) - implemented):
        if not _is_off(body[name], _OFF[name]):
            off = f" (only {', '.join(json.dumps(o) for o in _OFF[name])} or null)" if _OFF[name] else " (only null)"
            raise RequestError(f"{name}={json.dumps(body[name])[:60]} is not supported by this server{off}")


def _split(text: str, separator: str) -> list[str]:
    if not separator:
        return [text]
    return [p for p in text.split(separator) if p]


def _separator(body: dict, default: str = "") -> str:
    """The request's `separator`, else the server's `default` ("" for none)."""
    sep = body.get("separator")
    if sep is None:
        return default
    if not isinstance(sep, str):
        raise RequestError('separator must be a string ("" turns splitting off)')
    return sep


def split_native(obj, default: str = ""):
    """A native request ({"system", "segments", "suffix", ...}) with its texts split on the
    separator (its `separator` field, else `default`) and the field dropped: the system text before
    the first separator stays the system prompt and each piece after one becomes a segment, before
    the given segments; each text segment becomes its pieces; the suffix's last piece stays the
    suffix, the pieces before it become segments after the others. Empty pieces are dropped; a
    live segment's pieces stay live. Anything not as expected is left for Planner.parse to refuse."""
    if not isinstance(obj, dict):
        return obj
    sep = _separator(obj, default)
    obj = {k: v for k, v in obj.items() if k != "separator"}
    system, segments, suffix = obj.get("system"), obj.get("segments") or [], obj.get("suffix")
    live = obj.get("live_segments") or []
    if not sep or not isinstance(segments, list) or not isinstance(live, list):
        return obj
    texts = [t for t in (system, suffix, *segments) if isinstance(t, str)]
    if not any(sep in t for t in texts):
        return obj
    new_segments, new_live = [], []

    def add(piece, is_live: bool) -> None:
        if is_live:
            new_live.append(len(new_segments))
        new_segments.append(piece)

    if isinstance(system, str) and sep in system:
        head, *rest = system.split(sep)
        obj["system"] = head
        for p in rest:
            if p:
                add(p, False)
    for i, s in enumerate(segments):
        for p in _split(s, sep) if isinstance(s, str) else [s]:
            add(p, i in live)
    if isinstance(suffix, str) and sep in suffix:
        pieces = _split(suffix, sep)
        for p in pieces[:-1]:
            add(p, False)
        obj["suffix"] = pieces[-1] if pieces else ""
    obj["segments"] = new_segments
    if "live_segments" in obj:
        obj["live_segments"] = new_live
    return obj


def _opt_number(body: dict, name: str, kind) -> float | int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}")
    return kind(v)


def _top_count(n: int, name: str) -> int:
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise RequestError(f"{name} must be between 0 and {MAX_TOP_LOGPROBS}")
    return n


def chat_logprobs(body: dict) -> int | None:
    """Chat's logprobs (a boolean) and top_logprobs (alternatives per token): the count asked for, or None."""
    want = body.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise RequestError("logprobs must be a boolean")
    top = _opt_number(body, "top_logprobs", int)
    if top and not want:
        raise RequestError("top_logprobs needs logprobs: true")
    return _top_count(top or 0, "top_logprobs") if want else None


# Most requests one body may stand for (prompts times n or best_of).
MAX_CHOICES = 64


@dataclass(frozen=True)
class Fanout:
    """The native requests one API request stands for: `copies` of each prompt (n, or best_of), in
    prompt order; `listed`: the API answers with a list (SGLang's batched text or n > 1);
    `prompt_field`: what the client calls the text that becomes the suffix (named in refusals)."""

    requests: list[dict]
    copies: int = 1
    listed: bool = False
    prompt_field: str | None = None


def _count(body: dict, name: str, default: int = 1) -> int:
    v = _opt_number(body, name, int)
    if v is None:
        return default
    if v < 1:
        raise RequestError(f"{name} must be >= 1")
    return v


def copies(native: dict, n: int) -> list[dict]:
    """n copies of a native request, each its own sample: with a seed, copy j is seeded seed + j."""
    out = []
    for j in range(n):
        sp = dict(native.get("sampling_params") or {})
        for key in ("seed", "sampling_seed"):
            if j and isinstance(sp.get(key), int) and not isinstance(sp[key], bool):
                sp[key] = (sp[key] + j) % (1 << 64)
        out.append(dict(native, sampling_params=sp))
    return out


def _check_choices(count: int) -> None:
    """Refuse a request for more than MAX_CHOICES completions before any of them is made (n of a
    billion would otherwise be a billion copies first)."""
    if count > MAX_CHOICES:
        raise RequestError(f"the request asks for {count} completions (prompts times n or best_of); "
                           f"at most {MAX_CHOICES}")


def _is_prompt_list(prompt) -> bool:
    """A completions prompt that is a list of prompts (not one list of token ids)."""
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(p, (str, list)) for p in prompt)


def _fanout(requests: list[dict], n: int, **kw) -> Fanout:
    _check_choices(len(requests))
    return Fanout(requests, n, **kw)


def openai_sampling(body: dict) -> dict:
    sp: dict = {}
    max_new = _opt_number(body, "max_completion_tokens", int)
    if max_new is None:
        max_new = _opt_number(body, "max_tokens", int)
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    for src, dst, kind in (("temperature", "temperature", float), ("top_p", "top_p", float),
                           ("top_k", "top_k", int), ("seed", "seed", int), ("min_tokens", "min_new_tokens", int),
                           ("repetition_penalty", "repetition_penalty", float),
                           ("frequency_penalty", "frequency_penalty", float),
                           ("presence_penalty", "presence_penalty", float)):
        v = _opt_number(body, src, kind)
        if v is not None:
            sp[dst] = v
    # range checks here, so that a refusal names the field the client sent
    if sp.get("min_new_tokens", 0) < 0:
        raise RequestError("min_tokens must be >= 0")
    if sp.get("repetition_penalty", 1.0) <= 0:
        raise RequestError("repetition_penalty must be greater than 0")
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= sp.get(name, 0.0) <= 2.0:
            raise RequestError(f"{name} must be between -2 and 2")
    if body.get("ignore_eos") is not None:
        if not isinstance(body["ignore_eos"], bool):
            raise RequestError("ignore_eos must be a boolean")
        sp["ignore_eos"] = body["ignore_eos"]
    if body.get("stop") is not None:
        sp["stop"] = body["stop"]
    return sp


def _text_parts(content, where: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                raise RequestError(f"{where}.content[{j}] must be a text part ({{\"type\": \"text\", \"text\": ...}})")
        return out
    raise RequestError(f"{where}.content must be a string or a list of text parts")


_ROLES = ("system", "developer", "user", "assistant", "tool")
NO_TEMPLATE = "none: message texts concatenated without roles (the model has no chat template)"


def chat_to_native(body: dict, template: ChatTemplate | None = None, tokenizer=None, separator: str = "",
                   limits: ChatLimits | None = None) -> dict:
    """A chat request as the engine's native request. With a chat template (and the tokenizer)
    the prompt is the rendered template in token ids (chat_template.ChatTemplate.prompt); without
    one, system texts are the prefix, every other text part a segment, the last one the suffix.
    `separator`: the server's segment separator (the request's `separator` overrides it).
    `limits`: the chat's size checked before it renders, the render bounded (ChatLimits)."""
    _check_fields(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                         "seed", "stop", "n", "stream", "separator", "tools", "tool_choice", "cache_salt"}
                  | _OPENAI_IGNORED | _OPENAI_SAMPLING, "the request")
    native = _with_salt(body, _chat_native(body, template, tokenizer, _separator(body, separator),
                                           limits or ChatLimits()))
    top = chat_logprobs(body)
    if top is not None:
        native["sampling_params"]["logprobs"] = top
    return native


def chat_requests(body: dict, template: ChatTemplate | None = None, tokenizer=None, separator: str = "",
                  limits: ChatLimits | None = None) -> Fanout:
    """A chat request as its native requests: n copies (choices) of chat_to_native's."""
    n = _count(body, "n")
    _check_choices(n)
    native = chat_to_native(body, template, tokenizer, separator, limits)
    return _fanout(copies(native, n), n)


def _with_salt(body: dict, native: dict) -> dict:
    """vLLM's `cache_salt` request field, handed on (the planner checks it): the request's caches
    are its own key space (plan.salted_key)."""
    if body.get("cache_salt") is not None:
        native["cache_salt"] = body["cache_salt"]
    return native


def _chat_native(body: dict, template: ChatTemplate | None, tokenizer, sep: str, limits: ChatLimits) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    limits.check_body(messages, body.get("tools"), sep)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role")
        if template is not None and m["role"] not in _ROLES:
            raise RequestError(f"messages[{i}].role must be one of {', '.join(_ROLES)}")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise RequestError("tool_choice must be 'auto' or 'none' (a required or named tool is not supported)")
    if choice == "none":
        tools = None
    if template is None:
        if tools:
            raise RequestError("tools need a chat template, and the served model has none (--chat-template FILE)")
        return _chat_without_template(messages, sep, body)
    marked, texts = _marked_messages(messages, sep)
    native = template.prompt(marked, texts, tokenizer, tools=tools, limits=limits).native()
    native["sampling_params"] = openai_sampling(body)
    return native


def _chat_without_template(messages: list, sep: str, body: dict) -> dict:
    system, parts = [], []
    for i, m in enumerate(messages):
        texts = _text_parts(m.get("content"), f"messages[{i}]")
        if m["role"] in ("system", "developer"):
            system += texts
        else:
            for t in texts:
                parts += _split(t, sep)
    # the system texts before the first separator are the prefix, each piece after one a segment
    prefix, *system_pieces = "".join(system).split(sep) if sep else ["".join(system)]
    parts = [p for p in system_pieces + parts if p]
    if not parts:
        raise RequestError("the messages hold no text")
    return {"system": prefix, "segments": parts[:-1], "suffix": parts[-1],
            "sampling_params": openai_sampling(body)}


def _marked_messages(messages: list, sep: str) -> tuple[list[dict], list[str]]:
    """The messages for the template with chat_template.mark(k) in place of each text that may be
    a segment, and those texts: the text parts of user, assistant and tool messages, split further
    by the separator, and in system and developer messages each piece after a separator (the text
    before the first one stays in the markup, the prefix). The separators are removed: the
    template renders the texts joined. Assistant tool calls carry their arguments as objects, as
    templates expect."""
    texts: list[str] = []

    def marked_text(text: str, keep_head: bool) -> str:
        pieces = text.split(sep) if sep else [text]
        out = [pieces[0]] if keep_head else []
        for p in pieces[1:] if keep_head else pieces:
            if p:
                texts.append(p)
                out.append(mark(len(texts) - 1))
        return "".join(out)

    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        content = m.get("content")
        keep_head = m["role"] in ("system", "developer")
        if content is None and m["role"] == "assistant":
            pass
        elif isinstance(content, str):
            m["content"] = marked_text(content, keep_head)
        else:
            texts_here = _text_parts(content, f"messages[{i}]")
            m["content"] = [{"type": "text", "text": marked_text(t, keep_head)} for t in texts_here]
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_tool_call_for_template(c) for c in m["tool_calls"]]
        out.append(m)
    return out, texts


def _tool_call_for_template(call):
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise RequestError("tool_calls must be objects with a function")
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            raise RequestError("tool_calls[].function.arguments must be a JSON object") from None
    return dict(call, function=fn)


def prompt_list(prompt) -> list:
    """A completions prompt as its prompts: a string, a list of token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            for i, p in enumerate(prompt):
                if isinstance(p, list) and not (p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)):
                    raise RequestError(f"prompt[{i}] must be a non-empty list of token ids")
            return list(prompt)
    raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of either")


def completion_requests(body: dict, separator: str = "") -> Fanout:
    """A completions request as its native requests: for each prompt of a prompt list, best_of (else
    n) copies; best_of > n asks for the sampled tokens' log-probabilities, to rank the candidates."""
    n = _count(body, "n")
    best_of = _count(body, "best_of", n)
    if best_of < n:
        raise RequestError(f"best_of must be >= n ({n})")
    prompt = body.get("prompt")
    _check_choices(best_of * (len(prompt) if _is_prompt_list(prompt) else 1))
    prompts = prompt_list(prompt)
    if best_of > n and body.get("stream"):
        raise RequestError("best_of > n cannot be streamed: the best are known only at the end")
    out = []
    for p in prompts:
        native = completion_to_native(dict(body, prompt=p), separator)
        if best_of > n and native["sampling_params"].get("logprobs") is None:
            native["sampling_params"]["logprobs"] = 0
        out += copies(native, best_of)
    return _fanout(out, best_of, prompt_field="prompt")


def completion_to_native(body: dict, separator: str = "") -> dict:
    _check_fields(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                         "stream", "separator", "segments", "system", "logprobs", "cache_salt"} | _OPENAI_IGNORED
                  | _OPENAI_SAMPLING, "the request", implemented=frozenset({"best_of", "echo"}))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not isinstance(prompt, (str, list)):
        raise RequestError("prompt must be a string or a list of token ids")
    _count(body, "n")
    native = {"segments": body.get("segments") or [], "sampling_params": openai_sampling(body)}
    # the legacy completions API: logprobs is the number of alternatives (0: the chosen token's only)
    top = _opt_number(body, "logprobs", int)
    if top is not None:
        native["sampling_params"]["logprobs"] = _top_count(top, "logprobs")
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise RequestError("echo must be a boolean")
    if echo and top is not None:
        # the prompt comes back with its tokens' log-probabilities before the completion's
        if body.get("stream"):
            raise RequestError("echo with logprobs cannot be streamed: the prompt's log-probabilities come at the end")
        native["sampling_params"]["prompt_logprobs_from"] = 0
    if body.get("system") is not None:
        native["system"] = body["system"]
    native["suffix"] = prompt
    return split_native(native, _separator(body, separator))


# SGLang sampling parameters this engine does not implement, with the value that means "off".
_SGLANG_NEUTRAL = {"stop_regex": None, "regex": None, "json_schema": None, "ebnf": None,
                   "skip_special_tokens": True, "spaces_between_special_tokens": True, "no_stop_trim": False}


def sglang_sampling(sp) -> dict:
    if sp is None:
        return {}
    if not isinstance(sp, dict):
        raise RequestError("sampling_params must be an object")
    out = {}
    for k, v in sp.items():
        if k in _SGLANG_NEUTRAL:
            # the value that means "off", of its own type (True is not n = 1)
            off = _SGLANG_NEUTRAL[k]
            same_kind = type(v) is type(off) or (type(off) is float and type(v) is int)
            if not (v is None or v in ("", []) or (same_kind and v == off)):
                raise RequestError(f"sampling_params.{k}={v!r} is not supported by this server")
        elif k == "n" or (k in ("stop", "stop_token_ids") and not v):
            continue  # n: copies of the request (sglang_requests)
        else:
            out[k] = v
    return out


def sglang_requests(body: dict, separator: str = "") -> Fanout:
    """An SGLang /generate request as its native requests: each text (or token-id list) of a
    batch, sampling_params.n copies of each; answered with a list when batched or n > 1."""
    text = body.get("text", body.get("input_ids"))
    batched = isinstance(text, list) and bool(text) and (all(isinstance(t, str) for t in text)
                                                         or all(isinstance(t, list) for t in text))
    sp = body.get("sampling_params")
    n = _count(sp, "n") if isinstance(sp, dict) else 1
    _check_choices(n * (len(text) if batched else 1))
    field = "text" if "text" in body else "input_ids" if "input_ids" in body else "suffix"
    out = []
    for t in text if batched else [text]:
        one = {k: v for k, v in body.items() if k not in ("text", "input_ids")}
        if t is not None:
            one["text" if isinstance(t, str) else "input_ids"] = t
        out += copies(sglang_to_native(one, separator), n)
    return _fanout(out, n, listed=batched or n > 1, prompt_field=field)


def sglang_to_native(body: dict, separator: str = "") -> dict:
    _check_fields(body, {"text", "input_ids", "sampling_params", "stream", "system", "segments", "suffix",
                         "separator", "model", "return_logprob", "top_logprobs_num", "cache_salt"} | _SGLANG_IGNORED,
                  "the request")
    native = {k: body[k] for k in ("system", "segments") if body.get(k) is not None}
    native["sampling_params"] = sglang_sampling(body.get("sampling_params"))
    if body.get("return_logprob") is not None and not isinstance(body["return_logprob"], bool):
        raise RequestError("return_logprob must be a boolean")
    if body.get("return_logprob"):
        native["sampling_params"]["logprobs"] = _top_count(_opt_number(body, "top_logprobs_num", int) or 0,
                                                           "top_logprobs_num")
        # the prompt's log-probabilities from logprob_start_len on (-1, SGLang's default: none)
        start = _opt_number(body, "logprob_start_len", int)
        if start is not None and start >= 0:
            native["sampling_params"]["prompt_logprobs_from"] = start
    text = body.get("text", body.get("input_ids", body.get("suffix")))
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], (str, list)):
        text = text[0]  # a batch of one
    if isinstance(text, list) and text and all(isinstance(t, (str, list)) for t in text):
        raise RequestError("a batch of texts goes through sglang_requests")
    native["suffix"] = text if text is not None else ""
    return _with_salt(body, split_native(native, _separator(body, separator)))


TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """Qwen-style (Hermes) tool calls in a model's output, `<tool_call>{"name": ..., "arguments":
    {...}}</tool_call>`, as OpenAI tool_calls (arguments a JSON string), and the text around them
    (None when nothing else was said). A block that is not such JSON stays in the text."""
    calls, kept, pos = [], [], 0
    for m in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        args = call.get("arguments", call.get("parameters", {}))
        kept.append(text[pos : m.start()])
        pos = m.end()
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def streamable_prefix(text: str) -> int:
    """How much of a streamed answer may go out as content while tool calls may follow: up to the
    first `<tool_call>`, less any tail that could start one."""
    at = text.find(TOOL_CALL_OPEN)
    if at >= 0:
        return at
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return len(text) - n
    return len(text)
