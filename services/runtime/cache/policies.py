"""How a prefix page keeps the linear layers' state, and how a hit restores it (docs/concepts.md,
"Prefix cache and its policies").

All three policies share the page tree (radix.py) and keep full-attention K/V per page.

    checkpoint     the dense state of every linear layer (S and conv tail) after every N-th page;
                   a prefix hits only at those pages (what today's engines do). With
                   request_end_checkpoints also the state at the last page boundary each finished
                   request reached (prompt and output: where the next turn resumes), as SGLang's
                   mamba radix cache keeps every finished request's final state.
    suffix_replay  at the entry of each group of consecutive linear layers, the residual stream
                   of the last r tokens of each page (the anchors). A hit replays the last k
                   anchors through each group from a zero state: approximate, the error shrinks
                   as k grows on a model whose linear layers forget.
    exact_replay   anchors for every token plus the dense state after every N-th page. A hit
                   replays the anchors since the last checkpoint through each group: exact.

Anchors are exact inputs of a group because they were captured from the true run; a group's
layers need nothing else (no attention inside a group), so groups replay independently.

suffix_replay may store its anchors in bf16 (`anchor_dtype="bfloat16"`, whatever the model's dtype)
or in fp8 (`anchor_dtype="float8_e4m3fn"`, like fp8 KV caches in vLLM/SGLang): each fp8 anchor row
(one token at one group entry) keeps x / s in e4m3 and its fp32 scale s = amax|x| / 448, packed as
one uint8 row [h + 4] so every byte-count sees both. exact_replay and checkpoint refuse both: they
must stay exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# PrefixPolicy (the settings) lives with the runtime config, importable without torch.
from hybridcache.services.config import ANCHOR_DTYPES, POLICIES, PrefixPolicy  # noqa: F401 (re-exported)
from hybridcache.services.runtime.cache.radix import PageNode, PagePayload
from hybridcache.services.runtime.sequence import AttnState, LinearState, SequenceState

_FP8_MAX = 448.0  # largest finite float8_e4m3fn
_SCALE_BYTES = 4  # one fp32 scale per anchor row


def linear_state_bytes_per_token(policy: PrefixPolicy, dense_state_bytes: int, anchor_bytes: int) -> float:
    """Linear-state bytes a policy keeps per cached token. dense_state_bytes: one dense state of
    all linear layers (S and conv tails); anchor_bytes: one token's anchors at every group entry as
    stored (groups × policy.anchor_row_bytes(...), so fp8 anchors count their scales)."""
    dense = dense_state_bytes / policy.checkpoint_tokens if policy.stores_checkpoints else 0.0
    return dense + anchor_bytes * policy.anchors_kept / policy.page_size


def quantize_anchors(x: torch.Tensor) -> torch.Tensor:
    """Anchors [..., r, h] -> packed uint8 [..., r, h + 4]: x / s in float8_e4m3fn, then s =
    amax|x| / 448 (fp32) per row, so rows of any magnitude keep e4m3's relative precision."""
    x = x.float()
    scale = (x.abs().amax(dim=-1, keepdim=True) / _FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)  # [r, 1]
    # e4m3fn has no inf: a value rounded past 448 would become NaN.
    q = (x / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)  # [r, h]
    return torch.cat([q, scale.view(torch.uint8)], dim=-1)


