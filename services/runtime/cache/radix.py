"""A radix tree over fixed-size token pages: the prefix pool of docs/concepts.md ("Prefix cache and its policies").

Each node is one page (`page_size` token ids) under the page before it, and holds that page's
payload (attention K/V, and whatever linear state the policy keeps; see policies.py). A prefix
hits at any node the policy can restore from. Requests lock the path they read or wrote
(reference counts along the path to the root); eviction removes only unreferenced leaves,
least recently used first, so a page in use is never freed and every cached node keeps all its
ancestors (which replay policies read).

The budget also covers the linear states that running requests' page recorders hold for pages
not inserted yet (checkpoints taken during decode, request-end candidates): the engine reserves
their bytes before a state is copied (`reserve`, which evicts as an insert does) and gives them
back when the state goes into a page or is dropped (`unreserve`), so pages and held states
together never pass `capacity_bytes`; a state without room is not copied (SGLang's mamba radix
cache skips tracking a state when its pool has no free slot).

Pages of requests with a cache salt (vLLM's `cache_salt`) live under a root of that salt: a
prompt matches only pages a request of the same salt inserted.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from hybridcache.services.runtime.sequence import LinearState


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(slots=True)
class PagePayload:
    """What one page keeps. Attention K/V always; linear state as the policy decides."""

    attn: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (K, V) [1, Hkv, P, d], absolute positions
    checkpoint: dict[int, LinearState] | None = None  # linear layer -> state after this page
    anchors: dict[int, torch.Tensor] | None = None  # group entry layer -> hidden states [r, h]

    @property
    def linear_nbytes(self) -> int:
        n = 0
        if self.checkpoint:
            n += sum(_tensor_bytes(s.ssm) + _tensor_bytes(s.conv) for s in self.checkpoint.values())
        if self.anchors:
            n += sum(_tensor_bytes(a) for a in self.anchors.values())
        return n

    @property
    def nbytes(self) -> int:
        return self.linear_nbytes + sum(_tensor_bytes(k) + _tensor_bytes(v) for k, v in self.attn.values())


@dataclass(slots=True, eq=False)
class PageNode:
    tokens: tuple[int, ...]
    parent: PageNode | None
    depth: int  # pages from the root; the page covers [(depth - 1) P, depth P)
    payload: PagePayload | None  # None only at the root
    children: dict[tuple[int, ...], PageNode] = field(default_factory=dict)
    ref_count: int = 0
    last_access: int = 0

    def path(self) -> list[PageNode]:
        """Nodes from the first page down to this one (the root excluded)."""
        out, node = [], self
        while node.parent is not None:
            out.append(node)
            node = node.parent
        return out[::-1]


class PageTree:
    """Pages keyed by their token ids under their parent, within a byte budget."""

    def __init__(self, capacity_bytes: int, page_size: int = 64):
        if page_size <= 0 or capacity_bytes <= 0:
            raise ValueError("page_size and capacity_bytes must be positive")
        self.page_size = page_size
        self._capacity = capacity_bytes
        self.root = PageNode(tokens=(), parent=None, depth=0, payload=None)
        self._salted: dict[str, PageNode] = {}  # cache salt -> the root of its pages (none: self.root)
        self._used = 0
        self._linear_used = 0
        self._reserved = 0  # bytes held for states not in a page yet (reserve)
        self._pages = 0
        self._clock = itertools.count(1)
        self._lock = threading.RLock()

    def _pages_of(self, token_ids: Sequence[int], first: int = 0):
        p = self.page_size
        for a in range(first * p, len(token_ids) - p + 1, p):
            yield tuple(int(t) for t in token_ids[a : a + p])

    def _start(self, root: PageNode, start: PageNode | None) -> PageNode:
        """Where a walk of a request's pages begins: `start` (a page of its path the caller holds
        locked, so eviction cannot take it or its ancestors) when it still hangs under `root`,
        else the root. A walk from there reads only the pages after it."""
        node = start
        while node is not None and node.parent is not None:
            node = node.parent
        return start if start is not None and node is root else root

    def _root(self, salt: str, make: bool = False) -> PageNode | None:
        if not salt:
            return self.root
        root = self._salted.get(salt)
        if root is None and make:
            root = self._salted[salt] = PageNode(tokens=(), parent=None, depth=0, payload=None)
        return root

    def match(self, token_ids: Sequence[int], usable: Callable[[PageNode], bool] | None = None,
              salt: str = "", start: PageNode | None = None) -> list[PageNode]:
        """The path to the deepest cached page of `token_ids`' whole pages that `usable` accepts
        ([] on a miss), among the pages of cache salt `salt`. Marks the path as recently used;
        reference counts are not changed. `start` (without `usable`): a cached page of that path
        the caller holds locked, the walk's beginning (_start)."""
        with self._lock:
            root = self._root(salt)
            if root is None:
                return []
            node = best = root if usable is not None else self._start(root, start)
            for page in self._pages_of(token_ids, node.depth):
                node = node.children.get(page)
                if node is None:
                    break
                if usable is None or usable(node):
                    best = node
            if best is root:
                return []
            path = best.path()
            t = next(self._clock)
            for n in path:
                n.last_access = t
            return path

    def lock(self, node: PageNode) -> None:
        """Pin `node` and its ancestors against eviction (one reference each)."""
        with self._lock:
            while node is not None:
                node.ref_count += 1
                node = node.parent

    def unlock(self, node: PageNode) -> None:
        with self._lock:
            while node is not None:
                if node.ref_count <= 0:
                    raise RuntimeError("unlock of a page that is not locked")
                node.ref_count -= 1
                node = node.parent

    def insert(
        self, token_ids: Sequence[int], make_payload: Callable[[int], PagePayload | None], salt: str = "",
        start: PageNode | None = None,
    ) -> PageNode | None:
        """Add the whole pages of `token_ids` that are not cached yet (under cache salt `salt`).
        make_payload(page_start) builds a missing page's payload, or returns None when it cannot
        (insertion stops there). Evicts unreferenced leaves to make room. Returns the deepest node of
        the prefix now cached, locked (the caller unlocks it), or None when not even the first page
        is cached. `start`: a cached page of that prefix the caller holds locked, where the walk
        begins (_start: a chunked prefill's inserts then read only their new pages)."""
        with self._lock:
            root = self._root(salt, make=True)
            node = self._start(root, start)
            node.ref_count += 1  # the walk's pin (its ancestors get theirs at the end)
            try:
                for i, page in enumerate(self._pages_of(token_ids, node.depth), node.depth):
                    child = node.children.get(page)
                    if child is None:
                        payload = make_payload(i * self.page_size)
                        if payload is None:
                            break
                        over = payload.nbytes - self._free()
                        if over > 0 and not self._evict(over):
                            break
                        child = PageNode(page, node, node.depth + 1, payload)
                        node.children[page] = child
                        self._used += payload.nbytes
                        self._linear_used += payload.linear_nbytes
                        self._pages += 1
                    child.last_access = next(self._clock)
                    # Move the pin one page down, so eviction cannot take the path being extended.
                    child.ref_count += 1
                    node.ref_count -= 1
                    node = child
            except BaseException:
                node.ref_count -= 1
                raise
            if node is root:
                self.unlock(node)
                if root is not self.root and not root.children:
                    self._salted.pop(salt, None)
                return None
            # `node` holds one reference; give its ancestors theirs.
            anc = node.parent
            while anc is not None:
                anc.ref_count += 1
                anc = anc.parent
            return node

    def replace_payload(self, node: PageNode, payload: PagePayload) -> bool:
        """Give a cached page another payload (the same page with more state kept: a request-end
        checkpoint), its bytes counted in the budget; evicts unreferenced leaves to make room.
        The caller holds `node` locked (eviction must not take it). False: no room, the page
        keeps its payload."""
        with self._lock:
            if node.ref_count <= 0:
                raise RuntimeError("replace_payload of a page that is not locked")
            extra = payload.nbytes - node.payload.nbytes
            over = extra - self._free()
            if over > 0 and not self._evict(over):
                return False
            self._used += extra
            self._linear_used += payload.linear_nbytes - node.payload.linear_nbytes
            node.payload = payload
            return True

    def _free(self) -> int:
        return self._capacity - self._used - self._reserved

    def reserve(self, nbytes: int) -> bool:
        """Hold `nbytes` of the budget for a state a running request keeps until it goes into a
        page (its recorder's checkpoints), evicting unreferenced leaves to make room as an insert
        does. False: no room (nothing held)."""
        with self._lock:
            over = nbytes - self._free()
            if over > 0 and not self._evict(over):
                return False
            self._reserved += nbytes
            return True

    def unreserve(self, nbytes: int) -> None:
        """Give back `nbytes` that reserve held."""
        with self._lock:
            if not 0 <= nbytes <= self._reserved:
                raise RuntimeError(f"unreserve of {nbytes} bytes, {self._reserved} reserved")
            self._reserved -= nbytes

    def _evict(self, need: int) -> bool:
        """Free at least `need` bytes from unreferenced leaves, least recently used first."""
        heap = []
        stack = [self.root, *self._salted.values()]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.parent is not None and not n.children and n.ref_count == 0:
                heap.append((n.last_access, id(n), n))
        heapq.heapify(heap)
        freed = 0
        while freed < need and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.tokens]
            freed += leaf.payload.nbytes
            self._used -= leaf.payload.nbytes
            self._linear_used -= leaf.payload.linear_nbytes
            self._pages -= 1
            leaf.parent = None
            if parent.parent is not None and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        # a salt's root left without pages goes too (a client's many salts leave nothing behind)
        for salt in [k for k, r in self._salted.items() if not r.children and r.ref_count == 0]:
            del self._salted[salt]
        return freed >= need

    def evict(self, nbytes: int) -> int:
        """Free up to `nbytes` from unreferenced leaves; returns the bytes freed."""
        with self._lock:
            before = self._used
            self._evict(nbytes)
            return before - self._used

    def __len__(self) -> int:
        return self._pages

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def reserved_bytes(self) -> int:
        """Bytes held for states not in a page yet (reserve); used_bytes + reserved_bytes never
        passes capacity_bytes."""
        return self._reserved

    @property
    def linear_bytes(self) -> int:
        return self._linear_used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity
