"""compose_states_fwd (Triton) against folding naive.apply_segment over the segments."""

import pytest
import torch
from hybridcache.kernels.ops.transition import apply_segment
from kernel_testing import (
    compose_states_blocks,
    compose_states_fwd,
    compose_states_table,
    device,
    rel_rms,
    scattered_blocks,
)


def make_segments(N, G, K, V, dtype, seed=42):
    torch.manual_seed(seed)
    # Transitions of contractive segments: decayed near-identity with a low-rank erasure.
    u = torch.nn.functional.normalize(torch.randn(N, G, K, 2), dim=-2)
    T = 0.9 * (torch.eye(K) - 0.5 * u @ u.transpose(-1, -2))
    S = torch.randn(N, G, K, V)
    return T.to(device(), dtype), S.to(device(), dtype)


def reference(T, S, h0):
    h = h0.float() if h0 is not None else torch.zeros_like(S[0], dtype=torch.float32)
    for i in range(T.shape[0]):
        h = apply_segment(T[i][None], S[i][None], h[None])[0]
    return h


SHAPES = [(1, 1, 16, 16), (3, 2, 20, 12), (4, 3, 32, 40)]


@pytest.mark.parametrize("N,G,K,V", SHAPES, ids=[f"N{n}-G{g}-K{k}-V{v}" for n, g, k, v in SHAPES])
@pytest.mark.parametrize("with_init", [False, True])
def test_compose_matches_reference(N, G, K, V, with_init):
    T, S = make_segments(N, G, K, V, torch.float32)
    h0 = torch.randn(G, K, V, device=device()) if with_init else None
    out = compose_states_fwd(T, S, h0)
    ref = reference(T, S, h0)
    assert out.dtype == torch.float32 and out.shape == (G, K, V)
    assert rel_rms(out, ref) < 1e-5


def test_compose_bf16_entries_and_column_blocks():
    T, S = make_segments(3, 2, 32, 48, torch.bfloat16)
    h0 = torch.randn(2, 32, 48, device=device())
    out = compose_states_fwd(T, S, h0, block_v=16)
    assert rel_rms(out, reference(T, S, h0)) < 1e-5


def test_compose_column_blocks_launched_side_by_side():
    """grid_vg: the column blocks of one (layer, head) are neighbours on the grid's first axis."""
    T, S = make_segments(3, 3, 32, 40, torch.float32)
    h0 = torch.randn(3, 32, 40, device=device())
    out = compose_states_fwd(T, S, h0, block_v=16, grid_vg=True)
    assert rel_rms(out, reference(T, S, h0)) < 1e-5


def test_compose_split_state_needs_16_bit_transitions():
    T, S = make_segments(2, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="bf16x2 needs T in 16 bits"):
        compose_states_fwd(T, S, dot_precision="bf16x2")


def test_compose_order_matters():
    """Folding in a different order gives a different state (the kernel really applies T)."""
    T, S = make_segments(2, 1, 16, 16, torch.float32)
    h0 = torch.randn(1, 16, 16, device=device())
    fwd = compose_states_fwd(T, S, h0)
    rev = compose_states_fwd(T.flip(0), S.flip(0), h0)
    assert rel_rms(fwd, rev) > 1e-2


def test_compose_rejects_mismatched_shapes():
    T, S = make_segments(2, 1, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="does not match"):
        compose_states_fwd(T[:, :, :8], S)
    with pytest.raises(ValueError, match="initial_state"):
        compose_states_fwd(T, S, torch.zeros(1, 16, 8, device=device()))


@pytest.mark.gpu
def test_compose_qwen35_shape_gpu():
    """24 layers x 32 heads x 128^2, bf16 entries, 8 segments: fp32-level agreement with tf32x3;
    the bf16 default (one TF32 pass) within the entries' own bf16 precision (2^-8)."""
    T, S = make_segments(8, 24 * 32, 128, 128, torch.bfloat16)
    h0 = torch.randn(24 * 32, 128, 128, device="cuda")
    ref = reference(T, S, h0)
    assert rel_rms(compose_states_fwd(T, S, h0, dot_precision="tf32x3"), ref) < 1e-4
    err = rel_rms(compose_states_fwd(T, S, h0), ref)
    assert 0 < err < 2**-8


