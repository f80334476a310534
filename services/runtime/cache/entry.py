"""Segment entries: the cached body of one segment, keyed by what determines its content."""

from __future__ import annotations

import hashlib
import hmac
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


SEAL_PREFIX = "hmac-sha256:"


def entry_checksum(key: str, segment_tokens: int, data: SpanData) -> str:
    """The entry's seal: an HMAC-SHA256, keyed by the deployment's sealing key (services/security.py),
    over its key, segment length, body length, seam and every tensor's shape, dtype and bytes in a
    canonical order. Only a holder of the deployment secret can make one that verifies, and it binds
    the tensors to their key: a real entry copied under another key does not verify either."""
    from hybridcache.services.security import seal_key

    h = hmac.new(seal_key(), digestmod=hashlib.sha256)
    h.update(f"{key}|{segment_tokens}|{data.num_tokens}|{data.local_start}".encode())
    for t in _tensors(data):
        c = t.detach().contiguous().cpu()
        h.update(f"{tuple(c.shape)}{c.dtype}".encode())
        h.update(c.view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return SEAL_PREFIX + h.hexdigest()


@dataclass(frozen=True)
class EntryLayout:
    """The tensors an entry of one engine holds, per layer: (name, dtype, shape) in codec order,
    the token dimension of attention K/V ([1, Hkv, n, d]) left as -1. Learnt from an entry the
    engine built (`of`), it checks entries that came from elsewhere (`check`)."""

    seam_window: int
    linear: dict[int, tuple[tuple[str, str, tuple[int, ...]], ...]]
    attn: dict[int, tuple[tuple[str, str, tuple[int, ...]], ...]]

    @staticmethod
    def _spec(t: torch.Tensor, token_dim: int | None = None) -> tuple[str, tuple[int, ...]]:
        shape = tuple(t.shape)
        if token_dim is not None:
            shape = shape[:token_dim] + (-1,) + shape[token_dim + 1:]
        return str(t.dtype).removeprefix("torch."), shape

    @classmethod
    def of(cls, entry: SegmentEntry) -> EntryLayout:
        d = entry.data
        linear = {i: tuple((n, *cls._spec(getattr(s, n))) for n in ("T", "S", "conv_tail"))
                  for i, s in d.linear.items()}
        attn = {i: tuple((n, *cls._spec(getattr(a, n), 2)) for n in ("k", "v")) for i, a in d.attn.items()}
        return cls(d.local_start, linear, attn)

    def check(self, entry: SegmentEntry, segment_tokens: int) -> str | None:
        """None when `entry` is what this engine would build for a segment of `segment_tokens`
        tokens; otherwise what differs."""
        d = entry.data
        body = segment_tokens - self.seam_window
        if (entry.segment_tokens, d.num_tokens, d.local_start) != (segment_tokens, body, self.seam_window):
            return (f"entry of {entry.segment_tokens} tokens (body {d.num_tokens} from {d.local_start}) for a "
                    f"segment of {segment_tokens} tokens (body {body} from {self.seam_window})")
        if set(d.linear) != set(self.linear) or set(d.attn) != set(self.attn):
            return "entry layers differ from the model's"
        for i, s in d.linear.items():
            for name, dtype, shape in self.linear[i]:
                if self._spec(getattr(s, name)) != (dtype, shape):
                    return f"layer {i} {name}: {self._spec(getattr(s, name))}, expected {(dtype, shape)}"
        for i, a in d.attn.items():
            for name, dtype, shape in self.attn[i]:
                t = getattr(a, name)
                if self._spec(t, 2) != (dtype, shape) or t.shape[2] != body:
                    return f"layer {i} {name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype} with n={body}"
        return None


@dataclass(slots=True, weakref_slot=True)
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
        """Compute the seal (done once, when the entry leaves the process that built it)."""
        self.checksum = entry_checksum(self.key, self.segment_tokens, self.data)
        return self

    def verify(self) -> bool:
        """True when the entry is unsealed (it never left its process) or its seal verifies."""
        return not self.checksum or hmac.compare_digest(
            self.checksum, entry_checksum(self.key, self.segment_tokens, self.data))
