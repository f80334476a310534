"""Sampling parameters (SGLang's names) and token selection.

Tokens are picked on the logits' device for a whole batch at once (`sample`), so a decode step's
picks never go through the host (the overlap scheduler feeds them to the next step on the
device): on CUDA one Triton launch draws every row without sorting the vocabulary
(kernels/ops/sampling); elsewhere temperature, top-k, top-p and min-p are masks over the batch's
rows (`sampling_probs`) and each row is drawn by the exponential race (argmax of p / q with
q ~ Exp(1), which picks token i with probability p_i). A seeded request's noise comes from its own
generator (request_generator): the same seed gives the same tokens whatever else is in the batch.
`reference_probs` is one request's distribution written plainly (kernels/ops/sampling/naive.py),
what both are tested against."""

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
    min_p: float = 0.0  # tokens below min_p times the most likely one's probability are dropped
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
        known = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "seed",
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
        min_p = num("min_p", float, 0.0)
        if not 0.0 <= min_p <= 1.0:
            raise RequestError("sampling_params.min_p must be in [0, 1]")
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
        # SGLang's upper bound; the lower one keeps a positive logit divided by it finite (1e-39 made it inf)
        if not MIN_REPETITION_PENALTY <= repetition <= 2.0:
            raise RequestError(f"sampling_params.repetition_penalty must be between {MIN_REPETITION_PENALTY} and 2")
        frequency, presence = num("frequency_penalty", float, 0.0), num("presence_penalty", float, 0.0)
        for name, v in (("frequency_penalty", frequency), ("presence_penalty", presence)):
            if not -2.0 <= v <= 2.0:
                raise RequestError(f"sampling_params.{name} must be between -2 and 2")
        prompt_from = num("prompt_logprobs_from", int, None)
        if prompt_from is not None and prompt_from < 0:
            raise RequestError("sampling_params.prompt_logprobs_from must be >= 0")
        return cls(max_new, temperature, top_p, top_k, min_p, tuple(stop), tuple(stop_ids), seed, ignore_eos,
                   logprobs, min_new, repetition, frequency, presence, prompt_from)


MAX_TOP_LOGPROBS = 20
# the lowest temperature sampled at (vLLM's _MAX_TEMP): a request's (0, MIN_TEMPERATURE) is raised to it
MIN_TEMPERATURE = 1e-2
MIN_REPETITION_PENALTY = 1e-2


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
    """Pick the next token from logits [vocab] (fp32): greedy at temperature 0 (`sample` of one row)."""
    if params.temperature == 0.0:
        return int(logits.argmax())
    return int(sample(logits[None], [params], [generator])[0])


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """The next token of each row of logits [B, vocab] (fp32) under params[b], on the logits'
    device without a host round trip: int64 [B]. Greedy rows (temperature 0) take the argmax. On
    CUDA the others are drawn by one Triton launch that sorts nothing (kernels/ops/sampling: a
    Gumbel-max race over the kept tokens, redrawn when the pick falls outside the nucleus), from a
    Philox seed a row drawn on the host (from generators[b], a seeded request's own CPU generator,
    when it is not None); elsewhere by the exponential race over sampling_probs."""
    import torch

    greedy = [p.temperature == 0.0 for p in params]
    if all(greedy):
        return logits.argmax(-1)
    from hybridcache.services.runtime import backends

    if backends.use_fast_kernels(logits):
        picks = _sample_kernel(logits, params, generators)
    else:
        probs = sampling_probs(logits, params)
        q = torch.empty_like(probs).exponential_()
        for b, g in enumerate(generators):
            if g is not None and not greedy[b]:
                q[b].copy_(torch.empty(probs.shape[1]).exponential_(generator=g))
        picks = probs.div_(q).argmax(-1)
    if any(greedy):
        keep = _to(torch.tensor(greedy), logits.device)
        picks = torch.where(keep, logits.argmax(-1), picks)
    return picks