@pytest.mark.gpu
def test_compose_one_layer_of_heads_all_states_gpu():
    """One layer's 32 heads (the live scan's launch, narrower column blocks to fill the SMs), every
    intermediate state, 7 segments: within bf16 precision of the reference."""
    T, S = make_segments(7, 32, 128, 128, torch.bfloat16)
    h0 = torch.randn(32, 128, 128, device="cuda")
    ht, hs = compose_states_fwd(T, S, h0, output_all=True)
    for n in range(1, 8):
        assert rel_rms(hs[n - 1], reference(T[:n], S[:n], h0)) < 2**-8
    assert torch.equal(ht, hs[-1])


@pytest.mark.gpu
def test_compose_fp32_entries_keep_fp32_accuracy_gpu():
    T, S = make_segments(5, 2 * 3, 128, 96, torch.float32)
    h0 = torch.randn(6, 128, 96, device="cuda")
    assert rel_rms(compose_states_fwd(T, S, h0), reference(T, S, h0)) < 1e-5


@pytest.mark.parametrize("with_init", [False, True])
def test_compose_outputs_every_intermediate_state(with_init):
    """output_all: the state after each segment, as the live-token scan needs them."""
    T, S = make_segments(4, 3, 20, 12, torch.float32)
    h0 = torch.randn(3, 20, 12, device=device()) if with_init else None
    final, states = compose_states_fwd(T, S, h0, output_all=True)
    assert states.shape == (4, 3, 20, 12) and states.dtype == torch.float32
    for i in range(4):
        assert rel_rms(states[i], reference(T[: i + 1], S[: i + 1], h0)) < 1e-5
    assert torch.equal(states[-1], final)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_init", [False, True])
def test_compose_blocks_reads_entries_in_place(dtype, with_init, prefetch):
    """The address-table form over separately stored blocks equals the stacked form and the
    reference, final and every intermediate state, on odd shapes (K = 20, V = 12, 5 segments)."""
    T, S = make_segments(5, 3, 20, 12, dtype)
    h0 = torch.randn(3, 20, 12, device=device()) if with_init else None
    Ts, Ss, _keep = scattered_blocks(T, S)
    final, states = compose_states_blocks(Ts, Ss, h0, output_all=True, prefetch_addresses=prefetch)
    ref_final, ref_states = compose_states_fwd(T, S, h0, output_all=True)
    assert torch.allclose(states, ref_states, rtol=1e-6, atol=1e-6)
    assert torch.equal(states[-1], final)
    for i in range(5):
        assert rel_rms(states[i], reference(T[: i + 1], S[: i + 1], h0)) < 1e-5
    # the order of the table is the order of the fold
    rev = compose_states_blocks(Ts[::-1], Ss[::-1], h0, prefetch_addresses=prefetch)
    assert rel_rms(rev, ref_final) > 1e-2


