"""The states of running requests in preallocated memory, and the batched decode step over them.

A StatePool holds what the scheduler's running requests carry from one decode step to the next:

* the linear layers' states in slots, per layer one [slots + 1, ...] tensor (ssm fp32, conv tail);
* the attention layers' K/V in pages (KVPages): per layer one pool [num_pages, P, Hkv, d] of K
  and one of V, P = PAGE_SIZE tokens a page, and a block table [slots + 1, width] naming the pages
  of each slot in order.

The last slot, and page 0, are scratch: the padded rows of a decode batch (decode CUDA graphs pad
the batch up to a captured size) read and write there and their results are dropped (several
padded rows update the scratch slot's states at once: what it holds is never read for a request).

A request joins (assign) with its prefilled SequenceState: its linear states are copied into its
slot and become views of it, its K/V are copied into pages and each of its AttnStates becomes a
PagedAttnState, which reads its K/V back out of the pages when something asks (the page tree's
finish_prefix, a test): nothing outside the decode step needs to know where they lie. A decode
step (decode_step) then

1. allocates a page for each request whose new token starts one (host bookkeeping: the table row
   on the device gets the new entries in one indexed write for the batch);
2. copies the step's int64 inputs (token ids, positions, table rows, K/V row of the new token,
   lengths) to the device in one transfer;
3. runs the model over a DecodeBatch: every attention layer writes the B new K/V rows into their
   pages in one indexed copy per tensor and attends through the block table
   (common.decode_attention), every linear layer advances the states in the requests' slots in
   place, through the slot indices (mixer.LinearMixer.decode: a one-token conv update and one
   recurrence step, as vLLM and SGLang do): no copy of the batch's states out and back.

The op count of a step depends on neither the batch size nor the context lengths; the bytes it
moves for attention are the keys it reads, not a copy of every context. Leaving (release) frees the
slot and the pages; the request's K/V are first copied out when it still needs them (a page tree
insert at finish_prefix), and its PagedAttnStates refuse to be read after.

Pages are allocated as sequences grow; the scheduler's K/V budget (kv_cache_bytes) sizes the
pool: its tokens, plus one partly filled page a slot, plus the scratch page. On CUDA the pool is
allocated in full at the start, as vLLM does (the budget is what running requests may hold); on
the CPU it starts at MIN_CPU_TOKENS tokens a slot. A pool that runs out of pages (a request alone
grows past the budget rather than preempt itself) doubles; its `generation` then changes, and
whatever holds its tensors' addresses (a decode CUDA graph) must be built again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.sequence import AttnState, LinearState, SequenceState

log = logging.getLogger(__name__)

PAGE_SIZE = 16  # tokens of K/V a page (vLLM's default block size)
MIN_CPU_TOKENS = 4096  # tokens a slot a CPU pool starts with (it doubles when that runs out)
MAX_TABLE_WIDTH = 1 << 15  # pages a request's table row starts with at most (it widens when needed)


def _pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


@dataclass(slots=True)
class PagedWrite:
    """Where the forward under way writes a sequence's new K/V (KVPages.extend): `rows` [n] int64 on
    the device, the rows of the flattened pools its n new tokens take, in position order; `row` [2]
    int64 on the device, the sequence's table row (its slot) and `length`, its tokens once they are
    written (the keys its live queries may see; also on the host)."""

    rows: torch.Tensor
    row: torch.Tensor
    length: int


class KVPages:
    """Paged K/V of the attention layers (module docstring): k[layer], v[layer] [num_pages, P, H, d],
    table [slots + 1, width] int32 on the device; per slot its pages and length on the host."""

    def __init__(self, empty: SequenceState, slots: int, tokens: int, max_len: int, page_size: int = PAGE_SIZE):
        if page_size < 1 or slots < 1:
            raise ValueError(f"page_size and slots must be >= 1, got {page_size}, {slots}")
        self.page_size = page_size
        self.layers = tuple(empty.attn)
        first = next(iter(empty.attn.values()))
        self.device = first.k.device
        tokens = min(tokens, slots * max_len)
        if self.device.type != "cuda":
            tokens = min(tokens, slots * MIN_CPU_TOKENS)
        n_pages = 1 + slots + _pages(tokens, page_size)
        self.k = {i: a.k.new_zeros(n_pages, page_size, a.k.shape[1], a.k.shape[3]) for i, a in empty.attn.items()}
        self.v = {i: a.v.new_zeros(n_pages, page_size, a.v.shape[1], a.v.shape[3]) for i, a in empty.attn.items()}
        width = min(_pages(min(max_len, max(tokens, 1)), page_size) + 1, MAX_TABLE_WIDTH)
        self.table = torch.zeros(slots + 1, width, dtype=torch.int32, device=self.device)
        self.pages_of: list[list[int]] = [[] for _ in range(slots + 1)]
        self.lengths = [0] * (slots + 1)
        self.epoch = [0] * (slots + 1)  # bumped as a slot is released: its PagedAttnStates then refuse reads
        self.free = list(range(n_pages - 1, 0, -1))  # pop() takes the lowest page
        self.generation = 0  # bumped whenever the pool's or the table's tensors are reallocated
        # slot -> the PagedWrite of the forward under way for it (a prefill that runs in its pages)
        self.writes: dict[int, PagedWrite] = {}

    @property
    def num_pages(self) -> int:
        return next(iter(self.k.values())).shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    def _take(self, n: int) -> list[int]:
        if n > len(self.free):
            self._grow(self.num_pages + n - len(self.free))
        return [self.free.pop() for _ in range(n)]

    def _grow(self, at_least: int) -> None:
        """Reallocate the pools with at least `at_least` pages (twice as many as now, or more)."""
        old = self.num_pages
        new = max(2 * old, at_least)
        for d in (self.k, self.v):
            for i, t in d.items():
                grown = t.new_zeros(new, *t.shape[1:])
                grown[:old] = t
                d[i] = grown
        self.free = list(range(new - 1, old - 1, -1)) + self.free
        self.generation += 1

    def _widen(self, cols: int) -> None:
        width = max(2 * self.table.shape[1], cols)
        table = self.table.new_zeros(self.table.shape[0], width)
        table[:, : self.table.shape[1]] = self.table
        self.table = table
        self.generation += 1

    def _set_entries(self, slots: list[int], cols: list[int], pages: list[int]) -> None:
        """table[slots[j], cols[j]] = pages[j] on the device, one indexed write."""
        if not pages:
            return
        if max(cols) >= self.table.shape[1]:
            self._widen(max(cols) + 1)
        idx = backends.to_device_async(torch.tensor([slots, cols, pages], dtype=torch.long), self.device)
        self.table.index_put_((idx[0], idx[1]), idx[2].to(torch.int32))

    def store(self, slot: int, state: SequenceState) -> None:
        """Copy a prefilled state's K/V ([1, H, N, d] a layer) into new pages of `slot`; each of its
        AttnStates becomes a PagedAttnState of the slot."""
        n = state.length
        pages = self._take(_pages(n, self.page_size))
        self.pages_of[slot] = list(pages)
        self.lengths[slot] = n
        self._set_entries([slot] * len(pages), list(range(len(pages))), pages)
        if n:
            rows = (torch.tensor(pages)[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)[:n]
            rows = backends.to_device_async(rows, self.device)
            for i in self.layers:
                a = state.attn[i]
                for pool, t in ((self.k[i], a.k), (self.v[i], a.v)):
                    if t.shape[2] != n:
                        raise ValueError(f"layer {i}: {t.shape[2]} K/V rows for a state of length {n}")
                    pool.view(-1, *pool.shape[2:]).index_copy_(0, rows, t[0].transpose(0, 1).to(pool.dtype))
        for i in self.layers:
            state.attn[i] = PagedAttnState(self, slot, i, self.epoch[slot])

    def prepare(self, slots: list[int]) -> tuple[list[int], list[int], int]:
        """Room for one more token of each slot: a page where it starts one. Advances the slots'
        lengths; returns (K/V row of each new token in the flattened pools, new lengths, the most
        pages any of them spans)."""
        ps = self.page_size
        new_slots, cols, need = [], [], []
        for s in slots:
            if self.lengths[s] % ps == 0:
                new_slots.append(s)
                cols.append(self.lengths[s] // ps)
        if new_slots:
            pages = self._take(len(new_slots))
            for s, p in zip(new_slots, pages):
                self.pages_of[s].append(p)
            self._set_entries(new_slots, cols, pages)
        rows, lengths = [], []
        for s in slots:
            n = self.lengths[s]
            rows.append(self.pages_of[s][n // ps] * ps + n % ps)
            self.lengths[s] = n + 1
            lengths.append(n + 1)
            need.append(n // ps + 1)
        return rows, lengths, max(need)

    def extend(self, slot: int, n: int) -> PagedWrite:
        """Room for n more tokens of `slot` (a forward of a prefill that runs in the slot's pages):
        pages where they start new ones, the slot's length advanced. Returns (and keeps in
        `writes` for the attention layers to find) the PagedWrite of those tokens."""
        ps, start = self.page_size, self.lengths[slot]
        have = len(self.pages_of[slot])
        need = _pages(start + n, ps) - have
        if need > 0:
            pages = self._take(need)
            self.pages_of[slot] += pages
            self._set_entries([slot] * need, list(range(have, have + need)), pages)
        pos = torch.arange(start, start + n)
        page_ids = torch.tensor(self.pages_of[slot], dtype=torch.long)
        rows = page_ids[pos // ps] * ps + pos % ps
        self.lengths[slot] = start + n
        dev = backends.to_device_async(torch.cat([rows, torch.tensor([slot, start + n])]), self.device)
        write = self.writes[slot] = PagedWrite(dev[:n], dev[n:], start + n)
        return write

    def read(self, slot: int, layer: int, lo: int = 0, hi: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot's K/V of one layer at positions lo..hi-1 (default: all), contiguous [1, H, n, d]
        (a copy out of the pages it spans, not of the whole sequence)."""
        n = self.lengths[slot]
        hi = n if hi is None else min(hi, n)
        if hi <= lo:
            a, b = self.k[layer], self.v[layer]
            return a.new_zeros(1, a.shape[2], 0, a.shape[3]), b.new_zeros(1, b.shape[2], 0, b.shape[3])
        ps = self.page_size
        first = lo // ps
        # the page ids through pinned memory: a copy from pageable memory would stall the host until
        # the GPU drains (a page-tree insert reads a page at a time, the part chains every layer)
        idx = backends.to_device_async(torch.tensor(self.pages_of[slot][first : _pages(hi, ps)], dtype=torch.long),
                                       self.device)
        out = []
        for pool in (self.k[layer], self.v[layer]):
            t = pool[idx].reshape(-1, *pool.shape[2:])[lo - first * ps : hi - first * ps]  # [n, H, d]
            out.append(t.transpose(0, 1)[None].contiguous())
        return out[0], out[1]

    def release(self, slot: int, keep: SequenceState | None = None) -> None:
        """Free the slot's pages; `keep`: a state whose K/V are copied out of them first (contiguous
        AttnStates again, e.g. for a page-tree insert)."""
        if keep is not None:
            for i in self.layers:
                a = keep.attn.get(i)
                if isinstance(a, PagedAttnState) and a.slot == slot and a.epoch == self.epoch[slot]:
                    keep.attn[i] = AttnState(*self.read(slot, i))
        self.free.extend(self.pages_of[slot])
        self.pages_of[slot] = []
        self.lengths[slot] = 0
        self.epoch[slot] += 1
        self.writes.pop(slot, None)


