"""Apply n cached segments to a running state across all layers and heads in one launch (Triton).

For every (layer, head) pair g and segments i = 1..n in sequence order:

    S_g <- T_{i,g} S_g + S_{i,g}        (T matrix [K, K], S [K, V])

One program owns one g and a BV-wide column block of S, keeps that block in fp32 registers across
all n segments, and streams each T_{i,g} and S_{i,g} from memory exactly once per column block.
Entries may be stored in bf16 or fp32; the running state is fp32. The reference is
`naive.apply_segment` folded over the segments (README.md here).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.heuristics(
    {
        "USE_INITIAL_STATE": lambda args: args["h0"] is not None,
        "STORE_ALL": lambda args: args["hs"] is not None,
        "COUNT_ON_DEVICE": lambda args: args["count"] is not None,
        "MIXED": lambda args: args["run_index"] is not None,
    }
)
@triton.jit
def compose_states_fwd_kernel(
    T,
    S,
    h0,
    ht,
    hs,
    Tref,
    Sref,
    N,
    count,
    run_index,
    TRref,
    SRref,
    G: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_ALL: tl.constexpr,
    STORE_INITIAL: tl.constexpr,
    COUNT_ON_DEVICE: tl.constexpr,
    MIXED: tl.constexpr,
    INDIRECT: tl.constexpr,
    PREFETCH_ADDRESSES: tl.constexpr,
    SPLIT_STATE: tl.constexpr,
    GRID_VG: tl.constexpr,
):
    # INDIRECT: T and S are int64 tables of N addresses, each of one segment's [G, K, K] / [G, K, V]
    # block (contiguous), in the element types of Tref / Sref; else [N, G, K, K] / [N, G, K, V].
    # SPLIT_STATE (T in 16 bits): T stays in its storage type and the fp32 state is split into a
    # high and a low 16-bit part, two 16-bit dots (about 16 bits of the state's mantissa kept).
    # GRID_VG: axis 0 walks the column blocks of one g, so the programs sharing a T run together.
    # STORE_INITIAL (with STORE_ALL): hs has N + 1 rows, row 0 the entering state, row i + 1 the
    # state after segment i. COUNT_ON_DEVICE: only the first count[0] (<= N) segments are folded
    # (a CUDA graph's bucket of N holds fewer real ones); hs rows past them are left unwritten.
    # MIXED (INDIRECT, no PREFETCH_ADDRESSES): where run_index[i] >= 0 the addresses are of blocks
    # in TRref / SRref's element types (a pass's own runs, fp32) instead of Tref / Sref's; T is
    # rounded to Tref's type in registers (as a copy to it would), S read as it is.
    if GRID_VG:
        i_v, i_g = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    else:
        i_g, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    m_kk = m_k[:, None] & m_k[None, :]

    p_h = i_g * K * V + o_k[:, None] * V + o_v[None, :]
    if USE_INITIAL_STATE:
        b_h = tl.load(h0 + p_h, mask=m_kv, other=0.0).to(tl.float32)  # [BK, BV]
    else:
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if STORE_ALL and STORE_INITIAL:
        tl.store(hs + p_h, b_h, mask=m_kv)
        hs += G * K * V
    if COUNT_ON_DEVICE:
        N = tl.minimum(tl.load(count).to(tl.int32), N)
    if INDIRECT and PREFETCH_ADDRESSES:
        t_next = tl.load(T).to(Tref.dtype, bitcast=True)
        s_next = tl.load(S).to(Sref.dtype, bitcast=True)
    for i_n in range(N):
        if INDIRECT:
            if PREFETCH_ADDRESSES:
                # the next step's addresses load a step ahead, so the tile loads need not wait on them
                t_base, s_base = t_next, s_next
                i_next = tl.minimum(i_n + 1, N - 1)
                t_next = tl.load(T + i_next).to(Tref.dtype, bitcast=True)
                s_next = tl.load(S + i_next).to(Sref.dtype, bitcast=True)
            elif MIXED:
                t_raw = tl.load(T + i_n)
                s_raw = tl.load(S + i_n)
                # the flag as blocks (a scalar bool in a mask does not broadcast everywhere)
                flag = (tl.load(run_index + i_n) >= 0).to(tl.int32)
                is_run = (tl.zeros([BK, BV], dtype=tl.int32) + flag) != 0
                run_kk = (tl.zeros([BK, BK], dtype=tl.int32) + flag) != 0
                t_base = t_raw.to(Tref.dtype, bitcast=True)
                s_base = s_raw.to(Sref.dtype, bitcast=True)
                t_run = t_raw.to(TRref.dtype, bitcast=True)
                s_run = s_raw.to(SRref.dtype, bitcast=True)
            else:
                t_base = tl.load(T + i_n).to(Tref.dtype, bitcast=True)
                s_base = tl.load(S + i_n).to(Sref.dtype, bitcast=True)
            p_t = t_base + i_g * K * K + o_k[:, None] * K + o_k[None, :]
            p_s = s_base + i_g * K * V + o_k[:, None] * V + o_v[None, :]
        else:
            i_ng = i_g + i_n * G
            p_t = T + i_ng * K * K + o_k[:, None] * K + o_k[None, :]
            p_s = S + i_ng * K * V + o_k[:, None] * V + o_v[None, :]
        if INDIRECT and MIXED and not PREFETCH_ADDRESSES:
            # one of each pair of loads is masked off whole: the block is read in its own type
            o_t = i_g * K * K + o_k[:, None] * K + o_k[None, :]
            o_s = i_g * K * V + o_k[:, None] * V + o_v[None, :]
            b_s = (tl.load(p_s, mask=m_kv & ~is_run, other=0.0).to(tl.float32)
                   + tl.load(s_run + o_s, mask=m_kv & is_run, other=0.0).to(tl.float32))
            b_tm = (tl.load(p_t, mask=m_kk & ~run_kk, other=0.0).to(tl.float32)
                    + tl.load(t_run + o_t, mask=m_kk & run_kk, other=0.0).to(tl.float32))
            if Tref.dtype.element_ty == tl.bfloat16:  # rounded to nearest even in integer steps
                # (the interpreter's own cast truncates): exact casts once the low bits are cleared
                bits = b_tm.to(tl.int32, bitcast=True)
                bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
                b_tm = bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
            else:
                b_tm = b_tm.to(Tref.dtype.element_ty)
        else:
            b_s = tl.load(p_s, mask=m_kv, other=0.0).to(tl.float32)  # [BK, BV]
            b_tm = tl.load(p_t, mask=m_kk, other=0.0)  # [BK, BK], in its storage type
        if SPLIT_STATE:
            b_t = b_tm  # 16-bit
            b_hi = b_h.to(b_t.dtype)
            b_lo = (b_h - b_hi.to(tl.float32)).to(b_t.dtype)
            b_h = tl.dot(b_t, b_hi, b_s)
            b_h = tl.dot(b_t, b_lo, b_h)
        else:
            b_t = b_tm.to(tl.float32)  # [BK, BK]
            b_h = tl.dot(b_t, b_h, b_s, input_precision=DOT_PRECISION)
        if STORE_ALL:
            # the state after segment i_n (the live-token scan reads the states entering each run)
            tl.store(hs + i_n * G * K * V + p_h, b_h, mask=m_kv)
    tl.store(ht + p_h, b_h, mask=m_kv)


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def compose_states_fwd(
    T: torch.Tensor,
    S: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    block_v: int | None = None,
    dot_precision: str | None = None,
    output_all: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    grid_vg: bool | None = None,
):
    """Fold n segments into a running state: S_end = T_n(...(T_1 S_start + S_1)...) + S_n.

    Args:
        T: [N, G, K, K] transitions, segment-major (G = layers x heads flattened), bf16 or fp32.
        S: [N, G, K, V] zero-start states S(body|0), same dtype family.
        initial_state: [G, K, V] running state before the first segment (zeros if None).
        block_v: columns of S per program (default: all of V on CPU; on GPU 64, halved down to
            32 while the programs would not cover the GPU's SMs).
        dot_precision: Triton tl.dot input precision, or "bf16x2". Default under the interpreter:
            "ieee". On GPU: "tf32x3" (fp32-level accuracy at tensor-core speed) for fp32 T, and
            "bf16x2" for 16-bit T: T read as stored and the fp32 running state split into a high
            and a low bf16 part, two bf16 dots a step (about 16 of the state's mantissa bits kept).
            bf16x2 is both faster and about 400 x more accurate than a single TF32 pass on bf16
            entries (gpu_bench's compose section times it against fp32 math on the same entries).
        num_warps, num_stages: Triton launch options (defaults on GPU for K >= 128: 8 warps; 2
            stages for 16-bit T, Triton's for fp32 T).
        output_all: also return the state after every segment, [N, G, K, V] fp32.
        grid_vg: launch the column blocks of one (layer, head) next to each other (they read the
            same T: the second read may come from L2); default on GPU wherever V has two blocks
            or more.

    Returns:
        [G, K, V] fp32 (and the [N, G, K, V] states with output_all).
    """
    if T.dim() != 4 or S.dim() != 4:
        raise ValueError(f"T must be [N, G, K, K] and S [N, G, K, V], got {tuple(T.shape)}, {tuple(S.shape)}")
    N, G, K, V = S.shape
    if T.shape != (N, G, K, K):
        raise ValueError(f"T of shape {tuple(T.shape)} does not match S of shape {tuple(S.shape)}")
    if initial_state is not None and initial_state.shape != (G, K, V):
        raise ValueError(f"initial_state must be [{G}, {K}, {V}], got {tuple(initial_state.shape)}")
    T, S = T.contiguous(), S.contiguous()
    args = (initial_state, output_all, block_v, dot_precision, num_warps, num_stages)
    return _launch(T, S, T, S, N, G, K, V, *args, grid_vg=grid_vg)


def _launch(
    T, S, Tref, Sref, N, G, K, V, h0, output_all, block_v, precision, warps, stages, prefetch=False, grid_vg=None,
    store_initial=False, count=None, runs=None,
):
    """One launch of the kernel over stacked entries (T is Tref) or address tables (T is int64).
    precision "bf16x2" (16-bit T only): SPLIT_STATE (the kernel's comment); store_initial, count:
    compose_states_table's."""
    initial_state, dot_precision, num_warps, num_stages = h0, precision, warps, stages
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    on_gpu = Sref.is_cuda
    half_t = Tref.dtype in (torch.bfloat16, torch.float16)
    BK = max(16, triton.next_power_of_2(K))
    BV = block_v or max(16, triton.next_power_of_2(V))
    if on_gpu and block_v is None:
        BV = min(64, BV)
        # Few (layer, head) pairs, e.g. one layer's heads in the live scan: narrower column blocks
        # until the programs cover the SMs (one block per head leaves most SMs idle while each
        # program walks all n segments in sequence).
        while BV > 32 and G * triton.cdiv(V, BV) < _sm_count(Sref.device):
            BV //= 2
    # GPU defaults (docstring of compose_states_fwd): 16-bit T in two 16-bit dots of the split
    # state, the column blocks of a (layer, head) side by side, 8 warps, 2 stages for 16-bit T
    precision = dot_precision or (("bf16x2" if half_t and BK <= 128 else "tf32x3") if on_gpu else "ieee")
    split = precision == "bf16x2"
    if split and not half_t:
        raise ValueError(f"dot precision bf16x2 needs T in 16 bits, got {Tref.dtype}")
    if grid_vg is None:
        grid_vg = on_gpu and triton.cdiv(V, BV) > 1
    stages = num_stages or (2 if on_gpu and half_t and BK >= 128 else None)
    warps = num_warps or (8 if on_gpu and BK >= 128 else 4)
    ht = torch.empty(G, K, V, dtype=torch.float32, device=Sref.device)
    rows = N + 1 if store_initial else N
    hs = torch.empty(rows, G, K, V, dtype=torch.float32, device=Sref.device) if output_all else None
    grid = (triton.cdiv(V, BV), G) if grid_vg else (G, triton.cdiv(V, BV))
    compose_states_fwd_kernel[grid](
        T=T,
        S=S,
        h0=initial_state,
        ht=ht,
        hs=hs,
        Tref=Tref,
        Sref=Sref,
        N=N,
        count=count,
        run_index=runs[0] if runs else None,
        TRref=runs[1] if runs else Tref,
        SRref=runs[2] if runs else Sref,
        G=G,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        DOT_PRECISION="ieee" if split else precision,
        STORE_INITIAL=store_initial,
        INDIRECT=T is not Tref,
        PREFETCH_ADDRESSES=prefetch,
        SPLIT_STATE=split,
        GRID_VG=grid_vg,
        num_warps=warps,
        **({"num_stages": stages} if stages else {}),
    )
    return (ht, hs) if output_all else ht


def _block_addresses(blocks, inner: tuple[int, int, int], what: str):
    """Addresses of the [G, K, X] blocks `inner` in `blocks` (tensors whose leading dims are all 1,
    or (base, i) for row i of a [M, G, K, X] base), with one tensor for their dtype and device."""
    addrs, ref, size = [], None, inner[0] * inner[1] * inner[2]
    checked = set()
    for b in blocks:
        base, i = b if isinstance(b, tuple) else (b, 0)
        if id(base) not in checked:
            rows = base.shape[0] if isinstance(b, tuple) and base.dim() == 4 else 1
            if tuple(base.shape[-3:]) != inner or base.numel() != rows * size:
                raise ValueError(f"{what} block of shape {tuple(base.shape)} is not [{', '.join(map(str, inner))}]")
            if not base.is_contiguous():
                raise ValueError(f"{what} blocks must be contiguous")
            if ref is None:
                ref = base
            elif base.dtype != ref.dtype or base.device != ref.device:
                got, want = f"{base.dtype} on {base.device}", f"{ref.dtype} on {ref.device}"
                raise ValueError(f"{what} blocks differ in dtype or device: {got} against {want}")
            checked.add(id(base))
        if isinstance(b, tuple) and not 0 <= i < base.shape[0]:
            raise ValueError(f"{what} block row {i} is outside its base of {base.shape[0]} rows")
        addrs.append(base.data_ptr() + i * size * base.element_size())
    return addrs, ref


def compose_states_blocks(
    Ts,
    Ss,
    initial_state: torch.Tensor | None = None,
    output_all: bool = False,
    block_v: int | None = None,
    dot_precision: str | None = None,
    prefetch_addresses: bool = False,
    num_warps: int | None = None,
    num_stages: int | None = None,
    to_device=None,
):
    """compose_states_fwd over entries left where they are: no [N, ...] stack is copied.

    Ts, Ss: n blocks each, in order; a block is a contiguous tensor of one segment's [G, K, K] (T)
    or [G, K, V] (S) with leading dims of size 1 (e.g. an entry's [1, H, K, K] layer), or a pair
    (base, i) for row i of a contiguous [M, G, K, K] / [M, G, K, V] base (e.g. the live runs'
    pairs of one scan). All T blocks share a dtype and device, all S blocks too. The kernel reads
    each block through a table of addresses (one small host-to-device copy); the blocks must stay
    alive until the launch has run, as they do while the caller holds them. prefetch_addresses:
    each program reads the next segment's addresses a step ahead (off by default; fold_bench times
    both). The in-place fold is slower per launch than the stacked kernel but saves the stacking's
    copies, which cost more.
    Launch options as compose_states_fwd's. `to_device(host_table)` moves the address table to the
    device when given (the engine's copy, which a CUDA graph's capture redirects), else a pinned
    non-blocking copy.

    Returns as compose_states_fwd: [G, K, V] fp32 (and the [N, G, K, V] states with output_all).
    """
    if len(Ts) != len(Ss) or not Ts:
        raise ValueError(f"need as many T blocks as S blocks, at least one (got {len(Ts)} and {len(Ss)})")
    t0 = Ts[0][0] if isinstance(Ts[0], tuple) else Ts[0]
    s0 = Ss[0][0] if isinstance(Ss[0], tuple) else Ss[0]
    if t0.dim() < 3 or s0.dim() < 3:
        raise ValueError(f"T and S blocks must be [G, K, K] and [G, K, V], got {tuple(t0.shape)}, {tuple(s0.shape)}")
    G, K, V = s0.shape[-3:]
    if initial_state is not None and initial_state.shape != (G, K, V):
        raise ValueError(f"initial_state must be [{G}, {K}, {V}], got {tuple(initial_state.shape)}")
    t_addr, Tref = _block_addresses(Ts, (G, K, K), "T")
    s_addr, Sref = _block_addresses(Ss, (G, K, V), "S")
    if Tref.device != Sref.device:
        raise ValueError(f"T blocks on {Tref.device}, S blocks on {Sref.device}")
    table = torch.tensor(t_addr + s_addr, dtype=torch.int64)
    if to_device is not None:
        table = to_device(table)
    elif Sref.is_cuda:
        table = table.pin_memory().to(Sref.device, non_blocking=True)
    N = len(Ts)
    args = (initial_state, output_all, block_v, dot_precision, num_warps, num_stages, prefetch_addresses)
    return _launch(table[:N], table[N:], Tref, Sref, N, G, K, V, *args)


def compose_states_table(
    T_table: torch.Tensor,
    S_table: torch.Tensor,
    Tref: torch.Tensor,
    Sref: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_all: bool = False,
    block_v: int | None = None,
    dot_precision: str | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    prefetch_addresses: bool = False,
    store_initial: bool = False,
    count: torch.Tensor | None = None,
    runs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
):
    """compose_states_blocks over address tables already on the device: T_table, S_table [N] int64
    hold the addresses of each segment's contiguous [G, K, K] / [G, K, V] block, of the dtypes of
    Tref / Sref (any tensors of those dtypes, shapes [..., G, K, K] / [..., G, K, V], on the
    device). Made on the device (a CUDA graph's pass computes part of its table there), so nothing
    is checked against the blocks: every address must point at a live block of the right shape and
    dtype. block_v, dot_precision, num_warps, num_stages: as compose_states_fwd's;
    prefetch_addresses: each step's addresses loaded a step ahead. store_initial (with output_all):
    the states come back [N + 1, G, K, V], row 0 the initial state (zeros if None) and row i + 1 the
    state after segment i, so that "the state entering segment i" is row i for every i. count: an
    int tensor [1] on the device, the number of segments to fold (at most N; a CUDA graph's table
    of a bucket's N holds fewer real ones): the final state is the one after count segments, and the
    rows of the states after the others are left unwritten. runs: (run_index [N] int on the device,
    run_T, run_S): where run_index[i] >= 0 segment i's addresses are of blocks of run_T's and
    run_S's dtypes (a pass's own pairs, e.g. fp32 beside bf16 entries) instead of Tref's and Sref's;
    such a T is rounded to Tref's dtype as it is read (what a copy to that dtype would do first), its
    S read as it is. Returns as compose_states_fwd."""
    if T_table.dtype != torch.int64 or S_table.dtype != torch.int64 or T_table.shape != S_table.shape:
        raise ValueError(f"tables must be int64 of one shape, got {T_table.dtype} {tuple(T_table.shape)}, "
                         f"{S_table.dtype} {tuple(S_table.shape)}")
    G, K, V = Sref.shape[-3:]
    if tuple(Tref.shape[-3:]) != (G, K, K):
        raise ValueError(f"Tref {tuple(Tref.shape)} does not match Sref {tuple(Sref.shape)}")
    if initial_state is not None and initial_state.shape != (G, K, V):
        raise ValueError(f"initial_state must be [{G}, {K}, {V}], got {tuple(initial_state.shape)}")
    if store_initial and not output_all:
        raise ValueError("store_initial needs output_all")
    if count is not None and (count.numel() != 1 or count.dtype not in (torch.int32, torch.int64)
                              or count.device != Sref.device):
        raise ValueError(f"count must be one int32/int64 on {Sref.device}, got {count.dtype} "
                         f"{tuple(count.shape)} on {count.device}")
    N = T_table.shape[0]
    if runs is not None:
        run_index, run_T, run_S = runs
        if prefetch_addresses:
            raise ValueError("runs of another dtype are not read with prefetch_addresses")
        if run_index.shape != (N,) or run_index.device != Sref.device:
            raise ValueError(f"run_index must be [{N}] on {Sref.device}, got {tuple(run_index.shape)}")
        if tuple(run_T.shape[-3:]) != (G, K, K) or tuple(run_S.shape[-3:]) != (G, K, V):
            raise ValueError(f"run_T {tuple(run_T.shape)} / run_S {tuple(run_S.shape)} do not match [{G}, {K}, ...]")
    args = (initial_state, output_all, block_v, dot_precision, num_warps, num_stages, prefetch_addresses)
    return _launch(T_table.contiguous(), S_table.contiguous(), Tref, Sref, N, G, K, V, *args,
                   store_initial=store_initial, count=count, runs=runs)
