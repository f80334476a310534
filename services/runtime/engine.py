"""The engine: turns a request into a layout of live runs and cached spans, runs it, decodes.

Modes, one code path (DESIGN §3):
    full    no cache: every prompt token is live.
    prefix  exact prefix cache at part boundaries, the rest live (what every engine has).
    pic     prefix cache + position-independent segment entries: each segment's body is folded
            in from its entry (T, S(body|0), conv tail, K/V); its first w tokens (the seam) are live.
    naive   pic without T (S_end = S_start + S(body|0)): an ablation, wrong whenever there is decay.
Cold segments are first prefilled on their own into entries, then the request runs all-warm, so
a pic answer never depends on what was cached before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from hybridcache.services.runtime.cache import (
    EntryStore,
    MemoryEntryStore,
    PrefixSnapshot,
    PrefixStore,
    SegmentEntry,
    chain_key,
    segment_key,
)
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.sampling import RequestError, SamplingParams, sample_token
from hybridcache.services.runtime.sequence import CachedSpan, LiveRun, SequenceState
from hybridcache.services.runtime.tokenizer import SPECIAL_TOKENS, Tokenizer

MODES = ("full", "prefix", "pic", "naive")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "pic"
    seam_window: int = 8  # live tokens at the start of every reused segment (part of the entry key)
    entry_cache_bytes: int = 1 << 30
    prefix_cache_bytes: int = 1 << 30
    max_segments: int = 512
    verify_checksums: bool = False  # re-hash entries on every read (stores fed over the network do)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.seam_window < 0:
            raise ValueError("seam_window must be >= 0")
        if self.entry_cache_bytes <= 0 or self.prefix_cache_bytes <= 0:
            raise ValueError("cache budgets must be positive")

    @property
    def uses_prefix_cache(self) -> bool:
        return self.mode != "full"

    @property
    def uses_entries(self) -> bool:
        return self.mode in ("pic", "naive")


@dataclass(slots=True)
class Request:
    system_ids: list[int]
    segment_ids: list[list[int]]
    suffix_ids: list[int]
    sampling: SamplingParams

    @property
    def prompt_ids(self) -> list[int]:
        out = list(self.system_ids)
        for s in self.segment_ids:
            out += s
        return out + list(self.suffix_ids)

    def parts(self) -> list[tuple[str, list[int]]]:
        parts = [("system", self.system_ids)] if self.system_ids else []
        parts += [("segment", s) for s in self.segment_ids]
        if self.suffix_ids:
            parts.append(("suffix", self.suffix_ids))
        return parts


@dataclass(slots=True)
class SegmentStat:
    tokens: int
    hit: bool
    source: str  # prefix | entry | built | live


@dataclass
class RequestStats:
    mode: str
    seam_window: int
    prompt_tokens: int = 0
    reused_tokens: int = 0
    live_tokens: int = 0
    built_tokens: int = 0  # tokens of cold segments prefilled into entries for this request
    prefix_reused_tokens: int = 0
    segments: list[SegmentStat] = field(default_factory=list)
    ttft_ms: float = 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["segments"] = [{"tokens": s.tokens, "hit": s.hit, "source": s.source} for s in self.segments]
        return d


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: RequestStats

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "output_ids": self.output_ids,
            "prompt_ids": self.prompt_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


@dataclass
class Prefill:
    state: SequenceState
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the prompt
    stats: RequestStats
    started: float


class Engine:
    def __init__(
        self,
        model: HybridLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        entry_store: EntryStore | None = None,
        prefix_store: PrefixStore | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or EngineConfig()
        self.cfg = model.cfg
        self.fingerprint = getattr(model, "fingerprint", "unfingerprinted")
        self.entries = entry_store or MemoryEntryStore(self.config.entry_cache_bytes, self.config.verify_checksums)
        self.prefixes = prefix_store or PrefixStore(self.config.prefix_cache_bytes)
        eos = set(self.cfg.eos_token_ids)
        for t in SPECIAL_TOKENS:
            tid = tokenizer.token_id(t)
            if tid is not None and t != "<|im_start|>":
                eos.add(tid)
        self.eos_ids = frozenset(eos)

    @classmethod
    def from_dir(cls, path: str | Path, device: str = "cpu", dtype=torch.float32, config: EngineConfig | None = None):
        return cls(load_model(path, device, dtype), Tokenizer.from_dir(path), config)

    # ------------------------------------------------------------------ requests

    def parse_request(self, obj) -> Request:
        """Validate a request object ({"system", "segments", "suffix", "sampling_params"})."""
        if not isinstance(obj, dict):
            raise RequestError("a request must be a JSON object")
        unknown = sorted(set(obj) - {"system", "segments", "suffix", "sampling_params", "id", "mode"})
        if unknown:
            raise RequestError(f"unknown request field(s): {', '.join(unknown)}")
        segments = obj.get("segments", [])
        if segments is None:
            segments = []
        if not isinstance(segments, list):
            raise RequestError("segments must be a list of strings or token-id lists")
        if len(segments) > self.config.max_segments:
            raise RequestError(f"too many segments: {len(segments)} (limit {self.config.max_segments})")
        seg_ids = [self._ids(s, f"segment {i}") for i, s in enumerate(segments)]
        for i, s in enumerate(seg_ids):
            if not s:
                raise RequestError(f"segment {i} is empty")
        suffix = obj.get("suffix", "")
        suffix_ids = self._ids(suffix, "suffix") if suffix not in (None, "") else []
        system = obj.get("system")
        system_ids = self._ids(system, "system") if system not in (None, "") else []
        if not seg_ids and not suffix_ids:
            raise RequestError("the request has no segments and no suffix: nothing to run")
        sampling = SamplingParams.from_dict(obj.get("sampling_params"))
        req = Request(system_ids, seg_ids, suffix_ids, sampling)
        n = len(system_ids) + sum(map(len, seg_ids)) + len(suffix_ids)
        limit = self.cfg.max_position_embeddings
        if n + sampling.max_new_tokens > limit:
            raise RequestError(
                f"prompt of {n} tokens plus max_new_tokens {sampling.max_new_tokens} exceeds the model's "
                f"context limit of {limit} tokens"
            )
        return req

    def _ids(self, value, what: str) -> list[int]:
        if isinstance(value, str):
            return self.tokenizer.encode(value)
        if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            bad = [t for t in value if not 0 <= t < self.cfg.vocab_size]
            if bad:
                raise RequestError(
                    f"{what} has token id {bad[0]} outside the vocabulary [0, {self.cfg.vocab_size})"
                )
            return list(value)
        raise RequestError(f"{what} must be a string or a list of token ids")

    # ------------------------------------------------------------------ entries

    def entry_key(self, segment_ids: list[int]) -> str:
        return segment_key(self.fingerprint, self.config.seam_window, segment_ids)

    def cacheable(self, segment_ids: list[int]) -> bool:
        """A body needs at least conv_width - 1 tokens: its conv tail must come from the body itself."""
        return len(segment_ids) - self.config.seam_window >= max(1, self.cfg.linear_conv_kernel_dim - 1)

    @torch.no_grad()
    def build_entry(self, segment_ids: list[int]) -> SegmentEntry:
        """Prefill the segment on its own (positions from 0) and keep its body as an entry."""
        w = self.config.seam_window
        ids = torch.tensor(segment_ids, dtype=torch.long)
        t0 = time.perf_counter()
        layout = [LiveRun(ids[w:], w, record="entry")]
        if w:
            layout.insert(0, LiveRun(ids[:w], 0))
        _, rec = self.model.forward_layout(self.model.empty_state(), layout, logits_for="none")
        data = rec.entries[len(layout) - 1]
        return SegmentEntry(
            key=self.entry_key(segment_ids),
            segment_tokens=len(segment_ids),
            data=data,
            build_seconds=time.perf_counter() - t0,
        )

    def get_or_build_entry(self, segment_ids: list[int]) -> tuple[SegmentEntry, bool]:
        key = self.entry_key(segment_ids)
        entry = self.entries.get(key)
        if entry is not None:
            return entry, True
        entry = self.build_entry(segment_ids)
        self.entries.put(entry)
        return entry, False

    # ------------------------------------------------------------------ prefill

    def _prefix_root(self) -> str:
        mode = self.config.mode
        tag = "exact" if mode == "prefix" else f"{mode}-w{self.config.seam_window}"
        return chain_key(self.fingerprint, tag, [])

    @torch.no_grad()
    def prefill(self, req: Request) -> Prefill:
        started = time.perf_counter()
        cfg = self.config
        stats = RequestStats(mode=cfg.mode, seam_window=cfg.seam_window)
        parts = req.parts()
        stats.prompt_tokens = sum(len(p) for _, p in parts)
        keys, k = [], self._prefix_root()
        for kind, ids in parts:
            k = chain_key(k, kind, ids)
            keys.append(k)

        # Longest cached prefix of whole parts; the last part always runs (it yields the logits).
        state, first = None, 0
        if cfg.uses_prefix_cache:
            for j in range(len(parts) - 2, -1, -1):
                snap = self.prefixes.get(keys[j])
                if snap is not None:
                    state, first = snap.restore(), j + 1
                    break
        if state is None:
            state = self.model.empty_state()
        stats.prefix_reused_tokens = state.length
        stats.reused_tokens = state.length
        seg_stats = [SegmentStat(len(p), True, "prefix") for kind, p in parts[:first] if kind == "segment"]

        layout, boundary = [], {}
        pos = state.length
        w = cfg.seam_window
        for j in range(first, len(parts)):
            kind, ids = parts[j]
            t = torch.tensor(ids, dtype=torch.long)
            last = j == len(parts) - 1
            if kind == "segment" and cfg.uses_entries and not last and self.cacheable(ids):
                entry, hit = self.get_or_build_entry(ids)
                if not hit:
                    stats.built_tokens += len(ids)
                if w:
                    layout.append(LiveRun(t[:w], pos))
                layout.append(CachedSpan(entry.data, pos + w, use_transition=cfg.mode == "pic"))
                stats.reused_tokens += entry.data.num_tokens
                stats.live_tokens += w
                seg_stats.append(SegmentStat(len(ids), hit, "entry" if hit else "built"))
            else:
                layout.append(LiveRun(t, pos))
                stats.live_tokens += len(ids)
                if kind == "segment":
                    seg_stats.append(SegmentStat(len(ids), False, "live"))
            pos += len(ids)
            boundary[len(layout) - 1] = j
        snapshot_after = set(boundary) if cfg.uses_prefix_cache else set()
        snapshot_after.discard(len(layout) - 1)
        logits, rec = self.model.forward_layout(state, layout, "last", snapshot_after)
        if cfg.uses_prefix_cache:
            for idx, lin in rec.snapshots.items():
                end = layout[idx].end
                attn = {i: type(a)(a.k[:, :, :end], a.v[:, :, :end]) for i, a in state.attn.items()}
                nbytes = sum(s.ssm.numel() * 4 + s.conv.numel() * s.conv.element_size() for s in lin.values())
                nbytes += sum(a.k.numel() * a.k.element_size() * 2 for a in attn.values())
                self.prefixes.put(keys[boundary[idx]], PrefixSnapshot(end, lin, attn, nbytes))
        stats.segments = seg_stats
        return Prefill(state, logits, stats, started)

    # ------------------------------------------------------------------ decode

    @torch.no_grad()
    def decode_one_token(self, state: SequenceState, token_id: int) -> torch.Tensor:
        run = LiveRun(torch.tensor([token_id], dtype=torch.long), state.length)
        logits, _ = self.model.forward_layout(state, [run], "last")
        return logits

    def start(self, req: Request) -> Generation:
        """Prefill now; iterate the returned Generation for the tokens."""
        return Generation(self, req, self.prefill(req))

    def generate(self, request) -> GenerateResult:
        req = request if isinstance(request, Request) else self.parse_request(request)
        gen = self.start(req)
        ids, text = [], []
        for tok, delta in gen:
            if tok >= 0:
                ids.append(tok)
            text.append(delta)
        return GenerateResult("".join(text), ids, req.prompt_ids, gen.finish_reason, gen.prefill.stats)


class Generation:
    """Decoding after a prefill: iterate for (token_id, text_delta); token_id -1 flushes text only.

    Text that could be the start of a stop string is held back until it cannot be.
    """

    def __init__(self, engine: Engine, req: Request, prefill: Prefill):
        self.engine = engine
        self.req = req
        self.prefill = prefill
        self.finish_reason = "length"
        self.output_ids: list[int] = []

    def __iter__(self) -> Iterator[tuple[int, str]]:
        eng, params, pre = self.engine, self.req.sampling, self.prefill
        gen = None
        if params.temperature > 0:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,)))
            gen = torch.Generator().manual_seed(seed)
        out = self.output_ids
        emitted = ""
        logits = pre.logits
        hold = max((len(s) for s in params.stop), default=0)
        if params.max_new_tokens == 0:
            pre.stats.ttft_ms = (time.perf_counter() - pre.started) * 1000
        for step in range(params.max_new_tokens):
            tok = sample_token(logits, params, gen)
            if step == 0:
                pre.stats.ttft_ms = (time.perf_counter() - pre.started) * 1000
            if (tok in eng.eos_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                self.finish_reason = "stop"
                break
            out.append(tok)
            text = eng.tokenizer.decode(out)
            cut = min((text.find(s) for s in params.stop if s in text), default=-1)
            if cut >= 0:
                self.finish_reason = "stop"
                yield tok, text[len(emitted) : cut] if cut > len(emitted) else ""
                return
            safe = max(len(text) - hold + 1, len(emitted)) if hold else len(text)
            yield tok, text[len(emitted) : safe]
            emitted = text[:safe]
            if step + 1 < params.max_new_tokens:
                logits = eng.decode_one_token(pre.state, tok)
        text = eng.tokenizer.decode(out)
        if len(text) > len(emitted):
            yield -1, text[len(emitted) :]
