"""The engine: turns a request into a layout of live runs and cached spans and says what its
prefill and decode steps mean for the caches. When requests run is the Scheduler's
(scheduler.py; llm.LLM pairs the two), how they execute is the ModelRunner's (runner.py: forwards,
cold builds, decode steps, staging); the engine keeps the caches, the layouts and the statistics.

Modes, one code path (docs/concepts.md, "Engine modes"):
    full    no cache: every prompt token is live.
    prefix  exact prefix cache over 64-token pages, the rest live (what every engine has).
    pic     prefix cache + position-independent segment entries: each segment's body is folded
            in from its entry (T, S(body|0), conv tail, K/V); its first w tokens (the seam) are live.
    naive   pic without T (S_end = S_start + S(body|0)): an ablation, wrong whenever there is decay.
Cold segments are first prefilled on their own into entries, then the request runs all-warm, so
a pic answer never depends on what was cached before.

Prefix cache (every mode but full): exact prefixes live in a page tree (cache/radix.py) whose
linear state follows the configured policy (cache/policies.py: checkpoint, suffix_replay,
exact_replay). Only pages computed exactly go in: every page of a prefix run live from position
0, i.e. up to the first reused segment body; the finished request's generated tokens extend
them, so the next turn of a conversation hits. PIC-assembled (approximate) states stay out of
the tree and are kept after whole parts in the chain store (cache/prefix.py), keyed by mode and
seam window, for modes pic and naive. Pages are keyed by token ids only: a page tree belongs to
one model, so engines share one (page_tree=) only when they run the same model.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from hybridcache.services.config import RuntimeConfig, parse_warmup_shape
from hybridcache.services.devices import with_cache_budgets
from hybridcache.services.runtime.cache import (
    EntryStore,
    MemoryEntryStore,
    PageRecorder,
    PageTree,
    PrefixStore,
    SegmentEntry,
)
from hybridcache.services.runtime.cache.host_tier import TieredEntryStore, is_host
from hybridcache.services.runtime.cache.policies import linear_state_nbytes
from hybridcache.services.runtime.cache.single_state import mark_single_state
from hybridcache.services.runtime.graphs import copy_linear_states
from hybridcache.services.runtime.loader import load_model
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.plan import Planner, Request
from hybridcache.services.runtime.runner import ModelRunner, PartedForward
from hybridcache.services.runtime.sampling import GenerationDefaults, SamplingParams
from hybridcache.services.runtime.sequence import CachedSpan, LinearSpan, LiveRun, SequenceState
from hybridcache.services.runtime.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The engine's settings: one frozen config whose fields are also the command-line flags.
EngineConfig = RuntimeConfig


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
    # of reused_tokens, those from caches filled before this request (prefix hits, entry hits);
    # entries built for it are reused but not cached
    cached_tokens: int = 0
    generated_tokens: int = 0  # tokens sampled, the one that stopped generation included
    prefix_policy: str = ""
    linear_state_bytes: int = 0  # linear-state bytes the page tree holds for this prompt's cached pages
    prefix_restore_ms: float = 0.0  # time to rebuild the state of a page-tree hit
    segments: list[SegmentStat] = field(default_factory=list)
    ttft_ms: float = 0.0
    # where a scheduler's wait for the first token went (Scheduler): the steps the request spent in
    # prefill, the host time of the batched cold builds that built its segments, and the time from
    # its prefill's start (Engine.start_prefill) to its first token
    prefill_steps: int = 0
    build_ms: float = 0.0
    assembly_ms: float = 0.0

    def to_dict(self) -> dict:
        # the fields as they are (numbers and strings; asdict would deep-copy every SegmentStat first)
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["segments"] = [{"tokens": s.tokens, "hit": s.hit, "source": s.source} for s in self.segments]
        return d


@dataclass
class GenerateResult:
    text: str
    output_ids: list[int]
    prompt_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list | None = None  # per output token (log p, top alternatives) when asked for

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "output_ids": self.output_ids,
            "prompt_ids": self.prompt_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.to_dict(),
        }


@dataclass(eq=False)
class PrefillJob:
    """A prefill under way (Engine.start_prefill): the layout it runs from `state`, in chunks
    (Engine.prefill_chunk), and what it records for the prefix caches as it goes."""

    req: Request
    state: SequenceState
    layout: list  # live runs and cached spans in position order
    snapshot_after: set  # layout indices whose linear states are kept (part ends, checkpoints)
    boundary: dict  # layout index -> the part it ends
    keys: list  # the request's chain keys
    recorder: PageRecorder | None  # the exact pages' recorder (None: nothing goes into the page tree)
    exact_end: int  # the position where exactly computed tokens end (the first reused body)
    locked: list  # page-tree nodes held
    stats: RequestStats
    started: float
    live_left: int = 0  # live tokens not run yet
    next: int = 0  # the next layout piece to run
    offset: int = 0  # its tokens already run (a live run cut at a chunk's end)
    chain: list = field(default_factory=list)  # (layout index, end, linear states) of part ends
    borrowed: object = None  # the chain's states are a graph's outputs while this says so (Recording.borrowed)
    running: ChunkRun | None = None  # a chunk whose forward is part-way (prefill_chunk's layer_parts)

    @property
    def part_way(self) -> bool:
        """Whether a chunk's forward has run some of its layers and not all."""
        return self.running is not None


@dataclass
class ChunkRun:
    """A chunk of a prefill whose forward runs over several calls (Engine.prefill_chunk)."""

    forward: PartedForward  # ModelRunner.forward_parts
    index: list  # layout index of each of the chunk's pieces (None: a run cut at its end)
    start: int  # the chunk's first position (its end: the state's length once the forward ran)
    calls: int = 0  # the forward's calls that ran a run of layers and did not end it
    ran: tuple | None = None  # the forward's (logits, rec) once it ended, while its chunk's end waits


@dataclass
class Prefill:
    state: SequenceState
    logits: torch.Tensor  # [vocab] fp32, next-token logits after the prompt
    stats: RequestStats
    started: float
    # Page-tree bookkeeping: what new pages need, and the locked path ends to release at finish.
    recorder: PageRecorder | None = None
    locked: list = field(default_factory=list)
    # the prefill whose part chains are still to be kept (prefill_chunk's defer_chains: Engine.keep_chains)
    chain_job: PrefillJob | None = None



