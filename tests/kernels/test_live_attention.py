"""The live-token attention kernel (kernels/ops/attention/triton.py) against its reference
(naive.py): GQA groupings, head dims that are not powers of two (dq != dv as in MLA), scattered
seam positions, a live tail, decode, key splits with their merge, strided views; fp32 under
Triton's interpreter on CPU, bf16 at the engine's shape on a GPU."""

import pytest
import torch
from hybridcache.kernels.ops.attention import naive
from kernel_testing import device, live_attention, rel_rms

HEADS = [(1, 1), (6, 2), (4, 4), (8, 1)]
DIMS = [(8, 8), (24, 24), (40, 24)]


def make(B, Hq, Hkv, n, N, dq, dv, gen, dtype=torch.float32, dev=None, q_std=1.0):
    dev = dev or device()
    q = (torch.randn(B, Hq, n, dq, generator=gen) * q_std).to(dev, dtype)
    k = torch.randn(B, Hkv, N, dq, generator=gen).to(dev, dtype)
    v = torch.randn(B, Hkv, N, dv, generator=gen).to(dev, dtype)
    return q, k, v


def positions(n, N, gen, dev=None):
    """n distinct ascending positions in [0, N), scattered."""
    return torch.randperm(N, generator=gen)[:n].sort().values.to(dev or device())


def seams(N, starts, width, tail):
    """`width` live tokens at each start, then the last `tail` positions."""
    pos = [s + j for s in starts for j in range(width)] + list(range(N - tail, N))
    assert pos == sorted(set(pos)) and pos[-1] < N
    return torch.tensor(pos, device=device())


def per_query(q, k, v, q_pos, scale):
    """Attention one query at a time over its visible keys, KV heads repeated: independent of the
    reference's mask and head folding."""
    G = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(G, dim=1), v.float().repeat_interleave(G, dim=1)
    out = []
    for i, p in enumerate(q_pos.tolist()):
        s = torch.einsum("bhd,bhjd->bhj", q[:, :, i].float(), kf[:, :, : p + 1]) * scale
        out.append(torch.einsum("bhj,bhjd->bhd", s.softmax(-1), vf[:, :, : p + 1]))
    return torch.stack(out, dim=2)


@pytest.mark.parametrize("Hq,Hkv", HEADS)
@pytest.mark.parametrize("dq,dv", DIMS)
def test_matches_reference_scattered(Hq, Hkv, dq, dv):
    gen = torch.Generator().manual_seed(Hq * 100 + Hkv * 10 + dq + dv)
    for B, n, N in [(1, 1, 1), (2, 1, 7), (1, 5, 7), (2, 5, 37), (1, 13, 37), (2, 13, 70), (1, 1, 70)]:
        q, k, v = make(B, Hq, Hkv, n, N, dq, dv, gen)
        pos = positions(n, N, gen)
        got = live_attention(q, k, v, pos, dq**-0.5)
        ref = naive.live_attention(q, k, v, pos, dq**-0.5)
        assert got.shape == (B, Hq, n, dv) and got.dtype == q.dtype and got.is_contiguous()
        assert rel_rms(got, ref) < 1e-5, (B, n, N)


@pytest.mark.parametrize("num_splits", [None, 1, 2, 5])
def test_seams(num_splits):
    """Live tokens between cached spans: three seams and a run up to the end."""
    gen = torch.Generator().manual_seed(3)
    N = 100
    pos = torch.tensor([3, 4, 5, 40, 41, 42, *range(90, 100)], device=device())
    q, k, v = make(2, 6, 2, len(pos), N, 24, 24, gen, q_std=3.0)
    got = live_attention(q, k, v, pos, 0.2, num_splits=num_splits)
    ref = naive.live_attention(q, k, v, pos, 0.2)
    assert rel_rms(got, ref) < 1e-5


def test_seams_many_row_blocks():
    """More rows than one block (n * G > BLOCK_M): 8-token seams at 12 places and an 8-token tail,
    blocks of early queries stopping early; with and without key splits."""
    gen = torch.Generator().manual_seed(4)
    N = 300
    pos = seams(N, starts=range(5, 280, 25), width=8, tail=8)
    q, k, v = make(1, 8, 2, len(pos), N, 40, 24, gen, q_std=2.0)
    ref = naive.live_attention(q, k, v, pos, 0.15)
    for splits in (1, 3):
        assert rel_rms(live_attention(q, k, v, pos, 0.15, num_splits=splits), ref) < 1e-5


@pytest.mark.parametrize("n,N", [(1, 1), (5, 37), (13, 13), (13, 70)])
def test_tail(n, N):
    """The live tokens are the last n positions (prefill when n == N, a prefix-cache resume else)."""
    gen = torch.Generator().manual_seed(n + N)
    q, k, v = make(1, 4, 2, n, N, 24, 24, gen)
    pos = torch.arange(N - n, N, device=device())
    got = live_attention(q, k, v, pos, 0.3)
    assert rel_rms(got, naive.live_attention(q, k, v, pos, 0.3)) < 1e-5


