"""Row norms of the hybrid models (RMSNorm, gated RMSNorm, L2 norm): reference (naive.py) and one
Triton kernel (triton.py)."""