def test_compose_table_made_on_the_device():
    """The planned assembly's fold: a device table mixing rows of one stack (addresses computed on
    the device from the stack's base, as inside a CUDA graph) with blocks stored apart, then
    identity padding pairs; every real state equals the reference and the padding leaves the last
    real state unchanged."""
    T, S = make_segments(5, 3, 20, 12, torch.float32)
    h0 = torch.randn(3, 20, 12, device=device())
    stack_T, stack_S = T[0::2].clone(), S[0::2].clone()  # pairs 0, 2, 4
    apart = [(T[i : i + 1].clone(), S[i : i + 1].clone()) for i in (1, 3)]
    run = torch.tensor([0, -1, 1, -1, 2, -1, -1], device=device())  # stack row, or -1
    eye = torch.eye(20, device=device()).expand(3, 20, 20).contiguous()
    zero = torch.zeros(3, 20, 12, device=device())
    span_T = [0, apart[0][0].data_ptr(), 0, apart[1][0].data_ptr(), 0, eye.data_ptr(), eye.data_ptr()]
    span_S = [0, apart[0][1].data_ptr(), 0, apart[1][1].data_ptr(), 0, zero.data_ptr(), zero.data_ptr()]
    j = run.clamp(min=0)
    t_tab = torch.where(run >= 0, stack_T.data_ptr() + j * stack_T[0].numel() * 4,
                        torch.tensor(span_T, device=device()))
    s_tab = torch.where(run >= 0, stack_S.data_ptr() + j * stack_S[0].numel() * 4,
                        torch.tensor(span_S, device=device()))
    final, states = compose_states_table(t_tab, s_tab, stack_T, stack_S, h0, output_all=True)
    for i in range(5):
        assert rel_rms(states[i], reference(T[: i + 1], S[: i + 1], h0)) < 1e-5
    assert rel_rms(states[6], states[4]) < 1e-6 and torch.equal(final, states[6])
    # its launch options (column blocks narrower than V, warps, addresses a step ahead) fold alike
    for kw in (dict(block_v=4), dict(num_warps=2, num_stages=1), dict(prefetch_addresses=True)):
        _, other = compose_states_table(t_tab, s_tab, stack_T, stack_S, h0, output_all=True, **kw)
        assert rel_rms(other, states) < 1e-6, kw
    with pytest.raises(ValueError, match="int64"):
        compose_states_table(t_tab.int(), s_tab, stack_T, stack_S, h0)


def test_compose_table_reads_runs_of_another_dtype():
    """The planned assembly's fold with bf16 entries: the pass's own pairs stay fp32 (runs), read
    beside the entries through one table; each run's T is rounded to bf16 as it is read and its S
    read in fp32: equal to the reference over those values, off from it with the runs' S rounded."""
    T, S = make_segments(6, 2, 20, 12, torch.float32, seed=5)
    is_run = [True, False, True, True, False, True]
    T_bf, S_bf = T.to(torch.bfloat16), S.to(torch.bfloat16)
    runs_T = torch.stack([T[i] for i in range(6) if is_run[i]])  # fp32, the pass's stack
    runs_S = torch.stack([S[i] for i in range(6) if is_run[i]])
    spans = {i: (T_bf[i : i + 1].clone(), S_bf[i : i + 1].clone()) for i in range(6) if not is_run[i]}
    run_of = torch.tensor([sum(is_run[:i]) if is_run[i] else -1 for i in range(6)], device=device())
    t_tab = torch.tensor([runs_T[int(run_of[i])].data_ptr() if is_run[i] else spans[i][0].data_ptr()
                          for i in range(6)], device=device())
    s_tab = torch.tensor([runs_S[int(run_of[i])].data_ptr() if is_run[i] else spans[i][1].data_ptr()
                          for i in range(6)], device=device())
    h0 = torch.randn(2, 20, 12, device=device())
    final, states = compose_states_table(t_tab, s_tab, spans[1][0], spans[1][1], h0, output_all=True,
                                         store_initial=True, runs=(run_of, runs_T, runs_S))
    T_eff = T_bf.float()  # every T as bf16
    S_eff = torch.stack([S[i] if is_run[i] else S_bf[i].float() for i in range(6)])
    for i in range(6):
        assert rel_rms(states[i + 1], reference(T_eff[: i + 1], S_eff[: i + 1], h0)) < 1e-5
    assert rel_rms(final, reference(T_eff, S_bf.float(), h0)) > 1e-4  # the runs' S were not rounded
    with pytest.raises(ValueError, match="prefetch"):
        compose_states_table(t_tab, s_tab, spans[1][0], spans[1][1], h0, runs=(run_of, runs_T, runs_S),
                             prefetch_addresses=True)


