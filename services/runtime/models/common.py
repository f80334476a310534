"""Pieces every hybrid architecture shares: the layout loops of linear and attention layers and
the model-level forward over a layout and batched standalone prefill (LayoutLM). The linear
layers' contract and the code built on it (batched scans and builds) are in mixer.py.

A linear layer supplies `scan(inputs, state, output_transition)` for one live run; the loop
folds cached spans in with one T S + S and records entries. An attention layer supplies its
fresh q/k/v; the loop gathers cached spans' K/V (re-rotated when the family uses RoPE).
A state whose attention K/V lie in its request's pages (paged.PagedAttnState: a prefill that runs
in its slot, e.g. a long prompt's chunks) gets the new K/V written into the pages, and the live
queries attend through the block table (backends.paged_prefill_attention).
"""

from __future__ import annotations

import torch
from hybridcache.kernels.ops.transition import apply_segment
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.assembly import AssemblyBatch, finish_recording
from hybridcache.services.runtime.sequence import (
    AttnSpan,
    AttnState,
    CachedSpan,
    LinearSpan,
    LinearState,
    LiveRun,
    Recording,
    SequenceState,
    SpanData,
)
from torch import nn


class LayerTypes:
    """Derived layer lists of a config with `layer_types` (mixin of the architectures' configs)."""

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]


def eos_ids(eos) -> tuple[int, ...]:
    """config.json's eos_token_id (int, list or null) as a tuple."""
    return tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))


def need(cfg: dict, key: str):
    """cfg[key], or a ModelConfigError naming the missing key."""
    if cfg.get(key) is None:
        raise ModelConfigError(f"config.json of model_type {cfg.get('model_type')!r} is missing {key!r}")
    return cfg[key]


