"""Routed experts as two grouped GEMMs over the token-expert pairs sorted by expert (torch's
grouped matrix multiply, as transformers' "grouped_mm" experts run it); reference: naive.py.

    pairs p = t * k + j (token t's j-th expert), P = n * k
    order = the pairs sorted by expert (stable), ends[e] = number of pairs with expert <= e
    h_sorted = x[order // k]                                     [P, h]
    gu = grouped_mm(h_sorted, gate_up^T, ends)                   [P, 2I]  rows of group e by expert e
    y = grouped_mm(silu(gu[:, :I]) * gu[:, I:], down^T, ends)    [P, h]
    out[t] = sum_j top_w[t, j] * y[pair t * k + j]               (one batched [1, k] @ [k, h] per token)

Every op runs on the device whatever the routing (the group sizes live in `ends`, never on the
host), so the op sequence depends on n only. On CUDA, torch's grouped GEMM is a CUTLASS kernel
for bf16 on sm90/sm100 only; other dtypes and GPUs take torch's fallback, which copies the offsets
to the host (a synchronisation). Row strides must be multiples of 16 bytes on every device:
grouped_mm_supported says where it applies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)

# Tokens per pass: a 32k-token prefill of the Qwen3.5-35B-A3B shape (top-8, h = 2048) holds about
# 1 GB of bf16 pair rows per [P, h] buffer per chunk of this size; larger passes run in chunks.
CHUNK_TOKENS = 8192


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these experts without a host synchronisation: row strides
    of 16 bytes (h and I multiples of 4 in fp32, 8 in bf16) and unit-stride weight rows, and on the
    CPU torch >= 2.10 (any of its dtypes), on CUDA bf16 on sm90/sm100 with 16-byte aligned weights."""
    if GROUPED_MM is None or not (x.dtype == gate_up.dtype == down.dtype):
        return False
    h, inter = down.shape[1], down.shape[2]
    align = 16 // x.element_size()
    if h % align or inter % align or gate_up.stride(-1) != 1 or down.stride(-1) != 1:
        return False
    if x.device.type == "cpu":
        return TorchVersion(torch.__version__) >= "2.10"
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(x.device)[0] not in (9, 10):
        return False
    return gate_up.data_ptr() % 16 == 0 and down.data_ptr() % 16 == 0


def sort_by_expert(top_i: torch.Tensor, num_experts: int, leading_zero: bool = False):
    """top_i [n, k] -> (experts [P] sorted, order [P] the pairs in that order (int64), ends [E]
    int32: the number of pairs whose expert is <= e; with leading_zero, [E + 1] with a 0 first, so
    that group e is rows ends[e]:ends[e + 1]). Stable: a group keeps its pairs' order."""
    experts, order = torch.sort(top_i.reshape(-1), stable=True)
    ids = torch.arange(-int(leading_zero), num_experts, device=top_i.device, dtype=experts.dtype)
    ends = torch.searchsorted(experts, ids, right=True, out_int32=True)
    return experts, order, ends


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_i: torch.Tensor,
                    top_w: torch.Tensor, silu_mul: Callable | None = None) -> torch.Tensor:
    """x [n, h], gate_up [E, 2I, h], down [E, h, I], top_i / top_w [n, k] -> out [n, h] in x's dtype.
    silu_mul(gate, up) -> silu(gate) * up may be a fused kernel that reads the two halves in place."""
    n = x.shape[0]
    if n > CHUNK_TOKENS:
        return torch.cat([grouped_experts(x[s: s + CHUNK_TOKENS], gate_up, down, top_i[s: s + CHUNK_TOKENS],
                                          top_w[s: s + CHUNK_TOKENS], silu_mul) for s in range(0, n, CHUNK_TOKENS)])
    k, h, inter = top_i.shape[1], x.shape[1], down.shape[2]
    _, order, ends = sort_by_expert(top_i, gate_up.shape[0])
    rows = x.index_select(0, order // k)  # [P, h], grouped by expert
    gu = GROUPED_MM(rows, gate_up.transpose(1, 2), offs=ends)  # [P, 2I]
    act = (silu_mul or _silu_mul)(gu[:, :inter], gu[:, inter:])  # [P, I]
    y = GROUPED_MM(act, down.transpose(1, 2), offs=ends)  # [P, h]
    by_pair = torch.empty((n * k, h), dtype=y.dtype, device=y.device).index_copy_(0, order, y)
    return torch.bmm(top_w.reshape(n, 1, k).to(y.dtype), by_pair.view(n, k, h)).view(n, h).to(x.dtype)
