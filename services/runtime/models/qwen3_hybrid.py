"""Qwen3-Next and Qwen3.5 (dense and MoE) text models: Gated DeltaNet + gated full attention.

The modules mirror the Hugging Face checkpoints' tensor names, so a checkpoint loads by name.
`HybridLM.forward_layout` runs only the live tokens of a layout (sequence.py), layer by layer:
linear layers scan live runs from the running state and fold cached spans in with one T S + S;
attention layers let live tokens attend to all K/V before them, cached spans' K re-rotated.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfig
from hybridcache.services.runtime.models.common import (
    Backbone,
    DecodeBatch,
    LayoutLM,
    attention_layout,
    linear_layout,
    merge_weights,
    merged_linear,
)
from hybridcache.services.runtime.sequence import (
    AttnSpan,
    AttnState,
    CachedSpan,
    LinearSpan,
    LinearState,
    Recording,
    SpanData,
)
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaled by (1 + weight), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if backends.use_fast_kernels(x):
            fused = backends.fused_rms_norm(x, self._scale(), self.eps)
            if fused is not None:
                return fused
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)

    def _scale(self):
        """1 + weight in fp32, kept until the weight changes (the fused kernel's multiplier)."""
        w = self.weight
        key = (backends.tensor_version(w), w.data_ptr(), w.device, w.dtype)
        if getattr(self, "_scale_key", None) != key:
            self._scale_cache = 1.0 + w.detach().float()
            self._scale_key = key
        return self._scale_cache


class GatedRMSNorm(nn.Module):
    """RMSNorm over the value head dim, then times silu(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x, gate):
        if backends.use_fast_kernels(x):
            fused = backends.fused_rms_norm_gated(x, gate, self.weight, self.eps)
            if fused is not None:
                return fused
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        xf = self.weight * xf.to(dtype)
        return (xf * F.silu(gate.float())).to(dtype)


@functools.lru_cache(maxsize=16)
def _inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim
    return 1.0 / (theta**exponents)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype):
    """cos, sin [n, rotary_dim] for integer positions [n].

    Every attention layer of a forward rotates its queries and keys at the same positions tensor
    (and the cached keys at one shift table): the result is kept with the positions tensor
    (backends.kept_for) instead of about ten launches per rotation again (16 rotations a forward
    at the Qwen3.5-9B shape, a decode step included)."""

    def build():
        freqs = positions.float()[:, None] * _inv_freq(rotary_dim, float(theta), positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    return backends.kept_for(("rope", rotary_dim, float(theta), dtype, positions.device), positions, None, build)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [1, H, n, d] by cos/sin [n, rotary_dim]."""
    r = cos.shape[-1]
    x_rot, x_pass = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def gated_delta_rule(q, k, v, g, beta, initial_state, output_transition: bool):
    """Dispatch to the fastest path for the device and shapes at hand (backends.py)."""
    return backends.gated_delta_rule(q, k, v, g, beta, initial_state, output_transition)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_width = cfg.linear_conv_kernel_dim
        # Qwen3-Next packs q, k, v, z (and b, a) per key-head group; Qwen3.5 keeps them apart.
        self.fused_projections = cfg.family == "qwen3_next"
        h = cfg.hidden_size
        if self.fused_projections:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.hv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.hv, bias=False)
            self.in_proj_a = nn.Linear(h, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def project(self, x):
        """x [B, n, h] -> mixed_qkv [B, n, conv_dim] (pre-conv), z [B, n, Hv, dv], b, a [B, n, Hv]."""
        B, n = x.shape[:2]
        if self.fused_projections:
            qkvz, ba = merged_linear(x, getattr(self, "_in_proj", None), (self.in_proj_qkvz, self.in_proj_ba))
            qkvz, ba = qkvz.reshape(B, n, self.hk, -1), ba.reshape(B, n, self.hk, -1)
            r = self.hv // self.hk
            q, k, v, z = torch.split(qkvz, [self.dk, self.dk, r * self.dv, r * self.dv], dim=-1)
            b, a = torch.split(ba, [r, r], dim=-1)
            mixed = torch.cat([q.reshape(B, n, -1), k.reshape(B, n, -1), v.reshape(B, n, -1)], dim=-1)
            return mixed, z.reshape(B, n, self.hv, self.dv), b.reshape(B, n, self.hv), a.reshape(B, n, self.hv)
        mixed, z, b, a = merged_linear(
            x, getattr(self, "_in_proj", None), (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        )
        return mixed, z.reshape(B, n, self.hv, self.dv), b, a

    def merge_projections(self) -> int:
        if self.fused_projections:
            self._in_proj = merge_weights(self.in_proj_qkvz, self.in_proj_ba)
        else:
            self._in_proj = merge_weights(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        return int(self._in_proj is not None)

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """Standalone prefill of B segments at once (x [B, L, h] normed, segment j real for its
        first lengths[j] tokens): records each body's (T, S(body|0), conv tail) into datas[j] and
        returns the layer's output [B, L, h]. Padding steps are identity steps of the recurrence."""
        B, L = x.shape[:2]
        mixed, z, b, a = self.project(x)
        W1 = self.conv_width - 1
        zero_tail = mixed.new_zeros(B, self.conv_dim, W1)
        # one causal conv over seam and body: the same as the seam from zero, then the body from its tail
        conv_out, _ = backends.causal_conv1d(mixed, self.conv1d.weight.squeeze(1), None, zero_tail, "silu")
        q, k, v, g, beta = self.qkv_gates(conv_out, b, a)
        if min(lengths) < L:  # padded steps become identity steps (equal lengths need no pass)
            lens = backends.to_device_async(torch.tensor(lengths), x.device)
            pad = (torch.arange(L, device=x.device)[None, :] >= lens[:, None])[..., None]  # [B, L, 1]
            k = k.masked_fill(pad[..., None], 0.0)
            v = v.masked_fill(pad[..., None], 0.0)
            g = g.masked_fill(pad, 0.0)
            beta = beta.masked_fill(pad, 0.0)
        outs, S_w = [], None
        if seam:
            sw = slice(0, seam)
            o_seam, S_w = gated_delta_rule(q[:, sw], k[:, sw], v[:, sw], g[:, sw], beta[:, sw], None, False)
            outs.append(o_seam)
        sl = slice(seam, L)
        o_body, _, (T, S0) = gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], S_w, True)
        outs.append(o_body)
        for j, n in enumerate(lengths):
            # the last W1 conv inputs of the segment (zeros before its start), as a tensor of its
            # own: a view of a cat over the whole segment kept D x n values alive per entry and layer
            last = mixed[j : j + 1, max(0, n - W1) : n].transpose(1, 2)
            tail = torch.cat([zero_tail[j : j + 1], last], dim=-1)[..., -W1:].clone()
            datas[j].linear[layer_idx] = LinearSpan(T=T[j : j + 1].clone(), S=S0[j : j + 1].clone(), conv_tail=tail)
        o = torch.cat(outs, dim=1).to(x.dtype)  # [B, L, Hv, dv]
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).view(B, L, self.value_dim)
        return self.out_proj(o)

    def empty_state(self, device) -> LinearState:
        return LinearState(
            ssm=torch.zeros(1, self.hv, self.dk, self.dv, dtype=torch.float32, device=device),
            conv=torch.zeros(1, self.conv_dim, self.conv_width - 1, dtype=self.out_proj.weight.dtype, device=device),
        )

    def scan(self, mixed, b, a, state: LinearState, output_transition: bool):
        """One live run: conv from the state's tail, then the recurrence from the state's S."""
        weight = self.conv1d.weight.squeeze(1)
        conv_out, tail = backends.causal_conv1d(mixed, weight, None, state.conv, "silu")
        q, k, v, g, beta = self.qkv_gates(conv_out, b, a)
        out = gated_delta_rule(q, k, v, g, beta, state.ssm, output_transition)
        return out, tail

    def forward_layout(self, x, layout, state: LinearState, rec: Recording | None, layer_idx: int):
        """x [1, n_live, h] (normed) -> [1, n_live, h]; state updated in place."""
        mixed, z, b, a = self.project(x)
        if isinstance(layout, DecodeBatch):
            o = self.sequential_scan(mixed, b, a, layout, state, rec, layer_idx, 0, 0, 0).to(x.dtype)
            o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).view(1, -1, self.value_dim)
            return self.out_proj(o)
        # Two regions: the pieces before the first cached span (live runs only, e.g. a prompt
        # split where prefix checkpoints are kept), and the rest (seams and the question between
        # cached spans). A region with two or more live runs runs them all at once (batched_scan)
        # instead of one scan per run: per-run scans cost launches in proportion to the runs.
        first_span = next((i for i, p in enumerate(layout) if isinstance(p, CachedSpan)), len(layout))
        outs, off = [], 0
        for lo, hi in ((0, first_span), (first_span, len(layout))):
            if lo == hi:
                continue
            runs = [layout[i].token_ids.numel() for i in range(lo, hi) if not isinstance(layout[i], CachedSpan)]
            batched = len(runs) >= 2
            if batched and lo == 0:
                # runs are padded to the longest: before the first span (a seam and a body, say)
                # that can double the work, so batch only runs of about equal length there
                batched = len(runs) * max(runs) <= 1.25 * sum(runs)
            scan = self.batched_scan if batched else self.sequential_scan
            outs.append(scan(mixed, b, a, layout, state, rec, layer_idx, lo, hi, off))
            off += sum(runs)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        o = o.to(x.dtype)  # [1, n_live, Hv, dv]
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).view(1, -1, self.value_dim)
        return self.out_proj(o)

    def sequential_scan(self, mixed, b, a, layout, state, rec, layer_idx, lo, hi, off):
        """Pieces lo..hi-1 one after another (common.linear_layout); `off` is the live offset of
        piece lo. Returns the outputs [1, n, Hv, dv]."""

        def scan(inputs, state, want_t):
            res, tail = self.scan(*inputs, state, want_t)
            return res[0], res[1], res[2] if want_t else None, tail

        o = linear_layout(layout, (mixed, b, a), state, rec, layer_idx, scan, lo, hi, off)
        return mixed.new_zeros(1, 0, self.hv, self.dv) if o is None else o

    @staticmethod
    def _entering_states(states, rows, state_in):
        """[m, H, K, V]: for each run, the folded state before it, row r of `states` (a stack
        [n, 1, H, K, V] from the CUDA fold, else a list of [1, H, K, V]), -1 for state_in. From
        the stack: one strided view when the rows are evenly spaced (runs and spans alternating),
        else one gather; never a select and a copy per run."""
        if not isinstance(states, torch.Tensor):
            return torch.cat([state_in if r < 0 else states[r] for r in rows], dim=0)
        head, rest = (rows[:1], rows[1:]) if rows[0] < 0 else ([], rows)
        if not rest:
            picked = None
        elif len(rest) == 1 or len({b - a for a, b in zip(rest, rest[1:])}) == 1 and rest[1] > rest[0]:
            step = rest[1] - rest[0] if len(rest) > 1 else 1
            picked = states[rest[0] : rest[-1] + 1 : step, 0]
        else:
            picked = states[backends.to_device_async(torch.tensor(rest), states.device), 0]
        if not head:
            return picked
        return state_in if picked is None else torch.cat([state_in, picked], dim=0)

    def qkv_gates(self, conv_out, b, a):
        """conv outputs [B, n, conv_dim], b, a [B, n, Hv] -> q, k [B, n, Hv, dk] (L2-normed; fp32, or
        v's dtype on CUDA with fla, whose kernels take that), v [B, n, Hv, dv], g, beta [B, n, Hv] fp32."""
        B, n = conv_out.shape[:2]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, n, self.hk, self.dk)
        k = k.reshape(B, n, self.hk, self.dk)
        v = v.reshape(B, n, self.hv, self.dv)
        rep = self.hv // self.hk  # grouped value heads share a key head
        q, k = backends.l2norm_qk(q, v.dtype, rep), backends.l2norm_qk(k, v.dtype, rep)
        g, beta = backends.gdn_gates(a, b, self.A_log, self.dt_bias)
        return q, k, v, g, beta

    def batched_scan(self, mixed, b, a, layout, state, rec, layer_idx, lo, hi, off):
        """The live runs of pieces lo..hi-1 (`off`: the live offset of piece lo) in three batched
        steps:

        1. each run from a zero state, all runs padded into one batch: its (T, S(run|0)), its
           outputs from zero o0 and its query transition u (u_t = scale T_t^T q_t);
        2. the states entering each run, by folding (T, S) pairs of runs and spans in order;
        3. the outputs: o0 + u S_in for each run's entering state S_in (one batched product).
        Padding steps have k = v = 0, g = 0 and beta = 0: the identity, so T and S are unchanged.
        The number of kernel launches per layer does not grow with the number of runs (on CUDA
        the fold is one launch). Returns the runs' outputs [1, n, Hv, dv] in layout order.
        """
        W1 = self.conv_width - 1
        dev, dt = mixed.device, mixed.dtype
        # Each run's conv input state is the tail left by the piece before it: a span's stored
        # tail, or (rarely, two live runs in a row) the last inputs of the run before it, which
        # is only computed when needed.
        runs, conv_src = [], []
        prev = state.conv
        for idx in range(lo, hi):
            piece = layout[idx]
            if isinstance(piece, CachedSpan):
                prev = piece.data.linear[layer_idx].conv_tail
                continue
            n = piece.token_ids.numel()
            runs.append((idx, off, n))
            conv_src.append(prev)
            prev = len(runs) - 1  # the tail after that run
            off += n
        m, L = len(runs), max(n for _, _, n in runs)
        # Gather indices depend on the layout only: built once per forward, shared by all layers.
        key = ("batched_scan", lo)
        if rec is not None and key in rec.scratch:
            flat, pad, tail_index = rec.scratch[key]
        else:
            flat, pad = [], []
            for j, (_, _, n) in enumerate(runs):
                flat += range(j * L, j * L + n)
                pad += [False] * n + [True] * (L - n)
            # real positions of the padded batch, in run order; the padding steps
            flat = backends.to_device_async(torch.tensor(flat, dtype=torch.long), dev)
            pad = backends.to_device_async(torch.tensor(pad), dev).view(m, L, 1)
            # the last W - 1 inputs of every run at least that long (its conv tail)
            tails = [list(range(o0 + n - W1, o0 + n)) for _, o0, n in runs if n >= W1]
            tail_index = backends.to_device_async(torch.tensor(tails), dev).view(len(tails), W1) if tails else None
            if rec is not None:
                rec.scratch[key] = (flat, pad, tail_index)
        first, count = runs[0][1], sum(n for _, _, n in runs)  # the region's live rows, in run order
        long_pos = {j: i for i, j in enumerate(j for j, (_, _, n) in enumerate(runs) if n >= W1)}
        tails_buf = []

        def source(j):
            src = conv_src[j]
            return tail_after(src) if isinstance(src, int) else src.to(dt)

        def tail_after(j):
            """The conv tail after run j: for runs of W - 1 inputs or more, a view into one small
            gather of every such run's last inputs (one launch per layer, and nothing kept alive
            but those inputs), else the tail of the state before it and the run's inputs."""
            _, o0, n = runs[j]
            if n >= W1:
                if not tails_buf:
                    tails_buf.append(mixed[0][tail_index].transpose(1, 2))  # [runs, D, W - 1]
                i = long_pos[j]
                return tails_buf[0][i : i + 1]
            return torch.cat([source(j), mixed[:, o0 : o0 + n].transpose(1, 2)], dim=-1)[..., -W1:]

        def padded(t):  # [1, n_live, X] -> [m, L, X], zeros past each run
            rows = t[0, first : first + count]
            return t.new_zeros(m * L, t.shape[-1]).index_copy_(0, flat, rows).view(m, L, -1)

        conv_src = [source(j) for j in range(m)]
        conv_in = torch.cat(conv_src, dim=0)  # [m, D, W - 1]
        conv_out, _ = backends.causal_conv1d(padded(mixed), self.conv1d.weight.squeeze(1), None, conv_in, "silu")
        # Padding steps (after each run's last token) are identity steps: g = beta = 0 makes
        # alpha = 1 and the update beta k (v - k^T S) exactly zero whatever k and v are, so T and S
        # pass through unchanged, and no real step of a run sees a later (padding) one; their
        # outputs are dropped. (Zeroing the conv outputs too would cost a pass over [runs, longest,
        # conv dim] a layer.)
        q, k, v, g, beta = self.qkv_gates(conv_out, padded(b), padded(a))
        g = g.masked_fill(pad, 0.0)
        beta = beta.masked_fill(pad, 0.0)
        # 1. zero-start pairs, with each run's outputs from zero and its query transition u
        o0, T_runs, S0_runs, u = backends.gated_delta_rule_pieces(q, k, v, g, beta)
        # 2. states entering each run

        # The pieces' (T, S) pairs in order, folded in one pass (one launch on CUDA). Entries kept
        # in bf16 (EngineConfig.entry_state_dtype) take the runs' pairs in bf16 too: a mixed-dtype
        # concatenation copies its inputs one launch each, and the fold reads them in fp32 anyway.
        span_dt = next(
            (layout[i].data.linear[layer_idx].T.dtype for i in range(lo, hi) if isinstance(layout[i], CachedSpan)),
            T_runs.dtype,
        )
        if backends.use_fast_kernels(T_runs) and span_dt != T_runs.dtype:
            T_runs, S0_runs = T_runs.to(span_dt), S0_runs.to(span_dt)
        Ts, Ss, use_t, pair_of = [], [], [], {}
        j = 0
        for idx in range(lo, hi):
            piece = layout[idx]
            pair_of[idx] = len(Ts)
            if isinstance(piece, CachedSpan):
                span = piece.data.linear[layer_idx]
                Ts.append(span.T)
                Ss.append(span.S)
                use_t.append(piece.use_transition)
            else:
                Ts.append((T_runs, j))  # row j of the runs' pairs, not a slice (host time per piece)
                Ss.append((S0_runs, j))
                use_t.append(True)
                j += 1
        state_in = state.ssm
        states = backends.fold_states(Ts, Ss, state_in, use_t)
        # States kept for the prefix store: one gather per layer (not a clone per piece); the
        # snapshots are views of it. Restoring a snapshot clones, and entries are never written
        # in place, so a span's conv tail is kept as is.
        snap_at = [i for i in range(lo, hi) if rec is not None and i in rec.snapshots]
        kept = {}
        if snap_at:
            rows = [pair_of[i] for i in snap_at]
            if isinstance(states, torch.Tensor):
                gathered = states[backends.to_device_async(torch.tensor(rows), states.device)]
            else:
                gathered = torch.stack([states[r] for r in rows])
            kept = {i: gathered[n] for n, i in enumerate(snap_at)}
        entering = []  # per run: the fold's row of the state entering it, -1 for the layer's state
        j = 0
        for idx in range(lo, hi):
            piece, p = layout[idx], pair_of[idx]
            if isinstance(piece, CachedSpan):
                if idx in kept:
                    tail = piece.data.linear[layer_idx].conv_tail.to(dt)
                    rec.snapshots[idx][layer_idx] = LinearState(kept[idx], tail)
                continue
            entering.append(p - 1)
            if rec is not None and piece.record == "entry":
                rec.entries[idx].linear[layer_idx] = LinearSpan(
                    T=T_runs[j : j + 1].clone(), S=S0_runs[j : j + 1].clone(), conv_tail=tail_after(j)
                )
            if idx in kept:
                rec.snapshots[idx][layer_idx] = LinearState(kept[idx], tail_after(j))
            j += 1
        S = states[len(Ts) - 1]
        last = layout[hi - 1]
        state.ssm = S
        if isinstance(last, CachedSpan):
            state.conv = last.data.linear[layer_idx].conv_tail.to(dt)
        else:
            state.conv = tail_after(m - 1)
        # 3. outputs from the entering states: o0 + u S_in (one batched product, no second scan)
        s_in = self._entering_states(states, entering, state_in)  # [m, Hv, dk, dv] fp32
        o_pad = (o0.float() + backends.run_outputs_from_states(u, s_in)).to(o0.dtype)
        o_runs = o_pad.reshape(m * L, *o_pad.shape[2:])[flat]  # gather, no host sync
        return o_runs.unsqueeze(0)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.hq * self.d * 2, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.hkv * self.d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.hkv * self.d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, h, bias=cfg.attention_bias)
        self.q_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.d, cfg.rms_norm_eps)

    def merge_projections(self) -> int:
        self._qkv = merge_weights(self.q_proj, self.k_proj, self.v_proj)
        return int(self._qkv is not None)

    def rope(self, positions, dtype):
        return rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, dtype)

    def rotate(self, x, positions):
        """x [1, H, N, d] rotated by per-position angles positions [N]."""
        if backends.use_fast_kernels(x):
            return backends.rope_heads(x, *self.rope(positions, torch.float32))
        cos, sin = self.rope(positions, x.dtype)
        return apply_rope(x, cos, sin)

    def empty_state(self, device) -> AttnState:
        dt = self.o_proj.weight.dtype
        z = torch.zeros(1, self.hkv, 0, self.d, dtype=dt, device=device)
        return AttnState(k=z, v=z.clone())

    def qkv(self, x, positions):
        """x [B, n, h] -> q [B, Hq, n, d], k, v [B, Hkv, n, d] (q, k rotated at `positions`), gate [B, n, Hq, d]."""
        B, n = x.shape[:2]
        qg, k, v = merged_linear(x, getattr(self, "_qkv", None), (self.q_proj, self.k_proj, self.v_proj))
        q, gate = torch.chunk(qg.reshape(B, n, self.hq, 2 * self.d), 2, dim=-1)  # gate [B, n, Hq, d]
        v = v.reshape(B, n, self.hkv, self.d).transpose(1, 2)
        k = k.reshape(B, n, self.hkv, self.d)
        if backends.use_fast_kernels(x):
            # head norm and rotation in one launch each for q and k (kernels/ops/rope)
            cos, sin = self.rope(positions, torch.float32)
            q = backends.norm_rope(q, self.q_norm._scale(), self.q_norm.eps, cos, sin)
            k = backends.norm_rope(k, self.k_norm._scale(), self.k_norm.eps, cos, sin)
            return q, k, v, gate
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        return self.rotate(q, positions), self.rotate(k, positions), v, gate

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """Standalone prefill of B segments at once: causal attention within each segment (padding
        sits at the end, where real queries never look), body K/V at local positions into datas[j]."""
        B, L = x.shape[:2]
        positions = torch.arange(L, device=x.device)
        q, k, v, gate = self.qkv(x, positions)
        out = backends.attention(q, k, v, positions, self.d**-0.5, first_pos=0)  # [B, Hq, L, d]
        for j, n in enumerate(lengths):
            body = slice(seam, n)
            datas[j].attn[layer_idx] = AttnSpan(k=k[j : j + 1, :, body].clone(), v=v[j : j + 1, :, body].clone())
        return self.o_proj(backends.gated_heads(out, gate))

    def forward_layout(self, x, layout, state: AttnState, rec: Recording | None, layer_idx: int, live_pos):
        """x [1, n_live, h]; live_pos [n_live] absolute positions of the live tokens."""
        q, k, v, gate = self.qkv(x, live_pos)
        out = attention_layout(
            q, k, v, layout, state, rec, layer_idx, live_pos, self.d**-0.5, self.rotate, head_major=True
        )
        return self.o_proj(backends.gated_heads(out, gate))


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def merge_projections(self) -> int:
        self._gate_up = merge_weights(self.gate_proj, self.up_proj)
        return int(self._gate_up is not None)

    def forward(self, x):
        gate, up = merged_linear(x, getattr(self, "_gate_up", None), (self.gate_proj, self.up_proj))
        act = backends.fused_silu_mul(gate, up)
        return self.down_proj(act if act is not None else F.silu(gate) * up)


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))


class Experts(nn.Module):
    """Expert weights fused as 3-D tensors; the loader also accepts per-expert checkpoints."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))

    def forward(self, x, top_i, top_w):
        """x [n, h]; top_i, top_w [n, k]: sum over each token's k experts of w * expert(x)."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_i = torch.topk(probs, self.cfg.num_experts_per_tok, dim=-1)
        if self.cfg.norm_topk_prob:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = self.experts(x, top_i, top_w)
        out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def empty_state(self, device):
        mixer = self.linear_attn if self.kind == "linear_attention" else self.self_attn
        return mixer.empty_state(device)

    def forward_layout(self, x, layout, state, rec, layer_idx, positions):
        """x [1, n_live, h] -> [1, n_live, h], residuals included."""
        h = self.input_layernorm(x)
        if self.kind == "linear_attention":
            h = self.linear_attn.forward_layout(h, layout, state, rec, layer_idx)
        else:
            h = self.self_attn.forward_layout(h, layout, state, rec, layer_idx, positions)
        x, h = self.add_norm(x, h)
        return x + self.mlp(h)

    def add_norm(self, x, h):
        """The residual sum x + h and the post-attention norm of it (one launch on CUDA)."""
        ln = self.post_attention_layernorm
        fused = backends.fused_add_rms_norm(x, h, ln._scale(), ln.eps)
        if fused is not None:
            return fused
        x = x + h
        return x, ln(x)


