"""Scalar-decay linear attention (simple GLA, RetNet, Lightning; scalar T): reference recurrence."""

from hybridcache.kernels.ops.simple_gla.naive import (
    lightning_slopes,
    naive_lightning_attention,
    naive_recurrent_simple_gla,
)

__all__ = ["lightning_slopes", "naive_lightning_attention", "naive_recurrent_simple_gla"]
