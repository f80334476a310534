"""Short causal convolution with conv state in and tail out."""

from hybridcache.kernels.ops.causal_conv.naive import (
    loop_causal_conv1d,
    naive_causal_conv1d,
    naive_causal_conv1d_update,
)

__all__ = ["loop_causal_conv1d", "naive_causal_conv1d", "naive_causal_conv1d_update"]