def dequantize_anchors(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_anchors' inverse: packed uint8 [r, h + 4] -> anchors [r, h] in `dtype`."""
    h = packed.shape[-1] - _SCALE_BYTES
    q = packed[:, :h].contiguous().view(torch.float8_e4m3fn).float()  # [r, h]
    scale = packed[:, h:].contiguous().view(torch.float32)  # [r, 1]
    return (q * scale).to(dtype)


def _page_anchors(payload: PagePayload, layer: int, dtype: torch.dtype) -> torch.Tensor:
    """A page's anchors at a group entry [r, h] in `dtype`; packed fp8 ones (uint8) are dequantized,
    bf16 ones cast, whatever the reading policy says, so a policy built without anchor_dtype still
    reads them right."""
    anchors = payload.anchors[layer]
    return dequantize_anchors(anchors, dtype) if anchors.dtype == torch.uint8 else anchors.to(dtype)


def linear_state_nbytes(linear: dict[int, LinearState]) -> int:
    """Bytes of a dense linear state (every layer's S and conv tail), as a copy of it takes."""
    return sum(t.numel() * t.element_size() for s in linear.values() for t in (s.ssm, s.conv))


def _copy_linear(linear: dict[int, LinearState]) -> dict[int, LinearState]:
    return {i: LinearState(s.ssm.clone(), s.conv.clone()) for i, s in linear.items()}


def restore_state(model, policy: PrefixPolicy, path: list[PageNode]) -> SequenceState:
    """The state after the prefix `path` (root's child first), rebuilt from the pages' payloads
    (restore_pages)."""
    return restore_pages(model, policy, [n.payload for n in path])


def restore_pages(model, policy: PrefixPolicy, pages: list[PagePayload], replay=None) -> SequenceState:
    """The state after a prefix of whole pages, from their payloads (the first page's first).
    Reads the pages only; the returned state shares no tensor that it will write in place.
    replay(group, hidden, state): suffix_replay's run of a group from a zero state (default
    model.replay_linear_group; the runner's graphs.ReplayGraphs.run replays a captured graph)."""
    if not pages:
        raise ValueError("restore_state needs at least one page")
    attn = {
        i: AttnState(*(torch.cat([p.attn[i][kv] for p in pages], dim=2) for kv in (0, 1)))
        for i in pages[0].attn
    }
    state = SequenceState(length=len(pages) * policy.page_size, linear={}, attn=attn)
    if policy.name == "checkpoint":
        state.linear = _copy_linear(pages[-1].checkpoint)
        return state
    if policy.name == "exact_replay":
        base = max((j for j, p in enumerate(pages) if p.checkpoint is not None), default=-1)
        replay = pages[base + 1 :]
        if base >= 0:
            state.linear = _copy_linear(pages[base].checkpoint)
        else:
            state.linear = model.empty_state().linear
        for group in model.linear_groups():
            if replay:
                hidden = torch.cat([p.anchors[group[0]] for p in replay])  # [m, h]
                model.replay_linear_group(group, hidden, state)
        return state
    # suffix_replay: the last k anchors of the path, from a zero state.
    k = policy.replay_anchors
    last = pages[-math.ceil(k / policy.anchors_per_page) :]
    state.linear = model.empty_state().linear
    for group, hidden in zip(model.linear_groups(), _replay_anchors(model, last)):
        (replay or model.replay_linear_group)(group, hidden[-k:], state)
    return state


def _replay_anchors(model, pages: list[PagePayload]) -> list[torch.Tensor]:
    """Each linear group's anchors over `pages` [m, h] in the model's dtype, the groups in order.
    Packed fp8 anchors of equal shapes are dequantized in one pass over every group's pages (one
    concatenation and one dequantization instead of one of each a page and group: a restore's
    launches on a GPU); others page by page (_page_anchors)."""
    entries = [group[0] for group in model.linear_groups()]
    packed = [p.anchors[i] for i in entries for p in pages]
    if packed and all(a.dtype == torch.uint8 and a.shape == packed[0].shape for a in packed):
        x = dequantize_anchors(torch.cat(packed), model.dtype)  # [groups * pages * r, h]
        return list(x.view(len(entries), -1, x.shape[-1]).unbind(0))
    return [torch.cat([_page_anchors(p, i, model.dtype) for p in pages]) for i in entries]


def _by_page(t: torch.Tensor, p: int, page_major: bool | None = None) -> torch.Tensor:
    """K or V of whole pages [1, H, n P, d] as page_payload reads them: on CUDA page-major, [n, 1,
    H, P, d] contiguous (one copy; each page's rows one contiguous block, which _page_kv's stack
    copies in one launch where a strided one takes a launch a tensor); elsewhere as it is (a CPU
    copies strided rows as fast, and the page-major copy would cost more than it saves).
    `page_major` forces either form."""
    if not (t.is_cuda if page_major is None else page_major):
        return t
    _, h, n, d = t.shape
    return t.view(1, h, n // p, p, d).permute(2, 0, 1, 3, 4).contiguous()


def _page_of(t: torch.Tensor, offset: int, p: int) -> torch.Tensor:
    """The page at `offset` tokens into a _by_page read: [1, H, P, d]."""
    return t[offset // p] if t.dim() == 5 else t[:, :, offset : offset + p]


def _page_kv(views: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One page's K/V of every attention layer (contiguous views into the layers' page-major
    reads) copied out into storage of the page's own: one stack of all of them where they share a
    shape and dtype (one copy launch a page instead of two a layer; each layer's K and V are views
    of that page's buffer, freed with the page), else a copy each."""
    flat = [t for kv in views.values() for t in kv]
    if len({(t.shape, t.dtype) for t in flat}) != 1:
        return {i: tuple(t.clone(memory_format=torch.contiguous_format) for t in kv) for i, kv in views.items()}
    buf = torch.stack(flat)
    return {i: (buf[2 * j], buf[2 * j + 1]) for j, i in enumerate(views)}


@dataclass
class PageRecorder:
    """Collects, while a request runs exactly from position `start`, what new pages need: the
    residual stream at each group entry (anchor policies), the linear state at checkpoint
    positions, and (policy.request_end_checkpoints) the linear state at the last page boundary the
    request has reached, which its page gets as a checkpoint when the request ends
    (checkpoint_payload). `token_ids` are the tokens run so far from position 0.

    The states it holds count in the page tree's budget (radix.PageTree.reserve; held_bytes): the
    engine says, before each state is kept, whether there is room (add_checkpoint's `keep`). A
    checkpoint position without room is `declined`: its page is made without a checkpoint (an
    exact_replay hit replays its anchors from an earlier checkpoint; a checkpoint hit ends at an
    earlier page that has one); a request-end candidate without room leaves the earlier one."""

    policy: PrefixPolicy
    start: int
    token_ids: list[int]
    anchor_layers: tuple[int, ...]
    hidden: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # layer -> chunks [n, h]
    salt: str = ""  # the request's cache salt: its pages go under that salt's root (radix.PageTree)
    checkpoints: dict[int, dict[int, LinearState]] = field(default_factory=dict)  # position -> state
    # (position, state) at the last page boundary reached, for the request-end checkpoint
    end_state: tuple[int, dict[int, LinearState]] | None = None
    declined: set[int] = field(default_factory=set)  # checkpoint positions whose state was not kept
    reserved: int = 0  # page-tree bytes the engine reserved for the held states (rank 0's bookkeeping)
    # the deepest page its inserts reached, locked by the request until it ends: where the next
    # insert's walk begins (radix.PageTree.insert's start)
    tip: object = None
    _hidden_cat: dict[int, torch.Tensor] = field(default_factory=dict)
    _blocks: dict[int, int] = field(default_factory=dict)  # layer -> joined blocks leading its hidden list

    @property
    def capture_layers(self) -> tuple[int, ...]:
        return self.anchor_layers if self.policy.anchors_kept else ()

    # a layer's rows are kept as at most this many recent chunks (a decode step adds one of one
    # row) before they are joined into one block; blocks of equal size are joined in turn
    JOIN_CHUNKS = 32

    def add_hidden(self, captured: dict[int, torch.Tensor], n: int) -> None:
        """Append the first n captured tokens' hidden states (a forward's rec.hidden). A layer's
        list holds a few blocks, each of more rows than the next, then up to JOIN_CHUNKS recent
        chunks: a request that decodes thousands of tokens holds tens of tensors a layer, not one
        a token (each a Python object every full collection of the interpreter's collector walks),
        at one join per JOIN_CHUNKS steps, each row copied about log2(rows / JOIN_CHUNKS) times."""
        for i in self.capture_layers:
            chunks = self.hidden.setdefault(i, [])
            rows = captured[i]
            chunks.append(rows if rows.shape[0] == n else rows[:n])  # a decode step's row: as given
            k = self._blocks.get(i, 0)
            if len(chunks) - k >= self.JOIN_CHUNKS:
                # the recent chunks and the blocks before them no larger than what they join, in one copy
                joined = sum(c.shape[0] for c in chunks[k:])
                while k and chunks[k - 1].shape[0] <= joined:
                    k -= 1
                    joined += chunks[k].shape[0]
                chunks[k:] = [torch.cat(chunks[k:])]
                self._blocks[i] = k + 1
        self._hidden_cat.clear()

    def _due(self, pos: int) -> tuple[bool, bool]:
        """(a checkpoint position without its state, a page boundary past the request-end candidate)."""
        grid = self.policy.is_checkpoint_position(pos) and pos not in self.checkpoints and pos not in self.declined
        end = pos > 0 and self.policy.request_end_position(pos) == pos and (
            self.end_state is None or pos > self.end_state[0])
        return grid, end

    def keeps_state_at(self, pos: int) -> bool:
        """Would add_checkpoint keep the state after `pos` tokens (one new state held)?"""
        return any(self._due(pos))

    def held_bytes(self) -> int:
        """Bytes of memory the linear states held for pages not inserted yet keep alive: their
        storages, each once (a checkpoint that is also the request-end candidate is one; a
        forward's snapshots may be views of one buffer, which a view keeps whole)."""
        states = list(self.checkpoints.values()) + ([self.end_state[1]] if self.end_state is not None else [])
        storages = {}
        for linear in states:
            for s in linear.values():
                for t in (s.ssm, s.conv):
                    st = t.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    def add_checkpoint(self, pos: int, linear: dict[int, LinearState], copy: bool, keep: bool = True) -> None:
        """The linear state after `pos` tokens (copied when `copy`: `linear` changes in place later),
        kept where the policy keeps one: a checkpoint position, or a page boundary past the
        request-end candidate (which it replaces: only the request's last one is kept). Not `keep`
        (the page tree has no room for it): nothing is copied, a checkpoint position is declined."""
        grid, end = self._due(pos)
        if not (grid or end):
            return
        if not keep:
            if grid:
                self.declined.add(pos)
            return
        kept = _copy_linear(linear) if copy else linear
        if grid:
            self.checkpoints[pos] = kept
        if end:
            self.end_state = (pos, kept)

    def add_step(self, token: int | None, captured: dict[int, torch.Tensor], state: SequenceState,
                 keep: bool = True) -> None:
        """One decode step of the request, `state` after it: its input token (None: fed on the
        device, appended to token_ids once known), its captured hidden rows, a checkpoint of its
        linear state where one is due and `keep` says there is room."""
        if token is not None:
            self.token_ids.append(token)
        self.add_hidden(captured, 1)
        self.add_checkpoint(state.length, state.linear, copy=True, keep=keep)

    def state_at(self, pos: int) -> dict[int, LinearState] | None:
        """The held state after `pos` tokens (a checkpoint or the request-end candidate), or None."""
        if pos in self.checkpoints:
            return self.checkpoints[pos]
        if self.end_state is not None and self.end_state[0] == pos:
            return self.end_state[1]
        return None

    def checkpoint_payload(self, payload: PagePayload, pos: int) -> PagePayload:
        """`payload`, of the page that ends at `pos`, with the state held there as its checkpoint
        (the page's K/V and anchors shared, not copied)."""
        return PagePayload(attn=payload.attn, checkpoint=self.state_at(pos), anchors=payload.anchors)

    def forget_states(self) -> None:
        """Drop every held state (the page tree has no room for them): their checkpoint positions
        are declined, the request-end candidate goes."""
        self.declined.update(self.checkpoints)
        self.checkpoints = {}
        self.end_state = None

    def drop_before(self, pos: int) -> None:
        """Forget what pages ending at or before `pos` needed (they are cached); later pages are
        still buildable. pos is a page boundary. The request-end candidate stays (its page gets it
        when the request ends)."""
        if pos <= self.start:
            return
        for i in self.capture_layers:
            self.hidden[i] = [self._anchors(i)[pos - self.start :].clone()]
            self._blocks[i] = 1
        self._hidden_cat.clear()
        self.checkpoints = {p: c for p, c in self.checkpoints.items() if p > pos}
        self.declined = {p for p in self.declined if p > pos}
        self.start = pos

    def _anchors(self, layer: int) -> torch.Tensor:
        if layer not in self._hidden_cat:
            self._hidden_cat[layer] = torch.cat(self.hidden[layer])
        return self._hidden_cat[layer]

    # tokens of K/V page_payloads reads out of a layer at once (a chunk's pages in one read, a
    # long prompt's in several)
    READ_TOKENS = 4096

    def _ran(self, state: SequenceState, page_start: int) -> bool:
        end = page_start + self.policy.page_size
        return self.start <= page_start and end <= len(self.token_ids) and end <= state.length

    def page_payloads(self, state: SequenceState, starts: list[int]) -> list[PagePayload | None]:
        """page_payload of each of `starts` in order, up to the first None (the last in the list).
        Each attention layer's K/V of up to READ_TOKENS tokens of those pages is read in one span
        (out of the pages, for a running request: one index copy a layer instead of one a page) and
        each page's K/V copied out of the spans into a buffer of its own (_page_kv)."""
        p = self.policy.page_size
        ran = []
        for a in starts:
            if not self._ran(state, a):
                break
            ran.append(a)
        out: list[PagePayload | None] = []
        i = 0
        while i < len(ran):
            j = i + 1
            while j < len(ran) and ran[j] + p - ran[i] <= max(self.READ_TOKENS, p):
                j += 1
            lo, hi = min(ran[i:j]), max(ran[i:j]) + p
            spans = {layer: (lo, tuple(_by_page(t, p) for t in a.span(lo, hi))) for layer, a in state.attn.items()}
            for a in ran[i:j]:
                out.append(self.page_payload(a, spans))
                if out[-1] is None:
                    return out
            i = j
        if len(ran) < len(starts):
            out.append(None)
        return out

    def page_payload(self, page_start: int, spans: dict) -> PagePayload | None:
        """The payload of the page at [page_start, page_start + P) that this run computed
        (page_payloads checks that), or None where its checkpoint is missing. `spans`: layer -> (lo,
        (k, v) from position lo, as _by_page leaves them) holding the page, read already."""
        p = self.policy.page_size
        end = page_start + p
        checkpoint = None
        if self.policy.is_checkpoint_position(end):
            checkpoint = self.checkpoints.get(end)
            if checkpoint is None and end not in self.declined:
                return None
        attn = _page_kv({i: tuple(_page_of(t, page_start - lo, p) for t in kv) for i, (lo, kv) in spans.items()})
        anchors = None
        r = self.policy.anchors_kept
        if r:
            lo = end - self.start - r
            layers = self.capture_layers
            # every group entry's rows in one buffer of the page's own [groups, r, h] (one copy a
            # page, not one a group), quantized or cast as a whole; each layer's anchors a view of it
            rows = torch.stack([self._anchors(i)[lo : end - self.start] for i in layers])
            if self.policy.anchor_dtype == "float8_e4m3fn":
                rows = quantize_anchors(rows)
            elif self.policy.anchor_dtype == "bfloat16":
                rows = rows.to(torch.bfloat16)
            anchors = {i: rows[j] for j, i in enumerate(layers)}
        return PagePayload(attn=attn, checkpoint=checkpoint, anchors=anchors)
