"""Segment entries: the cached body of one segment, keyed by what determines its content."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from hybridcache.services.config import ENTRY_STATE_DTYPES as ENTRY_STATE_DTYPE_NAMES
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.plan import CACHE_FORMAT, segment_key  # noqa: F401 (re-exported)
from hybridcache.services.runtime.plan import expected_entry_nbytes as plan_entry_nbytes
from hybridcache.services.runtime.sequence import SpanData


def _tensors(data: SpanData):
    for i in sorted(data.linear):
        s = data.linear[i]
        yield s.T
        yield s.S
        yield s.conv_tail
    for i in sorted(data.attn):
        a = data.attn[i]
        yield a.k
        yield a.v


def entry_nbytes(data: SpanData) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(data))


def expected_entry_nbytes(
    cfg: ModelConfig, body_tokens: int, dtype: torch.dtype, state_dtype: torch.dtype = torch.float32
) -> int:
    """plan.expected_entry_nbytes for torch dtypes."""
    return plan_entry_nbytes(cfg, body_tokens, str(dtype).removeprefix("torch."),
                             str(state_dtype).removeprefix("torch."))


ENTRY_STATE_DTYPES = {name: getattr(torch, name) for name in ENTRY_STATE_DTYPE_NAMES}


def cast_entry_states(data: SpanData, dtype: torch.dtype) -> SpanData:
    """Every linear layer's T and S(body|0) stored in `dtype`, in place (returned). bf16 halves the
    dense T and S, the bulk of a delta-rule entry (a Qwen3.5-9B 1k-token entry: 129 -> 81 MB);
    composition still accumulates the running state in fp32."""
    from hybridcache.services.runtime.sequence import LinearSpan

    for i, span in data.linear.items():
        if span.T.dtype != dtype or span.S.dtype != dtype:
            data.linear[i] = LinearSpan(T=span.T.to(dtype), S=span.S.to(dtype), conv_tail=span.conv_tail)
    return data


def entry_checksum(data: SpanData) -> str:
    """sha256 over every tensor's shape, dtype and bytes, in a canonical order."""
    h = hashlib.sha256()
    h.update(f"{data.num_tokens}|{data.local_start}".encode())
    for t in _tensors(data):
        c = t.detach().contiguous().cpu()
        h.update(f"{tuple(c.shape)}{c.dtype}".encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


@dataclass(slots=True)
class SegmentEntry:
    key: str
    segment_tokens: int  # whole segment, seam included
    data: SpanData  # the body
    build_seconds: float
    nbytes: int = 0
    checksum: str = ""
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.nbytes:
            self.nbytes = entry_nbytes(self.data)

    def seal(self) -> SegmentEntry:
        """Compute the checksum (done once, when the entry leaves the process that built it)."""
        self.checksum = entry_checksum(self.data)
        return self

    def verify(self) -> bool:
        return not self.checksum or self.checksum == entry_checksum(self.data)
