"""Which implementation of each op runs for a device and dtype (the model's dispatch points).

CPU (and CI): the pure-PyTorch references in kernels/ops. CUDA: fla-core's chunked gated delta
rule (with initial state) when importable, MoE experts as torch's grouped GEMM (bf16 on sm90/sm100)
or else the Triton fused-MoE kernel (kernels/ops/moe; on the CPU the grouped GEMM too, where
torch has it), our fused entry construction for runs that record a
cache entry, Triton causal conv, our live-token attention kernel (kernels/ops/attention) where live
tokens sit between cached spans, and SDPA for the other attention (flash for a plain causal
prefill, a live tail and decode).
Which of these a call takes is an OpDispatch: a ModelRunner holds the one its runtime config
chooses (`--kernels reference` forces the references on any device, `--sdpa-backends` names the
SDPA backends allowed) and enters it for each of its calls (`dispatching`, a context variable: it
holds for that thread's call alone, so runners of other choices can run side by side); outside a
runner's call the default applies (fast kernels for CUDA tensors). Nothing here reads the
environment.
Kernel modules are imported lazily, so importing the runtime never imports Triton.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.causal_conv import naive_causal_conv1d
from hybridcache.kernels.ops.gated_delta_rule import chunk_gated_delta_rule, naive_recurrent_gated_delta_rule
from hybridcache.kernels.ops.gla import naive_recurrent_gla
from hybridcache.kernels.ops.kda import naive_recurrent_kda
from hybridcache.kernels.ops.mamba2 import naive_ssd
from hybridcache.kernels.ops.moe import (
    SharedExpert,
    grouped_experts,
    grouped_mm_supported,
    naive_experts,
    naive_shared_expert,
)
from hybridcache.kernels.ops.simple_gla.naive import naive_lightning_attention, naive_recurrent_simple_gla
from hybridcache.kernels.ops.transition import apply_segment
from hybridcache.services.config import KERNELS, RuntimeConfig, sdpa_backend_names

MOE_PATHS = ("auto", "grouped_mm", "triton", "pairs", "loop")
GEMV_PATHS = ("auto", "cublas")
# Token-expert pairs up to which CUDA takes the pair-major kernels (kernels/ops/moe/triton.py
# pair_experts). They read each pair's expert weights, where the sorted kernels read each distinct
# expert's once: n k pairs over E experts hit E (1 - (1 - 1/E)^(n k)) distinct ones, 1.58x fewer than
# the pairs at 256 pairs of 256 experts (Qwen3.5-35B-A3B at batch 32). The repeats come from the
# L2 cache (programs of a launch read the same experts together), and the pair path leaves out the
# sort, the padded blocks, the k-sum and the shared expert's launches: one graphed block at 32 tokens
# takes 386 us on the pairs against 423 us for the fastest sorted tiles on an H100
# (moe_bench_h100_18a0f58.json; 396 against 432 in moe_bench_h100_d461794.json).
MOE_PAIR_MAX = 256

# Below this many tokens the step loop beats chunking on CPU, and fla's fused recurrent kernel
# beats its chunked one on GPU (decode, seam windows).
SHORT_RUN = 16


@dataclass(frozen=True)
class OpDispatch:
    """A choice of op implementations (RuntimeConfig.kernels and .sdpa_backends): fast kernels for
    CUDA tensors unless kernels is "reference"; the SDPA backends allowed."""

    kernels: str = RuntimeConfig.kernels
    sdpa_backends: str = RuntimeConfig.sdpa_backends
    # MoE experts (moe_experts): "auto" picks the fastest path that has no host synchronisation;
    # "grouped_mm", "triton", "pairs" and "loop" force one (benchmarks/moe_bench.py compares them)
    moe: str = "auto"
    # one-row linear layers (linear): "auto" takes the Triton GEMV for the weight shapes where
    # plan_gemv measured it faster; "cublas" always runs torch's linear (benchmarks compare them)
    gemv: str = "auto"

    def __post_init__(self):
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        if self.moe not in MOE_PATHS:
            raise ValueError(f"moe must be one of {', '.join(MOE_PATHS)}, got {self.moe!r}")
        if self.gemv not in GEMV_PATHS:
            raise ValueError(f"gemv must be one of {', '.join(GEMV_PATHS)}, got {self.gemv!r}")
        sdpa_backend_names(self.sdpa_backends)

    @classmethod
    def of(cls, config: RuntimeConfig) -> OpDispatch:
        return cls(config.kernels, config.sdpa_backends)


DEFAULT_DISPATCH = OpDispatch()
# the choice in force for this thread's (or task's) current call; the default outside any
_DISPATCH: contextvars.ContextVar[OpDispatch] = contextvars.ContextVar("op_dispatch", default=DEFAULT_DISPATCH)


def current_dispatch() -> OpDispatch:
    return _DISPATCH.get()


@contextlib.contextmanager
def dispatching(dispatch: OpDispatch):
    """`dispatch` inside the block (for this thread's calls), the previous choice after it (a
    ModelRunner's calls; comparisons in benchmarks and tests)."""
    token = _DISPATCH.set(dispatch)
    try:
        yield dispatch
    finally:
        _DISPATCH.reset(token)


def use_fast_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda and _DISPATCH.get().kernels != "reference"


@functools.cache
def fla_available() -> bool:
    return fla_has("fla.ops.gated_delta_rule")


def gated_delta_rule(q, k, v, g, beta, initial_state, output_transition: bool):
    """q, k [B, T, H, K]; v [B, T, H, V]; g, beta [B, T, H]; state [B, H, K, V] fp32.

    Returns (o, final_state) or, with output_transition, (o, final_state, (T, S(run|0))).
    """
    if use_fast_kernels(v) and fla_available():
        q, k = q.to(v.dtype), k.to(v.dtype)
        beta = beta.to(v.dtype)
        if output_transition:
            from hybridcache.kernels.ops.gated_delta_rule.fla_entry import chunk_gated_delta_rule_entry

            return chunk_gated_delta_rule_entry(q, k, v, g, beta, initial_state=initial_state)
        state = initial_state.float().contiguous() if initial_state is not None else None
        if q.shape[1] < SHORT_RUN:
            from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

            return fused_recurrent_gated_delta_rule(
                q, k, v, g=g.float(), beta=beta, initial_state=state, output_final_state=True
            )
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

        return chunk_as_varlen(fla_chunk, q, k, v, g.float(), beta, state)
    if q.shape[1] < SHORT_RUN:
        return naive_recurrent_gated_delta_rule(
            q, k, v, g, beta, initial_state=initial_state, output_transition=output_transition
        )
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_transition=output_transition)


