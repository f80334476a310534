"""One decode token of the linear recurrences, states updated in place in their pool slots."""

from hybridcache.kernels.ops.recurrent_step.naive import naive_recurrent_step

__all__ = ["naive_recurrent_step"]
