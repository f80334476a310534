"""Request and response shapes of the HTTP API: OpenAI chat/completions and SGLang's native /generate,
mapped onto the engine's native request ({"system", "segments", "suffix", "sampling_params"}).

Segmentation: each text part of a message's content list is one segment; a message whose content
is a string is one segment; the last part of the last message is the suffix (the question). An
optional `separator` string splits parts further. `segments` may also be given directly. A chat
with the model's chat template keeps those segments and puts the template's markup around them
(api/chat_template.py).
"""

from __future__ import annotations

import json
import re
import uuid

from hybridcache.services.api.chat_template import ChatLimits, ChatTemplate, mark
from hybridcache.services.runtime.sampling import MAX_TOP_LOGPROBS, RequestError

# Fields clients send that this server does not implement. Each is accepted only when absent, null
# or at a value listed here (of that type: `true` is not 1), the one that asks for nothing; any
# other value is refused, never silently ignored. Fields listed with no value must be null.
_OFF = {
    "frequency_penalty": (0.0, 0), "presence_penalty": (0.0, 0), "logit_bias": ({},),
    "response_format": ({"type": "text"},), "echo": (False,), "best_of": (1,),
    "suffix_text": ("",), "reasoning_effort": (), "modalities": (["text"],),
    "logprob_start_len": (-1,), "token_ids_logprob": (),
    "return_text_in_logprobs": (False, True), "image_data": (), "video_data": (), "audio_data": (), "lora_path": (),
    "custom_logit_processor": (), "return_hidden_states": (False,), "bootstrap_host": (), "bootstrap_port": (),
    "bootstrap_room": (), "session_params": (), "data_parallel_rank": (),
}
# Fields that change nothing in the answer (identifiers, storage and routing hints): accepted.
_OPENAI_IGNORED = {"user", "stream_options", "service_tier", "store", "metadata", "parallel_tool_calls",
                   "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
                   "response_format", "echo", "best_of", "suffix_text", "reasoning_effort", "modalities"}
_SGLANG_IGNORED = {"rid", "return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                   "return_text_in_logprobs", "image_data", "video_data", "audio_data", "lora_path", "modalities",
                   "custom_logit_processor", "return_hidden_states", "bootstrap_host", "bootstrap_port",
                   "bootstrap_room", "session_params", "log_metrics", "data_parallel_rank"}


def _is_off(value, offs: tuple) -> bool:
    return value is None or any(type(value) is type(o) and value == o for o in offs)


def _check_fields(body: dict, known: set[str], what: str) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise RequestError(f"unknown field(s) in {what}: {', '.join(unknown)}")
    for name in sorted(set(body) & set(_OFF)):
        if not _is_off(body[name], _OFF[name]):
            off = f" (only {', '.join(json.dumps(o) for o in _OFF[name])} or null)" if _OFF[name] else " (only null)"
            raise RequestError(f"{name}={json.dumps(body[name])[:60]} is not supported by this server{off}")


def _split(text: str, separator: str | None) -> list[str]:
    if not separator:
        return [text]
    return [p for p in text.split(separator) if p]


def _separator(body: dict) -> str | None:
    sep = body.get("separator")
    if sep is not None and (not isinstance(sep, str) or not sep):
        raise RequestError("separator must be a non-empty string")
    return sep


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


def openai_sampling(body: dict) -> dict:
    n = _opt_number(body, "n", int)
    if n not in (None, 1):
        raise RequestError("only n = 1 is supported")
    sp: dict = {}
    max_new = _opt_number(body, "max_completion_tokens", int)
    if max_new is None:
        max_new = _opt_number(body, "max_tokens", int)
    if max_new is not None:
        sp["max_new_tokens"] = max_new
    for src, dst, kind in (("temperature", "temperature", float), ("top_p", "top_p", float),
                           ("top_k", "top_k", int), ("seed", "seed", int)):
        v = _opt_number(body, src, kind)
        if v is not None:
            sp[dst] = v
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


def chat_to_native(body: dict, template: ChatTemplate | None = None, tokenizer=None,
                   limits: ChatLimits | None = None) -> dict:
    """A chat request as the engine's native request. With a chat template (and the tokenizer)
    the prompt is the rendered template in token ids (chat_template.ChatTemplate.prompt); without
    one, system texts are the prefix, every other text part a segment, the last one the suffix.
    `limits`: the chat's size checked before it renders, the render bounded (ChatLimits)."""
    _check_fields(body, {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                         "seed", "stop", "n", "stream", "separator", "tools", "tool_choice", "cache_salt"}
                  | _OPENAI_IGNORED, "the request")
    native = _with_salt(body, _chat_native(body, template, tokenizer, limits or ChatLimits()))
    top = chat_logprobs(body)
    if top is not None:
        native["sampling_params"]["logprobs"] = top
    return native


