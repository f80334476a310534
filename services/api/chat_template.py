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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True) -> str:
        kwargs = dict(self.special, messages=messages, add_generation_prompt=add_generation_prompt)
        if tools is not None:
            kwargs["tools"] = tools
        try:
            return self._template.render(**kwargs)
        except jinja2.TemplateError as e:
            raise RequestError(f"the chat template refused the messages: {e}") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise RequestError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None

    def prompt(self, marked: list[dict], texts: list[str], tokenizer, tools: list | None = None) -> ChatPrompt:
        """The prompt of the messages `marked`, where mark(k) stands for texts[k] (each text that
        may be a segment); the template sees the messages with the texts in place. A text the
        template does not render is no part of the prompt."""
        full = self.render(substitute(marked, texts), tools)
        rendered = self.render(marked, tools)
        spans, out, pos = [], [], 0
        for k, text in enumerate(texts):
            if mark(k) not in rendered:
                continue  # a text the template leaves out (a role it does not render)
            at = rendered.find(mark(k), pos)
            if at < 0 or rendered.count(mark(k)) != 1:
                spans = None
                break
            out.append(rendered[pos:at])
            start = sum(map(len, out))
            out.append(text)
            spans.append((start, start + len(text)))
            pos = at + len(mark(k))
        if spans is None or "".join(out) + rendered[pos:] != full:
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


def substitute(obj, texts: list[str]):
    """obj with every mark(k) in its strings replaced by texts[k]."""
    if isinstance(obj, str):
        for k, text in enumerate(texts):
            obj = obj.replace(mark(k), text)
        return obj
    if isinstance(obj, list):
        return [substitute(x, texts) for x in obj]
    if isinstance(obj, dict):
        return {key: substitute(v, texts) for key, v in obj.items()}
    return obj