@pytest.mark.parametrize("with_init", [False, True])
def test_compose_table_initial_row_and_count_on_the_device(with_init):
    """store_initial: row 0 the entering state, row i + 1 the state after pair i (the planned
    assembly's rows); count (device data, as a CUDA graph's bucket reads it): the fold stops after
    the real pairs, whatever the table's padding pairs would do, and leaves the rows past them as
    they were."""
    T, S = make_segments(6, 2, 20, 12, torch.float32, seed=3)
    h0 = torch.randn(2, 20, 12, device=device()) if with_init else None
    t_tab = torch.tensor([T[i].data_ptr() for i in range(6)], device=device())
    s_tab = torch.tensor([S[i].data_ptr() for i in range(6)], device=device())
    final, states = compose_states_table(t_tab, s_tab, T, S, h0, output_all=True, store_initial=True)
    assert states.shape == (7, 2, 20, 12)
    assert torch.equal(states[0], h0 if with_init else torch.zeros_like(states[0]))
    for i in range(6):
        assert rel_rms(states[i + 1], reference(T[: i + 1], S[: i + 1], h0)) < 1e-5
    assert torch.equal(final, states[6])
    # the last two pairs would change the state (they are not identity pairs): count 4 stops before
    for dtype in (torch.int64, torch.int32):
        count = torch.tensor([4], dtype=dtype, device=device())
        final4, states4 = compose_states_table(t_tab, s_tab, T, S, h0, output_all=True, store_initial=True,
                                               count=count)
        assert torch.equal(final4, states[4]) and torch.equal(states4[:5], states[:5])
        assert rel_rms(final4, final) > 1e-2
    # a count over the table's length folds the whole table
    final9 = compose_states_table(t_tab, s_tab, T, S, h0, count=torch.tensor([9], device=device()))
    assert torch.equal(final9, final)
    with pytest.raises(ValueError, match="output_all"):
        compose_states_table(t_tab, s_tab, T, S, h0, store_initial=True)
    with pytest.raises(ValueError, match="count"):
        compose_states_table(t_tab, s_tab, T, S, h0, count=torch.tensor([1.0], device=device()))


def test_compose_blocks_rejects_bad_blocks():
    T, S = make_segments(2, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="as many"):
        compose_states_blocks([T[0:1]], [S[0:1], S[1:2]])
    with pytest.raises(ValueError, match="is not"):
        compose_states_blocks([T[0:1], T[0:1, :1]], [S[0:1], S[1:2]])
    with pytest.raises(ValueError, match="contiguous"):
        compose_states_blocks([T[0:1].transpose(-1, -2)], [S[0:1]])
    with pytest.raises(ValueError, match="dtype"):
        compose_states_blocks([T[0:1], T[1:2].double()], [S[0:1], S[1:2]])
    with pytest.raises(ValueError, match="outside"):
        compose_states_blocks([(T, 2)], [(S, 0)])
    with pytest.raises(ValueError, match="initial_state"):
        compose_states_blocks([T[0:1]], [S[0:1]], torch.zeros(2, 16, 4, device=device()))


@pytest.mark.gpu
def test_compose_blocks_one_layer_gpu():
    """The engine's per-layer launch at Qwen3.5-9B's head shape: 32 heads x 128^2, bf16 entries
    scattered over 65 blocks, against the stacked kernel (same math: equal up to rounding)."""
    T, S = make_segments(65, 32, 128, 128, torch.bfloat16)
    h0 = torch.randn(32, 128, 128, device="cuda")
    Ts, Ss, _keep = scattered_blocks(T, S)
    ref_final, ref_states = compose_states_fwd(T, S, h0, output_all=True)
    for prefetch in (True, False):
        final, states = compose_states_blocks(Ts, Ss, h0, output_all=True, prefetch_addresses=prefetch)
        assert torch.equal(final, ref_final) and torch.equal(states, ref_states)


@pytest.mark.gpu
@pytest.mark.parametrize("grid_vg", [False, True])
def test_compose_split_state_bf16_dots_gpu(grid_vg):
    """bf16x2: T as stored (bf16), the fp32 state in two bf16 halves: about as close to fp32 math on
    the same bf16 entries as one TF32 pass (whose 10-bit mantissa the default keeps)."""
    T, S = make_segments(32, 48, 128, 128, torch.bfloat16)
    h0 = torch.randn(48, 128, 128, device="cuda")
    ref = reference(T, S, h0)
    tf32 = rel_rms(compose_states_fwd(T, S, h0, dot_precision="tf32"), ref)
    for bv in (64, 128):
        split = rel_rms(compose_states_fwd(T, S, h0, block_v=bv, dot_precision="bf16x2", grid_vg=grid_vg), ref)
        assert split < max(2 * tf32, 1e-3), (bv, split, tf32)