@pytest.mark.parametrize("num_splits", [None, 1, 4, 100])
def test_decode(num_splits):
    """One query at the last position, the keys optionally split (more splits than key blocks: the
    split count is clamped, none is empty)."""
    gen = torch.Generator().manual_seed(5)
    N = 150
    q, k, v = make(2, 8, 2, 1, N, 40, 24, gen, q_std=2.0)
    pos = torch.tensor([N - 1], device=device())
    got = live_attention(q, k, v, pos, 0.2, num_splits=num_splits)
    assert rel_rms(got, naive.live_attention(q, k, v, pos, 0.2)) < 1e-5


def test_reference_is_not_trivial():
    """The reference agrees with attention computed query by query, and a wrong mask or head
    mapping is far off."""
    gen = torch.Generator().manual_seed(6)
    N = 40
    q, k, v = make(2, 6, 2, 7, N, 8, 8, gen, q_std=3.0)
    pos = torch.tensor([2, 3, 4, 20, 21, 38, 39], device=device())
    ref = naive.live_attention(q, k, v, pos, 0.5)
    assert rel_rms(per_query(q, k, v, pos, 0.5), ref) < 1e-6
    assert rel_rms(live_attention(q, k, v, pos, 0.5), ref) < 1e-5
    # every query seeing every key
    assert rel_rms(naive.live_attention(q, k, v, torch.full_like(pos, N - 1), 0.5), ref) > 0.05
    # off by one: the query's own key left out
    assert rel_rms(per_query(q, k, v, pos - 1, 0.5), ref) > 0.05
    # KV heads mapped h % Hkv instead of h // G
    heads = [per_query(q[:, h : h + 1], k[:, h % 2 : h % 2 + 1], v[:, h % 2 : h % 2 + 1], pos, 0.5) for h in range(6)]
    assert rel_rms(torch.cat(heads, dim=1), ref) > 0.05


def test_strided_inputs():
    """q as a token-major projection view with a non-unit channel stride, k and v as slices of one
    packed cache with room for more tokens, positions a strided view."""
    gen = torch.Generator().manual_seed(7)
    B, Hq, Hkv, n, N, dq, dv = 2, 6, 2, 5, 37, 24, 8
    proj = torch.randn(B, n, Hq, 2 * dq + 3, generator=gen).to(device())
    q = proj[..., 3::2].transpose(1, 2)  # [B, Hq, n, dq], channel stride 2
    cache = torch.randn(B, Hkv, N + 11, dq + dv, generator=gen).to(device())
    k, v = cache[:, :, :N, :dq], cache[:, :, :N, dq:]
    pos_all = torch.arange(2 * n, device=device()) * 3
    pos = pos_all[1::2]  # [3, 9, 15, 21, 27]
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous() or pos.is_contiguous())
    ref = naive.live_attention(q.contiguous(), k.contiguous(), v.contiguous(), pos.contiguous(), 0.25)
    for splits in (1, 2):
        got = live_attention(q, k, v, pos, 0.25, num_splits=splits)
        assert got.is_contiguous() and rel_rms(got, ref) < 1e-5


def test_int32_positions_and_empty():
    gen = torch.Generator().manual_seed(8)
    q, k, v = make(1, 4, 2, 3, 20, 8, 8, gen)
    pos = torch.tensor([0, 7, 19], device=device())
    ref = naive.live_attention(q, k, v, pos, 0.3)
    assert rel_rms(live_attention(q, k, v, pos.int(), 0.3), ref) < 1e-5
    empty = live_attention(q[:, :, :0], k, v, pos[:0], 0.3)
    assert empty.shape == (1, 4, 0, 8)


def test_clear_errors():
    d = device()
    q, k, v = torch.zeros(1, 4, 3, 8, device=d), torch.zeros(1, 2, 10, 8, device=d), torch.zeros(1, 2, 10, 8, device=d)
    pos = torch.tensor([1, 2, 3], device=d)
    cases = [
        ((q[0], k, v, pos), "4-D"),
        ((q, k.half(), v, pos), "dtype"),
        ((q.double(), k.double(), v.double(), pos), "not supported"),
        ((q, k, v[:, :, :9], pos), "differ in"),
        ((q, k[:, :1], v, pos), "differ in"),
        ((torch.zeros(2, 4, 3, 8, device=d), k, v, pos), "batch"),
        ((torch.zeros(1, 4, 3, 16, device=d), k, v, pos), "head dim"),
        ((torch.zeros(1, 3, 3, 8, device=d), k, v, pos), "GQA"),
        ((q, k, v, pos[:2]), "q_pos must be"),
        ((q, k, v, pos[None]), "q_pos must be"),
        ((q, k, v, pos.float()), "int32 or int64"),
        ((q, k[:, :, :0], v[:, :, :0], pos), "no keys"),
        ((q, k, v, pos.to("meta")), "one device"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            live_attention(*args, 0.3)
    with pytest.raises(ValueError, match="num_splits"):
        live_attention(q, k, v, pos, 0.3, num_splits=0)


# GPU: the engine's shape in bf16 (Qwen3.5-9B attention layer)

HQ, HKV, D, N_CTX = 16, 4, 256, 32768


def engine_positions(dev="cuda"):
    """32 seams of 8 tokens spread over the cached context, then a 64-token live tail: n = 320."""
    starts = torch.linspace(100, N_CTX - 64 - 8 - 100, 32).long().tolist()
    pos = [s + j for s in starts for j in range(8)] + list(range(N_CTX - 64, N_CTX))
    return torch.tensor(pos, device=dev)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_engine_shape_seams_bf16_gpu(num_splits):
    gen = torch.Generator().manual_seed(10)
    pos = engine_positions()
    assert pos.numel() == 320
    q, k, v = make(1, HQ, HKV, 320, N_CTX, D, D, gen, dtype=torch.bfloat16, dev="cuda", q_std=2.0)
    got = live_attention(q, k, v, pos, D**-0.5, num_splits=num_splits)
    ref = naive.live_attention(q.float(), k.float(), v.float(), pos, D**-0.5)
    assert got.dtype == torch.bfloat16 and rel_rms(got, ref) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1])
