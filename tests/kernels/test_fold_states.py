"""backends.fold_states (the live scan's fold of cached spans and runs) and the scan's gather of
the states entering its runs: the CUDA dispatch (address-table compose, forced here on CPU under
Triton's interpreter) against the reference fold, with entries as the engine holds them."""

import pytest
import torch
from hybridcache.kernels.ops.transition import apply_segment
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models.mixer import entering_states
from kernel_testing import rel_rms, scattered_blocks  # sets TRITON_INTERPRET on CPU


def _pieces(n, H=3, K=20, V=12, dtype=torch.float32, seed=0):
    """n pieces alternating run / span: runs as rows of one stack, spans as separate entries."""
    g = torch.Generator().manual_seed(seed)
    u = torch.nn.functional.normalize(torch.randn(n, H, K, 2, generator=g), dim=-2)
    T = (0.9 * (torch.eye(K) - 0.5 * u @ u.transpose(-1, -2))).to(dtype)
    S = torch.randn(n, H, K, V, generator=g).to(dtype)
    Ts, Ss, _ = scattered_blocks(T, S)  # the bases stay alive through the blocks that hold them
    return T, S, Ts, Ss


def _reference(T, S, h0, use_t):
    out, h = [], h0
    for i in range(T.shape[0]):
        h = apply_segment(T[i : i + 1].float(), S[i : i + 1].float(), h, use_t[i])
        out.append(h)
    return out


@pytest.mark.parametrize("fast", [False, True], ids=["reference", "table-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_states_with_row_blocks(monkeypatch, fast, dtype):
    monkeypatch.setattr(backends, "use_fast_kernels", lambda t: fast)
    T, S, Ts, Ss = _pieces(7, dtype=dtype)
    h0 = torch.randn(1, 3, 20, 12)
    got = backends.fold_states(Ts, Ss, h0, [True] * 7)
    ref = _reference(T, S, h0, [True] * 7)
    if fast:
        assert isinstance(got, torch.Tensor) and got.shape == (7, 1, 3, 20, 12)
    for i in range(7):
        assert rel_rms(got[i], ref[i]) < (1e-5 if dtype == torch.float32 else 1e-2)


def test_fold_states_mixed_dtypes_and_strided_blocks_fall_back_to_a_stack(monkeypatch):
    """Blocks the address table cannot describe (dtypes differing, a transposed view) take the
    stacked kernel, with the same result."""
    monkeypatch.setattr(backends, "use_fast_kernels", lambda t: True)
    T, S, Ts, Ss = _pieces(5)
    h0 = torch.randn(1, 3, 20, 12)
    ref = _reference(T, S, h0, [True] * 5)
    mixed = list(Ts)
    mixed[1] = mixed[1].double()
    for blocks in (mixed, [T[i : i + 1].transpose(-1, -2).contiguous().transpose(-1, -2) for i in range(5)]):
        got = backends.fold_states(blocks, Ss, h0, [True] * 5)
        for i in range(5):
            assert rel_rms(got[i], ref[i]) < 1e-5


def test_naive_fold_keeps_the_reference_path(monkeypatch):
    monkeypatch.setattr(backends, "use_fast_kernels", lambda t: True)
    T, S, Ts, Ss = _pieces(4)
    h0 = torch.randn(1, 3, 20, 12)
    use_t = [True, False, True, False]
    got = backends.fold_states(Ts, Ss, h0, use_t)
    ref = _reference(T, S, h0, use_t)
    assert isinstance(got, list)
    for i in range(4):
        assert torch.allclose(got[i], ref[i], atol=1e-6)


@pytest.mark.parametrize(
    "rows",
    [[-1, 1, 3, 5], [0, 2, 4], [-1], [3], [-1, 2], [0, 1, 4, 6], [1, 5, 6]],
    ids=["state-in+even", "even", "state-in-only", "one", "state-in+one", "irregular", "irregular2"],
)
def test_entering_states_gather(rows):
    """The states entering the runs, from the fold's stack (views / one gather) or its list."""
    states = torch.randn(8, 1, 2, 4, 3)
    state_in = torch.randn(1, 2, 4, 3)
    want = torch.cat([state_in if r < 0 else states[r] for r in rows])
    got = entering_states(states, rows, state_in)
    assert got.shape == want.shape and torch.equal(got, want)
    assert torch.equal(entering_states(list(states), rows, state_in), want)


def test_fold_reads_blocks_in_place_and_stacks_only_mixed_dtypes(monkeypatch):
    """Pieces of one dtype, contiguous where they lie, are folded through the address table; a
    piece of another dtype makes the fold stack them first (as torch.cat promotes): same states."""
    from hybridcache.kernels.ops.transition import compose_triton

    monkeypatch.setattr(backends, "use_fast_kernels", lambda t: True)
    T, S, Ts, Ss = _pieces(5)
    h0 = torch.randn(1, 3, 20, 12)
    launched = []
    for name in ("compose_states_fwd", "compose_states_blocks"):
        real = getattr(compose_triton, name)
        monkeypatch.setattr(compose_triton, name, lambda *a, _r=real, _n=name, **k: launched.append(_n) or _r(*a, **k))
    blocks = backends.fold_states(Ts, Ss, h0, [True] * 5)
    mixed_Ts = [*Ts[:-1], T[4:5].double()]
    stacked = backends.fold_states(mixed_Ts, Ss, h0, [True] * 5)
    assert launched == ["compose_states_blocks", "compose_states_fwd"]
    assert torch.allclose(blocks, stacked, atol=1e-5)
