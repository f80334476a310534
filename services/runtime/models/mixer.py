"""The contract of a linear-attention layer (a mixer) and the layout code every family builds on it.

A mixer turns a layer's normed input x [B, n, h] into per-token tensors, runs a recurrence over
them from a state S, and summarises a span as (T, S(span|0), conv tail). The families differ in
the per-token math, which a subclass of LinearMixer supplies; what they share is written once here:

- `scan_run`: one live run, conv from the state's tail, the recurrence from its S;
- `batched_scan`: several live runs of a layout in one padded batch (their zero-start pairs, the
  fold of the entering states, the output correction), a fixed number of launches per layer
  whatever the number of runs;
- `build_spans`: the standalone prefill of several segments in one padded batch (cold entries).

The batched scan rests on a decomposition every family here has: a run started from any state
S_in has outputs o_t = o0_t + u_t S_in and final state T S_in + S(run|0), where o0 and S(run|0)
are the run's from a zero state, T_t the transition of its first t steps and u_t = scale T_t^T q_t
its query transition (contracted with S_in over the key dim):

    Gated DeltaNet, KDA   T_t = A_t ... A_1, a dense K x K matrix per head (from the kernels)
    Mamba2 (SSD)          T_t = exp(A sum_{s<=t} dt_s), a scalar per head; u_t = T_t C_t (D skip in o0)
    lightning attention   T_t = exp(-slope t) (per-step log-decay g: exp(sum g)); u_t = T_t q_t

Padding steps after a run's last token are identity steps of the recurrence (each family's
`identity_steps`: zero decay and zero update), so T and S pass through them unchanged and no real
step sees one; their outputs are dropped.
"""

from __future__ import annotations

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models.assembly import PLANNED_SNAPSHOTS, AssemblyBatch
from hybridcache.services.runtime.models.common import DecodeBatch, linear_layout
from hybridcache.services.runtime.sequence import AttnSpan, CachedSpan, LinearSpan, LinearState
from torch import nn


def time_slice(rec: tuple, lo: int, hi: int) -> tuple:
    """Steps lo..hi-1 of per-token tensors [B, n, ...] (None entries stay None)."""
    return tuple(None if t is None else t[:, lo:hi] for t in rec)


def padding_mask(lengths: list[int], L: int, device) -> torch.Tensor:
    """[B, L] booleans: step t of segment j is padding (t >= lengths[j])."""
    lens = backends.to_device_async(torch.tensor(lengths), device)
    return torch.arange(L, device=device)[None, :] >= lens[:, None]


