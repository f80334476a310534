"""Routed experts of the MoE blocks (SwiGLU experts, weights fused as 3-D tensors): the per-expert
loop (naive.py, the reference), one grouped GEMM over the token-expert pairs sorted by expert
(grouped.py, torch's grouped matrix multiply) and a Triton fused-MoE kernel over expert-aligned
blocks (triton.py). The last two issue a fixed sequence of ops whatever the routing: no host
synchronisation, so a step that runs them can be captured in a CUDA graph."""

from hybridcache.kernels.ops.moe.grouped import grouped_experts, grouped_mm_supported, sort_by_expert
from hybridcache.kernels.ops.moe.naive import naive_experts

__all__ = ["grouped_experts", "grouped_mm_supported", "naive_experts", "sort_by_expert"]
