"""Routed experts of the MoE blocks (SwiGLU experts, weights fused as 3-D tensors): the per-expert
loop (naive.py, the reference), one grouped GEMM over the token-expert pairs sorted by expert
(grouped.py, torch's grouped matrix multiply) and a Triton fused-MoE kernel over expert-aligned
blocks (triton.py), and for a few token-expert pairs (decode) pair-major GEMV kernels with the
shared expert folded in and a one-launch softmax top-k router (triton.py). The fast paths issue a
fixed sequence of ops whatever the routing: no host synchronisation, so a step that runs them can
be captured in a CUDA graph."""

from hybridcache.kernels.ops.moe.grouped import grouped_experts, grouped_mm_supported, sort_by_expert
from hybridcache.kernels.ops.moe.naive import SharedExpert, naive_experts, naive_shared_expert

__all__ = [
    "SharedExpert",
    "grouped_experts",
    "grouped_mm_supported",
    "naive_experts",
    "naive_shared_expert",
    "sort_by_expert",
]
