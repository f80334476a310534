"""The parallel modules a sharded model is made of (Megatron-LM's layout, as vLLM has it).

A column-parallel projection is an ordinary nn.Linear holding a rank's rows (its heads' outputs),
so it needs no module of its own; shard.py slices it. The modules here communicate:
RowParallelLinear sums the ranks' partial products (one all-reduce), VocabParallelEmbedding sums
the ranks' rows of the vocabulary, ParallelLMHead gathers the ranks' logits, and HeadShardedRMSNorm
normalises over channels spread across ranks. Every collective runs on the default process group,
which is the tensor-parallel group (ranks.py starts it).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of x over the ranks, in place on a contiguous x (returned)."""
    if world_size() == 1:
        return x
    x = x.contiguous()
    dist.all_reduce(x)
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    """The ranks' x [..., n] side by side along the last dim: [..., world * n]."""
    n = world_size()
    if n == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b where x [.., in] holds this rank's input channels and `weight` [out, in_local]
    the matching columns: the ranks' partial products are summed by one all-reduce, the bias
    (replicated) is added once after it."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x):
        y = all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding table: a token outside them embeds to zeros here,
    and the sum over ranks (one all-reduce) is the full table's row."""

    def __init__(self, weight: torch.Tensor, start: int, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.vocab_size = start, vocab_size
        self.embedding_dim = weight.shape[1]

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill(outside[..., None], 0.0))


class ParallelLMHead(nn.Module):
    """Rows [start, start + n) of the LM head, padded with zero rows to an equal share per rank so
    that the ranks' logits gather into one [.., padded vocab] tensor, cut back to `vocab_size`."""

    def __init__(self, weight: torch.Tensor, vocab_size: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.vocab_size = vocab_size

    def forward(self, x):
        return all_gather_last(F.linear(x, self.weight))[..., : self.vocab_size]


class HeadShardedRMSNorm(nn.Module):
    """RMSNorm over `dim` channels of which this rank holds `weight`'s (whole heads): the sum of
    squares is all-reduced, and divided by `replicas` where every channel is held by that many
    ranks (key heads replicated when there are fewer of them than ranks)."""

    def __init__(self, weight: torch.Tensor, dim: int, eps: float, replicas: int = 1):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.dim, self.eps, self.replicas = dim, eps, replicas

    def forward(self, x):
        xf = x.float()
        sq = all_reduce(xf.pow(2).sum(-1, keepdim=True))
        if self.replicas > 1:
            sq = sq / self.replicas
        xf = xf * torch.rsqrt(sq / self.dim + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def reduce_output(module: nn.Module) -> nn.Module:
    """Make `module` all-reduce its output (a module whose output is one rank's partial sum, e.g.
    routed experts holding a slice of every expert's intermediate channels)."""
    module.register_forward_hook(lambda _m, _args, out: all_reduce(out))
    return module
