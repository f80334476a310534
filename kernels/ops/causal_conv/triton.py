"""Short depthwise causal convolution with state in and tail out (Triton); reference: naive.py.

One program computes a [BT, BD] tile of the output. Inputs before the run (negative time) come
from the conv state, the previous W - 1 inputs; the new tail is the last W - 1 of state ++ x.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.heuristics(
    {
        "USE_INITIAL_STATE": lambda args: args["h0"] is not None,
        "USE_BIAS": lambda args: args["bias"] is not None,
    }
)
@triton.jit
def causal_conv1d_fwd_kernel(
    x,
    weight,
    bias,
    h0,
    y,
    T,
    D: tl.constexpr,
    W: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    ACTIVATION: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    USE_BIAS: tl.constexpr,
):
    i_t, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b = tl.program_id(2).to(tl.int64)
    o_t = i_t * BT + tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t = o_t < T
    m_d = o_d < D
    b_y = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        # input time of tap j; negative times read the state's slot W - 1 + src
        src = o_t - (W - 1) + j  # [BT]
        m_x = (src >= 0) & m_t
        p_x = x + (i_b * T + src)[:, None] * D + o_d[None, :]
        b_x = tl.load(p_x, mask=m_x[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        if USE_INITIAL_STATE:
            m_s = (src < 0) & m_t
            p_s = h0 + i_b * D * (W - 1) + o_d[None, :] * (W - 1) + (W - 1 + src)[:, None]
            b_x += tl.load(p_s, mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)  # [BD]
        b_y += b_x * b_w[None, :]
    if USE_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    if ACTIVATION == "silu":
        b_y = b_y * tl.sigmoid(b_y)
    p_y = y + (i_b * T + o_t)[:, None] * D + o_d[None, :]
    tl.store(p_y, b_y.to(y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
    block_t: int | None = None,
    block_d: int | None = None,
):
    """Same contract as naive_causal_conv1d: x [B, T, D], weight [D, W], bias [D], state [B, D, W - 1].

    Returns y [B, T, D] (dtype of x) and the tail [B, D, W - 1] (dtype of x).
    """
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    B, T, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [{D}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if initial_state is not None and initial_state.shape != (B, D, W - 1):
        raise ValueError(f"initial_state must be [{B}, {D}, {W - 1}], got {tuple(initial_state.shape)}")
    x, weight = x.contiguous(), weight.contiguous()
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    state = initial_state if initial_state is not None else x.new_zeros(B, D, W - 1)
    tail = torch.cat([state.to(x.dtype), x[:, max(0, T - (W - 1)) :].transpose(1, 2)], dim=-1)
    tail = tail[..., tail.shape[-1] - (W - 1) :].contiguous()
    y = torch.empty_like(x)
    if T == 0:
        return y, tail
    on_gpu = x.is_cuda
    BT = block_t or (64 if on_gpu else max(16, triton.next_power_of_2(T)))
    BD = block_d or (128 if on_gpu else max(16, triton.next_power_of_2(D)))
    grid = (triton.cdiv(T, BT), triton.cdiv(D, BD), B)
    causal_conv1d_fwd_kernel[grid](
        x=x,
        weight=weight,
        bias=bias,
        h0=initial_state,
        y=y,
        T=T,
        D=D,
        W=W,
        BT=BT,
        BD=BD,
        ACTIVATION=activation or "",
    )
    return y, tail


@triton.heuristics({"USE_BIAS": lambda args: args["bias"] is not None})
@triton.jit
def causal_conv1d_update_kernel(
    x,
    weight,
    bias,
    state,
    slots,
    y,
    stride_x,
    D: tl.constexpr,
    W: tl.constexpr,
    BD: tl.constexpr,
    ACTIVATION: tl.constexpr,
    USE_BIAS: tl.constexpr,
):
    i_b, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    slot = tl.load(slots + i_b).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_s = state + slot * D * (W - 1) + o_d * (W - 1)
    b_x = tl.load(x + i_b * stride_x + o_d, mask=m_d, other=0.0)
    b_y = b_x.to(tl.float32) * tl.load(weight + o_d * W + (W - 1), mask=m_d, other=0.0).to(tl.float32)
    # the state's taps, oldest first; each moves one place down once all are read
    prev = tl.load(p_s, mask=m_d, other=0.0)
    for j in tl.static_range(W - 1):
        b_y += prev.to(tl.float32) * tl.load(weight + o_d * W + j, mask=m_d, other=0.0).to(tl.float32)
        if j < W - 2:
            nxt = tl.load(p_s + (j + 1), mask=m_d, other=0.0)
            tl.store(p_s + j, nxt, mask=m_d)
            prev = nxt
    tl.store(p_s + (W - 2), b_x.to(state.dtype.element_ty), mask=m_d)
    if USE_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if ACTIVATION == "silu":
        b_y = b_y * tl.sigmoid(b_y)
    tl.store(y + i_b * D + o_d, b_y.to(y.dtype.element_ty), mask=m_d)


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
    block_d: int | None = None,
) -> torch.Tensor:
    """naive_causal_conv1d_update's contract: x [B, D] (rows may be strided, a slice of a
    projection's columns), weight [D, W], bias [D], conv_state [S, D, W - 1] contiguous (the pool),
    slots [B]. Returns y [B, D] (x's dtype); the slots' states advance in place."""
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    B, D = x.shape
    if weight.dim() != 2 or weight.shape[0] != D:
        raise ValueError(f"weight must be [{D}, W], got {tuple(weight.shape)}")
    W = weight.shape[1]
    if W < 2:
        raise ValueError("a conv of width 1 keeps no state")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (D, W - 1) or not conv_state.is_contiguous():
        raise ValueError(f"conv_state must be contiguous [S, {D}, {W - 1}], got {tuple(conv_state.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.empty(B, D, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    BD = block_d or min(triton.next_power_of_2(D), 256 if x.is_cuda else 1024)
    causal_conv1d_update_kernel[(B, triton.cdiv(D, BD))](
        x=x,
        weight=weight.contiguous(),
        bias=bias,
        state=conv_state,
        slots=slots if slots.is_contiguous() else slots.contiguous(),
        y=y,
        stride_x=x.stride(0),
        D=D,
        W=W,
        BD=BD,
        ACTIVATION=activation or "",
    )
    return y