def warm_kernels(device, vocab: int, max_rows: int) -> int:
    """Compile the CUDA sampling kernels of every launch shape that batches of 1 to max_rows
    sampled rows of `vocab` logits take (kernels/ops/sampling launch_shape: the split path's
    partial count is a compile-time constant that depends on the rows), by sampling one batch of
    each shape, top-k included; a worker's warm-up calls it, so that no request's first sampled
    step at a new batch size waits for Triton's compilation (seconds). Returns how many shapes
    ran (0 off CUDA)."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    from hybridcache.kernels.ops.sampling.triton import launch_shape

    shapes = {}
    for rows in range(1, max_rows + 1):
        shapes.setdefault(launch_shape(rows, vocab, dev)[1], rows)
    params = SamplingParams(temperature=0.8, top_p=0.95, top_k=20)
    for rows in shapes.values():
        sample(torch.randn(rows, vocab, device=dev), [params] * rows, [None] * rows)
    torch.cuda.synchronize(dev)
    return len(shapes)


def _sample_kernel(logits: torch.Tensor, params: list[SamplingParams], generators: list) -> torch.Tensor:
    """sample's CUDA path: the rows' settings and seeds to the device in two copies, each top-k
    row's k-th largest logit from one torch.topk, then kernels/ops/sampling's one launch."""
    import torch
    from hybridcache.kernels.ops.sampling.triton import sample_rows

    B, V = logits.shape
    seeds = torch.randint(0, 1 << 62, (B,))
    for b, g in enumerate(generators):
        if g is not None:
            seeds[b] = int(torch.randint(0, 1 << 62, (1,), generator=g))
    ks = [p.top_k if p.temperature > 0 and p.top_k > 0 else 0 for p in params]
    table = settings_table(params, ks, logits.device)
    kth = torch.full_like(table[3], float("-inf"))
    if any(ks):
        kmax = min(max(ks), V)
        top = torch.topk(logits, kmax, dim=-1).values.gather(1, (table[3].long().clamp(1, kmax) - 1)[:, None])[:, 0]
        kth = torch.where(table[3] > 0, top, kth)
    return sample_rows(logits, table[0], table[1], table[2], kth, _to(seeds, logits.device))


def settings_table(params: list[SamplingParams], ks: list[int], device):
    """The rows' temperature, top-p (2 for off), min-p and top-k as fp32 [4, B] on `device` in one
    copy, each of the four rows starting 16 bytes aligned (the columns padded to a multiple of
    four): Triton specializes a kernel on its pointers' alignment, so rows at offsets that depend
    on B would compile the sampling kernels again for batch sizes of each residue."""
    import torch

    B = len(params)
    width = -(-B // 4) * 4
    table = torch.zeros(4, width)
    table[:, :B] = torch.tensor([[_temperature(p) for p in params],
                                 [p.top_p if p.top_p < 1.0 else 2.0 for p in params],
                                 [p.min_p for p in params], [float(k) for k in ks]])
    return _to(table, device)[:, :B]


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[B, vocab] fp32: each row's distribution after its temperature, top-k, top-p and min-p, on
    the logits' device in a fixed number of batched ops (rows at temperature 0 as at 1). top-k
    takes one topk of the largest k asked; top-p one sort of the rows, only when a row asks for
    it; the per-row values go to the device in one copy."""
    import torch

    B, V = logits.shape
    sampled = [p for p in params if p.temperature > 0]
    ks = [p.top_k if p.temperature > 0 and p.top_k > 0 else 0 for p in params]
    table = settings_table(params, ks, logits.device)
    # shifted by each row's largest logit first: every value is <= 0 before the division, so no
    # temperature scales a finite logit to +inf (whose softmax is NaN); the largest stays 0
    x = logits.float()
    x = (x - x.amax(-1, keepdim=True)) / table[0, :, None]
    if any(ks):
        kmax = min(max(ks), V)
        kth = torch.topk(x, kmax, dim=-1).values.gather(1, (table[3].long().clamp(1, kmax) - 1)[:, None])
        kth = torch.where(table[3, :, None] > 0, kth, torch.full_like(kth, float("-inf")))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if any(p.top_p < 1.0 for p in sampled):
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > table[1, :, None]
        probs = torch.zeros_like(probs).scatter_(1, idx, sorted_p.masked_fill(drop, 0.0))
    if any(p.min_p > 0 for p in sampled):
        floor = table[2, :, None] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One request's distribution over logits [vocab] written plainly (kernels/ops/sampling/naive.py):
    what sampling_probs and the sampling kernel are tested against."""
    from hybridcache.kernels.ops.sampling import naive_sampling_probs

    return naive_sampling_probs(logits, params.temperature if params.temperature > 0 else 1.0, params.top_k,
                                params.top_p, params.min_p)


def _temperature(p: SamplingParams) -> float:
    """The temperature a row is divided by: 1 for a greedy row (its pick is the argmax anyway), at
    least MIN_TEMPERATURE for a sampled one (also where parameters were made without from_dict)."""
    return max(p.temperature, MIN_TEMPERATURE) if p.temperature > 0 else 1.0


def _to(t: torch.Tensor, device) -> torch.Tensor:
    from hybridcache.services.runtime.backends import to_device_async

    return to_device_async(t, device)