class PagedAttnState:
    """A running request's K/V of one attention layer, held in a KVPages slot; `k` and `v` read them
    back as contiguous [1, H, N, d] copies (an AttnState's fields). Refuses reads once the slot is
    released."""

    __slots__ = ("pages", "slot", "layer", "epoch", "__weakref__")

    def __init__(self, pages: KVPages, slot: int, layer: int, epoch: int):
        self.pages, self.slot, self.layer, self.epoch = pages, slot, layer, epoch

    def _read(self, which: int) -> torch.Tensor:
        return self.span(0, None)[which]

    def span(self, lo: int, hi: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) at positions lo..hi-1 [1, H, n, d], copied out of the pages they lie in (a page-tree
        insert reads a page at a time: never the whole sequence per page)."""
        if self.pages.epoch[self.slot] != self.epoch:
            raise RuntimeError(f"the K/V of layer {self.layer} were in slot {self.slot}, released since")
        return self.pages.read(self.slot, self.layer, lo, hi)

    @property
    def write(self) -> PagedWrite:
        """Where the forward under way writes this sequence's new K/V (KVPages.extend)."""
        return self.pages.writes[self.slot]

    @property
    def length(self) -> int:
        return self.pages.lengths[self.slot]

    @property
    def k(self) -> torch.Tensor:
        return self._read(0)

    @property
    def v(self) -> torch.Tensor:
        return self._read(1)


