"""Gated activations of the models' MLPs (SwiGLU: silu(gate) * up): reference (naive.py) and one
Triton kernel (triton.py)."""
