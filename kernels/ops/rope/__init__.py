"""Rotary position embedding of attention heads, optionally after the head's RMSNorm: reference
(naive.py) and one Triton kernel (triton.py)."""
