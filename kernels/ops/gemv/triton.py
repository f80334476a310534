"""y = x W^T (+ bias) for one row x in one Triton launch; reference: naive.py.

At one row a linear layer is a matrix-vector product bound by reading W once: the time it can
take is W's bytes at the GPU's copy bandwidth. cuBLAS runs it as a GEMM with an 8-row tile, and
for few outputs (N = 4096 of a 12288-wide input) as split-K with a second reduce launch; on an
H100 those reached 81 % of the copy bandwidth on the Qwen3.5-9B shape's down and output
projections (benchmarks/results/profile_decode_9b_h100_faa5b0e.json).

Here one program reads BN whole rows of W, BK columns at a time, multiplies by x in fp32 and keeps
a [BN, BK] partial sum that it reduces once at the end: no split-K, no second launch, N / BN
programs each streaming BN * K contiguous elements. The block shape and warps are a GemvConfig;
backends.plan_gemv measures the configs of CONFIGS against cuBLAS on the device, per weight
shape, and keeps the fastest. N and K are runtime arguments, so each (config, dtypes, bias or
not) compiles once for every shape.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class GemvConfig(NamedTuple):
    BN: int  # rows of W a program
    BK: int  # columns a step
    num_warps: int
    num_stages: int


CONFIGS = (
    GemvConfig(4, 512, 4, 3),
    GemvConfig(8, 256, 4, 3),
    GemvConfig(8, 512, 4, 3),
    GemvConfig(8, 512, 8, 3),
    GemvConfig(16, 256, 4, 3),
    GemvConfig(16, 512, 8, 2),
    # a row or two a program: few outputs (a MoE router's 256 or 512) still spread over every SM
    GemvConfig(1, 1024, 4, 2),
    GemvConfig(2, 1024, 4, 2),
)
DEFAULT = GemvConfig(8, 512, 4, 3)


@triton.jit(do_not_specialize=["N", "K"])
def gemv_kernel(x, w, bias, y, N, K, stride_w, BN: tl.constexpr, BK: tl.constexpr, HAS_BIAS: tl.constexpr):
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = rows < N
    base = w + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BN, BK], dtype=tl.float32)
    for k0 in range(0, K, BK):
        cols = k0 + tl.arange(0, BK)
        cmask = cols < K
        b_w = tl.load(base + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0)
        b_x = tl.load(x + cols, mask=cmask, other=0.0)
        acc += b_w.to(tl.float32) * b_x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(bias + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=rmask)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig = DEFAULT) -> torch.Tensor:
    """x [..., K] holding one row, w [N, K] (rows may be strided, columns unit-stride), bias [N] or
    None: x W^T + bias as [..., N] in x's dtype, fp32 inside."""
    K = x.shape[-1]
    if x.numel() != K:
        raise ValueError(f"gemv takes one row, got x {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"w {tuple(w.shape)} does not match x's {K} columns")
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"bias {tuple(bias.shape)} does not match w's {w.shape[0]} rows")
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, w on {w.device}")
    N = w.shape[0]
    if w.stride(1) != 1:
        w = w.contiguous()
    xv = x.reshape(K)
    if xv.stride(0) != 1:
        xv = xv.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    if K == 0:
        return y.zero_() if bias is None else y.copy_(bias)
    gemv_kernel[(triton.cdiv(N, config.BN),)](
        xv, w, bias if bias is not None else xv, y, N, K, w.stride(0), BN=config.BN, BK=config.BK,
        HAS_BIAS=bias is not None, num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y