class LinearMixer(nn.Module):
    """A linear-attention layer. Subclasses set `conv_width` (1: no short conv, the conv state is
    empty) and supply:

    project(x [B, n, h]) -> (inputs, gate): per-token tensors [B, n, ...]; inputs[0] is the short
        conv's input [B, n, D], inputs[1:] the rest of what the recurrence reads; `gate` is what
        `finish` reads besides the outputs (the output gate's input, say).
    conv_weight() -> (weight [D, W], bias [D] or None) of the short conv (default: self.conv1d's).
    recurrence_inputs(conv_out [B, n, D], rest) -> rec: the recurrence's per-token tensors [B, n, ...].
    identity_steps(rec, pad [B, n] bool) -> rec with the padding steps made identity steps.
    recurrence(rec, initial_state [B, ...] or None, output_transition) -> (o [B, n, H, V],
        final state, (T, S(run|0)) with output_transition else None).
    pieces(rec) -> (o0, T, S(run|0), u [B, n, H, K]): the runs from a zero state and their query
        transitions (module docstring), so that o = o0 + u S_in.
    finish(o [B, n, H, V] in x's dtype, gate) -> the layer's output [B, n, h].
    empty_state(device) -> LinearState.
    recurrence_step(conv_out [B, D], rest [B, ...], pool [S, ...], slots [B]) -> o [B, H, V]: one
        decode token of B requests whose states are rows `slots` of the pool, advanced in place
        (backends.recurrent_step). Every family here has its own; the default copies the rows
        out, runs `recurrence` and copies them back.
    """

    conv_width: int = 1

    def project(self, x):
        raise NotImplementedError

    def recurrence_inputs(self, conv_out, rest):
        raise NotImplementedError

    def identity_steps(self, rec, pad):
        raise NotImplementedError

    def recurrence(self, rec, initial_state, output_transition):
        raise NotImplementedError

    def pieces(self, rec):
        raise NotImplementedError

    def finish(self, o, gate):
        raise NotImplementedError

    def empty_state(self, device) -> LinearState:
        raise NotImplementedError

    def recurrence_step(self, conv_out, rest, pool, slots):
        rec = self.recurrence_inputs(conv_out[:, None], tuple(t[:, None] for t in rest))
        o, S, _ = self.recurrence(rec, pool[slots], False)
        pool.index_copy_(0, slots, S.to(pool.dtype))
        return o[:, 0]

    def conv_weight(self):
        return self.conv1d.weight.squeeze(1), self.conv1d.bias

    def conv(self, x, tail):
        """The short conv (silu) of x [B, n, D] from tail [B, D, W - 1] -> (out, new tail)."""
        if self.conv_width <= 1:
            return x, tail
        weight, bias = self.conv_weight()
        return backends.causal_conv1d(x, weight, bias, tail, "silu")

    def scan(self, inputs, state: LinearState, output_transition: bool):
        """One live run (common.linear_layout's scan): -> (o, S_final, (T, S0) or None, conv tail)."""
        conv_out, tail = self.conv(inputs[0], state.conv)
        o, S, pair = self.recurrence(self.recurrence_inputs(conv_out, inputs[1:]), state.ssm, output_transition)
        return o, S, pair, tail

    def forward_layout(self, x, layout, state: LinearState, rec, layer_idx: int):
        """x [1, n_live, h] (normed) -> [1, n_live, h]; state updated in place.

        Two regions: the pieces before the first cached span (live runs only, e.g. a prompt split
        where prefix checkpoints are kept), and the rest (seams and the question between cached
        spans). A region with two or more live runs runs them all at once (batched_scan) instead
        of one scan per run: per-run scans cost launches in proportion to the runs."""
        inputs, gate = self.project(x)
        if isinstance(layout, AssemblyBatch):
            return self.finish(self.planned_scan(inputs, layout, state, rec, layer_idx).to(x.dtype), gate)
        if isinstance(layout, DecodeBatch):
            if layout.states_in_pool:
                return self.finish(self.decode(inputs, state, layout.rows).to(x.dtype), gate)
            return self.finish(self.sequential_scan(inputs, layout, state, rec, layer_idx, 0, 0, 0).to(x.dtype), gate)
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
            o = scan(inputs, layout, state, rec, layer_idx, lo, hi, off)
            if o is not None:
                outs.append(o)
            off += sum(runs)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self.finish(o.to(x.dtype), gate)

    def decode(self, inputs, pool: LinearState, slots):
        """One token of each of B running requests (a DecodeBatch): inputs [1, B, ...] (project's),
        `pool` the layer's states of every slot (ssm [S, ...], conv [S, D, W - 1]), of which rows
        `slots` [B] advance in place: a one-token conv update and one recurrence step, no copy of
        the batch's states. Returns the outputs [1, B, H, V]."""
        x = inputs[0][0]  # [B, D]
        if self.conv_width > 1:
            weight, bias = self.conv_weight()
            x = backends.causal_conv1d_update(x, weight, bias, pool.conv, slots, "silu")
        return self.recurrence_step(x, tuple(t[0] for t in inputs[1:]), pool.ssm, slots)[None]

    def sequential_scan(self, inputs, layout, state, rec, layer_idx, lo, hi, off):
        """Pieces lo..hi-1 one after another (common.linear_layout); `off` is the live offset of
        piece lo. Returns the outputs [1, n, H, V] (None when the pieces hold no live run)."""
        return linear_layout(layout, inputs, state, rec, layer_idx, self.scan, lo, hi, off)

    def batched_scan(self, inputs, layout, state, rec, layer_idx, lo, hi, off):
        """The live runs of pieces lo..hi-1 (`off`: the live offset of piece lo) in three batched
        steps:

        1. each run from a zero state, all runs padded into one batch: its (T, S(run|0)), its
           outputs from zero o0 and its query transition u;
        2. the states entering each run, by folding (T, S) pairs of runs and spans in order;
        3. the outputs: o0 + u S_in for each run's entering state S_in (one batched product).
        The number of kernel launches per layer does not grow with the number of runs (the fold
        is one launch on CUDA for a dense T, and a fixed number of ops for a scalar T). Returns
        the runs' outputs [1, n, H, V] in layout order.
        """
        mixed, rest = inputs[0], inputs[1:]
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
            pad = backends.to_device_async(torch.tensor(pad), dev).view(m, L)
            # the last W - 1 inputs of every run at least that long (its conv tail)
            tails = [list(range(o0 + n - W1, o0 + n)) for _, o0, n in runs if n >= W1] if W1 else []
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
            if not W1:
                return state.conv  # no short conv: the empty tail
            _, o0, n = runs[j]
            if n >= W1:
                if not tails_buf:
                    tails_buf.append(mixed[0][tail_index].transpose(1, 2))  # [runs, D, W - 1]
                i = long_pos[j]
                return tails_buf[0][i : i + 1]
            return torch.cat([source(j), mixed[:, o0 : o0 + n].transpose(1, 2)], dim=-1)[..., -W1:]

        def padded(t):  # [1, n_live, ...] -> [m, L, ...], zeros past each run
            rows = t[0, first : first + count]
            return t.new_zeros(m * L, *t.shape[2:]).index_copy_(0, flat, rows).view(m, L, *t.shape[2:])

        if W1:
            conv_in = torch.cat([source(j) for j in range(m)], dim=0)  # [m, D, W - 1]
            conv_out, _ = self.conv(padded(mixed), conv_in)
        else:
            conv_out = padded(mixed)
        # (Zeroing the conv outputs of the padding steps too would cost a pass over [runs,
        # longest, conv dim] a layer: identity_steps makes them harmless instead.)
        rec_in = self.identity_steps(self.recurrence_inputs(conv_out, tuple(padded(t) for t in rest)), pad)
        # 1. zero-start pairs, with each run's outputs from zero and its query transition u
        o0, T_runs, S0_runs, u = self.pieces(rec_in)
        # 2. states entering each run: the pieces' (T, S) pairs in order, folded in one pass (one
        # launch on CUDA). Entries kept in bf16 (EngineConfig.entry_state_dtype) take the runs'
        # pairs in bf16 too: a mixed-dtype concatenation copies its inputs one launch each, and
        # the fold reads them in fp32 anyway.
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
        state.ssm = states[len(Ts) - 1]
        last = layout[hi - 1]
        if isinstance(last, CachedSpan):
            state.conv = last.data.linear[layer_idx].conv_tail.to(dt)
        else:
            state.conv = tail_after(m - 1)
        # 3. outputs from the entering states: o0 + u S_in (one batched product, no second scan)
        s_in = entering_states(states, entering, state_in)  # [m, H, K, V] fp32
        o_pad = (o0.float() + backends.run_outputs_from_states(u, s_in)).to(o0.dtype)
        o_runs = o_pad.reshape(m * L, *o_pad.shape[2:])[flat]  # gather, no host sync
        return o_runs.unsqueeze(0)

    def planned_scan(self, inputs, plan: AssemblyBatch, state, rec, layer_idx):
        """batched_scan over a planned assembly (models/assembly.py): the same three steps, every
        shape a bucket's and every index the plan's device data, so that a CUDA graph of it serves
        any layout of the bucket. The sub-runs [m, L] come from the plan's rows, each one's conv
        source from its bound tail or the tail of the sub-run before it; the fold reads the spans'
        T and S through the plan's address tables (CUDA) or as blocks; the kept states go to
        rec.scratch (assembly.finish_recording). Returns the outputs [1, n, H, V]."""
        mixed, rest = inputs[0], inputs[1:]
        m, L, W1 = plan.m, plan.L, plan.W1
        dt = mixed.dtype

        def padded(t):  # [1, n, ...] -> [m, L, ...]: each live token at its row, zeros elsewhere
            rows = t[0]
            out = rows.new_zeros(m * L + 1, *rows.shape[1:]).index_copy_(0, plan.flat, rows)
            return out[: m * L].view(m, L, *rows.shape[1:])

        if W1:
            tails = mixed[0].index_select(0, plan.tail_rows).view(m, W1, -1).transpose(1, 2)  # [m, D, W1]
            src = plan.conv_src[layer_idx].to(dt)
            conv_in = torch.where(plan.prev_src.view(m, 1, 1) > 0, torch.roll(tails, 1, 0), src)
            conv_out, _ = self.conv(padded(mixed), conv_in.contiguous())
        else:
            tails = conv_in = None
            conv_out = padded(mixed)
        pad = plan.pad.view(m, L) > 0
        rec_in = self.identity_steps(self.recurrence_inputs(conv_out, tuple(padded(t) for t in rest)), pad)
        o0, T_runs, S0_runs, u = self.pieces(rec_in)
        # [p + 1, 1, H, K, V] fp32: row 0 the entering state, row k + 1 the state after pair k
        states = self._planned_fold(plan, layer_idx, T_runs, S0_runs, state.ssm)
        if plan.tables:  # each run's outputs read its entering state where the fold left it
            from hybridcache.kernels.ops.transition.outputs_triton import run_outputs

            o_pad = run_outputs(o0, u, states[:, 0], plan.enter)  # [m, L, H, V]
        else:
            s_in = states.index_select(0, plan.enter)[:, 0]  # [m, H, K, V]
            o_pad = (o0.float() + backends.run_outputs_from_states(u, s_in)).to(o0.dtype)
        o_runs = o_pad.reshape(m * L, *o_pad.shape[2:]).index_select(0, plan.flat.clamp(max=m * L - 1))
        if rec is not None and plan.s:
            kept = states.index_select(0, plan.snap_rows)
            kept_tails = torch.cat([tails, conv_in]).index_select(0, plan.snap_tails) if W1 else None
            rec.scratch[(PLANNED_SNAPSHOTS, layer_idx)] = (kept, kept_tails)
        state.ssm = states.index_select(0, plan.final)[0]
        if W1:
            state.conv = tails.index_select(0, plan.last_run)
        return o_runs.unsqueeze(0)

    def _planned_fold(self, plan: AssemblyBatch, layer_idx, T_runs, S0_runs, state_in):
        """The entering state and the states after each fold pair of a planned assembly, [p + 1, 1,
        H, K, V] fp32 (row k + 1 after pair k): on CUDA with a matrix T one launch over the plan's
        address tables (the sub-runs' pairs where this pass holds them, the spans' where they lie),
        folding the real pairs alone (their count is the plan's device data; the rows of the
        bucket's padding pairs are left unwritten and never read); else the real pairs as blocks
        (backends.fold_states)."""
        if plan.tables:
            from hybridcache.kernels.ops.transition.compose_triton import compose_states_table

            span_dt = plan.key[7]
            T_runs, S0_runs = T_runs.contiguous(), S0_runs.contiguous()
            run = plan.pair_run
            # the runs' pairs read in their own dtype beside the entries' (no copy of them to it)
            runs = (run, T_runs, S0_runs) if span_dt is not None and span_dt != T_runs.dtype else None
            Tref, Sref = plan.span_refs if runs else (T_runs, S0_runs)
            on_run = run >= 0
            j = run.clamp(min=0)
            t_tab = torch.where(on_run, T_runs.data_ptr() + j * (T_runs[0].numel() * T_runs.element_size()),
                                plan.span_T[layer_idx])
            s_tab = torch.where(on_run, S0_runs.data_ptr() + j * (S0_runs[0].numel() * S0_runs.element_size()),
                                plan.span_S[layer_idx])
            _, states = compose_states_table(t_tab, s_tab, Tref, Sref, state_in[0], output_all=True,
                                             store_initial=True, count=plan.n_pairs, runs=runs)
            return states[:, None]
        Ts, Ss = [], []
        for kind, ref in plan.pairs:
            if kind == "run":
                Ts.append((T_runs, ref))
                Ss.append((S0_runs, ref))
            else:
                span = plan.span_data(ref).linear[layer_idx]
                Ts.append(span.T)
                Ss.append(span.S)
        states = backends.fold_states(Ts, Ss, state_in, [True] * len(Ts))
        states = states if isinstance(states, torch.Tensor) else torch.stack(states)
        return torch.cat([state_in[None].float(), states.float()])

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        """Standalone prefill of B segments at once (x [B, L, h] normed, segment j real for its
        first lengths[j] tokens): records each body's (T, S(body|0), conv tail) into datas[j] and
        returns the layer's output [B, L, h]. Padding steps are identity steps of the recurrence."""
        B, L = x.shape[:2]
        inputs, gate = self.project(x)
        mixed = inputs[0]
        W1 = self.conv_width - 1
        zero_tail = mixed.new_zeros(B, mixed.shape[-1], W1) if W1 else self.empty_state(x.device).conv
        # one causal conv over seam and body: the same as the seam from zero, then the body from its tail
        conv_out, _ = self.conv(mixed, zero_tail)
        rec = self.recurrence_inputs(conv_out, inputs[1:])
        if min(lengths) < L:  # padded steps become identity steps (equal lengths need no pass)
            rec = self.identity_steps(rec, padding_mask(lengths, L, x.device))
        outs, S_w = [], None
        if seam:
            o_seam, S_w, _ = self.recurrence(time_slice(rec, 0, seam), None, False)
            outs.append(o_seam)
        o_body, _, (T, S0) = self.recurrence(time_slice(rec, seam, L), S_w, True)
        outs.append(o_body)
        tails = conv_tails(mixed, lengths, W1) if W1 else zero_tail.expand(B, *zero_tail.shape[1:])  # [B, D, W1]
        # each entry's pieces in storage of its own (a view would keep the whole batch alive)
        pieces = backends.own_copies([t[j : j + 1] for t in (T, S0, tails) for j in range(B)])
        for j in range(B):
            datas[j].linear[layer_idx] = LinearSpan(T=pieces[j], S=pieces[B + j], conv_tail=pieces[2 * B + j])
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return self.finish(o.to(x.dtype), gate)


