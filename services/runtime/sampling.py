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
                 "sampling_seed", "ignore_eos", "logprobs"}
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
        if 0.0 < temperature < MIN_TEMPERATURE:
            # vLLM's rule: a temperature this close to 0 is raised to MIN_TEMPERATURE (a nearly greedy
            # draw either way), so that no accepted value scales finite logits to inf
            temperature = MIN_TEMPERATURE
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
        return cls(max_new, temperature, top_p, top_k, tuple(stop), tuple(stop_ids), seed, ignore_eos, logprobs)


MAX_TOP_LOGPROBS = 20
# the lowest temperature sampled at (vLLM's _MAX_TEMP): a request's (0, MIN_TEMPERATURE) is raised to it
MIN_TEMPERATURE = 1e-2


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


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from logits [vocab] (fp32): greedy at temperature 0."""
    import torch  # here: the request plan (plan.py) parses sampling parameters without torch

    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    # shifted by the largest logit first: every value is <= 0 before the division, so no temperature
    # scales a finite logit to +inf (the softmax of which is NaN); the largest stays 0
    logits = logits.float()
    logits = (logits - logits.max()) / max(params.temperature, MIN_TEMPERATURE)
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
    probs = probs.cpu()
    if not bool(torch.isfinite(probs).all()):
        raise RuntimeError("the model's logits are not finite: no token can be sampled")
    return int(torch.multinomial(probs, 1, generator=generator))