def chunk_as_varlen(chunk_fn, q, k, v, g, beta, state):
    """fla's chunked gated delta rule over B equal-length runs [B, T, ...] as one variable-length
    row of B sequences (cu_seqlens), initial states [B, H, K, V] or None. fla's chunk-local cumsum
    takes the batch size as a compile-time constant and autotunes per value, so batches of runs
    (a prompt's splits, one per checkpoint) compiled it again for every new count; as varlen the
    batch is always 1. Returns (o [B, T, H, V], final states [B, H, K, V])."""
    B, T = q.shape[:2]
    if B == 1:
        return chunk_fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True)
    cu, cu_cpu = equal_run_offsets(B, T, q.device)
    flat = [x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final = chunk_fn(
        *flat[:3],
        g=flat[3],
        beta=flat[4],
        initial_state=state,
        output_final_state=True,
        cu_seqlens=cu,
        cu_seqlens_cpu=cu_cpu,
    )
    return o.reshape(B, T, *o.shape[2:]), final


@functools.cache  # never evicted: a CUDA graph may read the tensors it returned
def equal_run_offsets(B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens of B runs of T tokens, on `device` and on the host, the same two objects for
    every call with these arguments: fla keys its chunk-index tables on the identity of the
    cu_seqlens tensor (and some of its kernels rebuild them from the device copy, a host sync
    each time), so every linear layer of a forward reuses the tables the first one built."""
    cu_cpu = torch.arange(0, (B + 1) * T, T, dtype=torch.long)
    return cu_cpu.to(device), cu_cpu


def gated_delta_rule_pieces(q, k, v, g, beta):
    """Runs from a zero state, each with what folding it after other state needs: returns
    (o0 [B, T, H, V] (v's dtype), T [B, H, K, K] fp32, S(run|0) [B, H, K, V] fp32,
    u [B, T, H, K]), u_t = scale T_t^T q_t. From any entering state S_in the run's outputs are
    o0 + u S_in and its final state T S_in + S(run|0): no second pass over the run."""
    if use_fast_kernels(v) and fla_available():
        from hybridcache.kernels.ops.gated_delta_rule.fla_entry import chunk_gated_delta_rule_entry

        o, _, (T, S0), u = chunk_gated_delta_rule_entry(
            q.to(v.dtype), k.to(v.dtype), v, g, beta.to(v.dtype), output_query_transition=True
        )
        return o, T, S0, u
    run = naive_recurrent_gated_delta_rule if q.shape[1] < SHORT_RUN else chunk_gated_delta_rule
    o, _, (T, S0), u = run(q, k, v, g, beta, output_transition=True, output_query_transition=True)
    return o, T, S0, u


def run_outputs_from_states(u: torch.Tensor, s_in: torch.Tensor) -> torch.Tensor:
    """u S_in for each run: u [m, L, H, K] (query transitions), s_in [m, H, K, V] fp32 (the states
    entering the runs) -> [m, L, H, V] fp32. On CUDA one batched TF32 product (fp32 FFMA is a
    visible share of the assembly; the result goes into bf16 outputs, whose rounding is coarser
    than TF32's); elsewhere fp32."""
    if not use_fast_kernels(s_in):
        return torch.einsum("mlhk,mhkv->mlhv", u.float(), s_in)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        out = torch.matmul(u.float().transpose(1, 2), s_in)  # [m, H, L, V]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    return out.transpose(1, 2)


@functools.cache
def fla_has(module: str) -> bool:
    """Whether fla's op package (e.g. "fla.ops.kda") imports here."""
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


def kda(q, k, v, g, beta, initial_state, output_transition: bool):
    """Kimi delta attention; naive_recurrent_kda's arguments and contract. CUDA: fla's chunk_kda
    (fused_recurrent_kda for short runs), T from the same call (kernels/ops/kda/fla_entry.py)."""
    if use_fast_kernels(v) and fla_has("fla.ops.kda"):
        from hybridcache.kernels.ops.kda.fla_entry import kda_fla

        return kda_fla(q, k, v, g, beta, initial_state=initial_state, output_transition=output_transition)
    return naive_recurrent_kda(q, k, v, g, beta, initial_state=initial_state, output_transition=output_transition)


def kda_pieces(q, k, v, g, beta):
    """KDA runs from a zero state, each with what folding it after other state needs (the
    contract of gated_delta_rule_pieces): (o0 [B, T, H, V] (v's dtype), T [B, H, K, K] fp32,
    S(run|0) [B, H, K, V] fp32, u [B, T, H, K]), u_t = scale T_t^T q_t. CUDA: one chunk_kda call
    with K extra value columns (kernels/ops/kda/fla_entry.py)."""
    if use_fast_kernels(v) and fla_has("fla.ops.kda"):
        from hybridcache.kernels.ops.kda.fla_entry import kda_fla_pieces

        return kda_fla_pieces(q, k, v, g, beta)
    o, _, (T, S0), u = naive_recurrent_kda(q, k, v, g, beta, output_transition=True, output_query_transition=True)
    return o, T, S0, u


def simple_gla(q, k, v, g, scale, initial_state, output_transition: bool):
    """Scalar-decay linear attention with a per-step log decay g [B, T, H]; naive_recurrent_simple_gla's
    contract. CUDA: fla's simple GLA kernels (kernels/ops/simple_gla/fla_entry.py)."""
    if use_fast_kernels(v) and fla_has("fla.ops.simple_gla"):
        from hybridcache.kernels.ops.simple_gla.fla_entry import simple_gla_fla

        return simple_gla_fla(
            q, k, v, g=g, scale=scale, initial_state=initial_state, output_transition=output_transition
        )
    return naive_recurrent_simple_gla(
        q, k, v, g, scale=scale, initial_state=initial_state, output_transition=output_transition
    )


def simple_gla_pieces(q, k, v, g, scale):
    """Scalar-decay runs from a zero state (the contract of gated_delta_rule_pieces): (o0, T [B, H],
    S(run|0), u [B, T, H, K] fp32). T_t = exp(g_1 + ... + g_t) is a scalar per head, so the query
    transition is u_t = scale T_t q_t, computed here from g on any device."""
    o, _, (T, S0) = simple_gla(q, k, v, g, scale, None, True)
    u = g.float().cumsum(1).exp()[..., None] * (q.float() * scale)
    return o, T, S0, u


def ssd_pieces(x, dt, A, B, C, D):
    """Mamba2 SSD runs from a zero state (the contract of gated_delta_rule_pieces): (y0 (D skip
    included), T [B, H], S(run|0) [B, H, N, P], u [B, T, H, N] fp32), u_t = exp(A sum_{s<=t} dt_s) C_t
    (C repeated over the heads of its group): y from any S_in is y0 + u S_in."""
    y, _, (T, S0) = ssd(x, dt, A, B, C, D, None, True)
    rep = x.shape[2] // C.shape[2]
    decay = (dt.float() * A.float()[None, None, :]).cumsum(1).exp()  # [B, T, H]
    return y, T, S0, decay[..., None] * C.float().repeat_interleave(rep, dim=2)


def gla(q, k, v, gk, scale, initial_state, output_transition: bool):
    """Gated linear attention (per-channel decay); naive_recurrent_gla's contract. CUDA: fla's
    chunk_gla (fused_recurrent_gla for short runs), vector T = exp(sum of the log-gates)."""
    if use_fast_kernels(v) and fla_has("fla.ops.gla"):
        from hybridcache.kernels.ops.gla.fla_entry import gla_fla

        return gla_fla(q, k, v, gk, scale=scale, initial_state=initial_state, output_transition=output_transition)
    return naive_recurrent_gla(
        q, k, v, gk, scale=scale, initial_state=initial_state, output_transition=output_transition
    )


def lightning_attention(q, k, v, slopes, scale, initial_state, output_transition: bool):
    """Lightning attention (fixed decay exp(-slopes[h]) per head); naive_lightning_attention's
    contract. CUDA: fla's simple GLA with g_gamma = -slopes, scalar T = exp(-n slopes)."""
    if use_fast_kernels(v) and fla_has("fla.ops.simple_gla"):
        from hybridcache.kernels.ops.simple_gla.fla_entry import simple_gla_fla

        g_gamma = -slopes.float().to(v.device)
        return simple_gla_fla(
            q, k, v, g_gamma=g_gamma, scale=scale, initial_state=initial_state, output_transition=output_transition
        )
    return naive_lightning_attention(
        q, k, v, slopes, scale=scale, initial_state=initial_state, output_transition=output_transition
    )


def ssd(x, dt, A, B, C, D, initial_state, output_transition: bool):
    """Mamba2 SSD scan; naive_ssd's contract. CUDA: fla's simple GLA kernels (q = C, k = dt B,
    v = x, g = dt A, scale 1; D outside), scalar T = exp(A sum dt)."""
    if use_fast_kernels(x) and fla_has("fla.ops.simple_gla"):
        from hybridcache.kernels.ops.mamba2.fla_entry import ssd_fla

        return ssd_fla(x, dt, A, B, C, D=D, initial_state=initial_state, output_transition=output_transition)
    return naive_ssd(x, dt, A, B, C, D=D, initial_state=initial_state, output_transition=output_transition)


def _block(b):
    """A fold_states block as a tensor: b itself, or row i of base for a pair (base, i)."""
    return b[0][b[1] : b[1] + 1] if isinstance(b, tuple) else b


def fold_states(Ts, Ss, initial_state, use_transition):
    """States after each of n (T, S) pairs folded in order from initial_state [1, H, K, V]:
    S_i = T_i S_{i-1} + S_i (S_{i-1} + S_i where use_transition[i] is False, the naive ablation).
    Ts [1, H, K, K] (or vector / scalar T), Ss [1, H, K, V]; a block may also be a pair (base, i)
    standing for base[i : i + 1] of a stack of pairs. Returns a sequence of n [1, H, K, V].
    On CUDA, matrix T: one Triton launch that reads the blocks where they lie through a table of
    their addresses (compose_states_blocks), every intermediate state out, no stacked copy; the
    blocks of one kind must share a dtype and be contiguous there (else they are stacked, as
    torch.cat promotes). Scalar or vector T only (every block), on any device: fold_diagonal, a
    fixed number of ops."""
    if all((b[0] if isinstance(b, tuple) else b).dim() < initial_state.dim() for b in Ts):
        return fold_diagonal(Ts, Ss, initial_state, use_transition)
    if use_fast_kernels(initial_state) and all(use_transition):
        t0 = _block(Ts[0])
        if t0.dim() == 4 and t0.shape[-1] == t0.shape[-2]:
            from hybridcache.kernels.ops.transition.compose_triton import compose_states_blocks, compose_states_fwd

            bases_T = [b[0] if isinstance(b, tuple) else b for b in Ts]
            bases_S = [b[0] if isinstance(b, tuple) else b for b in Ss]
            uniform = len({b.dtype for b in bases_T}) == 1 and len({b.dtype for b in bases_S}) == 1
            if uniform and all(b.is_contiguous() for b in bases_T + bases_S):
                dev = initial_state.device
                _, states = compose_states_blocks(
                    Ts, Ss, initial_state[0], output_all=True, to_device=lambda t: to_device_async(t, dev)
                )
            else:
                Ts, Ss = [_block(b) for b in Ts], [_block(b) for b in Ss]
                _, states = compose_states_fwd(torch.cat(Ts), torch.cat(Ss), initial_state[0], output_all=True)
            return states[:, None]  # [n, 1, H, K, V]
    out, S = [], initial_state
    for T, S_i, use_t in zip(Ts, Ss, use_transition):
        S = apply_segment(_block(T), _block(S_i), S, use_t)
        out.append(S)
    return out


def fold_diagonal(Ts, Ss, initial_state, use_transition):
    """fold_states for scalar [1, H] or vector [1, H, K] transitions, in a fixed number of ops
    whatever the number n of pairs: S_i = sum_{j<=i} (T_{j+1} ... T_i) S_j + (T_1 ... T_i) S_init,
    the products exp(c_i - c_j) of the cumulative log-transitions c (fp64, log T clamped at -1e4 so
    that a T that underflowed to 0 stays 0); pieces without use_transition count T = 1. Returns
    [n, 1, H, K, V] fp32."""
    T = torch.cat([_block(b) for b in Ts]).double()  # [n, H] or [n, H, K]
    S = torch.cat([_block(b) for b in Ss]).float()  # [n, H, K, V]
    n, lead = T.shape[0], (1,) * (T.dim() - 1)
    if not all(use_transition):
        keep = to_device_async(torch.tensor(use_transition), T.device).view(n, *lead)
        T = torch.where(keep, T, torch.ones_like(T))
    c = T.log().clamp_min(-1e4).cumsum(0)
    causal = torch.ones(n, n, dtype=torch.bool, device=T.device).tril().view(n, n, *lead)
    W = (c[:, None] - c[None, :]).masked_fill(~causal, float("-inf")).exp().float()  # [i, j, H(, K)]
    P = c.exp().float()
    init = initial_state.float()[0]
    if T.dim() == 2:
        out = torch.einsum("ijh,jhkv->ihkv", W, S) + P[..., None, None] * init
    else:
        out = torch.einsum("ijhk,jhkv->ihkv", W, S) + P[..., None] * init
    return out[:, None]


def l2norm_fp32(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2, -1) + eps) in fp32 (q and k of the delta rules). CUDA: one launch of the
    row-norm kernel (kernels/ops/norm) instead of a cast and four eager ops."""
    if use_fast_kernels(x):
        from hybridcache.kernels.ops.norm.triton import l2norm

        return l2norm(x, eps)
    xf = x.float()
    return xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)


def l2norm_qk(x, dtype, repeat: int = 1, eps: float = 1e-6):
    """q or k [..., H, D] of the gated delta rule, each head repeated `repeat` times (grouped value
    heads) and L2-normalized in fp32. On CUDA: one launch (kernels/ops/norm l2norm_heads) and no
    repeated copy; with fla the result is stored straight in `dtype` (v's), which fla's kernels are
    given anyway: the same single rounding without an fp32 copy and a cast (four launches a layer
    fewer, and at a 32k-token prefill of the 9B shape ~3 GB less traffic a layer). Elsewhere
    repeat_interleave and fp32, as before."""
    if use_fast_kernels(x):
        from hybridcache.kernels.ops.norm.triton import l2norm_heads

        return l2norm_heads(x, repeat, eps, dtype if fla_available() else torch.float32)
    if repeat > 1:
        x = x.repeat_interleave(repeat, dim=-2)
    return l2norm_fp32(x, eps)


def fused_rms_norm(x, weight, eps: float):
    """CUDA: x * rsqrt(mean(x^2) + eps) * weight in one launch (kernels/ops/norm, fp32 inside, x's
    dtype out) instead of about eight eager ops; None elsewhere, and the caller runs its own eager
    reference."""
    if not use_fast_kernels(x):
        return None
    from hybridcache.kernels.ops.norm.triton import rms_norm

    return rms_norm(x, weight, eps)


def fused_add_rms_norm(x, r, weight, eps: float):
    """CUDA: (x + r, RMSNorm(x + r) * weight) in one launch (kernels/ops/norm), the residual sum
    in x's dtype as the eager add leaves it; None elsewhere."""
    if not use_fast_kernels(x):
        return None
    from hybridcache.kernels.ops.norm.triton import add_rms_norm

    return add_rms_norm(x, r, weight, eps)


def fused_rms_norm_gated(x, gate, weight, eps: float):
    """CUDA: rms_norm(x) * weight * silu(gate) in one launch (kernels/ops/norm); None elsewhere."""
    if not use_fast_kernels(x):
        return None
    from hybridcache.kernels.ops.norm.triton import rms_norm_gated

    return rms_norm_gated(x, gate, weight, eps)


def gdn_gates(a, b, A_log, dt_bias):
    """g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b), fp32 [..., H]: one launch on
    CUDA (kernels/ops/gated_delta_rule/gates.py) instead of about ten eager ops."""
    if use_fast_kernels(a):
        from hybridcache.kernels.ops.gated_delta_rule.gates import gdn_gates as fused

        return fused(a, b, A_log, dt_bias)
    from hybridcache.kernels.ops.gated_delta_rule.naive import gdn_gates_reference

    return gdn_gates_reference(a, b, A_log, dt_bias)


def rope_heads(x, cos, sin):
    """CUDA: x [B, H, n, D] rotated by cos/sin [n, R] (fp32) in one launch (kernels/ops/rope), as a
    contiguous [B, H, n, D]; None elsewhere, and the caller runs its eager form."""
    if not use_fast_kernels(x):
        return None
    from hybridcache.kernels.ops.rope.triton import rope_heads as fused

    return fused(x, cos, sin)


def norm_rope(x, scale, eps: float, cos, sin):
    """CUDA: the heads x [B, n, H, D] (token-major views of a projection) RMS-normalized with a
    per-channel scale, then rotated, in one launch (kernels/ops/rope): [B, H, n, D] contiguous.
    None elsewhere."""
    if not use_fast_kernels(x):
        return None
    from hybridcache.kernels.ops.rope.triton import norm_rope_tokens

    return norm_rope_tokens(x, scale, eps, cos, sin)


def norm_rope_into_pages(k, v, scale, eps: float, cos, sin, k_pages, v_pages, rows) -> bool:
    """CUDA: a decode step's keys k [n, H, D] (token-major views) RMS-normalized with a
    per-channel scale, rotated and written into k_pages at the flattened rows [n], its values v
    into v_pages, in one launch (kernels/ops/rope). False, having written nothing, elsewhere and
    where the pools' dtype is not the tokens' (the caller then rotates and copies)."""
    if not use_fast_kernels(k) or k_pages.dtype != k.dtype or v_pages.dtype != v.dtype:
        return False
    from hybridcache.kernels.ops.rope.triton import norm_rope_into_pages as fused

    fused(k, v, scale, eps, cos, sin, k_pages, v_pages, rows)
    return True


def to_device_async(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without stalling the host: on CUDA through pinned memory with a
    non-blocking copy (a copy from pageable memory waits, and in a launch-bound forward the host
    then no longer runs ahead of the GPU). torch's host allocator keeps the pinned block until the
    copy is done. While a live pass is captured into a CUDA graph (graphs.py), the result is a
    device tensor the graph keeps, filled once after the capture (HostConstants)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    arena = getattr(_CONSTANTS, "arena", None)
    if arena is not None:
        out = arena.to_device(t, device)
        if out is not None:
            return out
    return t.pin_memory().to(device, non_blocking=True)


def own_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of `tensors`, each in storage of its own (a batch's per-segment pieces that
    entries keep after the batch is gone), made by torch's multi-tensor copy per dtype: on CUDA a
    few launches for any number of contiguous tensors of one dtype instead of a clone each (a
    batched build's host cost); strided ones are copied one by one, as clone would."""
    outs = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        torch._foreach_copy_([outs[i] for i in idx], [tensors[i] for i in idx])
    return outs


def pin(t: torch.Tensor) -> torch.Tensor:
    """t in pinned host memory (a source a non-blocking copy to CUDA does not wait on)."""
    return t.pin_memory() if torch.cuda.is_available() and not t.is_pinned() else t


_CONSTANTS = threading.local()


class HostConstants:
    """The host tensors a live pass copies to the device (layout-derived index tensors, address
    tables), for a CUDA graph of that pass. A copy inside a capture would be a memcpy node of the
    graph, reading host memory on every replay and queued on the copy engine behind whatever else
    is copying (a host-tier request's entries: a replay then waited for all of them). Instead:
    `measuring()` (an eager run of the same pass) notes each copy's shape and dtype and allocates a
    device tensor for each; `serving()` (the capture) hands those tensors out in the same order,
    keeps the host values, and on leaving copies them in, outside the graph, once: a graph reads
    them as constants. The tensors live as long as the graph that keeps this object. A capture
    whose copies differ in number, shape or dtype from the measured ones fails (the pass then
    runs eagerly)."""

    def __init__(self):
        self.mode = None
        self.specs: list[tuple] = []
        self.slots: list[torch.Tensor] = []
        self.pending: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def to_device(self, t: torch.Tensor, device) -> torch.Tensor | None:
        """The device tensor for host tensor t as this mode makes it; None: copy as usual (measuring)."""
        if self.mode == "measure":
            self.specs.append((tuple(t.shape), t.dtype, torch.device(device)))
            return None
        i = len(self.pending)
        if i >= len(self.slots) or self.specs[i] != (tuple(t.shape), t.dtype, torch.device(device)):
            raise RuntimeError(
                f"host copy {i} of the captured pass ({t.dtype} {tuple(t.shape)}) differs from its eager run's"
            )
        self.pending.append(t.clone())
        return self.slots[i]

    @contextlib.contextmanager
    def measuring(self):
        self.specs = []
        with self._active("measure"):
            yield self
        self.slots = [torch.empty(shape, dtype=dtype, device=dev) for shape, dtype, dev in self.specs]

    @contextlib.contextmanager
    def serving(self):
        self.pending = []
        with self._active("serve"):
            yield self
        if len(self.pending) != len(self.slots):
            made, measured = len(self.pending), len(self.slots)
            raise RuntimeError(f"the captured pass made {made} host copies, its eager run {measured}")
        for slot, host in zip(self.slots, self.pending):
            slot.copy_(host)
        self.values, self.pending = self.pending, []  # the host values, as the graph reads them

    @contextlib.contextmanager
    def _active(self, mode):
        prev = getattr(_CONSTANTS, "arena", None)
        self.mode, _CONSTANTS.arena = mode, self
        try:
            yield
        finally:
            self.mode, _CONSTANTS.arena = None, prev


def gated_heads(o, gate):
    """Gated attention's output: o [B, H, n, d] (head-major) as [B, n, H * d] times sigmoid(gate)
    [B, n, H, d]. CUDA: one launch (kernels/ops/activation); elsewhere the eager transpose, sigmoid
    and product."""
    if use_fast_kernels(o):
        from hybridcache.kernels.ops.activation.triton import sigmoid_gate_heads

        return sigmoid_gate_heads(o, gate)
    B, H, n, d = o.shape
    # gate is a slice of the projection: copied for any n (a reshape copies it for n > 1 only, and
    # a decode step's ops would depend on its batch size)
    gate = gate.clone(memory_format=torch.contiguous_format).view(B, n, H * d)
    return o.transpose(1, 2).reshape(B, n, H * d) * torch.sigmoid(gate)


# plan_gemv takes a candidate over plain cuBLAS only where its time is under this fraction of
# cuBLAS's (timing noise never flips a shape to the slower path)
GEMV_MARGIN = 0.97
# rows at which a column-major weight must not be slower than a row-major one (a decode batch)
GEMV_BATCH_ROWS = 32
# the bytes of weight copies a timing reads in turn, so that each call reads HBM (H100: 50 MB L2)
GEMV_TIMING_BYTES = 256 << 20
GEMV_TIMING_COPIES = 16


@dataclass(frozen=True)
class GemvChoice:
    """What a one-row linear layer of one weight shape runs on one device: `path` "cublas" (torch's
    linear on the row-major [N, K] weight), "cublas_t" (the same on the weight stored column-major,
    [K, N] contiguous: cuBLAS's other layout) or "triton" (kernels/ops/gemv with `config`), and the
    times plan_gemv measured for one row (µs a call), by candidate."""

    path: str
    config: object | None
    times_us: dict


# (device index, N, K, dtype) -> GemvChoice, filled by plan_gemv alone: a shape never measured runs
# on cuBLAS, and nothing is measured inside a call (a CUDA graph's capture included)
_GEMV_PLAN: dict[tuple, GemvChoice] = {}


def _gemv_key(w: torch.Tensor) -> tuple:
    return (w.device.index, w.shape[0], w.shape[1], w.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias. One row on CUDA (a decode step of one request) runs kernels/ops/gemv's Triton
    GEMV where plan_gemv chose it for the weight's shape (a row-major weight); everything else
    runs torch's linear, on whichever layout the weight has."""
    if _GEMV_PLAN and x.is_cuda and x.shape[-1] == x.numel() and x.dtype == weight.dtype and weight.stride(1) == 1:
        choice = _GEMV_PLAN.get(_gemv_key(weight))
        dispatch = _DISPATCH.get()
        if (choice is not None and choice.path == "triton" and dispatch.kernels != "reference"
                and dispatch.gemv == "auto" and not weight.requires_grad):
            from hybridcache.kernels.ops.gemv.triton import gemv

            return gemv(x, weight, bias, choice.config)
    return F.linear(x, weight, bias)


class DispatchLinear(torch.nn.Linear):
    """nn.Linear whose forward is `linear` (the one-row GEMV choice); the runner turns a CUDA
    model's nn.Linear modules into these (use_gemv_plan) without touching their parameters."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def graph_us(calls) -> float:
    """The device time of one of `calls` (each a no-argument callable) as a decode step runs them:
    all of them back to back inside one CUDA graph, replayed; µs a call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture (compiles, cuBLAS handles)
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 5
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps / len(calls)


def plan_gemv(weights, measure=None) -> dict[str, dict]:
    """Measure, for each distinct shape of `weights` (2-D CUDA tensors read by linear layers), a
    one-row product through cuBLAS on the row-major weight, through cuBLAS on it stored
    column-major, and through each Triton GemvConfig of kernels/ops/gemv CONFIGS; then keep the
    fastest for linear (pick_gemv). Each candidate is timed as a decode step runs it (graph_us:
    back to back in a CUDA graph, over enough random copies of the weight that each call reads
    device memory); the column-major layout also at GEMV_BATCH_ROWS rows, where it must not lose,
    and a Triton config only if its output agrees with cuBLAS's. A shape planned before is not
    measured again. `measure(calls) -> µs a call` replaces graph_us (tests). Returns
    {"NxK dtype": {"path", "config", "times_us"}} of the shapes."""
    from hybridcache.kernels.ops.gemv.triton import CONFIGS, gemv

    measure = measure or graph_us
    out, measured = {}, False
    for w in weights:
        if not (isinstance(w, torch.Tensor) and w.is_cuda and w.dim() == 2 and w.is_floating_point()):
            continue
        key = _gemv_key(w)
        if key not in _GEMV_PLAN:
            N, K = w.shape
            copies = max(1, min(GEMV_TIMING_COPIES, -(-GEMV_TIMING_BYTES // max(1, N * K * w.element_size()))))
            mats = [torch.randn(N, K, device=w.device, dtype=w.dtype) / K**0.5 for _ in range(copies)]
            x = torch.randn(1, K, device=w.device, dtype=w.dtype)
            xb = torch.randn(GEMV_BATCH_ROWS, K, device=w.device, dtype=w.dtype)
            times = {"cublas": measure([functools.partial(F.linear, x, m) for m in mats]),
                     "cublas_batch": measure([functools.partial(F.linear, xb, m) for m in mats])}
            cols = [m.t().contiguous().t() for m in mats]
            times["cublas_t"] = measure([functools.partial(F.linear, x, m) for m in cols])
            times["cublas_t_batch"] = measure([functools.partial(F.linear, xb, m) for m in cols])
            del cols
            ref = F.linear(x, mats[0]).float()
            tol = 2e-2 * ref.abs().max().item() + 1e-6
            triton = None
            for config in CONFIGS:
                if (gemv(x, mats[0], None, config).float() - ref).abs().max().item() > tol:
                    continue
                us = measure([functools.partial(gemv, x, m, None, config) for m in mats])
                if triton is None or us < triton[0]:
                    triton = (us, config)
            if triton is not None:
                times["triton"] = triton[0]
            _GEMV_PLAN[key] = pick_gemv(times, triton[1] if triton is not None else None)
            del mats, x, xb, ref
            measured = True
        c = _GEMV_PLAN[key]
        out[f"{key[1]}x{key[2]} {str(key[3]).removeprefix('torch.')}"] = {
            "path": c.path, "config": None if c.config is None else list(c.config),
            "times_us": {k: round(v, 2) for k, v in c.times_us.items()}}
    if measured:  # the random matrices' memory goes back to the device (memory planning reads it)
        torch.cuda.empty_cache()
    return out


def pick_gemv(times: dict, config=None) -> GemvChoice:
    """The choice for one shape from plan_gemv's times (µs a call: "cublas", "cublas_batch",
    "cublas_t", "cublas_t_batch", "triton" where a config was correct, that config `config`):
    the fastest one-row candidate, where one other than plain cuBLAS must take under GEMV_MARGIN
    of its time, and the column-major layout also no more than plain cuBLAS's at a batch."""
    best, best_us = "cublas", times["cublas"]
    t = times.get("cublas_t")
    if (t is not None and t < GEMV_MARGIN * times["cublas"]
            and times.get("cublas_t_batch", float("inf")) <= times.get("cublas_batch", 0.0) / GEMV_MARGIN):
        best, best_us = "cublas_t", t
    if "triton" in times and times["triton"] < GEMV_MARGIN * times["cublas"] and times["triton"] < best_us:
        best = "triton"
    return GemvChoice(best, config if best == "triton" else None, dict(times))


def gemv_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights a one-row step of `model` reads through linear: each nn.Linear's, each merged
    projection (models/common.merge_weights: a tensor attribute whose rows begin at a linear
    layer's weight and reach past it), and those other modules name (`linear_weights()`, a MoE
    router's)."""
    extra = [w for m in model.modules() if hasattr(m, "linear_weights") for w in m.linear_weights()]
    lins = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return lins + [g for g, _ in _merged_groups(model)] + extra


def _merged_groups(model) -> list[tuple[torch.Tensor, list]]:
    """(merged weight, the nn.Linear layers whose weights are its views) of the model."""
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    starts = {m.weight.data_ptr(): m.weight.shape[0] for m in lins}
    groups, seen = [], set()
    for m in model.modules():
        for v in vars(m).values():
            if (isinstance(v, torch.Tensor) and v.dim() == 2 and v.data_ptr() in starts
                    and v.shape[0] > starts[v.data_ptr()] and id(v) not in seen):
                seen.add(id(v))
                store = v.untyped_storage().data_ptr()
                lo, hi = v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()
                members = [lin for lin in lins if lin.weight.untyped_storage().data_ptr() == store
                           and lo <= lin.weight.data_ptr() < hi]
                groups.append((v, members))
    return groups


def use_gemv_plan(model: torch.nn.Module) -> int:
    """Turn the model's nn.Linear modules into DispatchLinear (same parameters, forward through
    linear); returns how many."""
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.__class__ = DispatchLinear
            n += 1
    return n


def column_major_linears(model: torch.nn.Module) -> list:
    """Store column-major ([K, N] contiguous, seen as its transpose) the weight of each nn.Linear
    whose planned path (plan_gemv, of its merged projection where it has one) is "cublas_t", then
    merge the projections again (merge_weights keeps that layout). Left row-major: layers marked
    `keeps_row_major` (their weights are read by kernels that need unit stride along the input,
    e.g. a MoE block's shared expert) and any whose merged group holds one, weights shared with a
    parameter outside the linear layers (tied embeddings), and shapes never planned. Returns the
    layers changed (to_row_major undoes it)."""
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    own = {id(m.weight) for m in lins}
    shared = {p.untyped_storage().data_ptr() for p in model.parameters() if id(p) not in own}
    group_of = {}
    for merged, members in _merged_groups(model):
        for lin in members:
            group_of[id(lin)] = (merged, members)

    def planned(w):
        c = _GEMV_PLAN.get(_gemv_key(w))
        return c is not None and c.path == "cublas_t"

    changed = []
    for lin in lins:
        w = lin.weight
        merged, members = group_of.get(id(lin), (w, [lin]))
        if (not planned(merged) or any(getattr(m, "keeps_row_major", False) for m in members)
                or w.untyped_storage().data_ptr() in shared or w.stride(0) == 1):
            continue
        lin.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
        changed.append(lin)
    if changed and hasattr(model, "merge_projections"):
        model.merge_projections()
    return changed


def to_row_major(model: torch.nn.Module, lins: list) -> None:
    """Undo column_major_linears for `lins`: row-major weights, the projections merged again."""
    for lin in lins:
        lin.weight = torch.nn.Parameter(lin.weight.detach().contiguous(), requires_grad=lin.weight.requires_grad)
    if lins and hasattr(model, "merge_projections"):
        model.merge_projections()


def fused_silu_mul(gate, up):
    """CUDA: silu(gate) * up in one launch reading gate and up in place (kernels/ops/activation);
    None elsewhere, and the caller runs its eager form."""
    if not use_fast_kernels(gate):
        return None
    from hybridcache.kernels.ops.activation.triton import silu_mul

    return silu_mul(gate, up)


def moe_path(x, gate_up, down, top_k: int | None = None) -> str:
    """Which implementation moe_experts runs for these tensors: the per-expert loop under
    `--kernels reference` (it reads the routing on the host); else on CUDA the pair-major Triton
    kernels for at most MOE_PAIR_MAX token-expert pairs (n * top_k: a decode step of a few requests;
    the router's top-k then runs as one kernel too, and the shared expert rides in the experts'
    launches) and the Triton fused-MoE kernel beyond (faster than torch's grouped GEMM at every
    token count benchmarks/moe_bench.py measures on an H100, and free of host synchronisation on
    every GPU and dtype), torch's grouped GEMM on the CPU where it applies (grouped_mm_supported),
    the loop elsewhere. OpDispatch.moe forces one."""
    dispatch = _DISPATCH.get()
    if dispatch.moe != "auto":
        return dispatch.moe
    if dispatch.kernels == "reference":
        return "loop"
    if x.is_cuda:
        tokens = x.numel() // x.shape[-1]
        return "pairs" if top_k is not None and tokens * top_k <= MOE_PAIR_MAX else "triton"
    return "grouped_mm" if grouped_mm_supported(x, gate_up, down) else "loop"


def moe_experts(x, gate_up, down, top_i, top_w, shared: SharedExpert | None = None, path: str | None = None):
    """Routed SwiGLU experts: x [n, h], gate_up [E, 2I, h], down [E, h, I], top_i / top_w [n, k]
    (each token's experts and routing weights) -> [n, h] in x's dtype (kernels/ops/moe), plus the
    shared expert where given: inside the pair kernels' two launches on the "pairs" path, as its own
    ops (kernels/ops/moe/naive.py) on the others. path: moe_path's answer, where the caller has it."""
    path = path or moe_path(x, gate_up, down, top_i.shape[1])
    if path == "pairs":
        from hybridcache.kernels.ops.moe.triton import pair_experts

        return pair_experts(x, gate_up, down, top_i, top_w, shared)
    if path == "grouped_mm":
        silu_mul = fused_silu_mul if use_fast_kernels(x) else None
        out = grouped_experts(x, gate_up, down, top_i, top_w, silu_mul)
    elif path == "triton":
        from hybridcache.kernels.ops.moe.triton import fused_experts

        out = fused_experts(x, gate_up, down, top_i, top_w)
    else:
        out = naive_experts(x, gate_up, down, top_i, top_w)
    return out if shared is None else out + naive_shared_expert(x, shared)


def causal_conv1d_update(x, weight, bias, conv_state, slots, activation):
    """One decode token of B requests whose conv states are rows `slots` of the pool conv_state
    [S, D, W - 1], advanced in place: x [B, D] -> y [B, D]. CUDA: one Triton launch
    (kernels/ops/causal_conv); elsewhere the reference."""
    if use_fast_kernels(x):
        from hybridcache.kernels.ops.causal_conv.triton import causal_conv1d_update as kernel

        return kernel(x, weight, bias, conv_state, slots, activation)
    from hybridcache.kernels.ops.causal_conv import naive_causal_conv1d_update

    return naive_causal_conv1d_update(x, weight, bias, conv_state, slots, activation)


def recurrent_step(q, k, v, g, beta, pool, slots, scale=None, **gates):
    """One decode token of a linear recurrence for B requests whose states are rows `slots` of
    `pool` [S, HV, K, V] fp32, advanced in place (kernels/ops/recurrent_step: the delta rule when
    beta is given, per-head or per-key gates, optionally the gated delta rule's gates and q/k
    norms from the raw projections): o [B, HV, V]. CUDA: one Triton launch; elsewhere the reference."""
    if use_fast_kernels(v) and pool.dtype == torch.float32:
        from hybridcache.kernels.ops.recurrent_step.triton import recurrent_step as kernel

        return kernel(q, k, v, g, beta, pool, slots, scale, **gates)
    from hybridcache.kernels.ops.recurrent_step import naive_recurrent_step

    return naive_recurrent_step(q, k, v, g, beta, pool, slots, scale, **gates)


def causal_conv1d(x, weight, bias, initial_state, activation):
    """x [B, T, D], weight [D, W], state [B, D, W - 1] -> (y [B, T, D], tail [B, D, W - 1])."""
    if use_fast_kernels(x):
        from hybridcache.kernels.ops.causal_conv.triton import causal_conv1d_fwd

        return causal_conv1d_fwd(x, weight, bias, initial_state.to(x.dtype), activation)
    return naive_causal_conv1d(x, weight, bias, initial_state, activation)


DEFAULT_SDPA_BACKENDS = RuntimeConfig.sdpa_backends


def sdpa_backends(spec: str | None = None):
    """The torch SDPBackend list for a spec (default: the OpDispatch in force); None for "torch"
    (no restriction)."""
    return _sdpa_backends(spec if spec is not None else _DISPATCH.get().sdpa_backends)


@functools.cache
def _sdpa_backends(spec: str):
    from torch.nn.attention import SDPBackend

    names = sdpa_backend_names(spec)
    if names is None:
        return None
    table = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "math": SDPBackend.MATH,
    }
    return [table[n] for n in names]


def sdpa(q, k, v, **kw):
    """F.scaled_dot_product_attention under the allowed backends on CUDA (sdpa_backends); every
    attention call of the models goes through here."""
    allowed = sdpa_backends() if q.is_cuda else None
    if allowed is None:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(allowed):
        return F.scaled_dot_product_attention(q, k, v, **kw)


def paged_decode_attention(q, k_pages, v_pages, table, rows, lengths, scale: float, max_pages: int, gate=None,
                           q_rope=None):
    """Decode attention over paged K/V (kernels/ops/attention/paged.py): q [B, Hq, dq], pools
    [num_pages, P, Hkv, d], table [R, W], rows and lengths [B] -> [B, Hq, dv], times sigmoid(gate
    [B, Hq, dv]) where a gate is given. CUDA (head dims up to 256): the Triton kernel, reading the
    pages through the table and gating its output as it stores it; elsewhere the reference, the
    first max_pages pages of each request gathered and SDPA under a key mask, then the gate.
    q_rope (scale [dq], eps, cos, sin [B, R]): q holds raw query heads, RMS-normalized with the
    scale and rotated at each request's angles first (in the kernel on CUDA)."""
    if use_fast_kernels(q) and max(q.shape[-1], v_pages.shape[-1]) <= 256:
        from hybridcache.kernels.ops.attention.paged import paged_decode_attention as kernel

        return kernel(q, k_pages, v_pages, table, rows, lengths, scale, gate=gate, q_rope=q_rope)
    from hybridcache.kernels.ops.attention.paged import paged_decode_reference
    from hybridcache.kernels.ops.rope.naive import norm_rope

    if q_rope is not None:
        q = norm_rope(q[None], q_rope[0], q_rope[1], q_rope[2], q_rope[3])[0].transpose(0, 1)
    o = paged_decode_reference(q, k_pages, v_pages, table, rows, lengths, scale, max_pages)
    return o if gate is None else o * torch.sigmoid(gate)


def paged_prefill_attention(q, k_pages, v_pages, table, row, live_pos, length: int, scale: float,
                            first_pos: int | None = None):
    """Live queries q [1, Hq, n, d] at absolute positions live_pos [n] over the first `length` keys
    of the sequence in table row `row` (a one-element device tensor) of the pools [num_pages, P,
    Hkv, d] (kernels/ops/attention/paged.py) -> [1, Hq, n, dv]. CUDA (head dims up to 256): the
    live-attention kernel reading the pages through the table, no K/V gathered; elsewhere the
    sequence's keys gathered and `attention` (the CPU path, and the reference)."""
    if use_fast_kernels(q) and max(q.shape[-1], v_pages.shape[-1]) <= 256 and q.dtype == k_pages.dtype:
        from hybridcache.kernels.ops.attention.triton import paged_live_attention

        return paged_live_attention(q, k_pages, v_pages, table, row, live_pos, length, scale)
    from hybridcache.kernels.ops.attention.paged import sequence_keys

    k = sequence_keys(k_pages, table, row, length).to(q.dtype)
    v = sequence_keys(v_pages, table, row, length).to(q.dtype)
    return attention(q, k, v, live_pos, scale, first_pos)


# Largest mask (query rows x keys) for which GQA folds a KV head's query heads into its query rows
# instead of repeating the KV heads: 64M booleans.
GQA_FOLD_MAX_MASK = 1 << 26


def gqa_fold(q, n_kv: int):
    """[1, Hq, n, d] -> [1, Hkv, rep * n, d]: the rep query heads that share a KV head (heads
    kv * rep .. kv * rep + rep - 1, repeat_interleave's grouping) become rep blocks of n rows."""
    b, hq, n, d = q.shape
    rep = hq // n_kv
    return q.reshape(b, n_kv, rep * n, d)


def gqa_unfold(o, hq: int):
    """Inverse of gqa_fold on the output: [1, Hkv, rep * n, dv] -> [1, Hq, n, dv]."""
    b, hkv, rows, dv = o.shape
    return o.reshape(b, hq, rows * hkv // hq, dv)


def attention(q, k, v, live_pos: torch.Tensor, scale: float, first_pos: int | None = None):
    """Live queries q [1, Hq, n, d] (absolute positions live_pos [n], ascending) over all keys
    k, v [1, Hkv, N, d] at positions 0..N-1. GQA when Hq != Hkv. Returns [1, Hq, n, d].
    `first_pos`: live_pos[0] as known on the host; reading it from a device tensor syncs."""
    n, N = q.shape[2], k.shape[2]
    hq, hkv = q.shape[1], k.shape[1]
    gqa = hq != hkv
    # The live tokens are the last n keys (prefill, prefix-cache resume, decode): causal, aligned
    # bottom-right, through the fused kernels; no [n, N] mask is built.
    tail = (int(live_pos[0]) if first_pos is None else first_pos) == N - n
    if tail and n == 1:
        return sdpa(q, k, v, scale=scale, enable_gqa=gqa)
    masked = not tail or n < N
    narrow = max(q.shape[-1], v.shape[-1]) <= 256
    if not tail and narrow and use_fast_kernels(q):
        # Live tokens interleaved with cached spans (seams): kernels/ops/attention, each query's
        # keys bounded by its position inside the kernel, GQA folded: no mask, no repeated K/V
        # (its tiles are tuned and GPU-tested up to head dim 256; wider heads stay on SDPA)
        from hybridcache.kernels.ops.attention.triton import live_attention

        return live_attention(q, k, v, live_pos, scale)
    if gqa and masked and (hq // hkv) * n * N <= GQA_FOLD_MAX_MASK:
        # A masked call with few live rows (seams between cached spans, a short prefix-cache
        # resume): the query heads of a KV head become extra query rows with the mask repeated for
        # them, so the cached keys are read once per KV head and never copied (repeating them cost
        # 4 x the context's K/V in copies per layer at the Qwen3.5-9B shape).
        o = sdpa(gqa_fold(q, hkv), k, v, attn_mask=_live_mask(live_pos, N, hq // hkv), scale=scale)
        return gqa_unfold(o, hq)
    if gqa and q.is_cuda:
        # KV heads repeated: the fused causal kernels and the masked memory-efficient one take no GQA
        rep = hq // hkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        gqa = False
    if tail and n == N:
        return sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if tail and q.is_cuda:
        # imported here: this module pulls in torch's compiler stack (and Triton)
        from torch.nn.attention.bias import causal_lower_right

        return sdpa(q, k, v, attn_mask=causal_lower_right(n, N), scale=scale)
    # Live tokens interleaved with cached spans (seams): an explicit mask, n x N booleans.
    return sdpa(q, k, v, attn_mask=_live_mask(live_pos, N), scale=scale, enable_gqa=gqa)


def _live_mask(live_pos: torch.Tensor, N: int, repeat: int = 1) -> torch.Tensor:
    """[repeat * n, N] booleans: live query i (of each of `repeat` stacked copies) sees keys at
    positions <= live_pos[i]. Every attention layer of a forward asks for the same mask (same live
    positions tensor, same context length), so it is built once (kept_for)."""

    def build():
        mask = torch.arange(N, device=live_pos.device)[None, :] <= live_pos[:, None]
        return mask.repeat(repeat, 1) if repeat > 1 else mask

    return kept_for(("live_mask", live_pos.device), live_pos, (N, repeat), build)


def tensor_version(t: torch.Tensor):
    """t's in-place version counter; None for a tensor made under inference_mode (it has none)."""
    try:
        return t._version
    except RuntimeError:
        return None


_KEPT: dict = {}  # slot -> (tensor, its version, extra key, result) of the slot's last build


def clear_kept() -> None:
    """Forget every kept result (graphs.py: a graph must not read a tensor an eager forward made)."""
    _KEPT.clear()


def kept_for(slot, t: torch.Tensor, extra, build):
    """build()'s result, kept as `slot`'s last one together with the tensor t it derives from and
    returned again while a caller passes that very tensor, unmodified (same version counter), with
    an equal `extra`: what every layer of a forward derives alike from one positions tensor (RoPE
    angles, the live-token mask) is computed once. One result per slot; a tensor without a version
    counter is never kept."""
    version = tensor_version(t)
    last = _KEPT.get(slot)
    if version is not None and last is not None and last[0] is t and last[1] == version and last[2] == extra:
        return last[3]
    out = build()
    if version is not None:
        _KEPT[slot] = (t, version, extra, out)
    return out
