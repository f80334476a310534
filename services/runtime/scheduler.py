"""Continuous batching over one Engine: many requests in flight, one batched decode step a time.

A Scheduler owns an Engine and runs a loop in its own thread. Each step it
    1. drops the requests whose handles were cancelled (the client went away);
    2. admits waiting requests while fewer than `max_num_seqs` run and their attention K/V fits
       `kv_cache_bytes`: the prompt and a first chunk of `kv_chunk_tokens` new tokens (fewer when
       max_new_tokens is smaller), reserved at admission;
    3. spends up to `max_num_batched_tokens` on admitted requests' prefill: first their cold
       segments, built as one batched standalone prefill across requests (Engine.build_entries),
       then a chunk of each assembly (Engine.start_prefill, Engine.prefill_chunk over warm
       entries), each request's first token sampled from its last chunk;
    4. runs ONE decode step over every running request (Engine.decode_batch, paged.decode_step):
       B tokens in one forward over the requests' states in a preallocated pool (paged.StatePool):
       linear-layer states in slots, attention K/V in pages read through a block table.
A request's prefill is cut between steps at segment granularity (cold builds; a cold segment
longer than the budget is built whole) and its assembly into chunks of at most the step's budget
of live tokens (a plain prompt, a segment that runs live, the seams and question of an
assembly), each chunk running from the state the one before left, so running streams wait for
at most one step's budget of prefill between their tokens. The budget counts tokens at zero
context: a chunk that starts L positions into its sequence runs fewer live tokens, as many as
cost the budget once their attention over the L earlier keys is counted (chunk_tokens,
attention_cost_per_position), so each step of a 128k-token prompt's prefill has about the same
FLOPs, at its end as at its start. A prefill runs in the slot it will
decode in (models whose attention layers run in pages: all but MLA's): the request gets its slot
at its first chunk and every chunk writes its K/V into the slot's pages (paged.StatePool.assign,
KVPages.extend; a chunk's attention reads the pages where they lie, an assembly's cached spans
are written there rotated), so a long prompt makes no copy of its K/V beyond what its reservation
covers, and a request starts decoding without moving its K/V. On CUDA an assembly runs planned
from its bucket's CUDA graphs (runner.ModelRunner.forward, graphs.AssemblyGraphs). Prompts that
run all live from an empty state (Engine.plain_prefill_ok: no segments, no system prompt, no
page-tree hit, no prefix-cache checkpoint inside) are prefilled together instead, one batched
standalone forward of every such prompt admitted in the step but its last token
(Engine.prefill_plain); that token is their input to the step's decode, which yields their first
output token. A burst of short prompts then costs one batched pass, not an eager forward each.

Overlapped decoding (SchedulerConfig.overlap; RuntimeConfig.decode_overlap, on CUDA): while no
running request asks for logprobs or adjusts its logits (min_new_tokens, penalties), a step is
launched before the host handles the one before it, SGLang's overlap scheduler and vLLM's async
scheduling in kind. The step's picks (greedy or sampled on the device, sampling.sample) stay on
the device as the next step's inputs (paged.decode_step's `feed`) and are copied to the host
without blocking; the host then emits them (detokenization, stop checks, the streams' queues)
while the GPU runs the next step, and the GPU no longer idles through that host work. A request
whose pick ends it by length sits the next step out; one that stops on a token or a stop string,
or is cancelled or preempted meanwhile, has run one step more, whose pick is dropped (its state
and K/V went one token further, which the page recorder records as the token it was fed: the
pages it leaves hold what they say). A step with a request that asks for logprobs (read from the
step's logits on the host) or adjusts its logits runs synchronously, after the launched one is
handled.

K/V is reserved as a sequence grows, as vLLM allocates it: before a decode step, a running request
whose K/V would pass its reservation grows it by another chunk. When the budget has no room for
that, the most recently admitted requests are preempted by recompute (vLLM's policy): each gives
back its slot, pages and reservation and goes back to the head of the waiting queue with the
tokens it generated appended to its live suffix; re-admitted, it prefills them (its completed
prefix pages went into the page tree as it was preempted, so mostly a prefix hit) and samples its
next token from that prefill, the same TextStream and sampling generator going on, so its stream
neither repeats nor loses a token. A request alone in the scheduler grows past the budget rather
than preempt itself forever; one whose prompt and first chunk exceed the budget is refused
(KVBudgetError) when it is queued.

Sampling (per request: temperature, top_p, top_k, min_p, seed; min_new_tokens and vLLM's
penalties on the request's logits first, sampling.LogitsAdjuster; sampling.sample over the batch's
rows, a seeded request's own generator: request_generator) and stop conditions (TextStream) are per
request. A request that asks for its prompt's log-probabilities gets them from
Engine.prompt_logprobs as it is assembled. A finished request's prefix pages go into the page tree
and are released (Engine.finish_prefix), its slot is freed.

One request's failure never fails another. Its own work in a step (the cold build of its segments,
its prefill or assembly, the adjustment of its logits, its stop conditions and logprobs) that
raises finishes it alone with that error (_fail: a RequestError is what its parameters caused,
answered 400; anything else 500) and gives back what it held; a batched cold build or plain prefill
that fails is done again one request at a time, so only a request that fails by itself fails. The
batched decode forward (and the batch's sampling, row by row) is the step's shared work: when it
raises, the requests of that batch fail with it.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from hybridcache.services.config import default_of
from hybridcache.services.devices import CPU_KV_BYTES, kv_cache_budget
from hybridcache.services.runtime.backends import to_device_async
from hybridcache.services.runtime.engine import (
    Engine,
    GenerateResult,
    Prefill,
    PrefillJob,
    Request,
    RequestStats,
    named_entries,
)
from hybridcache.services.runtime.sampling import (
    LogitsAdjuster,
    RequestError,
    SamplingParams,
    sample,
    sample_token,
    token_logprobs,
)

log = logging.getLogger("hybridcache.scheduler")

_DONE = object()


# tokens of attention K/V a request reserves at admission beyond its prompt, and again each time
# its sequence reaches what it holds (fewer when it has fewer new tokens left to generate)
KV_CHUNK_TOKENS = 256


class TextStream:
    """Detokenization of one request's output and its stop conditions (stop ids, EOS, stop
    strings). push(token) -> (events, done): events are (token_id, text_delta) to emit, token_id -1
    for text only. Text that could be the start of a stop string is held back until it cannot be."""

    def __init__(self, engine: Engine, params: SamplingParams, stats: RequestStats | None = None):
        self.engine, self.params, self.stats = engine, params, stats
        self.output_ids: list[int] = []
        # per output token, when the request asks for them: (log p, [(id, log p) of the top alternatives])
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.finish_reason = "length"
        self.emitted = ""
        self.text = ""  # the output's text so far, whole characters (Tokenizer.decoder)
        self._decode = engine.tokenizer.decoder()
        self.hold = max((len(s) for s in params.stop), default=0)

    def push(self, tok: int, logprobs=None) -> tuple[list[tuple[int, str]], bool]:
        params = self.params
        if self.stats is not None:
            self.stats.generated_tokens += 1
        if (tok in self.engine.eos_ids and not params.ignore_eos) or tok in params.stop_token_ids:
            self.finish_reason = "stop"
            return self.flush(), True
        self.output_ids.append(tok)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        self.text = text = self.text + self._decode(tok)
        # no stop string before min_new_tokens (vLLM's StopChecker)
        stops = params.stop if len(self.output_ids) >= params.min_new_tokens else ()
        cut = min((text.find(s) for s in stops if s in text), default=-1)
        if cut >= 0:
            self.finish_reason = "stop"
            return [(tok, text[len(self.emitted) : cut] if cut > len(self.emitted) else "")], True
        safe = max(len(text) - self.hold + 1, len(self.emitted)) if self.hold else len(text)
        delta = text[len(self.emitted) : safe]
        self.emitted = text[:safe]
        return [(tok, delta)], len(self.output_ids) >= params.max_new_tokens

    def flush(self) -> list[tuple[int, str]]:
        """The text held back, once the output ends without a stop string (the whole output
        decoded once: an incomplete character at its end shows as the tokenizer shows it)."""
        text = self.engine.tokenizer.decode(self.output_ids)
        if len(text) <= len(self.emitted):
            return []
        rest, self.emitted = text[len(self.emitted) :], text
        return [(-1, rest)]


def request_generator(params: SamplingParams) -> torch.Generator | None:
    """The sampling generator of a seeded request (on the host): its tokens' noise is drawn from
    it alone (sampling.sample), the same for the same seed whatever else is in the batch. None
    when greedy or unseeded (the process's default generators draw for it)."""
    if params.temperature <= 0 or params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


class KVBudgetError(RequestError):
    """A request whose prompt and first chunk of new tokens never fit kv_cache_bytes (HTTP 400)."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: float = 1.0):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = default_of("max_num_seqs")  # requests decoding at once (vLLM's name)
    # requests queued beyond the free seats; one more is refused (QueueFull)
    max_waiting: int = default_of("max_waiting")
    # prefill tokens (cold builds, assemblies) a step
    max_num_batched_tokens: int = default_of("max_num_batched_tokens")
    # attention K/V reserved by running requests (prompt + generated tokens, grown by chunks of
    # kv_chunk_tokens); unset in RuntimeConfig means sized for the device (scheduler_config)
    kv_cache_bytes: int = CPU_KV_BYTES
    kv_chunk_tokens: int = KV_CHUNK_TOKENS  # K/V tokens reserved at admission beyond the prompt, and at each growth
    # launch a decode step before the host handles the one before it (module docstring)
    overlap: bool = False
    # steps a chunk without cached spans runs over, a run of layers each (RuntimeConfig.chunk_layer_parts)
    chunk_layer_parts: int = default_of("chunk_layer_parts")

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes", "kv_chunk_tokens",
                     "chunk_layer_parts"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


def scheduler_config(config, device, kv_cache_bytes: int | None = None) -> SchedulerConfig:
    """The SchedulerConfig of a RuntimeConfig (services/config.py), its K/V budget `kv_cache_bytes`
    when given (a planned worker's provisional one, Scheduler.resize_kv), else the config's, else
    sized for `device` (devices.kv_cache_budget)."""
    overlap = config.decode_overlap and torch.device(device).type == "cuda"
    kv = kv_cache_bytes if kv_cache_bytes is not None else kv_cache_budget(
        device, config.kv_cache_bytes, config.gpu_memory_utilization)
    return SchedulerConfig(config.max_num_seqs, config.max_waiting, config.max_num_batched_tokens, kv,
                           overlap=overlap, chunk_layer_parts=config.chunk_layer_parts)


def attention_cost_per_position(model) -> float:
    """How much one live token's prefill grows per earlier position it attends to, as a share of
    its matmuls: every attention layer's 2 Hq (dk + dv) FLOPs a key over 2 x the weights a token
    multiplies (linear layers but the LM head, which runs for the last token alone; of a MoE
    layer's experts the top-k share). A chunk of c live tokens at context L then costs about
    c (1 + a L) tokens of matmuls at zero context: at 128k tokens of context a Qwen3.5-9B token is
    about 2.2 times the FLOPs of one at the start."""
    cfg = model.cfg
    vocab = getattr(cfg, "vocab_size", None)
    experts, top_k = getattr(cfg, "num_experts", 0) or 0, getattr(cfg, "num_experts_per_tok", 0) or 0
    weights = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m.out_features != vocab:
            weights += m.weight.numel()
        elif not isinstance(m, torch.nn.Conv1d) and experts > 1:
            # a stack of experts [E, ...]: a token runs top-k of them
            weights += sum(p.numel() * top_k / experts for p in m.parameters(recurse=False)
                           if p.dim() == 3 and p.shape[0] == experts)
    hq = getattr(cfg, "num_attention_heads", 0)
    per_key = sum(2 * max(hq, a.k.shape[1]) * (a.k.shape[3] + a.v.shape[3]) for a in model.empty_state().attn.values())
    return per_key / (2 * weights) if weights else 0.0


def chunk_tokens(budget: int, context: int, slope: float) -> int:
    """The live tokens c of a chunk that starts `context` positions in, whose cost c (1 + slope
    context) (attention_cost_per_position) stays within `budget` tokens at zero context; at least
    one."""
    return max(1, int(budget / (1 + max(0.0, slope) * context)))


def chunk_cost(tokens: int, context: int, slope: float) -> int:
    """What a chunk of `tokens` live tokens at `context` spends of a step's budget (chunk_tokens)."""
    return math.ceil(tokens * (1 + max(0.0, slope) * context) - 1e-9)


def kv_bytes_per_token(model) -> int:
    """Bytes of attention K/V one token of a running request holds (every attention layer's k
    [1, H, 0, d] and v [1, H, 0, dv]; MLA: latents and the shared key part)."""
    return sum((a.k.shape[1] * a.k.shape[3] + a.v.shape[1] * a.v.shape[3]) * a.k.element_size()
               for a in model.empty_state().attn.values())


class RequestHandle:
    """One request in a Scheduler: iterate for (token_id, text_delta) as they come (token_id -1:
    text only); cancel() (or leaving the iteration early) ends it within one step.

    With a `listener`, the scheduler's thread hands it each step's events instead, listener(handle,
    events), and listener(handle, None) once the request has ended (done is set, finish_reason and
    error final): a server that streams many requests at once collects them there, with no thread
    woken per request and token. Such a handle is not iterated."""

    def __init__(self, req: Request, scheduler: Scheduler, listener=None):
        self.req = req
        self._scheduler = scheduler
        self._listener = listener
        self._events: queue.Queue = queue.Queue()
        self._cancelled = threading.Event()
        self.done = threading.Event()
        self.finish_reason: str | None = None
        self.output_ids: list[int] = []
        self.logprobs: list = []  # per output token, when the request asks for them (TextStream.logprobs)
        self.prompt_logprobs: list | None = None  # Engine.prompt_logprobs, when the request asks for them
        self.prefill: Prefill | None = None
        self.error: BaseException | None = None
        self.finished_step = -1  # the scheduler step that ended it
        self.arrived = time.perf_counter()
        self.admitted_at: float | None = None  # when it first left the waiting queue (its wait for a seat ended)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        if not self.done.is_set():
            self._cancelled.set()
            self._scheduler._wake()

    def __iter__(self):
        try:
            while (item := self._events.get()) is not _DONE:
                yield item
            if self.error is not None:
                raise self.error
        finally:
            if not self.done.is_set():
                self.cancel()

    def result(self) -> GenerateResult:
        """Wait for the end: the request's text, output ids, finish reason, stats (and logprobs)."""
        text = "".join(delta for _, delta in self)
        stats = self.prefill.stats if self.prefill is not None else None
        logprobs = list(self.logprobs) if self.req.sampling.logprobs is not None else None
        return GenerateResult(text, list(self.output_ids), self.req.prompt_ids, self.finish_reason, stats, logprobs)

    # called by the scheduler's thread
    def _emit(self, events) -> None:
        if self._listener is not None:
            if events:
                self._listener(self, events)
            return
        for ev in events:
            self._events.put(ev)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        self.finish_reason, self.error = reason, error
        self.finished_step = self._scheduler.steps
        self.done.set()
        if self._listener is not None:
            self._listener(self, None)
        else:
            self._events.put(_DONE)
        if self._scheduler.on_finish is not None:
            self._scheduler.on_finish(self)


@dataclass(slots=True, eq=False)  # compared by identity: `seq in self._running` in every step
class _Seq:
    handle: RequestHandle
    req: Request
    arrived: float
    pinned: dict
    reused: list = field(default_factory=list)  # the planner's reused_segments of req
    cold: dict = field(default_factory=dict)  # key -> token ids still to build
    built: dict = field(default_factory=dict)  # key -> entry built ahead for it
    job: PrefillJob | None = None  # its prefill under way (run a chunk a step)
    prefill: Prefill | None = None
    stream: TextStream | None = None
    generator: torch.Generator | None = None
    slot: int = -1
    last_token: int = -1
    reserved: int = 0  # bytes of kv_cache_bytes held since admission
    kv_tokens: int = 0  # tokens of K/V that reservation covers
    admitted: int = -1  # admission order (the latest admitted is preempted first)
    first_pending: bool = False  # prefilled without its last prompt token: the next decode step yields token 1
    runs: int = 0  # times it entered the running list (a step launched before it left is stale for it)
    fed: bool = False  # its input of the latest launched step came from the device (its id not yet known here)
    adjuster: LogitsAdjuster | None = None  # min_new_tokens and penalties, made on its first pick
    part_share: tuple[int, int] = (0, 0)  # (tokens, cost) a step of its part-way chunk counts
    # its first token's wait (RequestStats.prefill_steps, build_ms, assembly_ms)
    prefill_steps: int = 0
    build_s: float = 0.0
    assembly_started: float | None = None


@dataclass(slots=True)
class _Launched:
    """A decode step launched and not yet handled (overlapped decoding): its requests, their `runs`
    when it was launched, and its picks, on the device and copied (non-blocking) to the host."""

    batch: list
    runs: list
    picks: torch.Tensor
    host: torch.Tensor
    event: object  # torch.cuda.Event recorded after the copy (None on CPU)


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig | None = None, on_finish=None, on_preempt=None,
                 on_step=None):
        """on_finish(handle): called in the scheduler's thread as each request ends; on_preempt(handle):
        as a request is preempted; on_step(kind, seconds): after each step that ran anything, kind
        "decode", "prefill" or "mixed" (both), seconds the step's wall time (for metrics)."""
        self.engine = engine
        self.config = config or SchedulerConfig()
        if self.config.overlap and not engine.runner.overlaps:  # a split model's (ModelRunner says why)
            self.config = dataclasses.replace(self.config, overlap=False)
        self.on_finish = on_finish
        self.on_preempt = on_preempt
        self.on_step = on_step
        self._cv = threading.Condition()
        self._waiting: collections.deque[_Seq] = collections.deque()
        self._admitted: list[_Seq] = []  # prefill in progress
        self._running: list[_Seq] = []  # decoding, in slot order
        self._kv_reserved = 0
        self._stop = False
        self._kv_per_token = kv_bytes_per_token(engine.model)
        self._attention_slope = attention_cost_per_position(engine.model)
        # the running requests' linear states and K/V pages, sized by the K/V budget
        kv_tokens = self.config.kv_cache_bytes // max(self._kv_per_token, 1)
        self.pool = engine.new_state_pool(self.config.max_num_seqs, kv_tokens)
        self._device = torch.device(engine.model.device)
        self.steps = 0
        self.preemptions = 0  # running requests preempted (recomputed) for lack of K/V budget
        self._admissions = 0
        self.batch_sizes: collections.Counter = collections.Counter()  # decode batch size -> steps
        self.overlapped_steps = 0  # decode steps launched before the step before them was handled
        self.plain_prefilled = 0  # requests prefilled together by Engine.prefill_plain
        # a prefill runs in its slot's pages (models whose attention layers write K/V there:
        # common.attention_layout), so no copy of the prompt's K/V is made
        self._paged_prefill = (engine.config.paged_prefill and bool(getattr(engine.model, "paged_prefill", False))
                               and self.pool.kv is not None)
        # (step, prefill tokens, decode batch size) of the latest steps that did work
        self.step_log: collections.deque = collections.deque(maxlen=4096)
        self._step_tokens = 0
        self._launched: _Launched | None = None
        self._thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self._thread.start()


    def add_request(self, req: Request, pinned: dict | None = None, listener=None) -> RequestHandle:
        """Queue a request; raises QueueFull when max_waiting requests are already waiting.
        pinned: key -> segment entry gathered for this request (held until it is assembled);
        listener: where its events go instead of the handle's iteration (RequestHandle)."""
        self.check_fits(req)
        handle = RequestHandle(req, self, listener)
        seq = _Seq(handle, req, time.perf_counter(), dict(pinned or {}))
        self._plan(seq)
        with self._cv:
            if self._stop:
                raise RuntimeError("the scheduler is stopped")
            if not self._room():
                raise QueueFull(self.queue_full_message(), self.retry_after_s())
            self._waiting.append(seq)
            self._cv.notify()
        return handle

    def _first_chunk(self, seq_req: Request, generated: int = 0) -> int:
        """Tokens of K/V a request reserves at admission: its prompt and a first chunk."""
        return seq_req.prompt_len + min(self.config.kv_chunk_tokens, seq_req.sampling.max_new_tokens - generated)

    def admission_kv_bytes(self, req: Request) -> int:
        """Bytes of attention K/V the request reserves at admission (its prompt and a first chunk):
        a K/V budget under this refuses it (check_fits)."""
        return self._first_chunk(req) * self._kv_per_token

    def kv_minimum(self, requests=()) -> int:
        """The least K/V budget this scheduler must have: max_num_seqs requests starting (a first
        chunk each), and each of `requests` admitted (a worker's warm-up requests: the one of its
        --warmup-shape included)."""
        starting = self.config.max_num_seqs * self.config.kv_chunk_tokens * self._kv_per_token
        return max([starting] + [self.admission_kv_bytes(r) for r in requests])

    def check_fits(self, req: Request) -> None:
        """Raise KVBudgetError when the request's prompt and first chunk exceed the whole K/V budget."""
        tokens = self._first_chunk(req)
        need = self.admission_kv_bytes(req)
        if need > self.config.kv_cache_bytes:
            n = len(req.prompt_ids)
            raise KVBudgetError(
                f"the prompt ({n} tokens) and its first {tokens - n} new tokens need {need} bytes of attention "
                f"K/V, over this worker's kv_cache_bytes "
                f"({self.config.kv_cache_bytes}); shorten the prompt")

    def has_room(self) -> bool:
        """Whether add_request would queue a request now (it may still refuse one later)."""
        with self._cv:
            return self._room()

    def _room(self) -> bool:
        # Requests that arrived during a step wait for the next one even when seats are free:
        # only those beyond the free seats count against max_waiting.
        free = max(0, self.config.max_num_seqs - len(self._admitted) - len(self._running))
        return len(self._waiting) < self.config.max_waiting + free

    def queue_full_message(self) -> str:
        with self._cv:
            busy = len(self._admitted) + len(self._running)
            return (f"{busy} requests running and {len(self._waiting)} waiting (limits {self.config.max_num_seqs} "
                    f"and {self.config.max_waiting}); retry later")

    def retry_after_s(self) -> float:
        """A client's back-off when the queue is full (HTTP's Retry-After is whole seconds)."""
        return 1.0

    def generate(self, request) -> GenerateResult:
        req = request if isinstance(request, Request) else self.engine.parse_request(request)
        return self.add_request(req).result()

    def warm_decode_graphs(self) -> int:
        """Capture the decode CUDA graph of every padded batch size up to max_num_seqs, for each
        set of hidden layers a step may capture (Engine.decode_capture_sets), before requests
        come: otherwise the first step of each size compiles its kernels and captures while its
        requests wait. Runs while the scheduler is idle (its lock held: requests queue meanwhile).
        Returns the graphs captured (0 where decode graphs do not apply)."""
        with self._cv:
            if self._waiting or self._admitted or self._running or self._launched is not None:
                raise RuntimeError("warm_decode_graphs needs an idle scheduler")
            return self.engine.runner.warm_decode(self.pool, self.engine.decode_capture_sets())

    @property
    def kv_per_token(self) -> int:
        return self._kv_per_token

    def resize_kv(self, kv_cache_bytes: int) -> None:
        """Give the running requests' K/V `kv_cache_bytes` (a planned worker, after its warm-up:
        devices.plan_memory): the state pool is made anew at that size, the old one (and its decode
        and assembly graphs) freed first. Runs while the scheduler is idle; capture the decode
        graphs again after (warm_decode_graphs), and the assembly graphs (Engine.warmup with
        shaped_only)."""
        with self._cv:
            if self._waiting or self._admitted or self._running or self._launched is not None:
                raise RuntimeError("resize_kv needs an idle scheduler")
            self.config = dataclasses.replace(self.config, kv_cache_bytes=kv_cache_bytes)
            self.pool = None
            # the assembly graphs hold the old pool's tensors (warm up again to capture them anew)
            graphs = getattr(self.engine.runner, "assembly_graphs", None)
            if graphs is not None:
                graphs.clear()
            gc.collect()  # the old pool and its decode graphs refer to each other
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            tokens = kv_cache_bytes // max(self._kv_per_token, 1)
            self.pool = self.engine.new_state_pool(self.config.max_num_seqs, tokens)

    def load(self) -> dict:
        with self._cv:
            return {"waiting": len(self._waiting), "prefilling": len(self._admitted), "running": len(self._running)}

    def kv_usage(self) -> float:
        """Share of the K/V budget the running requests have reserved (a lone request may pass 1)."""
        return self._kv_reserved / self.config.kv_cache_bytes

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)


    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stop and not (self._waiting or self._admitted or self._running):
                    self._cv.wait()
                if self._stop:
                    break
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a fault outside any one request's work: those in flight get it
                log.exception("scheduler step failed")
                self._launched = None
                for seq in self._admitted + self._running:
                    self._release(seq)
                    seq.handle._finish("error", e)
                self._admitted, self._running = [], []
        for seq in list(self._waiting) + self._admitted + self._running:
            self._release(seq)
            seq.handle._finish("abort", RuntimeError("the scheduler stopped"))

    @torch.no_grad()
    def step(self) -> None:
        t0 = time.perf_counter()
        self._reap_cancelled()
        self._admit()
        self._step_tokens = 0
        self._prefill_step()
        self._grow()
        batch = 0
        if self._running:
            batch = len(self._running)
            self._decode_step()
        elif self._launched is not None:
            self._handle(self._launched)
        if self._step_tokens or batch:
            self.step_log.append((self.steps, self._step_tokens, batch))
            if self.on_step is not None:
                kind = "mixed" if self._step_tokens and batch else "prefill" if self._step_tokens else "decode"
                self.on_step(kind, time.perf_counter() - t0)
        self.steps += 1

    def _plan(self, seq: _Seq) -> None:
        """The segments the request folds in from entries (planned once, and again when a
        preemption changed the request)."""
        seq.reused = self.engine.planner.reused_segments(seq.req)

    def _reap_cancelled(self) -> None:
        with self._cv:
            gone = [s for s in self._waiting if s.handle.cancelled]
            for s in gone:
                self._waiting.remove(s)
        gone += [s for s in self._admitted + self._running if s.handle.cancelled]
        if not gone:
            return
        self._admitted = [s for s in self._admitted if not s.handle.cancelled]
        self._running = [s for s in self._running if not s.handle.cancelled]
        for seq in gone:
            self._release(seq)
            seq.handle._finish("abort")

    def _admit(self) -> None:
        cfg = self.config
        with self._cv:
            while self._waiting and len(self._admitted) + len(self._running) < cfg.max_num_seqs:
                seq = self._waiting[0]
                busy = self._admitted or self._running
                generated = len(seq.stream.output_ids) if seq.stream is not None else 0
                tokens = self._first_chunk(seq.req, generated)
                if busy and self._kv_reserved + tokens * self._kv_per_token > cfg.kv_cache_bytes:
                    break
                self._waiting.popleft()
                seq.kv_tokens, seq.reserved = tokens, tokens * self._kv_per_token
                self._kv_reserved += seq.reserved
                seq.admitted, self._admissions = self._admissions, self._admissions + 1
                if seq.handle.admitted_at is None:
                    seq.handle.admitted_at = time.perf_counter()
                self._admitted.append(seq)
                try:
                    seq.cold = self._cold_segments(seq)
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self._fail(seq, e, "admission")

    def _cold_segments(self, seq: _Seq) -> dict:
        eng = self.engine
        if not eng.config.uses_entries:
            return {}
        out = {}
        for seg in seq.reused:
            if seg.key not in seq.pinned and not eng.entries.contains(seg.key):
                out[seg.key] = seg.token_ids
        return out

    def _prefill_step(self) -> None:
        for seq in self._admitted:
            seq.prefill_steps += 1
        budget = self.config.max_num_batched_tokens
        left = self._plain_prefills(budget)
        plain_ran, budget = left < budget, left
        # cold segments of the admitted requests, oldest first, as one batched build
        todo: dict[str, list[int]] = {}
        for seq in self._admitted:
            for key, ids in seq.cold.items():
                if key in todo:
                    continue
                if todo and budget < len(ids):
                    break
                todo[key] = ids
                budget -= len(ids)
            if budget <= 0:
                break
        if todo:
            self._step_tokens += sum(map(len, todo.values()))
            t0 = time.perf_counter()
            entries, failed = self._build(todo)
            took = time.perf_counter() - t0
            for seq in self._admitted:
                if todo.keys() & seq.cold.keys():
                    seq.build_s += took
            for seq in [s for s in self._admitted if failed.keys() & s.cold.keys()]:
                self._fail(seq, next(failed[k] for k in seq.cold if k in failed), "cold build")
            # An entry is built for the first request that needed it; to the others it is a hit.
            claimed = set()
            for seq in self._admitted:
                for key in [k for k in seq.cold if k in entries]:
                    if key in claimed:
                        seq.pinned[key] = entries[key]
                    else:
                        seq.built[key] = entries[key]
                        claimed.add(key)
                    del seq.cold[key]
        # assemblies of the requests whose entries are all there, a chunk of each while the budget
        # lasts (the oldest first; one a step when no plain prefill or cold build ran, even past a
        # spent budget)
        still, progressed = [], plain_ran or bool(todo)
        for seq in self._admitted:
            if seq.cold or (budget <= 0 and progressed):
                still.append(seq)
                continue
            spent, cost = self._prefill_chunk(seq, budget if budget > 0 else self.config.max_num_batched_tokens)
            budget -= cost
            self._step_tokens += spent
            progressed = True
            if seq.job is not None:
                still.append(seq)
        self._admitted = still

    def _build(self, todo: dict[str, list[int]]) -> tuple[dict, dict]:
        """(key -> entry, key -> error) of the cold segments `todo`, built as one batch; when the batch
        fails, each alone, so that only the requests of a segment that fails by itself fail."""
        try:
            return named_entries(todo, self.engine.build_entries(list(todo.values()))), {}
        except Exception as e:  # noqa: BLE001 - retried one segment at a time below
            if len(todo) == 1:
                return {}, {next(iter(todo)): e}
            log.warning("batched build of %d cold segments failed; building them one by one", len(todo),
                        exc_info=True)
        entries, failed = {}, {}
        for key, ids in todo.items():
            try:
                entries.update(named_entries([key], self.engine.build_entries([ids])))
            except Exception as e:  # noqa: BLE001 - the requests of this segment fail
                failed[key] = e
        return entries, failed

    def _plain_prefills(self, budget: int) -> int:
        """The admitted requests whose prompts run all live from an empty state (Engine.plain_prefill_ok),
        prefilled together while the budget lasts (at least one): they start decoding with their
        last prompt token as their input. Returns the budget left."""
        eng = self.engine
        page = eng.pages.page_size if eng.config.uses_prefix_cache else 0
        plain, tokens, first_pages = [], 0, set()
        for seq in self._admitted:
            if (seq.stream is not None or not eng.plain_prefill_ok(seq.req)  # a resumed one runs its prefill
                    or seq.req.sampling.prompt_logprobs_from is not None or seq.job is not None
                    or seq.req.prompt_len > self.config.max_num_batched_tokens):  # a long one runs in chunks
                continue
            prompt = seq.req.prompt_ids
            head = tuple(prompt[:page]) if page and len(prompt) > page else None
            if head is not None and head in first_pages:
                continue  # shares a page with a prompt prefilled now: assembled after it, from its pages
            if plain and tokens + seq.req.prompt_len > budget:
                break
            plain.append(seq)
            tokens += seq.req.prompt_len
            if head is not None:
                first_pages.add(head)
        if not plain:
            return budget
        self._step_tokens += tokens
        self._admitted = [s for s in self._admitted if s not in plain]
        try:
            pres = eng.prefill_plain([s.req for s in plain])
        except Exception as e:  # noqa: BLE001 - each prompt again alone: only one that fails by itself fails
            pres = [e] if len(plain) == 1 else self._prefill_alone(plain)
        for seq, pre in zip(plain, pres):
            if isinstance(pre, BaseException):
                self._fail(seq, pre, "prefill")
                continue
            self.plain_prefilled += 1
            try:
                params = seq.req.sampling
                seq.prefill = seq.handle.prefill = pre
                pre.started = seq.arrived
                seq.stream = TextStream(eng, params, pre.stats)
                seq.handle.output_ids, seq.handle.logprobs = seq.stream.output_ids, seq.stream.logprobs
                seq.generator = request_generator(params)
                seq.last_token = seq.req.prompt_ids[-1]
                seq.first_pending = True
                self._run(seq)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(seq, e, "prefill")
        return budget - tokens

    def _prefill_chunk(self, seq: _Seq, budget: int) -> tuple[int, int]:
        """Run the next chunk of the request's prefill (started here on its first chunk:
        Engine.start_prefill; where the model's attention runs in pages, the request gets its slot
        now and its prefill runs in the slot's pages): as many live tokens as `budget` tokens at
        zero context buy at the chunk's context (chunk_tokens: a chunk deep into a long prompt
        attends to more keys, so it is shorter); the request starts decoding after its last chunk.
        With chunk_layer_parts P > 1 a chunk without cached spans is P times that many tokens (at
        most entry_batch_tokens, or the budget's chunk where that is more) run over P steps, a run
        of layers each (Engine.prefill_chunk's layer_parts): a step of it goes on with the chunk
        whatever the budget left, and while requests decode the chunk's end is a step of its own.
        Returns (the live tokens run, the budget they cost), a share of the chunk's for each of its
        steps; a request whose prefill fails fails alone."""
        eng, parts = self.engine, self.config.chunk_layer_parts
        try:
            if seq.job is None:
                if seq.assembly_started is None:
                    seq.assembly_started = time.perf_counter()
                seq.job = eng.start_prefill(seq.req, pinned=seq.pinned, built=seq.built)
                seq.pinned, seq.built = {}, {}
                if self._paged_prefill:
                    seq.slot = eng.runner.assign(self.pool, seq.job.state)
            job = seq.job
            if job.part_way:
                pre = eng.prefill_chunk(job, defer_chains=True, end_apart=bool(self._running))
                spent, cost = seq.part_share
            else:
                context = job.layout[job.next].start + job.offset
                before = job.live_left
                n = chunk_tokens(budget, context, self._attention_slope)
                # P times that, but no more tokens through a layer at once than a batched cold
                # build runs (entry_batch_tokens): the activations the warm-up has seen
                n = min(n * parts, max(n, eng.config.entry_batch_tokens))
                pre = eng.prefill_chunk(job, n, defer_chains=True, layer_parts=parts)
                spent = before - job.live_left
                cost = chunk_cost(spent, context, self._attention_slope)
                if job.part_way:  # the chunk's first run of layers: each of its steps counts a share
                    seq.part_share = spent, cost = -(-spent // parts), -(-cost // parts)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            self._fail(seq, e, "assembly")
            return 0, 0
        if pre is not None:
            seq.job = None
            self._assemble(seq, pre)
        return spent, cost

    def _prefill_alone(self, plain: list) -> list:
        """Each request's Prefill by its own plain prefill, or the error it failed with."""
        log.warning("batched prefill of %d prompts failed; prefilling them one by one", len(plain), exc_info=True)
        out = []
        for seq in plain:
            try:
                out.append(self.engine.prefill_plain([seq.req])[0])
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                out.append(e)
        return out

    def _assemble(self, seq: _Seq, pre: Prefill) -> None:
        try:
            self._assemble_one(seq, pre)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            self._fail(seq, e, "assembly")

    def _assemble_one(self, seq: _Seq, pre: Prefill) -> None:
        """A request whose prefill ran: its first token, then it decodes (or ends)."""
        eng, params = self.engine, seq.req.sampling
        seq.prefill = seq.handle.prefill = pre
        pre.started = seq.arrived  # TTFT counts the time in the queue
        if seq.stream is not None:
            # resumed after a preemption: the request's stats, stream and generator go on
            pre.stats = seq.stream.stats
            tok = self._pick(seq, pre.logits)
            if not self._push(seq, tok, pre.logits):
                eng.keep_chains(pre)  # after the first token went out
                self._run(seq)
            return
        seq.stream = TextStream(eng, params, pre.stats)
        seq.handle.output_ids, seq.handle.logprobs = seq.stream.output_ids, seq.stream.logprobs
        seq.generator = request_generator(params)
        if params.prompt_logprobs_from is not None:
            try:
                seq.handle.prompt_logprobs = eng.prompt_logprobs(seq.req.prompt_ids, params.prompt_logprobs_from,
                                                                 params.logprobs or 0)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._release(seq)
                seq.handle._finish("error", e)
                return
        if params.max_new_tokens == 0:
            self._first_token_stats(seq, pre.stats)
            self._end(seq, "length")
            return
        tok = self._pick(seq, pre.logits)
        self._first_token_stats(seq, pre.stats)
        if self._push(seq, tok, pre.logits):
            return  # ended: its release kept its part chains (Engine.finish_prefix)
        eng.keep_chains(pre)  # after the first token went out
        self._run(seq)

    @staticmethod
    def _first_token_stats(seq: _Seq, stats) -> None:
        """The request's first token is out now: its TTFT and where the wait went."""
        now = time.perf_counter()
        stats.ttft_ms = (now - seq.arrived) * 1000
        stats.prefill_steps = seq.prefill_steps
        stats.build_ms = seq.build_s * 1000
        if seq.assembly_started is not None:
            stats.assembly_ms = (now - seq.assembly_started) * 1000

    def _run(self, seq: _Seq) -> None:
        runner = self.engine.runner
        if seq.slot >= 0:  # prefilled in its slot's pages
            runner.adopt(self.pool, seq.slot, seq.prefill.state)
        else:
            seq.slot = runner.assign(self.pool, seq.prefill.state)
        seq.runs += 1
        seq.fed = False
        self._running.append(seq)
        self._running.sort(key=lambda s: s.slot)

    def _grow(self) -> None:
        """Before a decode step: every running request whose K/V reaches its reservation grows it by a
        chunk, the oldest first; where the budget lacks room, the latest admitted requests are
        preempted until it has (the request itself when it is the latest)."""
        per_token, budget = self._kv_per_token, self.config.kv_cache_bytes
        for seq in sorted(self._running, key=lambda s: s.admitted):
            if seq not in self._running or seq.prefill.state.length + 1 <= seq.kv_tokens:
                continue
            add = max(1, min(self.config.kv_chunk_tokens, seq.req.sampling.max_new_tokens - len(seq.stream.output_ids)))
            while seq in self._running and self._kv_reserved + add * per_token > budget:
                if len(self._admitted) + len(self._running) == 1:
                    break  # alone: it grows past the budget rather than preempt itself forever
                self._preempt(max(self._admitted + self._running, key=lambda s: s.admitted))
            if seq in self._running:
                seq.kv_tokens += add
                seq.reserved += add * per_token
                self._kv_reserved += add * per_token

    def _preempt(self, seq: _Seq) -> None:
        """Give back what a request holds and queue it again at the head of the waiting queue, its
        generated tokens appended to its live suffix (recomputed when it is admitted again)."""
        self._release(seq)
        seq.prefill = seq.handle.prefill = None  # its K/V goes (on every rank: nothing names it)
        self._running = [s for s in self._running if s is not seq]
        self._admitted = [s for s in self._admitted if s is not seq]
        if seq.stream is not None:
            req, generated = seq.req, seq.stream.output_ids[len(seq.req.prompt_ids) - len(seq.handle.req.prompt_ids):]
            live = req.live
            if not req.suffix_ids and req.segment_ids:
                # the last segment ran live (a last part is never an entry): so it does again
                live = live | {len(req.segment_ids) - 1}
            seq.req = dataclasses.replace(req, suffix_ids=list(req.suffix_ids) + generated, live=frozenset(live))
            self._plan(seq)
        seq.cold = {}
        with self._cv:
            self._waiting.appendleft(seq)
        self.preemptions += 1
        if self.on_preempt is not None:
            self.on_preempt(seq.handle)

    def _push(self, seq: _Seq, tok: int, logits, row: int | None = None) -> bool:
        """Emit what token `tok` (sampled from `logits`, or from its row `row` when given) gives;
        True when the request ended with it."""
        if seq.first_pending:  # its first token, from the decode step its last prompt token ran in
            seq.first_pending = False
            self._first_token_stats(seq, seq.prefill.stats)
        top = seq.req.sampling.logprobs
        lp = None
        if top is not None:  # the row is indexed only when asked for (a view costs a few us a request)
            lp = token_logprobs(logits if row is None else logits[row], tok, top)
        events, done = seq.stream.push(tok, lp)
        seq.handle._emit(events)
        if done:
            if seq.stream.finish_reason == "length":
                seq.handle._emit(seq.stream.flush())
            self._end(seq, seq.stream.finish_reason)
            return True
        seq.last_token = tok
        return False

    def _overlaps(self, seq: _Seq) -> bool:
        """Can the request's next token stay on the device (no logprobs, which are read from the
        logits on the host, and no logits adjusted by its output so far)?"""
        params = seq.req.sampling
        return params.logprobs is None and not params.adjusts_logits

    def _adjusted(self, seq: _Seq, logits):
        """The request's logits [vocab] after its LogitsAdjuster (min_new_tokens, penalties)."""
        params = seq.req.sampling
        if seq.adjuster is None:
            seq.adjuster = LogitsAdjuster(params, seq.handle.req.prompt_ids, self.engine.eos_ids)
        return seq.adjuster(logits, seq.stream.output_ids)

    def _pick(self, seq: _Seq, logits) -> int:
        """The request's next token from its logits [vocab], after its LogitsAdjuster where it has one."""
        params = seq.req.sampling
        if params.adjusts_logits:
            logits = self._adjusted(seq, logits)
        return sample_token(logits, params, seq.generator)

    def _decode_step(self) -> None:
        prev = self._launched
        if self.config.overlap and all(self._overlaps(s) for s in self._running):
            self._launch(prev)
            if prev is not None:
                self._handle(prev)
            return
        if prev is not None:
            self._handle(prev)
            if not self._running:
                return
        self._sync_step()

    def _launch(self, prev: _Launched | None) -> None:
        """Launch a decode step of the running requests whose last token is known or on its way:
        a request of `prev` (not handled yet) takes its pick there as its input, on the device; a
        request whose pick in `prev` is its last by length sits this step out."""
        col = {}
        if prev is not None:
            col = {id(s): j for j, (s, r) in enumerate(zip(prev.batch, prev.runs)) if s.runs == r}
        batch, toks, fed_cols, fed_src = [], [], [], []
        for seq in self._running:
            j = col.get(id(seq))
            if j is not None and len(seq.stream.output_ids) + 1 >= seq.req.sampling.max_new_tokens:
                continue  # ends with its pick in prev
            seq.fed = j is not None
            if seq.fed:
                fed_cols.append(len(batch))
                fed_src.append(j)
                toks.append(None)
            else:
                toks.append(seq.last_token)
            batch.append(seq)
        if not batch:
            return
        feed = None
        if fed_cols:
            k = len(fed_cols)
            if fed_cols == fed_src == list(range(k)):
                # the same requests in the same columns as the step before (a steady batch): no index
                # to bring to the device
                feed = (self._columns(k, prev.picks.device), prev.picks[:k])
            else:
                idx = to_device_async(torch.tensor([fed_cols, fed_src], dtype=torch.long), prev.picks.device)
                feed = (idx[0], prev.picks.index_select(0, idx[1]))
        logits = self._decode(batch, toks, feed)
        if logits is None:
            return
        picks = sample(logits, [s.req.sampling for s in batch], [s.generator for s in batch])
        device = picks.device
        host = torch.empty(picks.shape, dtype=picks.dtype, pin_memory=device.type == "cuda")
        host.copy_(picks, non_blocking=True)
        event = None
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._launched = _Launched(batch, [s.runs for s in batch], picks, host, event)
        self.batch_sizes[len(batch)] += 1
        self.overlapped_steps += prev is not None

    def _columns(self, k: int, device) -> torch.Tensor:
        """0..k-1 on `device` (kept: a steady batch feeds the same columns every step)."""
        cols = getattr(self, "_cols", None)
        if cols is None or cols.numel() < k or cols.device != device:
            cols = self._cols = torch.arange(max(k, self.config.max_num_seqs), device=device)
        return cols[:k]

    def _handle(self, launched: _Launched) -> None:
        """Emit the picks of a launched step (waiting for them): a request that left the running
        list since (ended, cancelled, preempted) drops its pick; one whose input of the step
        launched after it was this pick gets its id recorded (Engine.decode_batch)."""
        if self._launched is launched:
            self._launched = None
        if launched.event is not None:
            launched.event.synchronize()
        for seq, runs, tok in zip(launched.batch, launched.runs, launched.host.tolist()):
            if seq.runs != runs or seq.slot < 0 or seq.handle.done.is_set():
                continue
            try:
                if seq.fed and self._launched is not None:
                    seq.fed = False
                    rec = seq.prefill.recorder
                    if rec is not None:
                        rec.token_ids.append(tok)
                self._push(seq, tok, None)  # a request it ends leaves the running list (_end)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(seq, e, "output")

    def _sync_step(self) -> None:
        batch = self._running
        toks = [s.last_token for s in batch]
        logits = self._decode(batch, toks)
        if logits is None:
            return
        self.batch_sizes[len(batch)] += 1
        rows = logits
        adjusted = [b for b, seq in enumerate(batch) if seq.req.sampling.adjusts_logits]
        if adjusted:
            rows = logits.clone()
            for b in adjusted:
                try:
                    rows[b] = self._adjusted(batch[b], logits[b])
                except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                    self._fail(batch[b], e, "logits")
        picks = sample(rows, [s.req.sampling for s in batch], [s.generator for s in batch]).tolist()
        done = []
        for b, seq in enumerate(batch):
            if seq.handle.done.is_set():
                continue  # failed as its logits were adjusted
            try:
                if self._push(seq, picks[b], logits, b):
                    done.append(seq)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                self._fail(seq, e, "output")
        if done:
            self._running = [s for s in self._running if s not in done]

    def _decode(self, batch: list, toks: list, feed=None):
        """The batched decode forward of `batch` (the step's one shared piece of work): its logits,
        or None when it failed, every request of the batch then finished with the error."""
        try:
            return self.engine.decode_batch([s.prefill for s in batch], toks, self.pool, [s.slot for s in batch], feed)
        except Exception as e:  # noqa: BLE001 - a fault of the shared forward: its batch fails, the queue goes on
            log.exception("decode step of %d requests failed", len(batch))
            for seq in batch:
                self._fail(seq, e, None)
            return None

    def _fail(self, seq: _Seq, error: BaseException, stage: str | None) -> None:
        """Finish one request with its own error (RequestError: what its parameters caused, answered
        4xx; anything else 500), out of the lists, what it holds given back; the others go on."""
        if stage is not None:
            if isinstance(error, RequestError):
                log.warning("request failed in its %s: %s", stage, error)
            else:
                log.error("request failed in its %s", stage, exc_info=error)
        self._running = [s for s in self._running if s is not seq]
        self._admitted = [s for s in self._admitted if s is not seq]
        try:
            self._release(seq)
        except Exception:  # noqa: BLE001 - what it held may be lost, the answer is the error below
            log.exception("releasing a failed request failed")
        if not seq.handle.done.is_set():
            seq.handle._finish("error", error)

    def _end(self, seq: _Seq, reason: str) -> None:
        self._release(seq)
        # out of the running list before its handle says done, so that load() never counts a
        # finished request (a new list: the decode step iterates the old one)
        self._running = [s for s in self._running if s is not seq]
        seq.handle._finish(reason)

    def _release(self, seq: _Seq) -> None:
        """Give back what a request holds: its slot and K/V pages (copied out first when its prefix
        pages still go into the page tree), its prefix pages (finish_prefix), its K/V reservation."""
        self._kv_reserved -= seq.reserved
        seq.reserved = 0
        if seq.job is not None:
            self.engine.abandon_prefill(seq.job)
            seq.job = None
        # its last pages go into the page tree before its slot goes: they are read page by page
        # out of the slot's pages (no copy of the whole sequence's K/V)
        if seq.prefill is not None:
            try:
                self.engine.finish_prefix(seq.prefill)
            except Exception:  # noqa: BLE001 - a page insert that fails costs the cache, not the answer
                log.exception("finish_prefix failed")
        if seq.slot >= 0:
            self.engine.runner.release(self.pool, seq.slot)
            seq.slot = -1
        seq.pinned, seq.built = {}, {}
