"""A batched build's per-segment pieces: the conv tails gathered at once, and the copies each entry
keeps in storage of its own (backends.own_copies), against the per-segment slices they replace."""

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models.mixer import conv_tails


def test_conv_tails_are_each_segment_s_last_inputs_with_zeros_before_its_start():
    g = torch.Generator().manual_seed(0)
    B, L, D, W1 = 4, 9, 5, 3
    mixed = torch.randn(B, L, D, generator=g)
    lengths = [9, 4, 2, 1]  # two shorter than W1: zeros before their first input
    got = conv_tails(mixed, lengths, W1)
    assert got.shape == (B, D, W1) and got.is_contiguous()
    for j, n in enumerate(lengths):
        last = mixed[j : j + 1, max(0, n - W1) : n].transpose(1, 2)
        want = torch.cat([torch.zeros(1, D, W1), last], dim=-1)[..., -W1:]
        assert torch.equal(got[j : j + 1], want), j


def test_own_copies_are_equal_contiguous_and_share_no_storage():
    g = torch.Generator().manual_seed(1)
    T = torch.randn(3, 2, 4, 4, generator=g)
    k = torch.randn(3, 6, 2, 4, generator=g).to(torch.bfloat16).transpose(1, 2)  # [B, H, L, d], strided
    views = [T[j : j + 1] for j in range(3)] + [k[j : j + 1, :, 1:5] for j in range(3)]
    copies = backends.own_copies(views)
    ptrs = set()
    for v, c in zip(views, copies):
        assert torch.equal(c, v) and c.dtype == v.dtype and c.is_contiguous()
        ptrs.add(c.untyped_storage().data_ptr())
        assert c.untyped_storage().nbytes() == c.numel() * c.element_size()  # nothing of the batch kept
    assert len(ptrs) == len(views)
    T.zero_()
    assert copies[0].abs().sum() > 0  # the batch's storage can go: the copies do not read it
    assert backends.own_copies([]) == []