def extend_pages(state: SequenceState, n: int) -> None:
    """Before a forward of n new tokens of a state whose attention K/V lie in pages (PagedAttnState):
    the pages and rows they take (KVPages.extend), where the attention layers write them. A state
    with contiguous K/V (AttnState) is left alone."""
    a = next(iter(state.attn.values()), None)
    if isinstance(a, PagedAttnState):
        if a.length != state.length:
            raise ValueError(f"slot {a.slot} holds {a.length} tokens of K/V, the state {state.length}")
        a.pages.extend(a.slot, n)


class StatePool:
    """The running requests' states, one slot each (module docstring); `free` lists the free slots
    (the scratch slot, index `slots`, is never handed out)."""

    def __init__(self, empty: SequenceState, slots: int, kv_tokens: int = 0, max_len: int = MIN_CPU_TOKENS):
        self.slots = slots
        self.ssm = {i: s.ssm.new_zeros(slots + 1, *s.ssm.shape[1:]) for i, s in empty.linear.items()}
        self.conv = {i: s.conv.new_zeros(slots + 1, *s.conv.shape[1:]) for i, s in empty.linear.items()}
        self.kv = KVPages(empty, slots, kv_tokens, max_len) if empty.attn else None
        self.free = list(range(slots))

    @property
    def scratch(self) -> int:
        return self.slots

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for d in (self.ssm, self.conv) for t in d.values())
        return n + (self.kv.nbytes if self.kv is not None else 0)

    @property
    def generation(self) -> int:
        return self.kv.generation if self.kv is not None else 0

    def assign(self, state: SequenceState) -> int:
        """Move a prefilled state into the lowest free slot: its linear states view the slot, its
        K/V go into pages (PagedAttnStates)."""
        self.free.sort()
        slot = self.free.pop(0)
        for i, s in state.linear.items():
            self.ssm[i][slot].copy_(s.ssm[0])
            self.conv[i][slot].copy_(s.conv[0])
            state.linear[i] = LinearState(self.ssm[i][slot : slot + 1], self.conv[i][slot : slot + 1])
        if self.kv is not None:
            self.kv.store(slot, state)
        return slot

    def adopt(self, slot: int, state: SequenceState) -> None:
        """Make `slot` hold `state`, which a prefill ran in its pages (assign made its K/V paged
        there; its linear states may have been replaced since): the linear states are copied into
        the slot and become views of it again."""
        for i, s in state.linear.items():
            view = self.ssm[i][slot : slot + 1]
            if s.ssm.data_ptr() != view.data_ptr():
                view.copy_(s.ssm)
            conv = self.conv[i][slot : slot + 1]
            if s.conv.data_ptr() != conv.data_ptr():
                conv.copy_(s.conv)
            state.linear[i] = LinearState(view, conv)
        if self.kv is not None:
            for i, a in state.attn.items():
                if not isinstance(a, PagedAttnState) or a.slot != slot:
                    raise ValueError(f"layer {i}'s K/V are not in slot {slot}'s pages")
            if self.kv.lengths[slot] != state.length:
                raise ValueError(f"slot {slot} holds {self.kv.lengths[slot]} tokens of K/V, the state {state.length}")
            self.kv.writes.pop(slot, None)

    def release(self, slot: int, keep: SequenceState | None = None) -> None:
        """Free the slot and its pages (KVPages.release: `keep` gets its K/V copied out first)."""
        if self.kv is not None:
            self.kv.release(slot, keep)
        self.free.append(slot)

    def layer_states(self) -> dict[int, LinearState]:
        """Each linear layer's states of every slot (tensors [slots + 1, ...], not copies): what a
        decode step advances in place at its requests' slots."""
        return {i: LinearState(self.ssm[i], self.conv[i]) for i in self.ssm}

    def index(self, slots: list[int]):
        """The linear states' index of a batch: a slice when the slots are consecutive, else a tensor
        (the gather/scatter reference step, eager_step's in_place False)."""
        if slots == list(range(slots[0], slots[0] + len(slots))):
            return slice(slots[0], slots[0] + len(slots))
        return backends.to_device_async(torch.tensor(slots), next(iter(self.ssm.values())).device)

    def gather(self, idx) -> dict[int, LinearState]:
        """The linear states of a batch (a view for a slice index, a copy for a tensor)."""
        return {i: LinearState(self.ssm[i][idx], self.conv[i][idx]) for i in self.ssm}

    def scatter(self, idx, linear: dict[int, LinearState]) -> None:
        """Write a batch's new linear states back into their slots."""
        for i, s in linear.items():
            if isinstance(idx, slice):
                self.ssm[i][idx].copy_(s.ssm)
                self.conv[i][idx].copy_(s.conv)
            else:
                self.ssm[i].index_copy_(0, idx, s.ssm.to(self.ssm[i].dtype))
                self.conv[i].index_copy_(0, idx, s.conv.to(self.conv[i].dtype))

    def step_inputs(self, slots: list[int], tokens: list[int]) -> tuple[torch.Tensor, int]:
        """Room for one more token of each slot (KVPages.prepare) and the step's inputs as one host
        int64 tensor [5, B]: token ids, positions, table rows (the slots), K/V rows of the new
        tokens, lengths; with the most pages a request of the batch spans."""
        if self.kv is not None:
            kv_rows, lengths, max_pages = self.kv.prepare(slots)
        else:
            kv_rows, lengths, max_pages = [0] * len(slots), [0] * len(slots), 0
        return torch.tensor([tokens, [n - 1 for n in lengths], slots, kv_rows, lengths], dtype=torch.long), max_pages