def test_engine_shape_decode_bf16_gpu(num_splits):
    gen = torch.Generator().manual_seed(11)
    pos = torch.tensor([N_CTX - 1], device="cuda")
    q, k, v = make(1, HQ, HKV, 1, N_CTX, D, D, gen, dtype=torch.bfloat16, dev="cuda", q_std=2.0)
    got = live_attention(q, k, v, pos, D**-0.5, num_splits=num_splits)
    ref = naive.live_attention(q.float(), k.float(), v.float(), pos, D**-0.5)
    assert rel_rms(got, ref) < 1e-2


@pytest.mark.gpu
def test_mla_dims_and_fp32_gpu():
    """MLA's dq 192 / dv 128 in bf16, token-major strided views; fp32 (exact dots) at a small shape."""
    gen = torch.Generator().manual_seed(12)
    N, n = 5000, 70
    pos = positions(n, N, gen, dev="cuda")
    qp = torch.randn(1, n, 16, 192, generator=gen).cuda().bfloat16()
    kv = torch.randn(1, N, 16, 192 + 128, generator=gen).cuda().bfloat16()
    q, k, v = qp.transpose(1, 2), kv[..., :192].transpose(1, 2), kv[..., 192:].transpose(1, 2)
    got = live_attention(q, k, v, pos, 192**-0.5)
    assert rel_rms(got, naive.live_attention(q.float(), k.float(), v.float(), pos, 192**-0.5)) < 1e-2
    q, k, v = make(2, 8, 2, 37, 999, 40, 24, gen, dev="cuda", q_std=2.0)
    pos = positions(37, 999, gen, dev="cuda")
    for splits in (None, 1):
        got = live_attention(q, k, v, pos, 0.2, num_splits=splits)
        assert rel_rms(got, naive.live_attention(q, k, v, pos, 0.2)) < 1e-5


@pytest.mark.gpu
def test_new_lengths_do_not_recompile_gpu():
    """After one call of each kind (split or not, many rows or decode), other context lengths and
    live-token counts reuse the compiled kernels."""
    from hybridcache.kernels.ops.attention.triton import live_attention_kernel, merge_splits_kernel

    gen = torch.Generator().manual_seed(13)

    def run(n, N, splits):
        q, k, v = make(1, HQ, HKV, n, N, D, D, gen, dtype=torch.bfloat16, dev="cuda")
        pos = torch.arange(N - n, N, device="cuda")
        live_attention(q, k, v, pos, D**-0.5, num_splits=splits)

    def compiled():
        dev = torch.cuda.current_device()
        return sum(len(f.device_caches[dev][0]) for f in (live_attention_kernel, merge_splits_kernel))

    for splits in (1, 3):
        run(320, 4096, splits)
        run(1, 4096, splits)
    before = compiled()
    for n, N in ((100, 5000), (317, 32768), (64, 777), (1000, 1000)):
        for splits in (1, 3):
            run(n, N, splits)
    run(1, 12345, 2)
    run(1, 20000, 1)
    assert compiled() == before


@pytest.mark.gpu
def test_agrees_with_masked_sdpa_gpu():
    """The engine's seam shape: the kernel agrees with the masked memory-efficient SDPA it replaces
    (GQA folded into the rows, [G * n, N] boolean mask); their speeds are compared end to end in
    benchmarks/gpu_bench.py (pic_ttft_ms_*_gpu_resident vs *_sdpa_live_attention)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(14)
    pos = engine_positions()
    n, G = pos.numel(), HQ // HKV
    q, k, v = make(1, HQ, HKV, n, N_CTX, D, D, gen, dtype=torch.bfloat16, dev="cuda")
    mask = (torch.arange(N_CTX, device="cuda")[None, :] <= pos[:, None]).repeat(G, 1)
    qf = q.reshape(1, HKV, G * n, D)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        ref = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=D**-0.5).reshape(1, HQ, n, D)
    assert rel_rms(live_attention(q, k, v, pos, D**-0.5), ref) < 1e-2
