"""Short depthwise causal convolution with state in and tail out (pure PyTorch reference).

The state of a causal conv of width W is the last W - 1 inputs it has seen (the *conv tail*);
a cached segment stores its tail so the conv of whatever follows it is warmed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    activation: str | None = "silu",
):
    """y_t = act(sum_j w[:, j] * x_{t - W + 1 + j} + b), inputs before the run taken from the state.

    Args:
        x: [B, T, D] inputs.
        weight: [D, W].
        bias: [D] or None.
        initial_state: [B, D, W - 1], the previous W - 1 inputs, oldest first (zeros if None).
        activation: "silu" or None.

    Returns:
        y [B, T, D] (dtype of x), tail [B, D, W - 1] (the last W - 1 inputs, including the state's
        when T < W - 1).
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    xt = x.transpose(1, 2).float()  # [B, D, T]
    if initial_state is None:
        initial_state = torch.zeros(B, D, W - 1, dtype=torch.float32, device=x.device)
    if T == 0:
        return x.new_zeros(B, 0, D), initial_state.to(x.dtype).clone()
    full = torch.cat([initial_state.float(), xt], dim=-1)  # [B, D, W - 1 + T]
    y = F.conv1d(full, weight.float().unsqueeze(1), bias.float() if bias is not None else None, groups=D)
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    tail = full[..., full.shape[-1] - (W - 1) :].clone()
    return y.transpose(1, 2).to(x.dtype), tail.to(x.dtype)


def loop_causal_conv1d(x, weight, bias=None, initial_state=None, activation="silu"):
    """The same op written as an explicit loop over time: the definition the fast one is tested against."""
    B, T, D = x.shape
    W = weight.shape[-1]
    window = (
        torch.zeros(B, D, W - 1, dtype=torch.float32, device=x.device)
        if initial_state is None
        else initial_state.float().clone()
    )
    ys = []
    for t in range(T):
        window = torch.cat([window, x[:, t, :, None].float()], dim=-1)  # [B, D, W]
        y = (window * weight.float()).sum(-1)
        if bias is not None:
            y = y + bias.float()
        ys.append(F.silu(y) if activation == "silu" else y)
        window = window[..., 1:]
    return torch.stack(ys, dim=1).to(x.dtype), window.to(x.dtype)


def naive_causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One new input of each of B sequences whose conv states are rows `slots` of a pool, the
    states updated in place (a decode step: no copy of the batch's states out and back).

    Args:
        x: [B, D] the new inputs.
        weight: [D, W]; bias: [D] or None.
        conv_state: [S, D, W - 1] the pool (the previous W - 1 inputs of each slot, oldest first).
        slots: [B] int64, distinct (a padding row may share the scratch slot: its result is undefined).
        activation: "silu" or None.

    Returns:
        y [B, D] (dtype of x); conv_state[slots] holds the last W - 1 inputs, x's included.
    """
    if activation not in ("silu", None):
        raise ValueError(f"unsupported conv activation {activation!r}")
    window = torch.cat([conv_state[slots].float(), x.float()[..., None]], dim=-1)  # [B, D, W]
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    if activation == "silu":
        y = F.silu(y)
    conv_state.index_copy_(0, slots, window[..., 1:].to(conv_state.dtype))
    return y.to(x.dtype)
