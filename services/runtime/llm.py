"""The runtime as one object: an Engine and the Scheduler that runs its requests (nano-vllm's LLM).

Every way of running a request in-process (`hybridcache generate`, `demo`, `eval`, a worker's
warm-up, benchmarks and tests) goes through an LLM, so through the scheduler and the paged decode
step the combine worker serves with: there is no second decode path.

    llm = LLM.from_dir("models/default")
    result = llm.generate({"segments": [...], "suffix": [...]})      # one GenerateResult
    results = llm.generate([request, request, ...])                   # batched, in order

The scheduler runs in its own thread (scheduler.py); `close()` (or leaving a `with` block, or the
LLM being collected) stops it and lets its pool go.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from hybridcache.services.runtime.engine import Engine, EngineConfig, GenerateResult
from hybridcache.services.runtime.plan import Request
from hybridcache.services.runtime.sampling import warm_kernels
from hybridcache.services.runtime.scheduler import (
    QueueFull,
    Scheduler,
    SchedulerConfig,
    kv_bytes_per_token,
    scheduler_config,
)


class LLM:
    """`engine` and a Scheduler over it (`scheduling`: its SchedulerConfig, by default the one the
    engine's RuntimeConfig gives for its device, as a combine worker's)."""

    def __init__(self, engine: Engine, scheduling: SchedulerConfig | None = None):
        self.engine = engine
        if scheduling is None:
            scheduling = scheduler_config(engine.config, getattr(engine.model, "device", "cpu"))
        self.scheduler = Scheduler(engine, scheduling)
        # the scheduler's thread holds the scheduler, never this object: stop it when this goes
        self._finalizer = weakref.finalize(self, self.scheduler.stop)

    @classmethod
    def from_dir(cls, path: str | Path, device: str = "cpu", dtype=torch.float32, config: EngineConfig | None = None,
                 scheduling: SchedulerConfig | None = None) -> LLM:
        return cls(Engine.from_dir(path, device, dtype, config), scheduling)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def parse_request(self, obj) -> Request:
        """A request object ({"system", "segments", "suffix", "sampling_params"}) validated (Engine.parse_request)."""
        return obj if isinstance(obj, Request) else self.engine.parse_request(obj)

    def generate(self, requests):
        """Run requests to their end. One request (a dict or a parsed Request) gives its
        GenerateResult; a list gives theirs, in order, the requests running together (continuous
        batching: as many at once as the scheduler admits)."""
        if isinstance(requests, (dict, Request)):
            return next(self.results([requests]))
        return list(self.results(requests))

    def results(self, requests: Iterable) -> Iterator[GenerateResult]:
        """The requests' results in their order, each as soon as it and those before it are done.
        Every request is validated before any runs; requests are queued as the scheduler has room."""
        parsed = [self.parse_request(r) for r in requests]
        pending: collections.deque = collections.deque()
        for req in parsed:
            while True:
                try:
                    pending.append(self.scheduler.add_request(req))
                    break
                except QueueFull:
                    if not pending:
                        raise
                    yield pending.popleft().result()  # room comes as the oldest ends
        while pending:
            yield pending.popleft().result()

    def warmup(self) -> dict:
        """The engine's warm-up (Engine.warmup) with every request served by this scheduler, then the
        sampling kernels of every batch size it may step (sampling.warm_kernels)."""
        out = self.engine.warmup(run=self.scheduler.generate)
        out["sampling_shapes"] = warm_kernels(self.engine.model.device, self.engine.cfg.vocab_size,
                                              self.scheduler.config.max_num_seqs)
        return out

    def close(self) -> None:
        """Stop the scheduler (requests still in it end with "abort")."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def warmup_scheduling(engine: Engine) -> SchedulerConfig:
    """The SchedulerConfig of a scheduler made for a warm-up alone (a scatter worker's, whose engine
    serves no requests): one request at a time, with K/V room for the longest warm-up request."""
    requests, _ = engine.warmup_requests()
    longest = max(r.prompt_len + r.sampling.max_new_tokens for r in requests)
    return SchedulerConfig(max_num_seqs=1, max_waiting=1, max_num_batched_tokens=engine.config.max_num_batched_tokens,
                           kv_cache_bytes=max(1, longest * kv_bytes_per_token(engine.model)))