def named_entries(keys, entries: list[SegmentEntry]) -> dict[str, SegmentEntry]:
    """key -> entry, each entry renamed to its key: the key its request looks it up by (a salted
    request's, Planner.segment_key), where build_entries named it by its segment alone."""
    out = {}
    for key, entry in zip(keys, entries):
        entry.key = key
        out[key] = entry
    return out

class Engine:
    def __init__(
        self,
        model: HybridLM,
        tokenizer: Tokenizer,
        config: EngineConfig | None = None,
        entry_store: EntryStore | None = None,
        prefix_store: PrefixStore | None = None,
        page_tree: PageTree | None = None,
        runner=None,
    ):
        """`runner`: how the model executes when not this engine's own ModelRunner (rank 0's
        tensor_parallel.ranks.RankedRunner of a model split over ranks, whose calls run on every
        rank; `model` is then rank 0's shard, read for its structure only)."""
        self.model = model
        self.tokenizer = tokenizer
        # unset cache budgets: 1 GiB on the CPU, a share of the free memory on CUDA
        self.config = with_cache_budgets(config or EngineConfig(), getattr(model, "device", "cpu"))
        self.cfg = model.cfg
        self.fingerprint = getattr(model, "fingerprint", "unfingerprinted")
        # "rank/size" of a tensor-parallel shard (its entries hold that rank's heads), else None
        size = getattr(model, "tp_size", 1)
        if size != self.config.tensor_parallel_size:
            raise ValueError(
                f"the model is split over {size} ranks, the config says {self.config.tensor_parallel_size}"
            )
        self.tp_layout = f"{model.tp_rank}/{size}" if size > 1 else None
        # execution: the op implementations and CUDA graphs this engine's config chooses, the
        # forwards, cold builds, decode steps, staging and every change of a tensor the caches hold
        self.runner = runner if runner is not None else ModelRunner(model, self.config)
        # the tensor-parallel group of a split model (its workers hand entries' slices to the ranks)
        self.group = getattr(runner, "group", None)
        self.entries = entry_store or self._new_entry_store()
        self.prefixes = prefix_store or PrefixStore(self.config.prefix_cache_bytes)
        self.page_policy = self.config.page_policy
        self.pages = page_tree or PageTree(self.config.prefix_cache_bytes, self.page_policy.page_size)
        # what the request means (tokens, validation, keys): the same plan the router makes
        # the model directory's generation_config.json: stop ids and sampling defaults
        path = getattr(model, "path", None)
        generation = GenerationDefaults.from_dir(path) if path else GenerationDefaults()
        self.planner = Planner(self.cfg, tokenizer, self.config, self.fingerprint, generation)
        self.eos_ids = self.planner.eos_ids

    def set_cache_budgets(self, entry_bytes: int, prefix_bytes: int) -> None:
        """The entry and prefix budgets of a planned worker (devices.plan_memory), set once its
        warm-up has measured what its requests take, before any request: the stores are made
        anew, empty."""
        self.config = replace(self.config, entry_cache_bytes=entry_bytes, prefix_cache_bytes=prefix_bytes)
        self.entries = self._new_entry_store()
        self.prefixes = PrefixStore(prefix_bytes)
        self.pages = PageTree(prefix_bytes, self.page_policy.page_size)

    def _new_entry_store(self) -> EntryStore:
        cfg = self.config
        if cfg.host_cache_bytes:
            return TieredEntryStore(cfg.entry_cache_bytes, cfg.host_cache_bytes, cfg.verify_checksums,
                                    to_host_fn=self.runner.to_host)
        return MemoryEntryStore(cfg.entry_cache_bytes, cfg.verify_checksums)

    @classmethod
    def from_dir(cls, path: str | Path, device: str = "cpu", dtype=torch.float32, config: EngineConfig | None = None):
        return cls(load_model(path, device, dtype), Tokenizer.from_dir(path), config)

    def parse_request(self, obj) -> Request:
        """Validate a request object ({"system", "segments", "suffix", "sampling_params"})."""
        return self.planner.parse(obj)

    def entry_key(self, segment_ids: list[int]) -> str:
        return self.planner.entry_key(segment_ids)

    def cacheable(self, segment_ids: list[int]) -> bool:
        return self.planner.cacheable(segment_ids)

    def build_entry(self, segment_ids: list[int]) -> SegmentEntry:
        """Prefill the segment on its own (positions from 0) and keep its body as an entry."""
        return self._entries([segment_ids], [self.runner.build_span(segment_ids)])[0]

    def _entries(self, segments: list[list[int]], built: list) -> list[SegmentEntry]:
        """Entries of segments from their (span data, build seconds). Entries are built exact in
        fp32; the single-state policy drops their T and a bf16 state dtype rounds T and S as they
        are made (ModelRunner.as_entries), so every store (this engine's, a combine worker's, a
        cache tier) holds what the engine uses."""
        datas = self.runner.as_entries([data for data, _ in built])
        out = []
        for seg, data, (_, seconds) in zip(segments, datas, built):
            entry = SegmentEntry(key=self.entry_key(seg), segment_tokens=len(seg), data=data, build_seconds=seconds)
            if self.tp_layout is not None:
                entry.meta["tensor_parallel"] = self.tp_layout
            if self.config.entry_state_dtype != "float32":
                entry.meta["entry_state_dtype"] = self.config.entry_state_dtype
            out.append(mark_single_state(entry) if self.config.entry_policy == "single_state" else entry)
        return out

    @property
    def streams_layers(self) -> bool:
        """Whether build_entries can hand out each layer of a batch as soon as it is computed
        (on_layer): exact entries (the single-state policy reshapes an entry once it is whole), one
        rank (a callback cannot be mirrored on the followers of a tensor-parallel engine)."""
        return self.config.entry_policy == "exact" and self.tp_layout is None

    def _layer_span(self, data, layer: int):
        """Layer `layer` of a span being built, as the finished entry will hold it (states in the
        entry state dtype)."""
        if layer in data.linear:
            s = data.linear[layer]
            if self.config.entry_state_dtype == "float32":
                return s
            dt = self.config.state_dtype
            return LinearSpan(s.T.to(dt), s.S.to(dt), s.conv_tail)
        return data.attn[layer]

    def build_entries(self, segments: list[list[int]], on_layer=None) -> list[SegmentEntry]:
        """Entries of several segments, equal to build_entry of each: prefilled together
        (ModelRunner.build_spans) in batches of similar lengths of at most `entry_batch_tokens`
        padded tokens; build time is shared out by length.
        `on_layer(indices, layer, spans)`, where streams_layers, is called as each layer of a batch
        is computed: the batch's segment indices and their spans of that layer (a LinearSpan or an
        AttnSpan each, as the entries will hold them). Each entry has its segment's unsalted key: a
        salted request's caller renames it (named_entries)."""
        if on_layer is not None and self.streams_layers:
            def layer_done(indices, layer, datas):
                on_layer(indices, layer, [self._layer_span(d, layer) for d in datas])
        else:
            layer_done = None
        return self._entries(segments, self.runner.build_spans(segments, layer_done))

    def get_or_build_entry(self, segment_ids: list[int], key: str | None = None) -> tuple[SegmentEntry, bool]:
        """The entry of a segment (under `key`: a salted request's; default its unsalted key), from the
        store or built and stored."""
        key = key or self.entry_key(segment_ids)
        entry = self.entries.get(key)
        if entry is not None:
            return entry, True
        entry = self.build_entry(segment_ids)
        entry.key = key
        self.entries.put(entry)
        return entry, False

    def _lookup_prefix(self, req: Request, keys: list[str], stats: RequestStats, locked: list):
        """The state after the longest cached prefix (page tree, or in pic/naive a part chain),
        and whether that state is exact. The last prompt token always runs (it yields the logits)."""
        cfg = self.config
        prompt = req.prompt_ids
        snap = None
        if cfg.uses_entries:
            for j in range(len(keys) - 2, -1, -1):
                snap = self.prefixes.get(keys[j])
                if snap is not None:
                    break
        path = self.pages.match(prompt[: len(prompt) - 1], self.page_policy.usable, req.cache_salt)
        if path and path[-1].depth * self.pages.page_size > (snap.length if snap else 0):
            self.pages.lock(path[-1])
            locked.append(path[-1])
            t0 = time.perf_counter()
            state = self.runner.restore_state(self.page_policy, [n.payload for n in path])
            stats.prefix_restore_ms = (time.perf_counter() - t0) * 1000
            return state, True
        if snap is not None:
            return self.runner.restore_snapshot(snap), False
        return self.runner.empty_state(), True

    def _live_runs(self, t: torch.Tensor, pos: int, end_cut: int = 0) -> list[LiveRun]:
        """t as live runs split at the page tree's checkpoint positions and at `end_cut` (a request-end
        candidate, _request_end_cut), so that their states can be kept."""
        step = self.page_policy.checkpoint_tokens
        cuts = list(range((pos // step + 1) * step, pos + len(t), step))
        if not self.page_policy.stores_checkpoints:
            cuts = []
        if pos < end_cut < pos + len(t) and end_cut not in cuts:
            cuts = sorted([*cuts, end_cut])
        bounds = [pos, *cuts, pos + len(t)]
        return [LiveRun(t[a - pos : b - pos], a) for a, b in zip(bounds, bounds[1:])]

    def _request_end_cut(self, req: Request, start: int) -> int:
        """Where a prefill of `req` from position `start` keeps the linear state for the request-end
        checkpoint (PrefixPolicy.request_end_checkpoints): the prompt's last page boundary, if it
        lies inside what runs and the decode may stop before the next page boundary (a request sure
        to decode past it keeps its state there, from the decode step); 0: none."""
        policy, n = self.page_policy, req.prompt_len
        cut = policy.request_end_position(n)
        if not start < cut < n:
            return 0
        s = req.sampling
        # output tokens the request surely yields; the last one never runs, so its state reaches n + sure - 1
        sure = s.min_new_tokens
        if s.ignore_eos and not s.stop and not s.stop_token_ids and s.max_new_tokens:
            sure = max(sure, s.max_new_tokens)
        return 0 if n + sure - 1 >= cut + policy.page_size else cut

    @torch.no_grad()
    def prefill(self, req: Request, pinned: dict | None = None, built: dict | None = None) -> Prefill:
        """Assemble and run the prompt in one forward (start_prefill, then prefill_chunk without a
        budget). The prefix pages it read or wrote stay locked until finish_prefix(prefill) (the
        scheduler calls it as the request ends). pinned: key -> entry found for this request
        elsewhere (hits); built: key -> entry already built for it (the scheduler builds cold
        segments ahead, batched across requests)."""
        return self.prefill_chunk(self.start_prefill(req, pinned, built))

    @torch.no_grad()
    def start_prefill(self, req: Request, pinned: dict | None = None, built: dict | None = None) -> PrefillJob:
        """Everything of a prefill before its forward: the prefix-cache lookup (the state the
        prompt resumes from), the cold segments' entries (those not built ahead), the layout of
        live runs and cached spans, what to record for the prefix caches. The forward runs in
        prefill_chunk, all at once or a budget of live tokens at a time. Arguments as prefill's."""
        pinned, ahead = pinned or {}, built or {}
        # an entry of another tensor-parallel rank or split holds other heads: a miss, rebuilt here
        pinned = {k: e for k, e in pinned.items() if e.meta.get("tensor_parallel") == self.tp_layout}
        started = time.perf_counter()
        cfg = self.config
        stats = RequestStats(mode=cfg.mode, seam_window=cfg.seam_window)
        parts = req.parts()
        stats.prompt_tokens = sum(len(p) for _, p in parts)
        keys = self.planner.chain_keys(req)

        locked: list = []
        if cfg.uses_prefix_cache:
            stats.prefix_policy = cfg.prefix_policy
            state, exact = self._lookup_prefix(req, keys, stats, locked)
        else:
            state, exact = self.runner.empty_state(), False
        stats.prefix_reused_tokens = state.length
        stats.reused_tokens = state.length
        end_cut = self._request_end_cut(req, state.length) if cfg.uses_prefix_cache and exact else 0
        stats.cached_tokens = state.length

        # Parts wholly inside the hit are reused; the part the hit ends in runs live from there.
        seg_stats, first, skip, part_start = [], len(parts), 0, 0
        for j, (kind, ids) in enumerate(parts):
            if part_start + len(ids) > state.length:
                first, skip = j, state.length - part_start
                break
            if kind in ("segment", "live"):
                seg_stats.append(SegmentStat(len(ids), True, "prefix"))
            part_start += len(ids)

        # the parts folded in from segment entries (whole segments, not the last part)
        reused = {j for j in range(first, len(parts) - 1)
                  if parts[j][0] == "segment" and cfg.uses_entries and not (j == first and skip)
                  and self.cacheable(parts[j][1])}

        first_segment = 1 if req.system_ids else 0  # parts[j] is segment j - first_segment

        def key_of(j):
            return self.planner.segment_key(req, j - first_segment)

        # Cold segments are prefilled on their own first, all at once, then the request runs warm.
        cold = {}
        for j in sorted(reused):
            key = key_of(j)
            if key not in cold and key not in pinned and key not in ahead and not self.entries.contains(key):
                cold[key] = parts[j][1]
        built = dict(ahead)
        built.update(named_entries(cold, self.build_entries(list(cold.values()))))
        for entry in built.values():
            self.entries.put(entry)

        layout, boundary, staged = [], {}, []
        pos = state.length
        w = cfg.seam_window
        # the ids that run live, as views of one tensor: a reused segment's seam window (its body
        # comes from the entry), every other part whole
        pieces = [parts[j][1][skip if j == first else 0 :] for j in range(first, len(parts))]
        live = [(p[:w] if first + n in reused else p) for n, p in enumerate(pieces)]
        flat = torch.tensor(list(itertools.chain.from_iterable(live)), dtype=torch.long)
        live_ids = iter(flat.split(list(map(len, live))))
        for j, part in zip(range(first, len(parts)), pieces):
            kind, ids = parts[j]
            run_ids = next(live_ids)
            if j in reused:
                key = key_of(j)
                if key in built:
                    entry, hit = built.pop(key), False
                elif key in pinned:
                    entry, hit = pinned[key], True
                else:
                    entry, hit = self.get_or_build_entry(ids, key)
                if not hit:
                    stats.built_tokens += len(ids)
                if w:  # the seam window alone runs live
                    layout += self._live_runs(run_ids, pos, end_cut)
                if is_host(entry):
                    staged.append((len(layout), entry))
                layout.append(CachedSpan(entry.data, pos + w, use_transition=cfg.mode == "pic"))
                stats.reused_tokens += entry.data.num_tokens
                if hit:
                    stats.cached_tokens += entry.data.num_tokens
                stats.live_tokens += w
                source = ("host" if is_host(entry) else "entry") if hit else "built"
                seg_stats.append(SegmentStat(len(ids), hit, source))
            else:
                layout += self._live_runs(run_ids, pos, end_cut)
                stats.live_tokens += len(part)
                if kind in ("segment", "live"):
                    seg_stats.append(SegmentStat(len(ids), False, "live"))
            pos += len(part)
            boundary[len(layout) - 1] = j

        # Entries found in the host tier reach the device together, layer by layer: the forward
        # waits for a layer's copies only when it gets to that layer.
        if staged:
            datas = self.runner.stage([e for _, e in staged])
            for (idx, _), data in zip(staged, datas):
                piece = layout[idx]
                layout[idx] = CachedSpan(data, piece.start, piece.use_transition)

        # Pages computed exactly: from an exact start up to the first reused body.
        recorder, exact_end = None, 0
        if cfg.uses_prefix_cache and exact:
            exact_end = next((p.start for p in layout if isinstance(p, CachedSpan)), pos)
            anchor_layers = tuple(g[0] for g in self.model.linear_groups())
            recorder = PageRecorder(self.page_policy, state.length, req.prompt_head(exact_end), anchor_layers,
                                    salt=req.cache_salt)
        snapshot_after = set(boundary) if cfg.uses_entries else set()
        if recorder is not None:
            is_ckpt = self.page_policy.is_checkpoint_position
            snapshot_after |= {i for i, p in enumerate(layout)
                               if p.end <= exact_end and (is_ckpt(p.end) or p.end == end_cut)}
        snapshot_after.discard(len(layout) - 1)
        layout, snapshot_after, boundary = coalesce_live_runs(layout, snapshot_after, boundary)
        stats.segments = seg_stats
        return PrefillJob(req, state, layout, snapshot_after, boundary, keys, recorder, exact_end, locked, stats,
                          started, live_left=sum(p.token_ids.numel() for p in layout if isinstance(p, LiveRun)))

    @torch.no_grad()
    def prefill_chunk(self, job: PrefillJob, max_tokens: int | None = None,
                      defer_chains: bool = False, layer_parts: int = 1, end_apart: bool = True) -> Prefill | None:
        """Run the next at most `max_tokens` live tokens of a started prefill (all of them when None)
        from the state the previous chunk left: the layout's pieces in order, a live run cut where
        the budget ends (its rest starts the next chunk; linear states and K/V resume from any
        position), cached spans taken as they come. Returns the Prefill once the last chunk ran
        (its logits after the prompt), else None. A state whose attention K/V lie in pages
        (paged.PagedAttnState: the scheduler ran paged.StatePool.assign on it) gets each chunk's
        K/V written into them (KVPages.extend), so no copy of the whole prompt's K/V is made. Pages
        of the prefix tree are inserted after each chunk (their anchors and checkpoints are not
        kept for the whole prompt); a greedy prefill equals its one-forward run. `defer_chains`:
        the finished prefill's part chains go into the chain store when keep_chains (or
        finish_prefix) is called, not before this returns (a scheduler emits the first token
        first: storing them reads the prompt's K/V out of its pages). `layer_parts` > 1: a chunk
        without cached spans runs over that many calls, a run of consecutive layers each
        (ModelRunner.forward_parts: a step's host and device work is a share of the chunk's);
        while one is part-way (job.part_way) a call goes on with it and takes no new tokens; with
        `end_apart` such a chunk's end (its kept states, its pages recorded and inserted) is a call
        of its own after its last run of layers, so that no call does both (a scheduler asks for it
        while requests decode: each step stays short), but for the prompt's last chunk, whose end
        gives the first token. A chunk that runs a live piece of the layout to its end stops there
        rather than cut the next one (a long prompt's pieces end at the prefix cache's checkpoints)."""
        if job.running is None:
            self._start_chunk(job, max_tokens, layer_parts)
        run = job.running
        if run.ran is not None:
            # the chunk's forward ran in the call before: its end (kept states, the page tree's
            # recording and inserts) is this call's work, a step of its own
            (logits, rec), job.running = run.ran, None
            return self._finish_chunk(job, run, logits, rec, defer_chains)
        try:
            out = self.runner.run_part(run.forward)
        except BaseException:
            job.running = None  # the state is part-way: the prefill cannot go on
            raise
        if out is None:
            run.calls += 1
            return None  # a run of the chunk's layers ran, not yet all
        if end_apart and run.calls and job.next < len(job.layout) and (job.recorder is not None or out[1].snapshots):
            run.ran = out  # a chunk run in parts, not the prompt's last, ends in a call of its own
            return None
        logits, rec = out
        job.running = None
        return self._finish_chunk(job, run, logits, rec, defer_chains)

    def _start_chunk(self, job: PrefillJob, max_tokens: int | None, layer_parts: int) -> None:
        """The next chunk's pieces (prefill_chunk), its pages, and its forward, not yet run."""
        if job.next >= len(job.layout):
            raise ValueError("this prefill has run to its end")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        state, layout = job.state, job.layout
        pieces, index, snapshots = [], [], set()
        # states kept: part ends for the chain store, checkpoints while the page tree still takes pages
        keep = {i for i in job.snapshot_after
                if job.recorder is not None or (self.config.uses_entries and i in job.boundary)}
        take = job.live_left if max_tokens is None else max_tokens
        i, off = job.next, job.offset
        ended = False  # whether this chunk ran a live piece to its end
        while i < len(layout) and take > 0:
            piece = layout[i]
            if isinstance(piece, CachedSpan):
                pieces.append(piece)
            else:
                n = piece.token_ids.numel() - off
                k = min(n, take)
                if k < n and ended:
                    # the chunk ends where a piece does (a kept state, a part's end): the chunks
                    # after it start on a piece, their live runs whole, about equal in a long
                    # prompt cut at checkpoints, which the linear layers run batched (one
                    # recurrence call, LinearMixer.batched_scan)
                    break
                ended = ended or k == n
                run = piece if off == 0 and k == n else LiveRun(piece.token_ids[off : off + k], piece.start + off)
                pieces.append(run)
                take -= k
                if k < n:  # the rest of this run starts the next chunk
                    index.append(None)
                    off += k
                    break
                off = 0
            if i in keep:
                snapshots.add(len(pieces) - 1)
            index.append(i)
            i += 1
        chunk_start, chunk_end = state.length, pieces[-1].end
        job.next, job.offset = i, off
        job.live_left -= sum(p.token_ids.numel() for p in pieces if isinstance(p, LiveRun))
        done = job.next >= len(layout)
        recorder = job.recorder
        capture = recorder.capture_layers if recorder is not None and chunk_start < job.exact_end else ()
        self.runner.extend_pages(state, chunk_end - chunk_start)
        forward = self.runner.forward_parts(state, pieces, "last" if done else "none", snapshots, capture,
                                            parts=layer_parts)
        job.running = ChunkRun(forward, index, chunk_start)

    def _finish_chunk(self, job: PrefillJob, run: ChunkRun, logits, rec, defer_chains: bool) -> Prefill | None:
        """After a chunk's forward: its kept states, its pages into the page tree; the Prefill after
        the last chunk."""
        layout, state, index = job.layout, job.state, run.index
        checkpoints = []
        # snapshots that are views of a graph's outputs (rec.borrowed): the page recorder copies
        # them now, the part chains when they are kept (_keep_chains)
        borrowed = rec.borrowed is not None
        if borrowed and rec.snapshots:
            job.borrowed = rec.borrowed
        for j, lin in rec.snapshots.items():
            idx = index[j]
            if self.config.uses_entries and idx in job.boundary:
                job.chain.append((idx, layout[idx].end, lin))
            checkpoints.append((layout[idx].end, lin, idx in job.boundary or borrowed))
        recorder, chunk_start, chunk_end = job.recorder, run.start, state.length
        done = job.next >= len(layout)  # (a part-way chunk took no new pieces)
        if recorder is not None:
            if done and job.exact_end == chunk_end:
                checkpoints.append((chunk_end, state, True))
            rows = max(0, min(job.exact_end, chunk_end) - chunk_start)
            self.runner.record(recorder, rec.hidden if rows else {}, rows, checkpoints)
            computed = min(job.exact_end, chunk_end)
            tip = self._insert_pages(recorder, state, job.locked)
            page = self.pages.page_size
            if tip < computed // page * page or (done and job.exact_end < chunk_end):
                # the tree took no more (its budget), or the rest of the request is not exact: nothing
                # more of this request goes in, and nothing more is recorded for it
                self._release_recorded(recorder)
                job.recorder = None
        if not done:
            return None
        if not defer_chains:
            self._keep_chains(job)
        stats = job.stats
        if self.config.uses_prefix_cache:
            stats.linear_state_bytes = self._linear_state_bytes(job.req.prompt_ids, job.req.cache_salt)
        return Prefill(state, logits, stats, job.started, job.recorder, job.locked,
                       chain_job=job if defer_chains and job.chain else None)

    def keep_chains(self, pre: Prefill) -> None:
        """The part chains of a prefill run with defer_chains into the chain store (once; nothing
        when none are pending). Its K/V must still be where the prefill left them (before its
        slot is released: finish_prefix calls this first). A failure is logged, never raised: a
        chain not kept costs the cache, not the request."""
        job, pre.chain_job = pre.chain_job, None
        if job is None:
            return
        try:
            self._keep_chains(job)
        except Exception:  # noqa: BLE001
            log.exception("keeping the part chains failed")

    def _keep_chains(self, job: PrefillJob) -> None:
        """The part-chain snapshots of a finished prefill into the chain store: the linear states
        after each part and views of the prompt's K/V up to there (ModelRunner.snapshots: read out
        of the pages once where they lie in pages, when that fits the store's budget)."""
        if not job.chain:
            return
        end = max(e for _, e, _ in job.chain)
        if self.runner.kv_bytes(job.state, end) > self.prefixes.capacity:
            return
        chain = [(lin, e) for _, e, lin in job.chain]
        if job.borrowed is not None:
            # the states are views of a graph's outputs: copied out now, unless the graph has run
            # again since (then they hold another request's: the chains are not kept)
            if not job.borrowed():
                log.warning("part chains not kept: the graph that held their states ran again first")
                return
            copies = copy_linear_states([lin for lin, _ in chain])
            chain = [(lin, e) for lin, (_, e) in zip(copies, chain)]
            job.borrowed = None
        snaps = self.runner.snapshots(job.state, chain)
        for (idx, _, _), snap in zip(job.chain, snaps):
            self.prefixes.put(job.keys[job.boundary[idx]], snap)

    def abandon_prefill(self, job: PrefillJob) -> None:
        """A started prefill that will not finish (its request was cancelled, preempted or failed):
        release the prefix pages it holds, and a part-way chunk's forward."""
        if job.running is not None:
            self.runner.close_parts(job.running.forward)
            job.running = None
        for node in job.locked:
            self.pages.unlock(node)
        job.locked.clear()
        if job.recorder is not None:
            self._release_recorded(job.recorder)
        job.recorder = None

    def plain_prefill_ok(self, req: Request) -> bool:
        """Can the request's prompt be prefilled by prefill_plain: all live from an empty state (no
        system prompt or segments, no page-tree hit), at least two tokens, at least one new token
        asked, and no prefix-cache checkpoint or request-end cut inside it (the batched pass yields
        the state at its end only)?"""
        cfg, prompt = self.config, req.prompt_ids
        if (not cfg.batch_plain_prefills or req.system_ids or req.segment_ids or len(prompt) < 2
                or req.sampling.max_new_tokens < 1):
            return False
        if cfg.uses_prefix_cache:
            policy = self.page_policy
            if policy.stores_checkpoints and len(prompt) - 1 >= policy.checkpoint_tokens:
                return False
            if self._request_end_cut(req, 0) not in (0, len(prompt) - 1):
                return False
            if self.pages.match(prompt[: len(prompt) - 1], policy.usable, req.cache_salt):
                return False
        return True

    @torch.no_grad()
    def prefill_plain(self, reqs: list[Request]) -> list[Prefill]:
        """Prefill of several requests that plain_prefill_ok accepts, together: every prompt but its
        last token in one batched standalone forward, each state its span data folded into an
        empty state (ModelRunner.prompt_states). The last prompt token is left to the caller's
        next decode step, which yields the first output token: Prefill.logits is None. The
        prompts' pages go into the page tree as a prefill's do."""
        cfg, policy = self.config, self.page_policy
        started = time.perf_counter()
        anchor_layers = tuple(g[0] for g in self.model.linear_groups())
        capture = anchor_layers if cfg.uses_prefix_cache and policy.anchors_kept else ()
        prefilled = self.runner.prompt_states([r.prompt_ids[:-1] for r in reqs], capture)
        out = []
        for req, (state, captured) in zip(reqs, prefilled):
            n = len(req.prompt_ids) - 1
            stats = RequestStats(mode=cfg.mode, seam_window=cfg.seam_window)
            stats.prompt_tokens = stats.live_tokens = n + 1
            recorder, locked = None, []
            if cfg.uses_prefix_cache:
                stats.prefix_policy = cfg.prefix_policy
                recorder = PageRecorder(policy, 0, req.prompt_ids[:n], anchor_layers, salt=req.cache_salt)
                self.runner.record(recorder, captured, n, [(n, state, True)])
                self._insert_pages(recorder, state, locked)
                stats.linear_state_bytes = self._linear_state_bytes(req.prompt_ids, req.cache_salt)
            out.append(Prefill(state, None, stats, started, recorder, locked))
        return out

    @torch.no_grad()
    def prompt_logprobs(self, prompt_ids: list[int], start: int, top: int, chunk: int = 512) -> list:
        """(log p, [(id, log p) of the `top` likeliest]) of each prompt token from position `start`
        on, under the model's distribution after the tokens before it ((nan, []) for the prompt's
        first token, which has none): an exact forward of the prompt from an empty state, cached
        segments left out, `chunk` tokens at a time; logits only where they are needed."""
        n = len(prompt_ids)
        out = [(float("nan"), [])] if start == 0 and n else []
        lo = max(start, 1) - 1  # the logits after token p give token p + 1
        state, pos = self.runner.empty_state(), 0
        while pos < n - 1:
            t = torch.tensor(prompt_ids[pos : min(pos + chunk, n - 1)], dtype=torch.long)
            want = pos + len(t) > lo
            logits, _ = self.runner.forward(state, [LiveRun(t, pos)], "all" if want else "none")
            if want:
                lp = torch.log_softmax(logits.float(), dim=-1)  # [len(t), vocab]
                for row in range(max(lo - pos, 0), len(t)):
                    tok = prompt_ids[pos + row + 1]
                    alternatives = []
                    if top:
                        values, ids = torch.topk(lp[row], min(top, lp.shape[-1]))
                        alternatives = list(zip(ids.tolist(), values.tolist()))
                    out.append((float(lp[row, tok]), alternatives))
            pos += len(t)
        return out


    def _linear_state_bytes(self, prompt: list[int], salt: str = "") -> int:
        """Linear-state bytes the page tree holds for the prompt's cached pages (under its cache salt)."""
        return sum(n.payload.linear_nbytes for n in self.pages.match(prompt, salt=salt))

    def _insert_pages(self, recorder: PageRecorder, state: SequenceState, locked: list, last: bool = False) -> int:
        """The request's pages the tree lacks, their payloads made from its recorder (one runner
        call for all: ModelRunner.page_payloads), into the tree (under its cache salt); the deepest
        one locked. The states the recorder holds leave its reservation: into pages, or (not `last`)
        reserved again while it keeps them (_hold_recorded). Returns the tokens of the prompt the
        tree holds now (0: none)."""
        page = self.pages.page_size
        self._release_recorded(recorder)
        # both walks begin at the page the last insert reached (this request holds it locked): a
        # chunked prefill's inserts read their new pages, not the whole path again
        cached = len(self.pages.match(recorder.token_ids, salt=recorder.salt, start=recorder.tip))
        starts = [i * page for i in range(cached, len(recorder.token_ids) // page)]
        made = dict(zip(starts, self.runner.page_payloads(recorder, state, starts))) if starts else {}
        tip = self.pages.insert(recorder.token_ids, made.get, recorder.salt, start=recorder.tip)
        if tip is not None:
            locked.append(tip)
            recorder.tip = tip
            self._fill_checkpoints(recorder, tip, last)
            # The request holds these pages until it finishes: their anchors need not stay here too
            # (unless this is its last insert: the recorder goes with it).
            if not last and tip.depth * page > recorder.start:
                self.runner.drop_recorded(recorder, tip.depth * page)
        if not last:
            self._hold_recorded(recorder)
        return 0 if tip is None else tip.depth * page

    def _fill_checkpoints(self, recorder: PageRecorder, tip, last: bool) -> None:
        """Pages on the locked path to `tip` that end where the recorder holds a state and have no
        checkpoint get it, where the budget makes room (PageTree.replace_payload): a checkpoint
        position cached earlier without one (its state had no room then), and, as the request ends
        (`last`), the page of its request-end candidate."""
        ends = set(recorder.checkpoints)
        if last and recorder.end_state is not None:
            ends.add(recorder.end_state[0])
        if not ends:
            return
        page, lowest, node = self.pages.page_size, min(ends), tip
        while node.parent is not None and node.depth * page >= lowest:
            end = node.depth * page
            if end in ends and node.payload.checkpoint is None:
                self.pages.replace_payload(node, self.runner.checkpoint_payload(recorder, node.payload, end))
            node = node.parent

    def _hold_recorded(self, recorder: PageRecorder) -> None:
        """Reserve the page-tree bytes of the states the recorder still holds (PageTree.reserve), or,
        with no room for them, drop those states."""
        n = recorder.held_bytes()
        if n and not self.pages.reserve(n):
            self.runner.forget_recorded(recorder)
            n = 0
        recorder.reserved = n

    def _release_recorded(self, recorder: PageRecorder) -> None:
        """Give back the page-tree bytes reserved for the recorder's states."""
        self.pages.unreserve(recorder.reserved)
        recorder.reserved = 0

    def _may_keep(self, recorder: PageRecorder, state: SequenceState) -> bool:
        """Before a decode step in which the recorder keeps the state it reaches (from `state`):
        whether the page tree reserves the bytes of that state's copy."""
        n = linear_state_nbytes(state.linear)
        if not self.pages.reserve(n):
            return False
        recorder.reserved += n
        return True

    def finish_prefix(self, pre: Prefill) -> None:
        """A request ended: its part chains still pending (keep_chains), the pages its decode
        completed added, then its pages released."""
        try:
            self.keep_chains(pre)
            if pre.recorder is not None:
                recorder, pre.recorder = pre.recorder, None
                self._insert_pages(recorder, pre.state, pre.locked, last=True)
        finally:
            for node in pre.locked:
                self.pages.unlock(node)
            pre.locked.clear()

    def new_state_pool(self, slots: int, kv_tokens: int = 0):
        """A scheduler's paged.StatePool of `slots` running requests: their linear states and room
        for `kv_tokens` tokens of attention K/V in pages (per rank under tensor parallelism: its
        methods change per-rank tensors)."""
        return self.runner.new_state_pool(slots, kv_tokens)

    def decode_capture_sets(self) -> list[tuple[int, ...]]:
        """The sets of hidden layers a decode step may capture (those of its requests' page
        recorders): none, and the linear groups' entries where the prefix cache keeps anchors."""
        sets = [()]
        if self.config.uses_prefix_cache and self.page_policy.anchors_kept:
            sets.append(tuple(sorted(g[0] for g in self.model.linear_groups())))
        return sets

    @torch.no_grad()
    def decode_batch(self, prefills: list[Prefill], tokens: list[int | None], pool, slots: list[int],
                     feed=None) -> torch.Tensor:
        """One decode step of B running requests (the scheduler's): request b, prefilled as
        prefills[b] and held in slot slots[b] of `pool` (its linear states and K/V pages), takes
        tokens[b]; its states advance there (ModelRunner.decode: paged.decode_step), its state's
        length and its page recorder with them.
        A token None is fed from the device (`feed`, paged.decode_step's: the columns of the None
        entries and their ids there); its page recorder gets the id once the caller knows it
        (PageRecorder.token_ids). A recorder keeps the state a step reaches (a checkpoint, a
        request-end candidate) only where the page tree's budget reserves its bytes first
        (_may_keep): what running requests hold for their pages stays inside the prefix budget.
        Returns logits [B, vocab] fp32."""
        recorders = [p.recorder for p in prefills]
        capture = sorted({i for r in recorders if r is not None for i in r.capture_layers})
        keep, due = [], []
        if any(r is not None for r in recorders):
            for r, p in zip(recorders, prefills):
                if r is not None and r.keeps_state_at(p.state.length + 1):
                    due.append(r)
                    keep.append(self._may_keep(r, p.state))
                else:
                    keep.append(True)
        logits, _ = self.runner.decode(pool, slots, tokens, capture, feed, [p.state for p in prefills],
                                       recorders if keep else (), keep)
        for r in due:
            # a state the step replaced (an earlier request-end candidate) gives its bytes back
            held = r.held_bytes()
            if held < r.reserved:
                self.pages.unreserve(r.reserved - held)
                r.reserved = held
        return logits

    def warmup_shape(self) -> tuple[int, int, int, int] | None:
        """(system, segments, segment tokens, question tokens) of the shaped warm-up requests
        (RuntimeConfig.warmup_shape), the segments cut to what max_segments and the served length
        allow (with the warm-up's 3 new tokens); None when no such request fits or none is asked."""
        shape = parse_warmup_shape(self.config.warmup_shape)
        if shape is None:
            return None
        system, n, length, question = shape
        limit = self.config.max_model_len or self.cfg.max_position_embeddings
        n = min(n, self.config.max_segments, (limit - system - question - 3) // length)
        return (system, n, length, question) if n >= 1 else None

    def swap_caches(self) -> None:
        """Put empty caches of the same budgets (entries, part chains, page tree) in place of the
        engine's, or, called again, the engine's back (the warm-up's throwaway caches)."""
        saved = getattr(self, "_saved_caches", None)
        if saved is None:
            self._saved_caches = (self.entries, self.prefixes, self.pages)
            self.reset_caches()
        else:
            self.entries, self.prefixes, self.pages = saved
            self._saved_caches = None

    def reset_caches(self) -> None:
        """Empty caches of the same budgets (entries, part chains, page tree) in place of the
        engine's; no request may be in flight."""
        budget = self.config.prefix_cache_bytes
        self.entries = self._new_entry_store()
        self.prefixes = PrefixStore(budget)
        self.pages = PageTree(budget, self.page_policy.page_size)

    def warmup_requests(self) -> tuple[list[Request], tuple | None]:
        """The warm-up's requests (warmup says what each is for) and the shape of its shaped ones
        (warmup_shape), every one greedy with 3 new tokens."""
        w = self.config.seam_window
        gen = torch.Generator().manual_seed(0)

        def ids(n: int) -> list[int]:
            return torch.randint(0, self.cfg.vocab_size, (n,), generator=gen).tolist()

        a, b, c, d = ids(w + 29), ids(w + 48), ids(w + 130), ids(w + 37)
        sys1, sys2, q1, q2 = ids(5), ids(6), ids(7), ids(16)
        greedy = SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)
        requests = [
            Request(sys1, [a, b, c], q1, greedy),  # cold: one batch of builds, then the assembly
            Request(sys2, [c, a, b], q2, greedy),  # warm: reused after another prefix
            Request(sys1, [a, b, d], q1, greedy),  # prefix hit, one cold build
            Request([], [], ids(w + 40), greedy),  # a plain prompt (a scheduler prefills those batched)
        ]
        shape = self.warmup_shape()
        if shape is not None:
            system, n, length, question = shape
            docs, more = [ids(length) for _ in range(n)], [ids(length) for _ in range(n)]
            q, s0 = ids(question), ids(system)
            requests += [Request(s0, docs, q, greedy),  # all cold, then the assembly
                         Request(ids(system), docs[::-1], q, greedy),  # warm, another order: captured
                         Request(ids(system), docs[1:] + docs[:1], q, greedy),  # and replayed
                         # after a system prompt that is cached (the common case: one application's
                         # prompt, new documents): another shape, seen cold, then warm (captured)
                         # and cold again (replayed)
                         Request(s0, more, q, greedy),
                         Request(s0, docs[::-1], q, greedy),
                         Request(s0, [ids(length) for _ in range(n)], q, greedy)]
        return requests, shape

    def warmup(self, run, shaped_only: bool = False) -> dict:
        """Send synthetic requests down every path a request can take before real traffic comes.
        First small ones: a batch of cold entry builds (runs shorter and longer than one chunk,
        odd and multiple-of-16 lengths), an assembly with several seams, the same segments reused
        in another order after another prefix, a prefix-cache hit with one new segment, a plain
        prompt, and decode steps. Then, for the configured shape (warmup_shape), one request all cold and two
        with its segments reordered after other system prompts: the cold builds of that many
        segments of that length in the batches the request path makes, and the assembly of that
        shape seen three times, so that its CUDA graphs are captured here (the second time,
        graphs.LayoutGraphs) and replayed by the third, and the allocator holds the memory such a
        request takes; and three more after the first one's system prompt, which the prefix cache
        then holds (new documents, the first documents reordered, new documents again): a live
        pass that starts from the cached prompt is another shape, captured here too rather than
        on the second such request that comes. On CUDA the first call of each Triton kernel
        configuration compiles and autotunes (seconds to minutes: fla's KDA kernels are the
        slowest) and a new layout shape runs eagerly before it is captured, none of which a server
        must charge to its first requests. `run(request)` serves one request to its end through
        the path real requests take (a scheduler's: llm.LLM.warmup, a combine worker's). The
        engine's caches are swapped for throwaway ones meanwhile (swap_caches), so nothing of the
        warm-up stays cached or counts against a budget. `shaped_only`: the shaped requests alone (a
        worker whose state pool was made anew after its first warm-up captures the assembly graphs
        of their buckets again over the new pool, graphs.AssemblyGraphs). Returns {"requests": n,
        "shape": the shaped requests' shape or None, "seconds": wall time}."""
        t0 = time.perf_counter()
        requests, shape = self.warmup_requests()
        if shaped_only:
            requests = requests[4:]  # the small ones come first (warmup_requests)
        self.swap_caches()
        try:
            for n, req in enumerate(requests):
                if n == 1 and not shaped_only and isinstance(self.entries, TieredEntryStore):
                    self.entries.demote_all()  # the reuse after another prefix stages them from the host
                run(req)
        finally:
            self.swap_caches()
        if getattr(self.model, "device", torch.device("cpu")).type == "cuda":
            torch.cuda.synchronize()
        return {"requests": len(requests), "shape": shape, "seconds": round(time.perf_counter() - t0, 3)}


def coalesce_live_runs(layout: list, keep: set[int], boundary: dict[int, int]):
    """Merge adjacent live runs into one where no state is needed between them (`keep`: layout
    indices whose state after is snapshot). A prompt of several parts that all run live (mode
    `full`, or cold parts without a cache) is then one run per layer instead of one per part: the
    same result, far fewer launches. Returns the new layout, `keep` and `boundary` re-indexed
    (a boundary inside a merged run is dropped: nothing was kept there)."""
    out: list = []
    where: dict[int, int] = {}
    for i, piece in enumerate(layout):
        prev = out[-1] if out else None
        if (
            isinstance(piece, LiveRun)
            and isinstance(prev, LiveRun)
            and piece.record is None
            and prev.record is None
            and prev.end == piece.start
            and (i - 1) not in keep
        ):
            out[-1] = LiveRun(torch.cat([prev.token_ids, piece.token_ids]), prev.start)
            # index i - 1 no longer ends a piece
            where.pop(i - 1, None)
        else:
            out.append(piece)
        where[i] = len(out) - 1
    return out, {where[i] for i in keep}, {where[i]: j for i, j in boundary.items() if i in where}
