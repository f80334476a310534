"""Token sampling under temperature, top-k, top-p and min-p: the reference distribution."""

from hybridcache.kernels.ops.sampling.naive import naive_sampling_probs

__all__ = ["naive_sampling_probs"]