class RMSNorm(nn.Module):
    """weight * x / rms(x), computed in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def softmax_top_k(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype, fused: bool = False):
    """A softmax router's choice: (weights [n, k] in `dtype`, experts [n, k]) of logits [n, E]. The
    experts are the k largest logits (softmax keeps their order); renormalised over them, their
    weights are the softmax of those k logits alone, p_i / sum of the k p_j: one small softmax
    instead of the whole row's, a sum and a division (fewer launches a MoE layer of a decode step).
    fused: the same in one Triton launch (kernels/ops/moe/triton.py; the MoE "pairs" path takes it)."""
    if fused:
        from hybridcache.kernels.ops.moe.triton import softmax_top_k as kernel

        return kernel(logits, k, renormalize, dtype)
    if renormalize:
        top_l, top_i = torch.topk(logits, k, dim=-1)
        return torch.softmax(top_l, dim=-1, dtype=torch.float).to(dtype), top_i
    top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), k, dim=-1)
    return top_w.to(dtype), top_i


# the "pairs" path's router and top-k in one launch (kernels/ops/moe/triton.py router_top_k);
# False runs them apart (benchmarks/moe_bench.py times both)
FUSED_ROUTER = True


def route(x: torch.Tensor, weight: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype, path: str):
    """A softmax router's choice for x [n, h] and router weight [E, h]: softmax_top_k of the logits
    x @ weight^T (in x's dtype). On the MoE "pairs" path (backends.moe_path) the router and its top-k
    run as one Triton launch (FUSED_ROUTER), else as the router's linear layer and softmax_top_k."""
    if path == "pairs" and FUSED_ROUTER:
        from hybridcache.kernels.ops.moe.triton import router_counts, router_top_k

        counts = router_counts(x.shape[0], x.device)
        if counts is not None:
            return router_top_k(x, weight, k, renormalize, dtype, counts)
    return softmax_top_k(backends.linear(x, weight), k, renormalize, dtype, fused=path == "pairs")


def merge_weights(*linears: nn.Linear) -> torch.Tensor | None:
    """Make bias-free nn.Linear layers that read the same input share one weight tensor: each
    weight becomes a view of rows of `torch.cat` of them all (no extra memory once the old ones
    are freed; a state_dict load still writes each weight by name). Returns the merged
    [sum(out), in] weight, or None where the layers cannot merge (a bias, mixed dtypes, devices
    or input sizes). merged_linear then runs them as one GEMM: one launch instead of several."""
    w0 = linears[0].weight
    if any(lin.bias is not None for lin in linears) or any(
        (lin.weight.dtype, lin.weight.device, lin.in_features) != (w0.dtype, w0.device, linears[0].in_features)
        for lin in linears
    ):
        return None
    if all(lin.weight.stride(0) == 1 for lin in linears):
        # column-major weights (backends.column_major_linears): the merged weight is too, so that
        # each layer's weight stays a view of it with its own layout
        merged = torch.cat([lin.weight.detach().t() for lin in linears], dim=1).t()
    else:
        merged = torch.cat([lin.weight.detach() for lin in linears])
    off = 0
    for lin in linears:
        n = lin.out_features
        lin.weight = nn.Parameter(merged[off : off + n], requires_grad=lin.weight.requires_grad)
        off += n
    return merged


def merged_linear(x, merged: torch.Tensor | None, linears, groups: list[int] | None = None) -> tuple:
    """Each layer's output on x: one GEMM with `merged` while the layers' weights are still its views
    (a later .to() or weight assignment breaks that, and each layer then runs on its own).
    `groups` (counts of consecutive layers) returns some outputs side by side as one tensor, e.g.
    [3, 1] gives (q|k|v, b) for four layers: a view of the one GEMM's output, no copy."""
    groups = groups or [1] * len(linears)
    sizes, i = [], 0
    for n in groups:
        sizes.append(sum(lin.out_features for lin in linears[i : i + n]))
        i += n
    if merged is not None:
        ptr, row = merged.data_ptr(), merged.stride(0) * merged.element_size()
        off, intact = 0, True
        for lin in linears:
            if lin.weight.data_ptr() != ptr + off * row:
                intact = False
                break
            off += lin.out_features
        if intact:
            return backends.linear(x, merged).split(sizes, dim=-1)
    outs, i = [], 0
    for n in groups:
        parts = [lin(x) for lin in linears[i : i + n]]
        outs.append(parts[0] if n == 1 else torch.cat(parts, dim=-1))
        i += n
    return tuple(outs)


def linear_layout(
    layout, inputs: tuple, state: LinearState, rec: Recording | None, layer_idx: int, scan, lo=0, hi=None, off=0
):
    """Run one linear layer over pieces lo..hi-1 of a layout (all of it by default).

    inputs: per-token tensors [1, n_live, ...] of the live tokens, `off` the live offset of piece
    lo; scan(inputs_of_run, state, output_transition) -> (o [1, n, ...], S_final, (T, S0) or None,
    conv tail) for one live run. Updates `state` in place and returns the live outputs
    concatenated along dim 1 (None when the pieces hold no live run).
    A DecodeBatch layout runs one token of each of B requests: inputs [1, B, ...], `state` their
    states stacked [B, ...]; one scan for the batch, outputs [1, B, ...].
    """
    if isinstance(layout, DecodeBatch):
        # [1, B, ...] <-> [B, 1, ...] by reshape, not transpose: a view either way for any B (a
        # transposed output would make the caller's reshapes copy for B > 1 only)
        o, S, _, tail = scan(tuple(t.reshape(t.shape[1], 1, *t.shape[2:]) for t in inputs), state, False)
        state.ssm, state.conv = S, tail
        return o.reshape(1, o.shape[0], *o.shape[2:])
    outs = []
    for idx in range(lo, len(layout) if hi is None else hi):
        piece = layout[idx]
        if isinstance(piece, CachedSpan):
            span = piece.data.linear[layer_idx]
            state.ssm = apply_segment(span.T, span.S, state.ssm, piece.use_transition)
            state.conv = span.conv_tail.to(state.conv.dtype)
        else:
            n = piece.token_ids.numel()
            run_inputs = tuple(t[:, off : off + n] for t in inputs)
            off += n
            want_t = rec is not None and piece.record == "entry"
            o, S, pair, tail = scan(run_inputs, state, want_t)
            state.ssm, state.conv = S, tail
            if want_t:
                rec.entries[idx].linear[layer_idx] = LinearSpan(T=pair[0], S=pair[1], conv_tail=tail.clone())
            outs.append(o)
        if rec is not None and idx in rec.snapshots:
            rec.snapshots[idx][layer_idx] = LinearState(state.ssm.clone(), state.conv.clone())
    if not outs:
        return None
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # one run (decode, a prefill): no copy


def attention_layout(
    q, k, v, layout, state: AttnState, rec: Recording | None, layer_idx: int, live_pos, scale, rotate=None,
    head_major: bool = False,
):
    """Causal attention of live queries over all K/V before them.

    q [1, Hq, n, dq], k [1, Hkv, n, dq], v [1, Hkv, n, dv] of the live tokens (k already rotated at
    absolute positions); rotate(x, positions [N]) rotates keys by per-position angles (None: the
    family has no positions in attention). Cached spans' K go to absolute positions in one
    rotation per layer (live keys rotate by 0, which is exact). Updates `state`; returns
    [1, n, Hq * dv], or with head_major the attention's own [1, Hq, n, dv] (a caller that gates
    the output transposes it in the same pass).
    A DecodeBatch layout: the n live tokens are one token of each request, their K/V in pages
    (`state` unused).
    """
    if isinstance(layout, DecodeBatch):
        out = decode_attention(q, k, v, layout, layer_idx, scale)  # [1, Hq, B, dv]
        return out if head_major else out.transpose(1, 2).reshape(1, q.shape[2], -1)
    if isinstance(layout, AssemblyBatch):
        # a planned assembly: the spans' K/V are in the pages already (AssemblyBatch.fill); the live
        # K/V go to their rows (padding tokens to the scratch row), the queries read the pages
        pages = state.pages
        kp, vp = pages.k[layer_idx], pages.v[layer_idx]
        kp.view(-1, *kp.shape[2:]).index_copy_(0, layout.kv_rows, k[0].transpose(0, 1).to(kp.dtype))
        vp.view(-1, *vp.shape[2:]).index_copy_(0, layout.kv_rows, v[0].transpose(0, 1).to(vp.dtype))
        out = backends.paged_prefill_attention(q, kp, vp, pages.table, layout.where, live_pos, layout.length, scale)
        return out if head_major else out.transpose(1, 2).reshape(1, q.shape[2], -1)
    paged = hasattr(state, "pages")  # a paged.PagedAttnState: the sequence's K/V are in its pages
    ks, vs, shifts, lengths, off = [], [], [], [], 0
    for idx, piece in enumerate(layout):
        if isinstance(piece, CachedSpan):
            span = piece.data.attn[layer_idx]
            ks.append(span.k.to(q.dtype))
            vs.append(span.v.to(q.dtype))
            shifts.append(piece.shift)
            lengths.append(span.k.shape[2])
            continue
        m = piece.token_ids.numel()
        ks.append(k[:, :, off : off + m])
        vs.append(v[:, :, off : off + m])
        shifts.append(0)
        lengths.append(m)
        if rec is not None and piece.record == "entry":
            rec.entries[idx].attn[layer_idx] = AttnSpan(k=ks[-1].clone(), v=vs[-1].clone())
        off += m
    # one piece on a non-empty state (a decode step, a live tail) or in pages: its keys go straight
    # into the concatenation or the pages below, no copy of their own
    K_new = ks[0] if len(ks) == 1 and (paged or state.k.shape[2]) else torch.cat(ks, dim=2)
    if rotate is not None and any(shifts):
        # each key's shift depends on the layout only: built on the host once per forward and
        # shared by every attention layer (on the device, repeat_interleave syncs to size its output)
        key = ("attn_shifts", tuple(shifts), tuple(lengths))
        per_pos = rec.scratch.get(key) if rec is not None else None
        if per_pos is None:
            per_pos = torch.repeat_interleave(torch.tensor(shifts), torch.tensor(lengths))
            per_pos = backends.to_device_async(per_pos, K_new.device)
            if rec is not None:
                rec.scratch[key] = per_pos
        K_new = rotate(K_new, per_pos)
    if paged:
        # the new keys go into the sequence's pages (at the rows KVPages.extend took for them), and
        # the live queries attend to its pages where they lie: nothing of the context is copied
        write = state.write
        pages = state.pages
        kp, vp = pages.k[layer_idx], pages.v[layer_idx]
        V_new = vs[0] if len(vs) == 1 else torch.cat(vs, dim=2)
        kp.view(-1, *kp.shape[2:]).index_copy_(0, write.rows, K_new[0].transpose(0, 1).to(kp.dtype))
        vp.view(-1, *vp.shape[2:]).index_copy_(0, write.rows, V_new[0].transpose(0, 1).to(vp.dtype))
        out = backends.paged_prefill_attention(q, kp, vp, pages.table, write.row, live_pos, write.length, scale,
                                                first_pos=first_live_start(layout))
        return out if head_major else out.transpose(1, 2).reshape(1, q.shape[2], -1)
    # (an empty state, e.g. a request with nothing cached before it, takes the new K/V as they are:
    # K_new and the cat of vs are fresh tensors, not views of k or v)
    state.k = torch.cat([state.k, K_new], dim=2) if state.k.shape[2] else K_new.to(state.k.dtype)
    state.v = torch.cat([state.v, *vs], dim=2) if state.v.shape[2] else torch.cat(vs, dim=2).to(state.v.dtype)
    out = backends.attention(q, state.k, state.v, live_pos, scale, first_pos=first_live_start(layout))  # [1, Hq, n, dv]
    return out if head_major else out.transpose(1, 2).reshape(1, q.shape[2], -1)


class DecodeBatch:
    """The layout of a batched decode step: one new token for each of B running requests whose
    attention K/V lie in pages (paged.KVPages). Layers see the B tokens as one sequence [1, B, h]
    (their per-token math is unchanged); linear layers get the B states stacked, attention layers
    write their new K/V into the pages and attend through the block table (decode_attention).
    rows [B]: the requests' table rows, which are their slots in the state pool; kv_rows [B]: where
    each new token's K/V go in the flattened pools; lengths [B]: keys each request attends to, its
    new one included (all int64 on the device); max_pages: a host bound on the pages any request
    spans (the CPU path's gather). states_in_pool: a linear layer's state is the pool's (tensors
    [slots + 1, ...]) and advances in place at `rows` (LinearMixer.decode); else it is the B
    requests' states stacked [B, ...], replaced by the step (the gather/scatter reference)."""

    __slots__ = ("kv", "rows", "kv_rows", "lengths", "max_pages", "states_in_pool")

    def __init__(self, kv, rows: torch.Tensor, kv_rows: torch.Tensor, lengths: torch.Tensor, max_pages: int,
                 states_in_pool: bool = True):
        self.kv, self.rows, self.kv_rows, self.lengths, self.max_pages = kv, rows, kv_rows, lengths, max_pages
        self.states_in_pool = states_in_pool

    def write(self, pages: torch.Tensor, new: torch.Tensor) -> None:
        """Write the B new rows new [B, H, d] into pages [num_pages, P, H, d], one indexed copy."""
        pages.view(-1, *pages.shape[2:]).index_copy_(0, self.kv_rows, new.to(pages.dtype))

    def gather(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The batch's K and V of a layer gathered from the pages, padded [B, H, N, d] with the values
        past each length zeroed, and the key mask [B, 1, 1, N] (the CPU path; MLA)."""
        from hybridcache.kernels.ops.attention.paged import gather_pages

        kv = self.kv
        K = gather_pages(kv.k[layer], kv.table, self.rows, self.max_pages)
        V = gather_pages(kv.v[layer], kv.table, self.rows, self.max_pages)
        valid = torch.arange(K.shape[2], device=K.device)[None, :] < self.lengths[:, None]
        mask = valid[:, None, None]
        return K, torch.where(mask.transpose(2, 3), V, V.new_zeros(())), mask


def decode_attention(q, k, v, batch: DecodeBatch, layer: int, scale) -> torch.Tensor:
    """One decode step of B requests: q [1, Hq, B, d], k, v [1, Hkv, B, d] (rotated at each
    request's position) -> [1, Hq, B, dv]. The new K/V rows go into the layer's pages, then the B
    queries attend through the block table in one call (backends.paged_decode_attention): no
    per-request work, no copy of the contexts on CUDA. The query heads that share a KV head are its
    query rows (no repeated K/V)."""
    kp, vp = batch.kv.k[layer], batch.kv.v[layer]
    batch.write(kp, k[0].transpose(0, 1))
    batch.write(vp, v[0].transpose(0, 1))
    o = backends.paged_decode_attention(
        q[0].transpose(0, 1), kp, vp, batch.kv.table, batch.rows, batch.lengths, scale, batch.max_pages
    )  # [B, Hq, dv]
    return o.transpose(0, 1)[None]


def first_live_start(layout) -> int | None:
    """The position of the first live token (live_pos[0]) read from the layout on the host, where
    reading the device positions tensor would sync; None without a live run."""
    return next((p.start for p in layout if isinstance(p, LiveRun)), None)


def new_planned_recording(plan: AssemblyBatch) -> Recording:
    """The Recording a planned pass fills (its kept states go through rec.scratch first)."""
    rec = Recording()
    for idx in plan.snapshots:
        rec.snapshots[idx] = {}
    return rec


def run_to_end(gen):
    """Drive a generator to its end; its return value."""
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value


def new_recording(state: SequenceState, layout, snapshot_after):
    """Check the layout's positions; return (rec, live ids [n], live positions [n], end position)."""
    pos = state.length
    live_ids, live_pos = [], []
    rec = Recording()
    for idx, piece in enumerate(layout):
        if piece.start != pos:
            raise ValueError(f"layout piece {idx} starts at {piece.start}, expected {pos}")
        if isinstance(piece, LiveRun):
            live_ids.append(piece.token_ids)
            live_pos.append(torch.arange(piece.start, piece.end))
            if piece.record == "entry":
                rec.entries[idx] = SpanData(piece.token_ids.numel(), piece.start, {}, {})
        if idx in snapshot_after:
            rec.snapshots[idx] = {}
        pos = piece.end
    if not live_ids:
        raise ValueError("a layout needs at least one live token")
    if len(live_ids) == 1:
        return rec, live_ids[0], live_pos[0], pos
    return rec, torch.cat(live_ids), torch.cat(live_pos), pos


class Backbone(nn.Module):
    """The checkpoint layout every architecture here shares: `model.<embed_name>` (token
    embedding), `model.layers`, and a final norm named `norm_name` (norm, norm_f, final_layernorm)."""

    def __init__(self, cfg, layers: list[nn.Module], norm: nn.Module, embed_name="embed_tokens", norm_name="norm"):
        super().__init__()
        setattr(self, embed_name, nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layers)
        setattr(self, norm_name, norm)
        self.embed_name, self.norm_name = embed_name, norm_name

    def embed(self, ids):
        return getattr(self, self.embed_name)(ids)

    def final_norm(self, x):
        return getattr(self, self.norm_name)(x)


class LayoutLM(nn.Module):
    """Base of every architecture. Subclasses pass a Backbone whose `layers` each have `kind`
    "linear_attention" | "full_attention" | a stateless kind such as "mlp", `empty_state(device)` and
    `forward_layout(x, layout, state, rec, layer_idx, positions) -> x`, residuals included."""

    norm_offset = 1.0  # modelzoo.random_init_: these models use plain RMSNorm (weight * x)
    # Whether the live pass of an assembly and decode steps may run from CUDA graphs (graphs.py,
    # paged.py): only where they have no host synchronization and are tested so on a GPU.
    cuda_graphs = False
    # Whether the attention layers run a prefill whose K/V lie in the request's pages
    # (attention_layout with a paged.PagedAttnState): a scheduler then prefills a long prompt in
    # its slot, chunk after chunk, without a contiguous copy of its K/V.
    paged_prefill = True

    def __init__(self, cfg, backbone: nn.Module):
        super().__init__()
        self.cfg = cfg
        self.model = backbone
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layers(self):
        return self.model.layers

    def embed(self, ids):
        return self.model.embed(ids)

    def head(self, x):
        """Final norm and LM head."""
        return self.lm_head(self.model.final_norm(x))

    @property
    def device(self):
        return self.lm_head.weight.device

    @property
    def dtype(self):
        return self.lm_head.weight.dtype

    def empty_state(self) -> SequenceState:
        lin, att = {}, {}
        for i, layer in enumerate(self.layers):
            if layer.kind == "linear_attention":
                lin[i] = layer.empty_state(self.device)
            elif layer.kind == "full_attention":
                att[i] = layer.empty_state(self.device)
        return SequenceState(length=0, linear=lin, attn=att)

    @torch.no_grad()
    def forward_layout(
        self, state: SequenceState, layout: list, logits_for: str = "last", snapshot_after=(), capture_hidden=()
    ):
        """Run the live tokens of `layout` from `state` (updated in place), layer by layer.

        logits_for: "last" ([vocab] fp32 after the last live token), "all" ([n_live, vocab]) or
        "none". snapshot_after: layout indices whose linear states to record; capture_hidden:
        layers whose entering residual stream to record. Returns (logits or None, Recording).
        This is the eager pass; runner.ModelRunner.forward replays assemblies from CUDA graphs."""
        return run_to_end(self.forward_layout_parts(state, layout, logits_for, snapshot_after, capture_hidden))

    def forward_layout_parts(self, state: SequenceState, layout: list, logits_for: str = "last", snapshot_after=(),
                             capture_hidden=(), parts: int = 1):
        """forward_layout as a generator of `parts` runs of consecutive layers (as even as the layer
        count allows): it yields after each run but the last and returns forward_layout's (logits,
        rec). Between two runs the state is part-way (its layers before the cut hold the new tokens,
        those after it not yet; its length is set at the end): nothing else may run from it, and a
        generator closed early leaves it unusable. The caller sets the op dispatch and no_grad."""
        rec, ids, positions, end = new_recording(state, layout, snapshot_after)
        positions = backends.to_device_async(positions, self.device)
        x = self.embed(backends.to_device_async(ids, self.device))[None]  # [1, n_live, h]
        n = len(self.layers)
        cuts = {round(n * j / parts) for j in range(1, parts)} - {0, n}
        for i in range(n):
            if i in cuts:
                yield
            x = self.run_layer(i, x, layout, state, rec, positions, capture_hidden)
        state.length = end
        return self.logits_of(x, logits_for), rec

    # Whether assemblies may run planned (models/assembly.py: bucketed shapes, indices as data, the
    # K/V in the request's pages), the form CUDA graphs of unseen layouts replay; a model that
    # declares it gives span_rotation and conv_width.
    planned_assemblies = False

    def span_rotation(self, layer: int):
        """How attention layer `layer` rotates cached keys by per-position shifts: rotate(k [1, H,
        N, d], shifts [N]) -> k, or None where its keys carry no positions (planned assemblies)."""
        raise NotImplementedError

    def span_rope(self, layer: int):
        """span_rotation's angles, where the rotation is rotate-half by a cos/sin table: rope(shifts
        [N]) -> (cos, sin) [N, R] fp32, which a planned assembly's fused write of the spans' K/V into
        the pages uses (kernels/ops/rope spans_into_pages); None: rotate with span_rotation."""
        return None

    @torch.no_grad()
    def forward_planned(self, state: SequenceState, plan: AssemblyBatch):
        """The eager pass over a planned assembly (models/assembly.py), the reference of its CUDA
        graphs: each layer's request data bound (AssemblyBatch.fill: conv sources, fold tables,
        the spans' K/V into the pages), then the layer, as forward_layout runs it. The state's K/V
        are in pages (KVPages.extend ran for this pass). Returns (logits or None, Recording)."""
        rec = new_planned_recording(plan)
        plan.bind_rows(state)
        x = self.embed(plan.ids)[None]  # [1, n, h]
        for i in range(len(self.layers)):
            plan.fill(self, i, state)
            x = self.run_layer(i, x, plan, state, rec, plan.positions, plan.host["capture"])
        logits = plan.logits(self, x)
        state.length = plan.end
        finish_recording(plan, rec)
        return logits, rec

    def forward_decode(self, batch: DecodeBatch, token_ids: torch.Tensor, positions: torch.Tensor,
                       linear: dict[int, LinearState], capture_hidden=()):
        """The layers over a decode batch: token_ids, positions [B] on the device; linear: layer ->
        the pool's linear state, advanced in place at the batch's rows (batch.states_in_pool), or
        the B requests' states stacked [B, ...], replaced by the states after the step. Returns
        (logits [B, vocab] fp32, {layer in capture_hidden: entering stream [B, h]})."""
        x = self.embed(token_ids)[None]  # [1, B, h]
        hidden, r = {}, None
        for i, layer in enumerate(self.layers):
            # a layer that defers its residual (defers_residual) leaves its MLP output r for the
            # next one to add with its input norm; the stream is summed where it is captured, and
            # before a layer that does not take it so
            defers = getattr(layer, "defers_residual", False)
            if r is not None and (i in capture_hidden or not defers):
                x, r = x + r, None
            if i in capture_hidden:
                hidden[i] = x[0].clone()
            if defers:
                x, r = layer.forward_layout(x, batch, linear.get(i), None, i, positions, r=r, defer=True)
            else:
                x = layer.forward_layout(x, batch, linear.get(i), None, i, positions)
        if r is not None:
            x = x + r
        return self.head(x)[0].float(), hidden

    @torch.no_grad()
    def build_span_data(self, segments: list[list[int]], seam: int, on_layer=None) -> list[SpanData]:
        """Standalone prefill of several segments in one batched forward (positions from 0 each,
        padded at the end to the longest); returns each segment's body (tokens seam..end) as
        SpanData, equal to building them one by one. Every segment needs more than `seam` tokens.
        Each layer's `build_spans(x [B, L, h], lengths, seam, datas, i) -> x` runs the block and
        records its spans. `on_layer(i, datas)`, if given, is called as soon as layer i's spans of
        every segment are final (segment parallelism streams them); stateless layers have none."""
        return self._span_pass(segments, seam, on_layer)[0]

    @torch.no_grad()
    def prompt_spans(self, prompts: list[list[int]], capture_hidden=()) -> tuple[list[SpanData], dict]:
        """build_span_data of whole prompts (no seam window) and, for each layer in capture_hidden,
        the residual stream entering it [B, L, h] (row j real for its first len(prompts[j])
        tokens): the state after prompt j from an empty one is its SpanData folded into an empty
        state (Engine.prefill_plain)."""
        return self._span_pass(prompts, 0, None, capture_hidden)

    def _span_pass(self, segments, seam, on_layer, capture_hidden=()):
        lengths = [len(s) for s in segments]
        if min(lengths) <= seam:
            raise ValueError("every segment needs more tokens than the seam window")
        L = max(lengths)
        ids = torch.zeros(len(segments), L, dtype=torch.long)
        for j, s in enumerate(segments):
            ids[j, : len(s)] = torch.as_tensor(s)
        datas = [SpanData(n - seam, seam, {}, {}) for n in lengths]
        captured = {}
        x = self.embed(backends.to_device_async(ids, self.device))  # [B, L, h]
        for i, layer in enumerate(self.layers):
            if i in capture_hidden:
                captured[i] = x.clone()
            x = layer.build_spans(x, lengths, seam, datas, i)
            if on_layer is not None and layer.kind in ("linear_attention", "full_attention"):
                on_layer(i, datas)
        return datas, captured

    def run_layer(self, i: int, x, layout, state: SequenceState, rec: Recording, positions, capture_hidden=()):
        """Layer i of the live pass: x [1, n_live, h] -> [1, n_live, h]; its state updated."""
        if i in capture_hidden:
            rec.hidden[i] = x[0].clone()
        layer = self.layers[i]
        return layer.forward_layout(x, layout, state.linear.get(i, state.attn.get(i)), rec, i, positions)

    def logits_of(self, x, logits_for: str):
        """The forward's logits from the last layer's output x [1, n_live, h] (None for "none")."""
        if logits_for == "none":
            return None
        if logits_for == "last":
            x = x[:, -1:]
        logits = self.head(x)[0].float()
        return logits[-1] if logits_for == "last" else logits

    def merge_projections(self) -> int:
        """Merge the projections that read the same input into one GEMM each (merge_weights), in
        every module that offers it; returns how many groups merged. The loader calls it."""
        n = 0
        for m in self.modules():
            if m is not self and hasattr(m, "merge_projections"):
                n += m.merge_projections()
        return n

    def linear_groups(self) -> list[tuple[int, ...]]:
        """Runs of consecutive linear-attention layer indices, in order (prefix-cache replay units)."""
        groups, run = [], []
        for i, layer in enumerate(self.layers):
            if layer.kind == "linear_attention":
                run.append(i)
            elif run:
                groups.append(tuple(run))
                run = []
        return groups + [tuple(run)] if run else groups

    @torch.no_grad()
    def replay_linear_group(self, group: tuple[int, ...], hidden: torch.Tensor, state: SequenceState) -> None:
        """Run hidden states [n, h] entering group[0] through the layers of `group`, advancing
        state.linear[i] in place (attention layers and state.length untouched)."""
        x = hidden.to(self.dtype)[None]  # [1, n, h]
        n = x.shape[1]
        run = [LiveRun(torch.zeros(n, dtype=torch.long), 0)]
        positions = torch.arange(n, device=x.device)
        for i in group:
            x = self.layers[i].forward_layout(x, run, state.linear[i], None, i, positions)


class BlockLayer(nn.Module):
    """A decoder layer that is `block(x, mix)` around one mixer (the subclass's block: its norms,
    residuals and MLP): the linear-attention mixer or attention, by `kind`, taken from
    `mixer_module()` (default `self_attn`, the attribute name of both in their checkpoints)."""

    kind: str

    def mixer_module(self) -> nn.Module:
        return self.self_attn

    def forward_layout(self, x, layout, state, rec, layer_idx, positions):
        mixer = self.mixer_module()
        if self.kind == "linear_attention":
            return self.block(x, lambda h: mixer.forward_layout(h, layout, state, rec, layer_idx))
        return self.block(x, lambda h: mixer.forward_layout(h, layout, state, rec, layer_idx, positions))

    def build_spans(self, x, lengths, seam, datas, layer_idx):
        mixer = self.mixer_module()
        return self.block(x, lambda h: mixer.build_spans(h, lengths, seam, datas, layer_idx))
