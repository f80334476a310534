"""Routed experts (kernels/ops/moe): the grouped-GEMM path and the Triton fused-MoE kernel against
the per-expert loop (naive.py) on odd shapes, with experts no token chose and tokens whose experts
repeat across the batch; fp32 on CPU (Triton under its interpreter), bf16 on a GPU, where neither
fast path may synchronise the host."""

import pytest
import torch
from hybridcache.kernels.ops.moe import grouped_experts, grouped_mm_supported, naive_experts, sort_by_expert
from kernel_testing import FusedConfig, device, fused_experts, rel_rms


def problem(E, h, inter, n, k, dtype=torch.float32, unused=(), seed=0):
    """x [n, h], gate_up [E, 2I, h], down [E, h, I], top_i / top_w [n, k]: k distinct experts per
    token, none of them in `unused`."""
    g = torch.Generator().manual_seed(seed)
    live = torch.tensor([e for e in range(E) if e not in unused])
    top_i = torch.stack([live[torch.randperm(len(live), generator=g)[:k]] for _ in range(n)])
    top_w = torch.softmax(torch.randn(n, k, generator=g), -1)
    x = torch.randn(n, h, generator=g)
    gate_up = torch.randn(E, 2 * inter, h, generator=g) / h**0.5
    down = torch.randn(E, h, inter, generator=g) / inter**0.5
    dev = device()
    return [t.to(dev, dtype) for t in (x, gate_up, down)] + [top_i.to(dev), top_w.to(dev, dtype)]


def test_sort_by_expert_groups_pairs_stably():
    top_i = torch.tensor([[2, 0], [2, 3], [0, 2]])
    experts, order, ends = sort_by_expert(top_i, 5)
    assert experts.tolist() == [0, 0, 2, 2, 2, 3]
    assert order.tolist() == [1, 4, 0, 2, 5, 3]  # pairs t * k + j, in their order within a group
    assert ends.dtype == torch.int32 and ends.tolist() == [2, 2, 5, 6, 6]
    assert sort_by_expert(top_i, 5, leading_zero=True)[2].tolist() == [0, 2, 2, 5, 6, 6]


@pytest.mark.parametrize("E,h,inter,n,k", [(6, 36, 20, 5, 2), (4, 64, 48, 1, 2), (8, 40, 24, 23, 3)],
                         ids=["E6-h36-I20-n5", "E4-h64-I48-n1", "E8-h40-I24-n23"])
def test_grouped_experts_equal_the_loop(E, h, inter, n, k):
    x, gu, d, ti, tw = problem(E, h, inter, n, k, unused=(1,))
    if not grouped_mm_supported(x, gu, d):
        pytest.skip("torch's grouped GEMM does not run these tensors without a host sync here")
    ref = naive_experts(x, gu, d, ti, tw)
    got = grouped_experts(x, gu, d, ti, tw)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_rms(got, ref) < 1e-6
    # the routing weights matter: another weighting is far off
    assert rel_rms(grouped_experts(x, gu, d, ti, tw.flip(-1)), ref) > 1e-2


@pytest.mark.parametrize("E,h,inter,n,k,cfg", [
    (6, 33, 20, 5, 2, FusedConfig(16, 16, 32)),
    (4, 64, 48, 1, 2, FusedConfig(16, 32, 64)),
    (5, 40, 24, 9, 3, FusedConfig(32, 16, 16)),
], ids=["E6-h33-I20-n5", "E4-h64-I48-n1", "E5-h40-I24-n9"])
def test_fused_kernel_equals_the_loop(E, h, inter, n, k, cfg):
    """Blocks of one expert padded to BM rows, odd widths (masked tails), an unused expert, more
    blocks in the grid than the routing fills (programs past the last block return)."""
    x, gu, d, ti, tw = problem(E, h, inter, n, k, unused=(E - 2,))
    got = fused_experts(x, gu, d, ti, tw, cfg)
    ref = naive_experts(x, gu, d, ti, tw)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_rms(got, ref) < 1e-6
    with pytest.raises(ValueError, match="do not fit"):
        fused_experts(x, gu, d[:, :-1], ti, tw, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 32, 3000])
def test_fast_paths_bf16_gpu_without_host_sync(n):
    """The Qwen3.5-35B-A3B expert shape (256 experts, top-8, h = 2048, I = 512) in bf16: both fast
    paths equal the loop within bf16 rounding and issue no host synchronisation."""
    x, gu, d, ti, tw = problem(256, 2048, 512, n, 8, dtype=torch.bfloat16, unused=tuple(range(0, 256, 3)))
    ref = naive_experts(x, gu, d, ti, tw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused = fused_experts(x, gu, d, ti, tw)
        grouped = grouped_experts(x, gu, d, ti, tw) if grouped_mm_supported(x, gu, d) else None
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_rms(fused, ref) < 1e-2
    if torch.cuda.get_device_capability()[0] in (9, 10):
        assert grouped is not None and rel_rms(grouped, ref) < 1e-2


def test_grouped_gemm_needs_16_byte_row_strides():
    x, gu, d, _, _ = problem(4, 33, 20, 2, 2)
    assert not grouped_mm_supported(x, gu, d)  # h = 33 fp32 rows: 132 bytes
    x, gu, d, _, _ = problem(4, 36, 20, 2, 2)
    assert grouped_mm_supported(x, gu, d) == (x.device.type == "cpu")  # on CUDA, bf16 only