def decode_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The padded batch sizes decode CUDA graphs are captured for (vLLM's: 1, 2, 4, then multiples
    of 8), up to and including max_num_seqs."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return tuple(sizes) + (max_num_seqs,)


@torch.no_grad()
def decode_step(model, pool: StatePool, slots: list[int], tokens: list[int], capture_hidden=(), feed=None,
                graphs: DecodeGraphs | None = None):
    """One decode step of the requests in `slots` (module docstring), token ids `tokens`: their
    states in the pool advance by one token. With `graphs` (the runner's DecodeGraphs of this pool,
    on CUDA) the step replays the CUDA graph of its padded batch size where one covers it. `feed` =
    (columns, ids), two int64 tensors on the model's device: the token ids of those batch columns
    come from `ids` (the picks of the step before, never brought to the host; `tokens` holds
    anything there). Returns (logits [B, vocab] fp32, {layer in capture_hidden: entering stream [B, h]})."""
    host, max_pages = pool.step_inputs(slots, tokens)
    if graphs is not None:
        out = graphs.run(host, tuple(capture_hidden), feed)
        if out is not None:
            return out
    return eager_step(model, pool, slots, host, max_pages, capture_hidden, feed)


def _feed(inputs: torch.Tensor, feed) -> None:
    """Row 0 (token ids) of a step's device inputs takes the fed columns' ids (decode_step)."""
    if feed is not None:
        cols, ids = feed
        inputs[0].index_copy_(0, cols, ids)