def _with_salt(body: dict, native: dict) -> dict:
    """vLLM's `cache_salt` request field, handed on (the planner checks it): the request's caches
    are its own key space (plan.salted_key)."""
    if body.get("cache_salt") is not None:
        native["cache_salt"] = body["cache_salt"]
    return native


def _chat_native(body: dict, template: ChatTemplate | None, tokenizer, limits: ChatLimits) -> dict:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    sep = _separator(body)
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


def _chat_without_template(messages: list, sep: str | None, body: dict) -> dict:
    system, parts = [], []
    for i, m in enumerate(messages):
        texts = _text_parts(m.get("content"), f"messages[{i}]")
        if m["role"] in ("system", "developer"):
            system += texts
        else:
            for t in texts:
                parts += _split(t, sep)
    parts = [p for p in parts if p]
    if not parts:
        raise RequestError("the messages hold no text")
    return {"system": "".join(system), "segments": parts[:-1], "suffix": parts[-1],
            "sampling_params": openai_sampling(body)}


def _marked_messages(messages: list, sep: str | None) -> tuple[list[dict], list[str]]:
    """The messages for the template with chat_template.mark(k) in place of each text that may be
    a segment (text parts of user, assistant and tool messages; a separator splits them further),
    and those texts. Assistant tool calls carry their arguments as objects, as templates expect."""
    texts: list[str] = []

    def marked_text(text: str) -> str:
        pieces = text.split(sep) if sep else [text]
        out = []
        for p in pieces:
            if p:
                texts.append(p)
                out.append(mark(len(texts) - 1))
            else:
                out.append("")
        return (sep or "").join(out)

    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        content = m.get("content")
        segmentable = m["role"] not in ("system", "developer")
        if content is None and m["role"] == "assistant":
            pass
        elif isinstance(content, str):
            m["content"] = marked_text(content) if segmentable else content
        else:
            texts_here = _text_parts(content, f"messages[{i}]")
            m["content"] = [{"type": "text", "text": marked_text(t) if segmentable else t} for t in texts_here]
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


def completion_to_native(body: dict) -> dict:
    _check_fields(body, {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                         "stream", "separator", "segments", "system", "logprobs", "cache_salt"} | _OPENAI_IGNORED,
                  "the request")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if not isinstance(prompt, (str, list)):
        raise RequestError("prompt must be a string or a list of token ids")
    native = {"segments": body.get("segments") or [], "sampling_params": openai_sampling(body)}
    # the legacy completions API: logprobs is the number of alternatives (0: the chosen token's only)
    top = _opt_number(body, "logprobs", int)
    if top is not None:
        native["sampling_params"]["logprobs"] = _top_count(top, "logprobs")
    if body.get("system") is not None:
        native["system"] = body["system"]
    sep = _separator(body)
    if isinstance(prompt, str) and sep:
        pieces = _split(prompt, sep)
        if not isinstance(native["segments"], list):
            raise RequestError("segments must be a list")
        native["segments"] = list(native["segments"]) + pieces[:-1]
        prompt = pieces[-1] if pieces else ""
    native["suffix"] = prompt
    return _with_salt(body, native)


# SGLang sampling parameters this engine does not implement, with the value that means "off".
_SGLANG_NEUTRAL = {"min_new_tokens": 0, "n": 1, "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0,
                   "presence_penalty": 0.0, "repetition_penalty": 1.0, "regex": None, "json_schema": None, "ebnf": None,
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
        elif k in ("stop", "stop_token_ids") and not v:
            continue
        else:
            out[k] = v
    return out


def sglang_to_native(body: dict) -> dict:
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
    text = body.get("text", body.get("input_ids", body.get("suffix")))
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        if len(text) != 1:
            raise RequestError("batched text is not supported: send one prompt per request")
        text = text[0]
    sep = _separator(body)
    if isinstance(text, str) and sep:
        pieces = _split(text, sep)
        native["segments"] = list(native.get("segments") or []) + pieces[:-1]
        text = pieces[-1] if pieces else ""
    native["suffix"] = text if text is not None else ""
    return _with_salt(body, native)


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
