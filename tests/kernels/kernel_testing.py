"""Shared helpers for kernel tests (imported as a plain module: tests/ has no __init__.py)."""

import torch


def rel_rms(a, b):
    """Relative RMS error of a against the reference b."""
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"