def eager_step(model, pool: StatePool, slots: list[int], host: torch.Tensor, max_pages: int, capture_hidden=(),
               feed=None, in_place: bool = True):
    """decode_step's eager path from its inputs (StatePool.step_inputs: `host` [5, B], max_pages).
    in_place False: the reference path, the batch's linear states gathered out of their slots,
    stepped as a stack and scattered back (tests compare the two)."""
    from hybridcache.services.runtime.models.common import DecodeBatch

    inputs = backends.to_device_async(host, model.device)  # host is this step's own: written in place on CPU
    _feed(inputs, feed)
    batch = DecodeBatch(pool.kv, inputs[2], inputs[3], inputs[4], max_pages, states_in_pool=in_place)
    if in_place:
        return model.forward_decode(batch, inputs[0], inputs[1], pool.layer_states(), capture_hidden)
    idx = pool.index(slots)
    linear = pool.gather(idx)
    logits, hidden = model.forward_decode(batch, inputs[0], inputs[1], linear, capture_hidden)
    pool.scatter(idx, linear)
    return logits, hidden


class DecodeGraphs:
    """Decode CUDA graphs of one model over one StatePool (a ModelRunner holds them), vLLM style:
    for each padded batch size (decode_batch_sizes) and set of captured hidden layers, the whole
    step (embedding, every layer, head, the linear states' updates in their slots, the K/V writes)
    as one graph over static inputs:
    one [5, max size] int64 buffer of token ids, positions, table rows, K/V rows and lengths. A step
    of B requests is padded up to the next size (padding rows: token 0 at position 0 of the scratch
    slot, its K/V row the first of scratch page 0, length 1; their results are dropped), its inputs
    copied into the buffer in one transfer, and the graph replayed; logits and hidden states are
    copied out of the graph's memory. The first step of a size runs `step` eagerly on the static
    inputs (its answer, and every kernel compiled and warm), then captures it (a capture that
    fails leaves that size eager: the step's answer never depends on it). The attention reads
    every page a table row may name (the CPU reference's gather is bounded by the table width, not
    by a step's longest request): nothing in a graph depends on the context lengths. A pool whose
    tensors were reallocated (StatePool.generation) drops the graphs, captured again as needed.

    `graph_factory(mempool, device)` makes a graph with capture(fn) -> fn's outputs and replay()
    (graphs.CudaLayerGraph); a graph whose capture only keeps fn and whose replay() calls it and
    returns its outputs exercises the static-buffer path without CUDA (tests)."""

    def __init__(self, model, pool: StatePool, sizes: tuple[int, ...] | None = None, graph_factory=None):
        from hybridcache.services.runtime.graphs import CudaLayerGraph

        self.model, self.pool = model, pool
        self.sizes = tuple(sizes or decode_batch_sizes(pool.slots))
        self.inputs = torch.zeros(5, self.sizes[-1], dtype=torch.long, device=model.device)
        self._factory = graph_factory or CudaLayerGraph
        self._mempool = None
        self.graphs: dict[tuple, tuple] = {}  # (size, hidden layers) -> (graph, logits, hidden)
        self.failed: dict[tuple, str] = {}  # (size, hidden layers) whose capture failed -> why
        self.generation = pool.generation
        self.stats = {"captures": 0, "replays": 0}
        self._pad = torch.tensor([0, 0, pool.scratch, 0, 1], dtype=torch.long)[:, None]  # a padding column

    def size_for(self, batch: int) -> int | None:
        return next((s for s in self.sizes if s >= batch), None)

    def padded(self, host: torch.Tensor, size: int) -> torch.Tensor:
        """The step's inputs [5, B] padded to [5, size] with rows of the scratch slot."""
        if size == host.shape[1]:
            return host
        return torch.cat([host, self._pad.expand(5, size - host.shape[1])], dim=1)

    def step(self, size: int, capture_hidden: tuple):
        """The decode step over the first `size` static input columns (what a graph captures)."""
        from hybridcache.services.runtime.models.common import DecodeBatch

        pool, x = self.pool, self.inputs[:, :size]
        width = pool.kv.table.shape[1] if pool.kv is not None else 0
        batch = DecodeBatch(pool.kv, x[2], x[3], x[4], width)
        return self.model.forward_decode(batch, x[0], x[1], pool.layer_states(), capture_hidden)

    def _sync_generation(self) -> None:
        """Drop the graphs (and failed captures) of pool tensors since reallocated."""
        if self.pool.generation != self.generation:
            self.graphs.clear()
            self.failed.clear()
            self.generation = self.pool.generation

    def held(self, capture_sets) -> int:
        """The graphs held for the current pool tensors, of every size and capture set asked."""
        self._sync_generation()
        return sum((size, tuple(h)) in self.graphs for h in capture_sets for size in self.sizes)

    @torch.no_grad()
    def capture_all(self, capture_sets) -> int:
        """Capture the graph of every padded batch size for each set of captured hidden layers
        now (a server's warm-up, vLLM style), so that no request waits for a size's first eager
        step, its kernels' compilation (the paged attention kernel's key splits depend on the
        batch size) or its capture. Each step runs padding columns alone (the scratch slot, as a
        padded step's extra rows do). Returns the graphs captured."""
        self._sync_generation()  # graphs of reallocated pool tensors are not kept: capture them again
        before = self.stats["captures"]
        for hidden in capture_sets:
            for size in self.sizes:
                if (size, tuple(hidden)) not in self.graphs:
                    self.run(self._pad.expand(5, size).contiguous(), tuple(hidden))
        return self.stats["captures"] - before

    @torch.no_grad()
    def run(self, host: torch.Tensor, capture_hidden: tuple = (), feed=None):
        """(logits [B, vocab], hidden) of the step whose inputs are `host` [5, B] (StatePool.step_inputs;
        `feed`: decode_step's), from its size's graph; None when B is past the largest size (the
        caller runs eagerly)."""
        from hybridcache.services.runtime.graphs import _NoFlaTensorCache

        B = host.shape[1]
        size = self.size_for(B)
        if size is None or (size, capture_hidden) in self.failed:
            return None
        self._sync_generation()
        self.inputs[:, :size].copy_(backends.pin(self.padded(host, size)), non_blocking=True)
        _feed(self.inputs, feed)
        key = (size, capture_hidden)
        entry = self.graphs.get(key)
        if entry is None:
            logits, hidden = self.step(size, capture_hidden)  # this step's answer, every kernel warm
            if self._mempool is None and self.model.device.type == "cuda":
                self._mempool = torch.cuda.graph_pool_handle()
            graph = self._factory(self._mempool, self.model.device)
            backends.clear_kept()
            try:
                with _NoFlaTensorCache():
                    out = graph.capture(lambda: self.step(size, capture_hidden))
            except Exception as e:  # noqa: BLE001 - an op that cannot be captured: this size runs eagerly
                self.failed[key] = f"{type(e).__name__}: {e}"
                log.warning("decode step of batch size %d not captured, runs eagerly: %s", size, self.failed[key])
            else:
                self.graphs[key] = (graph, *out)
                self.stats["captures"] += 1
            finally:
                backends.clear_kept()
            return logits[:B], {i: h[:B] for i, h in hidden.items()}
        graph, logits, hidden = entry
        replayed = graph.replay()
        if replayed is not None:  # a graph that reruns the step returns its new outputs
            logits, hidden = replayed
        self.stats["replays"] += 1
        return logits[:B].clone(), {i: h[:B].clone() for i, h in hidden.items()}
