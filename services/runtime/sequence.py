"""What the model runs on: live runs and cached spans in position order, and the running state.

A request's prompt becomes a *layout*: LiveRun pieces (tokens the model computes) and CachedSpan
pieces (bodies of cached segments, folded in without running the model). The model keeps, per
layer, the state a forward leaves behind (SequenceState), so decode is just one more LiveRun.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(slots=True, weakref_slot=True)
class LinearSpan:
    """One linear layer's summary of a cached body: S_end = T S_start + S(body|0)."""

    T: torch.Tensor  # [1, H, K, K] (matrix families); [1, H, K] vector; [1, H] scalar
    S: torch.Tensor  # [1, H, K, V] fp32, S(body|0)
    conv_tail: torch.Tensor  # [1, D, W - 1], the body's last W - 1 conv inputs


@dataclass(slots=True, weakref_slot=True)
class AttnSpan:
    """One attention layer's body K/V, K rotated at segment-local positions."""

    k: torch.Tensor  # [1, Hkv, n, d]
    v: torch.Tensor  # [1, Hkv, n, d]


@dataclass(slots=True, weakref_slot=True)
class SpanData:
    """The per-layer data of a cached body (a segment entry's payload)."""

    num_tokens: int
    local_start: int  # local position of the body's first token (the seam window w)
    linear: dict[int, LinearSpan]
    attn: dict[int, AttnSpan]


class ArrivingLayers(Mapping):
    """layer -> LinearSpan / AttnSpan whose tensors are still arriving (a receive posted, a copy
    queued on another stream); indexing a layer first waits for what carries it: any object with
    wait(), called before the layer's tensors are used. The forward thus starts before the last
    layer is there and waits only when it reaches a layer."""

    def __init__(self, spans: dict, waits: dict):
        self._spans = spans
        self._waits = waits  # layer -> object with wait()

    def __getitem__(self, layer):
        w = self._waits.get(layer)
        if w is not None:
            w.wait()
        return self._spans[layer]

    def __iter__(self):
        return iter(self._spans)

    def __len__(self):
        return len(self._spans)


@dataclass(slots=True, weakref_slot=True)
class LiveRun:
    token_ids: torch.Tensor  # [n] int64
    start: int  # absolute position of the first token
    # None | "entry": record T, S(run|0), conv tail and K/V of this run as a cacheable span
    record: str | None = None

    @property
    def end(self) -> int:
        return self.start + int(self.token_ids.numel())


@dataclass(slots=True, weakref_slot=True)
class CachedSpan:
    data: SpanData
    start: int  # absolute position of the body's first token
    use_transition: bool = True  # False: the naive-addition ablation

    @property
    def end(self) -> int:
        return self.start + self.data.num_tokens

    @property
    def shift(self) -> int:
        """Positions to rotate cached K by: absolute minus local."""
        return self.start - self.data.local_start


@dataclass(slots=True, weakref_slot=True)
class LinearState:
    ssm: torch.Tensor  # [1, H, K, V] fp32
    conv: torch.Tensor  # [1, D, W - 1]


@dataclass(slots=True, weakref_slot=True)
class AttnState:
    k: torch.Tensor  # [1, Hkv, N, d], rotated at absolute positions
    v: torch.Tensor  # [1, Hkv, N, d]

    def span(self, lo: int, hi: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) at positions lo..hi-1 (views); paged.PagedAttnState reads them out of its pages."""
        return self.k[:, :, lo:hi], self.v[:, :, lo:hi]


@dataclass(slots=True, weakref_slot=True)
class SequenceState:
    """Everything a forward leaves for the next one: per linear layer (S, conv), per attention layer KV."""

    length: int
    linear: dict[int, LinearState]
    attn: dict[int, AttnState]

    def clone(self) -> SequenceState:
        return SequenceState(
            length=self.length,
            linear={i: LinearState(s.ssm.clone(), s.conv.clone()) for i, s in self.linear.items()},
            attn={i: AttnState(a.k, a.v) for i, a in self.attn.items()},  # KV is never written in place
        )

    def nbytes(self) -> int:
        n = sum(
            s.ssm.numel() * s.ssm.element_size() + s.conv.numel() * s.conv.element_size() for s in self.linear.values()
        )
        n += sum(a.k.numel() * a.k.element_size() + a.v.numel() * a.v.element_size() for a in self.attn.values())
        return n


@dataclass
class Recording:
    """What a forward recorded, keyed by piece index in the layout: entries of LiveRuns with
    record="entry", per linear layer the state after each piece asked for, and the hidden states
    entering the layers asked for (prefix-cache anchors)."""

    entries: dict[int, SpanData] = field(default_factory=dict)
    # per-forward values every layer would otherwise rebuild (e.g. the batched scan's gather indices)
    scratch: dict = field(default_factory=dict)
    snapshots: dict[int, dict[int, LinearState]] = field(default_factory=dict)
    # layer index -> the residual stream entering that layer for every live token [n_live, h]
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    # set where the snapshots' tensors are views of a CUDA graph's outputs (graphs.AssemblyGraphs):
    # a callable, true while they still hold what this pass left (the graph has not run again);
    # whoever keeps them past that copies them first
    borrowed: object = None
