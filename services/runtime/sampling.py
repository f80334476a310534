"""Sampling parameters (SGLang's names) and token selection."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class RequestError(ValueError):
    """A request the engine refuses; the message says what is wrong (HTTP 400, CLI exit 2)."""


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """A model's generation_config.json: the stop ids and sampling values a request starts from.

    As transformers reads it: every eos_token_id (an int or a list) ends generation; do_sample
    false means greedy; temperature, top_p, top_k and max_new_tokens are defaults only where the
    file sets them (what vLLM does with it), and a request's own values override them."""

    eos_token_ids: tuple[int, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> GenerationDefaults:
        eos = d.get("eos_token_id")
        eos_ids = tuple(int(t) for t in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        greedy = d.get("do_sample") is False
        return cls(
            eos_token_ids=eos_ids,
            temperature=0.0 if greedy else _opt(d, "temperature", float),
            top_p=None if greedy else _opt(d, "top_p", float),
            top_k=None if greedy else _opt(d, "top_k", int),
            max_new_tokens=_opt(d, "max_new_tokens", int),
        )

    @classmethod
    def from_dir(cls, path) -> GenerationDefaults:
        """generation_config.json of a model directory; none there means no defaults."""
        import json
        from pathlib import Path

        f = Path(path) / "generation_config.json"
        if not f.is_file():
            return cls()
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f} is not valid JSON: {e}") from None
        return cls.from_dict(d if isinstance(d, dict) else {})

    def sampling_defaults(self) -> dict:
        """The sampling_params keys a request without them gets."""
        names = ("temperature", "top_p", "top_k", "max_new_tokens")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}


def _opt(d: dict, key: str, kind):
    v = d.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return kind(v)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    # None: until the context is full (the request plan fills in what is left of it)
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    # return each generated token's log-probability and this many most likely alternatives (None: off)
    logprobs: int | None = None
    # no eos or stop token id, and no stop string, before this many output tokens (vLLM's min_tokens)
    min_new_tokens: int = 0
    # vLLM's penalties (apply_penalties): repetition over prompt and output tokens, frequency and
    # presence over output tokens; 1, 0, 0 are off
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # return the prompt's log-probabilities from this position on, each with `logprobs`
    # alternatives (SGLang's logprob_start_len, OpenAI's echo with logprobs; None: off)
    prompt_logprobs_from: int | None = None

    @property
    def adjusts_logits(self) -> bool:
        """Whether LogitsAdjuster changes this request's logits before a token is picked."""
        return (self.min_new_tokens > 0 or self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @classmethod
    def from_dict(
        cls, d: dict | None, max_new_tokens_limit: int = 1 << 16, defaults: dict | None = None
    ) -> SamplingParams:
        """Validate SGLang-style sampling parameters; keys the request leaves out (or sets to
        null) take `defaults` (the model's generation_config.json), then the built-in ones."""
        if d is not None and not isinstance(d, dict):
            raise RequestError("sampling_params must be an object")
        d = {**(defaults or {}), **{k: v for k, v in (d or {}).items() if v is not None}}
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "seed",
                 "sampling_seed", "ignore_eos", "logprobs", "min_new_tokens", "repetition_penalty",
                 "frequency_penalty", "presence_penalty", "prompt_logprobs_from"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")

        def num(name, kind, default):
            v = d.get(name, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
                raise RequestError(f"sampling_params.{name} must be {'an integer' if kind is int else 'a number'}")
            return kind(v)

        max_new = num("max_new_tokens", int, None)
        if max_new is not None and not 0 <= max_new <= max_new_tokens_limit:
            raise RequestError(f"sampling_params.max_new_tokens must be between 0 and {max_new_tokens_limit}")
        temperature = num("temperature", float, 0.0)
        if not 0.0 <= temperature <= 100.0:
            raise RequestError("sampling_params.temperature must be between 0 and 100")
        top_p = num("top_p", float, 1.0)
        if not 0.0 < top_p <= 1.0:
            raise RequestError("sampling_params.top_p must be in (0, 1]")
        top_k = num("top_k", int, -1)
        if top_k == 0 or top_k < -1:
            raise RequestError("sampling_params.top_k must be -1 (disabled) or a positive integer")
        stop = d.get("stop") or ()
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError("sampling_params.stop must be a non-empty string or a list of them")
        stop_ids = d.get("stop_token_ids") or ()
        if not isinstance(stop_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63 for t in stop_ids):
            raise RequestError("sampling_params.stop_token_ids must be a list of non-negative integers")
        seed = d.get("seed", d.get("sampling_seed"))
        # a torch.Generator seed: 64 bits
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64):
            raise RequestError("sampling_params.seed must be an integer in [0, 2^64)")
        ignore_eos = d.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise RequestError("sampling_params.ignore_eos must be a boolean")
        logprobs = num("logprobs", int, None)
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise RequestError(f"sampling_params.logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        min_new = num("min_new_tokens", int, 0)
        if not 0 <= min_new <= max_new_tokens_limit:
            raise RequestError(f"sampling_params.min_new_tokens must be between 0 and {max_new_tokens_limit}")
        repetition = num("repetition_penalty", float, 1.0)
        if not repetition > 0.0:
            raise RequestError("sampling_params.repetition_penalty must be greater than 0")
        frequency, presence = num("frequency_penalty", float, 0.0), num("presence_penalty", float, 0.0)
        for name, v in (("frequency_penalty", frequency), ("presence_penalty", presence)):
            if not -2.0 <= v <= 2.0:
                raise RequestError(f"sampling_params.{name} must be between -2 and 2")
        prompt_from = num("prompt_logprobs_from", int, None)
        if prompt_from is not None and prompt_from < 0:
            raise RequestError("sampling_params.prompt_logprobs_from must be >= 0")
        return cls(max_new, temperature, top_p, top_k, tuple(stop), tuple(stop_ids), seed, ignore_eos, logprobs,
                   min_new, repetition, frequency, presence, prompt_from)


MAX_TOP_LOGPROBS = 20


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under the model's distribution (log-softmax of the logits [vocab], before
    temperature and truncation, as vLLM reports them) and the `top` most likely (id, log p)."""
    import torch

    lp = torch.log_softmax(logits.float(), dim=-1)
    alternatives = []
    if top:
        values, ids = torch.topk(lp, min(top, lp.numel()))
        alternatives = list(zip(ids.tolist(), values.tolist()))
    return float(lp[token]), alternatives


class LogitsAdjuster:
    """One request's changes to its logits before a token is picked, as vLLM makes them: while
    fewer than min_new_tokens are out, its stop token ids (eos too, unless ignore_eos) are masked;
    then its penalties (vLLM's apply_penalties): a logit of a token seen in the prompt or the output
    is divided by repetition_penalty where positive, multiplied where not; frequency_penalty times
    the token's count in the output and presence_penalty where it occurs there are subtracted.
    The prompt's token mask is made once; the output counts grow with each call."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_ids=()):
        self.params = params
        self.prompt_ids = prompt_ids
        self.stop_ids = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids)))
        self._prompt_mask = None  # [vocab] bool, on the logits' device
        self._counts = None  # [vocab] of the output tokens seen so far
        self._seen = 0

    def __call__(self, logits: torch.Tensor, output_ids: list[int]) -> torch.Tensor:
        """logits [vocab] (not modified) -> the adjusted logits [vocab] fp32, given the output so far."""
        import torch

        p = self.params
        logits = logits.float().clone()
        vocab, device = logits.shape[-1], logits.device
        if len(output_ids) < p.min_new_tokens and self.stop_ids:
            ids = [t for t in self.stop_ids if t < vocab]
            logits[torch.tensor(ids, dtype=torch.long, device=device)] = float("-inf")
        if p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0:
            return logits
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._prompt_mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            if self.prompt_ids:
                self._prompt_mask[torch.tensor(self.prompt_ids, dtype=torch.long, device=device)] = True
        if len(output_ids) > self._seen:
            new = torch.tensor(output_ids[self._seen:], dtype=torch.long, device=device)
            self._counts.index_add_(0, new, torch.ones(len(new), dtype=torch.float32, device=device))
            self._seen = len(output_ids)
        in_output = self._counts > 0
        if p.repetition_penalty != 1.0:
            seen = self._prompt_mask | in_output
            penalized = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
            logits = torch.where(seen, penalized, logits)
        return logits - p.frequency_penalty * self._counts - p.presence_penalty * in_output.float()


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from logits [vocab] (fp32): greedy at temperature 0."""
    import torch  # here: the request plan (plan.py) parses sampling parameters without torch

    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(logits, min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, 0)
        drop = cum - sorted_p > params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
