"""Gated delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid): reference, chunked PyTorch path, transition T."""

from hybridcache.kernels.ops.gated_delta_rule.chunk import chunk_gated_delta_rule
from hybridcache.kernels.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule, naive_transition

__all__ = ["chunk_gated_delta_rule", "naive_recurrent_gated_delta_rule", "naive_transition"]