class HybridLM(LayoutLM):
    """Qwen3-Next / Qwen3.5: runs layouts of live runs and cached spans (LayoutLM.forward_layout)."""

    norm_offset = 0.0  # modelzoo.random_init_: zero-centred RMSNorm, scale (1 + weight)

    @property
    def cuda_graphs(self) -> bool:
        """Dense models only: the MoE block reads its routing on the host (torch.unique)."""
        return self.cfg.num_experts == 0

    def __init__(self, cfg: ModelConfig):
        super().__init__(
            cfg,
            Backbone(
                cfg,
                [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)],
                ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps),
            ),
        )

    @torch.no_grad()
    def build_span_data(self, segments: list[list[int]], seam: int, on_layer=None) -> list[SpanData]:
        """Standalone prefill of several segments in one batched forward (positions from 0 each);
        returns each segment's body (tokens seam..end) as SpanData, equal to building them one by
        one. Every segment needs more than `seam` tokens. `on_layer(i, datas)`, if given, is called
        as soon as layer i's spans of every segment are final (segment parallelism streams them)."""
        lengths = [len(s) for s in segments]
        if min(lengths) <= seam:
            raise ValueError("every segment needs more tokens than the seam window")
        L = max(lengths)
        ids = torch.zeros(len(segments), L, dtype=torch.long)
        for j, s in enumerate(segments):
            ids[j, : len(s)] = torch.as_tensor(s)
        datas = [SpanData(n - seam, seam, {}, {}) for n in lengths]
        x = self.embed(backends.to_device_async(ids, self.device))  # [B, L, h]
        for i, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            mixer = layer.linear_attn if layer.kind == "linear_attention" else layer.self_attn
            x, h = layer.add_norm(x, mixer.build_spans(h, lengths, seam, datas, i))
            if on_layer is not None:
                on_layer(i, datas)
            x = x + layer.mlp(h)
        return datas
