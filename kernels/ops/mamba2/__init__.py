"""Mamba2 SSD (scalar T; D skip and gate outside the recurrence): reference scan with fused transition."""

from hybridcache.kernels.ops.mamba2.naive import naive_ssd

__all__ = ["naive_ssd"]
