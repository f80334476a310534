"""Segment entries: the cached body of one segment, keyed by what determines its content."""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field

import torch
from hybridcache.services.config import ENTRY_STATE_DTYPES as ENTRY_STATE_DTYPE_NAMES
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.sequence import SpanData

CACHE_FORMAT = "hc-entry-v1"


def segment_key(fingerprint: str, seam_window: int, token_ids) -> str:
    """hash(model fingerprint, cache format, w, token ids) (DESIGN §4)."""
    h = hashlib.sha256()
    h.update(f"{fingerprint}|{CACHE_FORMAT}|w={seam_window}|".encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *[int(t) for t in token_ids]))
    return h.hexdigest()


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
    """Bytes of an entry before it is built: T and S in `state_dtype` (fp32 unless the engine keeps
    them in bf16: EngineConfig.entry_state_dtype), conv tail and K/V in the model dtype."""
    if hasattr(cfg, "entry_nbytes"):  # non-Qwen architectures know their own layout (models/registry.py)
        return cfg.entry_nbytes(body_tokens, dtype, state_dtype)
    esz = torch.tensor([], dtype=dtype).element_size()
    ssz = torch.tensor([], dtype=state_dtype).element_size()
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    conv_dim = 2 * cfg.linear_num_key_heads * dk + hv * dv
    per_linear = ssz * (hv * dk * dk + hv * dk * dv) + esz * conv_dim * (cfg.linear_conv_kernel_dim - 1)
    per_attn = 2 * esz * cfg.num_key_value_heads * cfg.head_dim * body_tokens
    return len(cfg.linear_layers) * per_linear + len(cfg.attention_layers) * per_attn


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
