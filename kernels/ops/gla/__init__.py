"""Gated linear attention (diagonal gate, vector T): reference recurrence with fused transition."""

from hybridcache.kernels.ops.gla.naive import naive_recurrent_gla

__all__ = ["naive_recurrent_gla"]
