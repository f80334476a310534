"""An assembly's live pass as data (AssemblyBatch): what lets one CUDA graph serve every layout of
a bucket instead of one graph per exact layout.

A warm request's layout (live runs and cached spans, sequence.py) fixes, in the eager pass, the
shapes of its tensors (how many live tokens, how many runs and how long, how many spans and how
long) and the values of its index tensors (positions, where each run's tokens sit in the padded
batch of runs, which state enters each run): every new layout would be a new graph. Planned, it is:

- live runs cut into sub-runs of at most `run_tokens` tokens (a seam window's length): a run
  after a cached span stays one sub-run of the seam's length, a question becomes several; the
  batch of runs is [m, L] with L = run_tokens, so seams are not padded to the question's length
  (the eager batched scan pads every run to the longest: 33 runs of 64 rows for 32 seams of 8
  and a question of 64, 6.6x the live tokens, all of it copied and computed);
- every count padded to a bucket (`bucket`: steps of an eighth of a power of two): n live tokens,
  m sub-runs, p (T, S) pairs to fold (sub-runs and spans), s states kept; padding tokens sit at
  position 0, write their K/V to the pool's scratch row and land in a dump row of the padded
  batch; padding steps of a run are identity steps of the recurrence; padding pairs come after
  the last real one (identity T, zero S) and no state after them is read;
- every layout-dependent index a device tensor of one packed int64 block (`index`): the live
  tokens' ids, positions, rows in the padded batch, the K/V rows in the request's pages, each
  sub-run's conv-tail inputs, which fold row enters each sub-run, the final row, the kept rows;
- what depends on the request's entries is bound per layer, outside the graph (`fill`): each
  sub-run's conv source (the tail of the span before it, or the entering state's), the fold's
  table of the spans' T and S addresses (the fold reads each entry where it lies,
  compose_triton.compose_states_table), and the spans' K/V, rotated to their positions and
  written straight into the request's pages (the K/V decode reads afterwards: no concatenation
  of the context, no copy of it at assign);
- attention reads the request's pages through its table row (backends.paged_prefill_attention),
  its row and length read on the device.

The key (`key`) is the bucketed sizes and dtypes: a RAG request of 32 documents of any lengths and
a 64-token question has one key. The models run an AssemblyBatch through their usual layer code
(the linear layers' planned_scan, attention_layout's planned branch), so the eager pass over a
plan is the reference of its graphs, and both equal the exact eager pass over the layout up to the
order of floating-point sums (tests/runtime/test_assembly_plan.py).

Which layouts plan (plan_assembly returns None otherwise): an assembly (a cached span at least)
of a model that declares `planned_assemblies`, its state's K/V in pages, every span folded with
its T, no run recording an entry, every live run of at most MAX_RUN tokens, and every run whose
conv tail would reach past it into a span (shorter than the conv's W - 1 inputs, after a span)
absent; logits of the last token or none.
"""

from __future__ import annotations

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.sequence import CachedSpan, LinearState

# live runs longer than this are not planned (a long prompt's chunk runs eagerly: its launches are
# few next to its work, and cut into sub-runs its fold would be a long serial chain)
MAX_RUN = 256
# the padded counts' floor (a bucket is never smaller)
MIN_BUCKET = 8


