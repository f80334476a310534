"""Chat templates: a model's Jinja template rendered as transformers renders it, cut into the
engine's request parts.

The template comes from `--chat-template FILE`, else the model directory's tokenizer_config.json
`chat_template` (a string, or a list of named ones: "default"), else its chat_template.jinja.
It renders in a sandboxed Jinja environment with transformers' settings (trim_blocks,
lstrip_blocks, loop controls, the `generation` tag, `tojson` without HTML escaping,
`raise_exception`, `strftime_now`) and the tokenizer's special tokens (`bos_token`, ...) as
variables; the rendered text is tokenized whole, without added special tokens, so the prompt ids
equal transformers' `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.

Each text part of a user, assistant or tool message stays one reusable segment: the template
renders once with the texts and once with a marker in place of each, the markers show where
every text lands, and each token of the rendered prompt goes to the text it lies in or to the
markup around. Markup before the first text (system prompt included) is the prefix, markup
between texts runs live, and the last text with the markup after it (the generation prompt) is
the suffix. A template that rewrites the texts (the two renders disagree) gives one live prompt.

What a chat costs is bounded before it renders (ChatLimits.check_body: message, text and
character counts) and while it renders (the rendered text's length, a deadline, the client gone):
finding and replacing the markers is linear in the rendered text, whatever the number of texts.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
from hybridcache.services.runtime.sampling import RequestError
from jinja2.sandbox import ImmutableSandboxedEnvironment

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # tokenizer_config.json's AddedToken form
        value = value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered chat as engine parts (token ids): prefix, segments (live ones marked), suffix."""

    system: list[int]
    segments: list[list[int]]
    live: list[int]  # indices into segments of template markup
    suffix: list[int]

    def native(self) -> dict:
        return {"system": self.system, "segments": self.segments, "live_segments": self.live, "suffix": self.suffix}


class PrepareDeadline(RuntimeError):
    """A request's preparation (rendering, tokenizing) ran past its deadline (HTTP 503)."""


class PrepareCancelled(RuntimeError):
    """The client went away while its request was prepared: the work stops, nobody is answered."""