def entering_states(states, rows, state_in):
    """[m, H, K, V]: for each run, the folded state before it, row r of `states` (a stack
    [n, 1, H, K, V] from a batched fold, else a list of [1, H, K, V]), -1 for state_in. From
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


class DeltaRuleMixer(LinearMixer):
    """Gated DeltaNet's recurrence (Qwen3-Next / Qwen3.5, OLMo-Hybrid): rec = (q, k, v, g, beta),
    q, k [B, n, Hv, dk], v [B, n, Hv, dv], g, beta [B, n, Hv]. g = beta = 0 is the identity step:
    alpha = 1 and the update beta k (v - k^T S) is exactly zero whatever k and v are."""

    def identity_steps(self, rec, pad):
        q, k, v, g, beta = rec
        return q, k, v, g.masked_fill(pad[..., None], 0.0), beta.masked_fill(pad[..., None], 0.0)

    def recurrence(self, rec, initial_state, output_transition):
        res = backends.gated_delta_rule(*rec, initial_state, output_transition)
        return res[0], res[1], (res[2] if output_transition else None)

    def pieces(self, rec):
        return backends.gated_delta_rule_pieces(*rec)

    beta_scale = 1.0  # beta = beta_scale sigmoid(b) (OLMo-Hybrid's negative eigenvalues: 2)

    def recurrence_step(self, conv_out, rest, pool, slots):
        """One launch on CUDA from the conv output and the raw projections b, a (rest): q and k
        L2-normalized and the gates computed inside the recurrence kernel (qkv_gates' math)."""
        b, a = rest
        B = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return backends.recurrent_step(
            q.view(B, self.hk, self.dk), k.view(B, self.hk, self.dk), v.view(B, self.hv, self.dv), a, b, pool, slots,
            A_log=self.A_log, dt_bias=self.dt_bias, beta_scale=self.beta_scale, l2norm_qk=True,
        )


def conv_tails(mixed: torch.Tensor, lengths: list[int], W1: int) -> torch.Tensor:
    """[B, D, W1] contiguous: the last W1 conv inputs of each segment of mixed [B, L, D] (segment j
    real for its first lengths[j] positions; zeros before a segment's start), gathered in one
    indexing launch."""
    pos = torch.tensor([[n - W1 + t for t in range(W1)] for n in lengths], dtype=torch.long)
    rows = torch.arange(len(lengths))[:, None].expand(-1, W1)
    idx = backends.to_device_async(torch.stack([rows, pos.clamp(min=0)]), mixed.device)
    tails = mixed[idx[0], idx[1]]  # [B, W1, D]
    if (pos < 0).any():  # a segment shorter than W1: zeros before its start
        tails = tails.masked_fill(backends.to_device_async(pos < 0, mixed.device)[..., None], 0)
    return tails.transpose(1, 2).contiguous()


def attention_spans(k, v, lengths, seam, datas, layer_idx):
    """Record each segment's body K/V (k, v [B, Hkv, L, d] of the batch, local positions) into datas[j]."""
    B = len(lengths)
    kv = backends.own_copies([t[j : j + 1, :, seam:n] for t in (k, v) for j, n in enumerate(lengths)])
    for j in range(B):
        datas[j].attn[layer_idx] = AttnSpan(k=kv[j], v=kv[B + j])


def build_attention(q, k, v, lengths, seam, datas, layer_idx, scale):
    """Standalone prefill of B segments at once through one attention layer: causal attention
    within each segment (padding sits at the end, where real queries never look), body K/V into
    datas[j]. q [B, Hq, L, d], k, v [B, Hkv, L, d] -> [B, Hq, L, dv]."""
    L = q.shape[2]
    out = backends.attention(q, k, v, torch.arange(L, device=q.device), scale, first_pos=0)
    attention_spans(k, v, lengths, seam, datas, layer_idx)
    return out