def bucket(n: int, floor: int = MIN_BUCKET) -> int:
    """n rounded up to a bucket: `floor` at least, then steps of an eighth of the power of two
    below n (at most 12.5 % padding; 8 buckets an octave)."""
    if n <= floor:
        return floor
    step = max(1, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // step) * step


# identity T and zero S blocks of the fold's padding pairs, per (dtype, G, K, V, device); never freed
# (a CUDA graph's tables may point at them)
_PADDING_BLOCKS: dict = {}


def padding_pair(dtype, G: int, K: int, V: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (dtype, G, K, V, torch.device(device))
    if key not in _PADDING_BLOCKS:
        eye = torch.eye(K, dtype=dtype, device=device).expand(G, K, K).contiguous()
        _PADDING_BLOCKS[key] = (eye, torch.zeros(G, K, V, dtype=dtype, device=device))
    return _PADDING_BLOCKS[key]


class AssemblyBatch:
    """A planned assembly (module docstring). Host sizes: n live tokens, m sub-runs of L tokens,
    p fold pairs, s kept states (bucketed), W1 = conv width - 1; `real` the real counts. Device
    index tensors (views of `packed`, int64; `index` names them):

        ids, positions [n]        live tokens (padding: token 0 at position 0)
        live_off [n]              offset of each live token among the forward's new tokens
                                  (padding: n_new, an extra row that maps to the scratch row)
        span_off [S]              offsets of the spans' tokens among them (S real, unpadded: used
                                  outside the graph only); span_shift [S] their rotation
        flat [n]                  row of each live token in the padded batch [m * L] (padding: m * L)
        pad [m * L]               1 where a row of the batch holds no token
        tail_rows [m * W1]        live-token indices of each sub-run's last W1 conv inputs
        prev_src [m]              1: the sub-run's conv source is the tail of the sub-run before it
        pair_run [p]              the sub-run of each fold pair (-1: a span's, or padding)
        enter [m]                 the fold's row entering each sub-run (the fold's rows: 0 the
                                  entering state, k + 1 the state after pair k)
        final [1], last_run [1], last_tok [1]
        n_pairs [1]               the real pairs (the fold stops after them)
        snap_rows [s]             fold rows of the kept states; snap_tails [s] rows of their conv
                                  tails in [tails; conv sources] (2m rows)
        where [2]                 the request's table row and its length after this pass

    Per layer, bound by fill: conv_src[layer] [m, D, W1], span_T[layer] / span_S[layer] [p] int64
    addresses (CUDA), and, for attention layers, the spans' K/V written into the pages. After the
    first layer's fill, kv_rows [n] holds the live tokens' K/V rows (device, from the request's
    PagedWrite)."""

    NAMES = ("ids", "positions", "live_off", "flat", "pad", "tail_rows", "prev_src", "pair_run", "enter", "final",
             "last_run", "last_tok", "n_pairs", "snap_rows", "snap_tails")

    def __init__(self, key, sizes: dict, real: dict, host: dict, packed: torch.Tensor, spans: list, runs: list,
                 snapshots: list, pairs: list, span_off: torch.Tensor, span_shift: torch.Tensor):
        self.key = key
        self.n, self.m, self.L, self.p, self.s, self.W1 = (sizes[k] for k in ("n", "m", "L", "p", "s", "W1"))
        self.real = real  # n, m, p, s (host ints)
        self.packed = packed
        self.index = _views(packed, self.sizes_of())
        self.spans = spans  # [(layout index, CachedSpan)] in order
        self.runs = runs  # per sub-run: its conv source ("span", layout index) | ("state",) | ("prev",)
        self.snapshots = snapshots  # layout indices kept, in snap_rows' order
        self.pairs = pairs  # per real fold pair: ("run", j) | ("span", layout index)
        self.span_off, self.span_shift = span_off, span_shift
        self.host = host  # start, end (positions), n_new, capture (hidden layers), logits_for
        self.conv_src: dict[int, torch.Tensor] = {}
        self.span_T: dict[int, torch.Tensor] = {}
        self.span_S: dict[int, torch.Tensor] = {}
        self.kv_rows: torch.Tensor | None = None
        self._span_index = None  # the spans' tokens' (span, index) on the device, made by the first fused write
        self.where: torch.Tensor | None = None
        self.length: int | None = host["end"]  # the keys' bound on the host (None inside a graph)
        self.tables = False  # the fold reads address tables (CUDA, matrix T); set by fill

    def sizes_of(self) -> dict[str, int]:
        n, m, L, p, s, W1 = self.n, self.m, self.L, self.p, self.s, self.W1
        return {"ids": n, "positions": n, "live_off": n, "flat": n, "pad": m * L, "tail_rows": m * W1, "prev_src": m,
                "pair_run": p, "enter": m, "final": 1, "last_run": 1, "last_tok": 1, "n_pairs": 1, "snap_rows": s,
                "snap_tails": s}

    def __getattr__(self, name):
        index = self.__dict__.get("index")
        if index is not None and name in index:
            return index[name]
        raise AttributeError(name)

    @property
    def start(self) -> int:
        return self.host["start"]

    @property
    def end(self) -> int:
        return self.host["end"]

    # -- per-layer binding (outside any graph) --------------------------------------------------

    def bind_rows(self, state, req: AssemblyBatch | None = None) -> None:
        """The live tokens' K/V rows and the table row/length pair, from the request's PagedWrite
        (KVPages.extend ran for this pass): kv_rows [n] (padding: the scratch row 0); and the
        spans' rows for `req` (by default this plan; a graph's static plan binds a request's)."""
        req = req or self
        write = next(iter(state.attn.values())).write
        rows = torch.cat([write.rows, write.rows.new_zeros(1)])
        kv_rows = rows.index_select(0, req.live_off)
        if self.kv_rows is None:
            self.kv_rows, self.where = kv_rows, write.row.clone()
        else:  # a graph's static plan: into its buffers
            self.kv_rows.copy_(kv_rows)
            self.where.copy_(write.row)
        req._span_rows = write.rows.index_select(0, req.span_off) if req.span_off.numel() else None
        self.bind_tables(state, req)

    def static_copy(self) -> AssemblyBatch:
        """A plan of the same key whose device data are buffers of its own (a CUDA graph's inputs):
        bind a request into it with load, bind_rows and fill."""
        other = object.__new__(AssemblyBatch)
        other.__dict__.update(self.__dict__)
        other.packed = self.packed.clone()
        other.index = _views(other.packed, self.sizes_of())
        other.conv_src, other.span_T, other.span_S = {}, {}, {}
        other.kv_rows = other.where = other._tables = other._span_index = None
        other.tables = False
        other.forget_request()
        return other

    def load(self, req: AssemblyBatch) -> None:
        """Take the request plan's index data (one copy) and host length into this static plan."""
        if req.key != self.key:
            raise ValueError("the request's plan is of another key")
        self.packed.copy_(req.packed)
        self.host = dict(self.host, start=req.host["start"], end=req.host["end"], n_new=req.host["n_new"])
        # the request's host data (what an eager pass over this plan reads: a graph's replay does not)
        for name in ("real", "spans", "runs", "snapshots", "pairs", "_pieces"):
            setattr(self, name, getattr(req, name))
        self.length = req.length if self.packed.device.type != "cuda" else None

    def forget_request(self) -> None:
        """Drop what a static plan holds of the last request it ran (its entries' span data, so
        that a graph kept for later requests does not keep evicted entries alive)."""
        self.spans, self.runs, self.pairs, self.snapshots, self._pieces = [], [], [], [], {}

    def fill(self, model, layer: int, state, req: AssemblyBatch | None = None) -> None:
        """Bind layer `layer`'s request data (module docstring), from `req` (the request's plan; by
        default this one): into this plan's buffers where it has them (a graph's static plan),
        else new tensors."""
        req = req or self
        kind = model.layers[layer].kind
        if kind == "linear_attention":
            self._fill_linear(layer, state, req)
        elif kind == "full_attention":
            req.write_span_kv(model, layer, state)

    def _fill_linear(self, layer: int, state, req: AssemblyBatch) -> None:
        lin = state.linear[layer]
        sources = []
        for src in req.runs:
            if src[0] == "span":
                sources.append(req.span_data(src[1]).linear[layer].conv_tail)
            else:  # the entering state's tail ("prev" rows are replaced inside the pass)
                sources.append(lin.conv)
        dt = lin.conv.dtype
        pad_rows = self.m - len(sources)
        dst = self.conv_src.get(layer)
        if dst is None:
            src = torch.cat([t.to(dt) for t in sources], dim=0)
            if pad_rows:
                src = torch.cat([src, src.new_zeros(pad_rows, *src.shape[1:])], dim=0)
            self.conv_src[layer] = src
        else:  # one launch into the static buffer's first rows
            torch.cat([t.to(dt) for t in sources], dim=0, out=dst[: len(sources)])

    def bind_tables(self, state, req: AssemblyBatch | None = None) -> None:
        """The fold's address tables of every linear layer (CUDA, matrix T), from `req` (by default
        this plan) in one host-to-device copy: per layer the span pairs' T and S blocks where they
        lie, 0 for the sub-runs' pairs (the pass points those at its own stack), the padding
        blocks for padding pairs. Read without waiting for arriving layers (the addresses are
        known; each layer's fill waits for its own)."""
        req = req or self
        self.tables = False
        first = _peek(req.span_data(req.spans[0][0]).linear)
        layers = list(first)
        if not layers:
            return
        T0, S0 = first[layers[0]].T, first[layers[0]].S
        lin = next(iter(state.linear.values()))
        if T0.dim() != 4 or not tables_apply(lin.ssm):
            return
        G, K, V = S0.shape[-3:]
        eye, zero = padding_pair(T0.dtype, G, K, V, T0.device)
        # blocks of the spans' dtypes that outlive any request (the fold's reference of their types)
        self.span_refs = (eye, padding_pair(S0.dtype, G, K, V, S0.device)[1])
        # [layer][T or S][pair], built as lists (one tensor made at the end: a few thousand entries)
        rows = [[[eye.data_ptr()] * self.p, [zero.data_ptr()] * self.p] for _ in layers]
        for k, pair in enumerate(req.pairs):
            if pair[0] != "span":
                for t_row, s_row in rows:
                    t_row[k] = s_row[k] = 0
                continue
            spans = _peek(req.span_data(pair[1]).linear)
            for (t_row, s_row), layer in zip(rows, layers):
                span = spans[layer]
                T, S = span.T, span.S
                if T.dtype != T0.dtype or S.dtype != S0.dtype or not (T.is_contiguous() and S.is_contiguous()):
                    raise ValueError("the spans' T and S must share dtypes and be contiguous to fold from a table")
                t_row[k], s_row[k] = T.data_ptr(), S.data_ptr()
        host = torch.tensor(rows, dtype=torch.int64)
        dst = getattr(self, "_tables", None)
        if dst is None:
            dst = self._tables = backends.to_device_async(host, T0.device)
        else:
            dst.copy_(backends.pin(host), non_blocking=True)
        for li, layer in enumerate(layers):
            self.span_T[layer], self.span_S[layer] = dst[li, 0], dst[li, 1]
        self.tables = True

    def write_span_kv(self, model, layer: int, state) -> None:
        """The spans' K/V of attention layer `layer`, rotated to their positions, into the request's
        pages (the rows KVPages.extend took for them): one concatenation, one rotation and one
        indexed write per tensor, whatever the number of spans."""
        if not self.spans:
            return
        pages = state.attn[layer].pages
        kp, vp = pages.k[layer], pages.v[layer]
        ks = [self.span_data(idx).attn[layer].k for idx, _ in self.spans]
        vs = [self.span_data(idx).attn[layer].v for idx, _ in self.spans]
        rope = model.span_rope(layer)
        if rope is not None and spans_fused(kp) and all(t.stride(-1) == 1 for t in ks + vs):
            # one launch: each span's K/V read where the entry holds it, rotated, into its rows
            from hybridcache.kernels.ops.rope.triton import spans_into_pages

            cos, sin = rope(self.span_shift)
            self._span_index = spans_into_pages(ks, vs, cos, sin, kp, vp, self._span_rows,
                                                *(self._span_index or (None, None)))
            return
        K = ks[0] if len(ks) == 1 else torch.cat(ks, dim=2)
        V = vs[0] if len(vs) == 1 else torch.cat(vs, dim=2)
        rotate = model.span_rotation(layer)
        if rotate is not None:
            K = rotate(K.to(kp.dtype), self.span_shift)
        rows = self._span_rows
        kp.view(-1, *kp.shape[2:]).index_copy_(0, rows, K[0].transpose(0, 1).to(kp.dtype))
        vp.view(-1, *vp.shape[2:]).index_copy_(0, rows, V[0].transpose(0, 1).to(vp.dtype))

    def span_data(self, idx: int):
        return self._pieces[idx].data

    # -- inside the pass -------------------------------------------------------------------------

    def logits(self, model, x):
        """The pass's logits from the last layer's output x [1, n, h]: the last real token's
        [vocab] fp32, or None."""
        if self.host["logits_for"] == "none":
            return None
        return model.head(x[0].index_select(0, self.last_tok))[0].float()


def spans_fused(pages: torch.Tensor) -> bool:
    """Whether a planned assembly writes its spans' K/V into the pages in one launch
    (AssemblyBatch.write_span_kv): on the GPU (the fast kernels' device)."""
    return backends.use_fast_kernels(pages)


def tables_apply(state: torch.Tensor) -> bool:
    """Whether the fold of a planned assembly reads address tables (compose_states_table): the fast
    kernels' device (a matrix T is required besides)."""
    return backends.use_fast_kernels(state)


def _peek(mapping):
    """A layer mapping without waiting for its tensors to arrive (sequence.ArrivingLayers waits
    when indexed)."""
    return getattr(mapping, "_spans", mapping)


def _views(packed: torch.Tensor, sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    out, off = {}, 0
    for name in AssemblyBatch.NAMES:
        n = sizes[name]
        out[name] = packed[off : off + n]
        off += n
    return out


def plannable(model, state, layout, logits_for: str) -> bool:
    """Whether the layout can run planned (module docstring), before any planning work."""
    if not getattr(model, "planned_assemblies", False) or logits_for not in ("last", "none"):
        return False
    if not state.attn or not all(hasattr(a, "pages") for a in state.attn.values()):
        return False
    spans = False
    for p in layout:
        if isinstance(p, CachedSpan):
            if not p.use_transition:
                return False
            spans = True
        elif p.record is not None or p.token_ids.numel() > MAX_RUN:
            return False
    return spans


def plan_assembly(model, state, layout, snapshot_after=(), capture_hidden=(), logits_for: str = "last",
                  run_tokens: int = 8) -> AssemblyBatch | None:
    """The planned form of a layout run from `state` (module docstring), or None when it does not
    plan. run_tokens: the sub-runs' length (the seam window's, at least 8 is a good choice)."""
    if not plannable(model, state, layout, logits_for):
        return None
    W1 = max(0, model.conv_width - 1) if hasattr(model, "conv_width") else 0
    L = max(1, run_tokens)
    base = state.length
    ids, positions, live_off = [], [], []
    span_runs = []  # (offset among the new tokens, tokens, shift) of each span
    runs: list[tuple] = []  # conv source per sub-run
    run_rows: list[list[int]] = []  # live-token indices of each sub-run
    pairs: list[tuple] = []
    spans: list[tuple] = []
    snapshots: list[int] = []
    snap_pairs: list[int] = []
    snap_tail: list[tuple] = []  # ("run", j) | ("src", j): the kept state's conv tail
    pos = base
    prev_kind = None  # "span" | "run" | None (the entering state)
    last_span = None
    for idx, piece in enumerate(layout):
        if piece.start != pos:
            raise ValueError(f"layout piece {idx} starts at {piece.start}, expected {pos}")
        if isinstance(piece, CachedSpan):
            n = piece.data.num_tokens
            spans.append((idx, piece))
            span_runs.append((piece.start - base, n, piece.shift))
            pairs.append(("span", idx))
            prev_kind, last_span = "span", idx
            if idx in snapshot_after:
                snapshots.append(idx)
                snap_pairs.append(len(pairs) - 1)
                snap_tail.append(("src_after_span", idx))
        else:
            tokens = piece.token_ids.tolist()
            n = len(tokens)
            for a in range(0, n, L):
                part = tokens[a : a + L]
                if prev_kind == "span":
                    if len(part) < W1:
                        return None  # its conv tail would reach into the span's
                    runs.append(("span", last_span))
                elif prev_kind == "run":
                    runs.append(("prev",))
                else:
                    runs.append(("state",))
                rows = list(range(len(ids), len(ids) + len(part)))
                run_rows.append(rows)
                ids += part
                positions += range(piece.start + a, piece.start + a + len(part))
                live_off += range(piece.start + a - base, piece.start + a - base + len(part))
                pairs.append(("run", len(runs) - 1))
                prev_kind = "run"
            if idx in snapshot_after:
                snapshots.append(idx)
                snap_pairs.append(len(pairs) - 1)
                snap_tail.append(("run", len(runs) - 1))
        pos = piece.end
    if not runs or prev_kind != "run":
        return None
    # each sub-run's last W1 conv inputs as live-token indices: its own, and the runs' before it
    # where it is shorter (only runs follow runs there: a run after a span is W1 long at least)
    tails = []
    for j, rows in enumerate(run_rows):
        need = rows[-W1:] if W1 else []
        k = j
        while len(need) < W1:
            if runs[k][0] != "prev":
                return None
            k -= 1
            need = run_rows[k][-(W1 - len(need)):] + need
        tails.append(need)
    n_new = pos - base
    real = {"n": len(ids), "m": len(runs), "p": len(pairs), "s": len(snapshots)}
    n, m, p = bucket(real["n"]), bucket(real["m"]), bucket(real["p"])
    s = bucket(real["s"]) if snapshots else 0
    sizes = {"n": n, "m": m, "L": L, "p": p, "s": s, "W1": W1}
    pad_n = n - real["n"]
    flat = [j * L + i for j, rows in enumerate(run_rows) for i in range(len(rows))]
    pad = [1] * (m * L)
    for f in flat:
        pad[f] = 0
    # fold rows: 0 the entering state, k + 1 the state after pair k; a sub-run of pair k enters
    # with the state after pair k - 1, row k
    pair_of_run = {pr[1]: k for k, pr in enumerate(pairs) if pr[0] == "run"}
    enter = [pair_of_run[j] for j in range(len(runs))]
    snap_tails = []
    for kind, ref in snap_tail:
        if kind == "run":
            snap_tails.append(ref)
        else:  # a span's tail is the conv source of the sub-run after it
            after = next(j for j, src in enumerate(runs) if src == ("span", ref))
            snap_tails.append(m + after)
    index = {
        "ids": ids + [0] * pad_n,
        "positions": list(positions) + [0] * pad_n,
        "live_off": live_off + [n_new] * pad_n,
        "flat": flat + [m * L] * pad_n,
        "pad": pad,
        "tail_rows": [r for t in tails for r in t] + [0] * ((m - len(runs)) * W1),
        "prev_src": [int(src[0] == "prev") for src in runs] + [0] * (m - len(runs)),
        "pair_run": [pr[1] if pr[0] == "run" else -1 for pr in pairs] + [-1] * (p - len(pairs)),
        "enter": enter + [0] * (m - len(runs)),
        "final": [len(pairs)],
        "last_run": [len(runs) - 1],
        "last_tok": [real["n"] - 1],
        "n_pairs": [len(pairs)],
        "snap_rows": [k + 1 for k in snap_pairs] + [0] * (s - len(snapshots)),
        "snap_tails": snap_tails + [0] * (s - len(snapshots)),
    }
    packed = torch.tensor([v for name in AssemblyBatch.NAMES for v in index[name]], dtype=torch.long)
    device = model.device
    packed = backends.to_device_async(packed, device)
    # the spans' token offsets and shifts, built as tensors (a 128k-token assembly has 128k of them)
    starts, counts, shifts = (torch.tensor(c, dtype=torch.long) for c in zip(*span_runs))
    S = int(counts.sum())
    first = torch.repeat_interleave(starts - torch.cumsum(counts, 0) + counts, counts)
    offs = torch.cat([torch.arange(S) + first, torch.repeat_interleave(shifts, counts)])
    offs = backends.to_device_async(offs, device)
    span_dt = spans[0][1].data.linear[next(iter(spans[0][1].data.linear))].T.dtype if spans[0][1].data.linear else None
    held = tuple((i, s_.ssm.dtype, s_.conv.dtype) for i, s_ in state.linear.items())
    key = ("assembly", n, m, L, p, s, W1, span_dt, held, logits_for, tuple(sorted(capture_hidden)),
           backends.current_dispatch())
    host = {"start": base, "end": pos, "n_new": n_new, "capture": tuple(capture_hidden), "logits_for": logits_for}
    plan = AssemblyBatch(key, sizes, real, host, packed, spans, runs, snapshots, pairs, offs[:S], offs[S:])
    plan._pieces = {idx: piece for idx, piece in spans}
    return plan


def finish_recording(plan: AssemblyBatch, rec) -> None:
    """After a planned pass (eager or replayed, its tensors out of any graph's memory): the kept
    states each linear layer left in rec.scratch (PLANNED_SNAPSHOTS: states [s, 1, H, K, V] and
    conv tails [s, D, W1] in snap_rows' order, padded) into rec.snapshots by layout index, and
    the captured hidden states cut to the real live tokens."""
    for key in [k for k in rec.scratch if isinstance(k, tuple) and k[0] == PLANNED_SNAPSHOTS]:
        states, tails = rec.scratch.pop(key)
        for k, idx in enumerate(plan.snapshots):
            rec.snapshots.setdefault(idx, {})[key[1]] = LinearState(states[k], tails[k : k + 1])
    for i, h in rec.hidden.items():
        rec.hidden[i] = h[: plan.real["n"]]


PLANNED_SNAPSHOTS = "planned_snapshots"  # rec.scratch key (with the layer) of a planned pass's kept states
