"""Kimi delta attention (per-channel gated delta rule, dense T): reference with fused transition."""

from hybridcache.kernels.ops.kda.naive import naive_recurrent_kda

__all__ = ["naive_recurrent_kda"]