@dataclass(frozen=True)
class ChatLimits:
    """What a chat may cost the router: checked on the request body before anything renders, and
    while the template renders (check, between its output chunks)."""

    max_messages: int = 1 << 30
    max_texts: int = 1 << 30  # text parts that may become segments (a separator's pieces counted)
    max_chars: int = 1 << 62  # characters of the messages and tools together, and of the rendered prompt
    deadline: float = math.inf  # time.monotonic() by which the preparation must be done
    cancelled: Callable[[], bool] = field(default=lambda: False, compare=False)

    def check(self) -> None:
        """Raise when the client went away or the deadline passed."""
        if self.cancelled():
            raise PrepareCancelled("the client went away")
        if time.monotonic() > self.deadline:
            raise PrepareDeadline("the request took too long to prepare (render and tokenize); retry later")

    def check_body(self, messages: list, tools, separator: str | None) -> None:
        """Counts and characters of a chat, in one pass over its JSON that stops at the first bound
        passed (no rendering): RequestError when over a bound."""
        if len(messages) > self.max_messages:
            raise RequestError(f"the chat has {len(messages)} messages, more than the {self.max_messages} served")
        texts = 0
        for m in messages:
            if not isinstance(m, dict) or m.get("role") in ("system", "developer"):
                continue  # not segments (their form is checked as the chat is converted)
            content = m.get("content")
            parts = content if isinstance(content, list) else [content] if isinstance(content, str) else []
            texts += len(parts)
            if separator:
                texts += sum(p.count(separator) for p in parts if isinstance(p, str))
                texts += sum(p["text"].count(separator) for p in parts
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
            if texts > self.max_texts:
                raise RequestError(f"the chat has more than {self.max_texts} text parts (the most segments a "
                                   f"request may have)")
        if _chars([messages, tools], self.max_chars) > self.max_chars:
            raise RequestError(f"the chat's messages and tools hold more than {self.max_chars} characters, more "
                               f"than could fit in the served length")


def _chars(obj, limit: int) -> int:
    """Characters of every string (keys included) in a JSON value, containers and other values one
    each; the walk stops once past `limit`."""
    n, stack = 0, [obj]
    while stack and n <= limit:
        x = stack.pop()
        if isinstance(x, str):
            n += len(x)
        elif isinstance(x, dict):
            n += 1 + sum(len(k) for k in x if isinstance(k, str))
            stack.extend(x.values())
        elif isinstance(x, list):
            n += 1
            stack.extend(x)
        else:
            n += 1
    return n


class ChatTemplate:
    def __init__(self, source: str, text: str, special: dict[str, str] | None = None):
        self.source = source  # where the template came from (response stats)
        self.text = text
        self.special = dict(special or {})
        try:
            self._template = _environment().from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template from {source} does not parse: {e}") from None

    @classmethod
    def load(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The model's template (override: a template file); None when it has none."""
        model_dir = Path(model_dir)
        special: dict[str, str] = {}
        text, source = None, None
        cfg_file = model_dir / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{cfg_file} is not valid JSON: {e}") from None
            special = {k: t for k in _SPECIAL if (t := _token_text(cfg.get(k))) is not None}
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):
                named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
                tpl = named.get("default", next(iter(named.values()), None))
            if isinstance(tpl, str):
                text, source = tpl, "tokenizer_config.json"
        if text is None and (model_dir / "chat_template.jinja").is_file():
            text, source = (model_dir / "chat_template.jinja").read_text(), "chat_template.jinja"
        if override:
            p = Path(override)
            if not p.is_file():
                raise ValueError(f"--chat-template {override}: no such file")
            text, source = p.read_text(), str(p)
        return None if text is None else cls(source, text, special)

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
               limits: ChatLimits | None = None) -> str:
        """The template's text for the messages; with `limits`, RequestError once the text passes
        limits.max_chars, and the deadline and the client checked between the template's output chunks."""
        kwargs = dict(self.special, messages=messages, add_generation_prompt=add_generation_prompt)
        if tools is not None:
            kwargs["tools"] = tools
        limits = limits or ChatLimits()
        out, n = [], 0
        try:
            for i, piece in enumerate(self._template.generate(**kwargs)):
                out.append(piece)
                n += len(piece)
                if n > limits.max_chars:
                    raise RequestError(f"the chat template renders these messages to more than {limits.max_chars} "
                                       f"characters, more than could fit in the served length")
                if i % 256 == 255:
                    limits.check()
            return "".join(out)
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template refused the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    def prompt(self, marked: list[dict], texts: list[str], tokenizer, tools: list | None = None,
               limits: ChatLimits | None = None) -> ChatPrompt:
        """The prompt of the messages `marked`, where mark(k) stands for texts[k] (each text that
        may be a segment); the template sees the messages with the texts in place. A text the
        template does not render is no part of the prompt."""
        limits = limits or ChatLimits()
        full = self.render(substitute(marked, texts), tools, limits=limits)
        rendered = self.render(marked, tools, limits=limits)
        limits.check()
        # the markers rendered, each once and in order (a text the template leaves out, a role it
        # does not render, has none): then each text's span in the full text follows
        found = list(_MARK.finditer(rendered))
        order = [int(m.group(1)) for m in found]
        spans: list[tuple[int, int]] | None = None
        if all(a < b for a, b in zip(order, order[1:])) and all(k < len(texts) for k in order):
            spans, out, pos, length = [], [], 0, 0
            for m, k in zip(found, order):
                out.append(rendered[pos:m.start()])
                start = length + m.start() - pos
                out.append(texts[k])
                spans.append((start, start + len(texts[k])))
                length = start + len(texts[k])
                pos = m.end()
            out.append(rendered[pos:])
            if "".join(out) != full:
                spans = None
        if spans is None:
            # the template changes, drops or repeats a text: no reusable parts
            return ChatPrompt([], [], [], tokenizer.encode(full))
        enc = tokenizer.encode_with_offsets(full)
        # every token goes to the text it lies in wholly, else to the markup (-1)
        runs: list[tuple[int, list[int]]] = []
        k = 0
        for tok, (a, b) in zip(enc.ids, enc.offsets):
            while k < len(spans) and spans[k][1] <= a:
                k += 1
            lab = k if k < len(spans) and spans[k][0] <= a and b <= spans[k][1] else -1
            if runs and runs[-1][0] == lab:
                runs[-1][1].append(tok)
            else:
                runs.append((lab, [tok]))
        last_text = max((lab for lab, _ in runs if lab >= 0), default=-1)
        system: list[int] = []
        segments: list[list[int]] = []
        live: list[int] = []
        suffix: list[int] = []
        for lab, ids in runs:
            if lab == last_text or suffix:
                suffix += ids
            elif lab < 0 and not segments:
                system += ids
            else:
                if lab < 0:
                    live.append(len(segments))
                segments.append(ids)
        return ChatPrompt(system, segments, live, suffix)


def mark(k: int) -> str:
    """What stands for the k-th text in the marked messages (private-use characters)."""
    return f"\ue000{k}\ue001"


_MARK = re.compile("\ue000([0-9]{1,9})\ue001")


def substitute(obj, texts: list[str]):
    """obj with every mark(k) in its strings replaced by texts[k] (one pass over each string)."""
    if isinstance(obj, str):
        if "\ue000" not in obj:
            return obj
        return _MARK.sub(lambda m: texts[int(m.group(1))] if int(m.group(1)) < len(texts) else m.group(0), obj)
    if isinstance(obj, list):
        return [substitute(x, texts) for x in obj]
    if isinstance(obj, dict):
        return {key: substitute(v, texts) for key, v in obj.items()}
    return obj
