"""Sampling a token per row of logits under temperature, top-k, top-p and min-p without sorting
the vocabulary (Triton); the distribution it draws from: naive.py.

Each row is sampled in rounds over its logits:

1. the row's maximum and softmax normalizer over the tokens top-k keeps (logits at or above the
   row's k-th largest, found by torch.topk beforehand; -inf keeps all);
2. a draw by the Gumbel-max race (argmax of log p + G, G standard Gumbel from Philox noise of the
   row's seed, the round and the token) among the kept tokens more likely than a lower bound (none
   at first);
3. the mass of the tokens more likely than the drawn one (a larger logit): it is in the nucleus
   when that mass is at most top_p and its probability at least min_p times the largest. Otherwise
   every token at most as likely is outside it too: the bound rises to its logit and step 2 draws
   again.

The nucleus is the set of tokens more likely than a threshold, so a draw conditioned on landing in
it follows p restricted to it whatever the bound: the accepted token has the reference's
distribution. A rejection happens with probability at most 1 - top_p a draw. Rows sharing a seed
draw the same noise: a seeded request's picks do not depend on the batch.

Two ways to run it. `sample_rows_kernel` runs every round of a row in one program (the whole
vocabulary in turn): the interpreter's path, where a program costs the same whatever its size. On
a GPU one program a row leaves most of the chip idle and waits on each block's load in turn, so
there the vocabulary is cut into chunks, a program a (row, chunk): `_race_kernel` writes each
chunk's softmax partials and race winner, `_mass_kernel` each chunk's mass above the row's winner,
`_decide_kernel` accepts or raises the bound; SPLIT_ROUNDS such rounds run, then
`sample_rows_kernel` carries on from their state for the rare row still undecided (a no-op for the
others).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _race(p_x, start, q, m_r, V, b_kth, inv_t, shift, lower, u, best, best_i):
    """The race over tokens start + q of each row (noise u): the best key so far and its token."""
    idx = start + q
    mask = m_r[:, None] & (idx < V)[None, :]
    x = tl.load(p_x + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    lp = tl.where(x >= b_kth[:, None], x * inv_t[:, None] - shift[:, None], float("-inf"))  # log p
    key = tl.where(x > lower[:, None], lp - tl.log(-tl.log(u)), float("-inf"))
    b_max = tl.max(key, 1)
    better = b_max > best
    return tl.where(better, b_max, best), tl.where(better, start + tl.argmax(key, 1).to(tl.int32), best_i)


@triton.jit(do_not_specialize=["B", "V", "rnd0"])
def sample_rows_kernel(
    logits,
    temperature,
    top_p,
    min_p,
    kth,
    seeds,
    out,
    lower0,
    done0,
    B,
    V,
    stride,
    rnd0,
    BR: tl.constexpr,
    BLOCK: tl.constexpr,
    BQ: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
    HAS_STATE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < B
    p_x = logits + rows[:, None] * stride  # [BR, 1]
    inv_t = 1.0 / tl.load(temperature + rows, mask=m_r, other=1.0).to(tl.float32)
    b_top_p = tl.load(top_p + rows, mask=m_r, other=2.0).to(tl.float32)
    b_min_p = tl.load(min_p + rows, mask=m_r, other=0.0).to(tl.float32)
    b_kth = tl.load(kth + rows, mask=m_r, other=float("-inf")).to(tl.float32)
    seed = tl.broadcast_to(tl.load(seeds + rows, mask=m_r, other=0)[:, None], (BR, BQ))
    o = tl.arange(0, BLOCK)
    q = tl.arange(0, BQ)
    lower = tl.full((BR,), float("-inf"), tl.float32)  # logits at or below it are out
    chosen = tl.zeros((BR,), tl.int32)
    done = tl.where(m_r, 0, 1)
    rnd = tl.program_id(0) * 0 + rnd0  # an int32 scalar tensor: the loop carries it
    if HAS_STATE:  # rounds run before (the split path): its bound and picks
        lower = tl.load(lower0 + rows, mask=m_r, other=float("-inf"))
        chosen = tl.load(out + rows, mask=m_r, other=0).to(tl.int32)
        done = tl.where(m_r, tl.load(done0 + rows, mask=m_r, other=1), 1)

    # 1. maximum and normalizer of the kept tokens (online softmax)
    m = tl.full((BR,), float("-inf"), tl.float32)
    s = tl.zeros((BR,), tl.float32)
    todo = tl.where(tl.min(done, 0) == 0, V, 0)  # rows all decided: nothing to read
    for off in range(0, todo, BLOCK):
        idx = off + o
        mask = m_r[:, None] & (idx < V)[None, :]
        x = tl.load(p_x + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(x >= b_kth[:, None], x * inv_t[:, None], float("-inf"))
        m_new = tl.maximum(m, tl.max(x, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), 1)
        m = m_new
    m = tl.where(m == float("-inf"), 0.0, m)
    log_s = tl.log(tl.maximum(s, 1e-30))

    while (tl.min(done, 0) == 0) & (rnd < rnd0 + MAX_ROUNDS):
        # 2. Gumbel-max race among the kept tokens above the bound; one Philox call gives the
        # noise of four quarters of a block
        best = tl.full((BR,), float("-inf"), tl.float32)
        best_i = tl.zeros((BR,), tl.int32)
        for off in range(0, V, BLOCK):
            u0, u1, u2, u3 = tl.rand4x(seed, tl.broadcast_to((rnd * V + off + q)[None, :], (BR, BQ)))
            best, best_i = _race(p_x, off, q, m_r, V, b_kth, inv_t, m + log_s, lower, u0, best, best_i)
            best, best_i = _race(p_x, off + BQ, q, m_r, V, b_kth, inv_t, m + log_s, lower, u1, best, best_i)
            best, best_i = _race(p_x, off + 2 * BQ, q, m_r, V, b_kth, inv_t, m + log_s, lower, u2, best, best_i)
            best, best_i = _race(p_x, off + 3 * BQ, q, m_r, V, b_kth, inv_t, m + log_s, lower, u3, best, best_i)
        x_t = tl.load(logits + rows * stride + best_i, mask=m_r, other=0.0).to(tl.float32)
        # 3. the mass of the tokens more likely than the drawn one (compared by logit: exact)
        above = tl.zeros((BR,), tl.float32)
        for off in range(0, V, BLOCK):
            idx = off + o
            mask = m_r[:, None] & (idx < V)[None, :]
            x = tl.load(p_x + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            p = tl.where(x >= b_kth[:, None], tl.exp(x * inv_t[:, None] - (m + log_s)[:, None]), 0.0)
            above += tl.sum(tl.where(x > x_t[:, None], p, 0.0), 1)
        # min-p: p_t / p_max = exp(x_t / T - max)
        ok = (done == 0) & (above <= b_top_p) & (tl.exp(x_t * inv_t - m) >= b_min_p)
        chosen = tl.where(ok, best_i, chosen)
        lower = tl.where((done == 0) & ~ok, x_t, lower)
        done = tl.where(ok, 1, done)
        rnd += 1
    # (a row not accepted within MAX_ROUNDS, which takes a probability below (1 - top_p)^MAX_ROUNDS,
    # takes its most likely token, always in the nucleus)
    if tl.min(done, 0) == 0:
        best = tl.full((BR,), float("-inf"), tl.float32)
        top = tl.zeros((BR,), tl.int32)
        for off in range(0, V, BLOCK):
            idx = off + o
            mask = m_r[:, None] & (idx < V)[None, :]
            x = tl.load(p_x + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
            b_max = tl.max(x, 1)
            better = b_max > best
            top = tl.where(better, off + tl.argmax(x, 1).to(tl.int32), top)
            best = tl.where(better, b_max, best)
        chosen = tl.where(done == 0, top, chosen)
    tl.store(out + rows, chosen.to(tl.int64), mask=m_r)


@triton.jit
def _chunk_of_rows(done, temperature, kth, B, V, CH, BR: tl.constexpr):
    """A split-path program's rows (program 0) and chunk [start, end) of their vocabulary (program 1):
    the rows, which exist, which are undecided, their 1 / temperature and top-k threshold."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < B
    live = m_r & (tl.load(done + rows, mask=m_r, other=1) == 0)
    inv_t = 1.0 / tl.load(temperature + rows, mask=m_r, other=1.0).to(tl.float32)
    b_kth = tl.load(kth + rows, mask=m_r, other=float("-inf")).to(tl.float32)
    start = tl.program_id(1) * CH
    return rows, m_r, live, inv_t, b_kth, start, tl.minimum(start + CH, V)


@triton.jit(do_not_specialize=["B", "V", "CH", "rnd"])
def _race_kernel(logits, temperature, kth, seeds, lower, done, part_m, part_s, part_key, part_idx,
                 B, V, stride, CH, rnd, SP: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr,
                 FIRST: tl.constexpr):
    """Chunk c of each undecided row: the race winner among its kept tokens above the bound (key,
    token); in the first round also its maximum and normalizer of the kept tokens."""
    rows, m_r, live, inv_t, b_kth, start, end = _chunk_of_rows(done, temperature, kth, B, V, CH, BR)
    b_low = tl.load(lower + rows, mask=m_r, other=float("-inf"))
    seed = tl.broadcast_to(tl.load(seeds + rows, mask=m_r, other=0)[:, None], (BR, BLOCK))
    p_x = logits + rows[:, None] * stride
    o = tl.arange(0, BLOCK)
    todo = tl.where(tl.max(live.to(tl.int32), 0) > 0, end, start)  # no undecided row: nothing to read
    m = tl.full((BR,), float("-inf"), tl.float32)
    s = tl.zeros((BR,), tl.float32)
    best = tl.full((BR,), float("-inf"), tl.float32)
    best_i = tl.zeros((BR,), tl.int32)
    for off in range(start, todo, BLOCK):
        idx = off + o
        mask = live[:, None] & (idx < end)[None, :]
        x = tl.load(p_x + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        kept = x >= b_kth[:, None]
        xs = tl.where(kept, x * inv_t[:, None], float("-inf"))
        if FIRST:
            m_new = tl.maximum(m, tl.max(xs, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(xs - m_safe[:, None]), 1)
            m = m_new
        u = tl.rand(seed, tl.broadcast_to((rnd * V + idx)[None, :], (BR, BLOCK)))
        key = tl.where(x > b_low[:, None], xs - tl.log(-tl.log(u)), float("-inf"))
        b_max = tl.max(key, 1)
        better = b_max > best
        best_i = tl.where(better, off + tl.argmax(key, 1).to(tl.int32), best_i)
        best = tl.where(better, b_max, best)
    at = rows * SP + tl.program_id(1)
    if FIRST:
        tl.store(part_m + at, m, mask=m_r)
        tl.store(part_s + at, s, mask=m_r)
    tl.store(part_key + at, best, mask=m_r)
    tl.store(part_idx + at, best_i, mask=m_r)


@triton.jit
def _row_stats(logits, part_m, part_s, part_key, part_idx, rows, m_r, stride, S, SP: tl.constexpr):
    """A row's maximum and log-normalizer from its S chunks' partials, its race winner and the
    winner's logit."""
    c = tl.arange(0, SP)
    at = rows[:, None] * SP + c[None, :]
    mask = m_r[:, None] & (c < S)[None, :]
    pm = tl.load(part_m + at, mask=mask, other=float("-inf"))
    ps = tl.load(part_s + at, mask=mask, other=0.0)
    m = tl.max(pm, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(ps * tl.exp(pm - m_safe[:, None]), 1)
    key = tl.load(part_key + at, mask=mask, other=float("-inf"))
    j = tl.argmax(key, 1)
    win = tl.sum(tl.where(c[None, :] == j[:, None], tl.load(part_idx + at, mask=mask, other=0), 0), 1)
    x_t = tl.load(logits + rows * stride + win, mask=m_r, other=0.0).to(tl.float32)
    return m_safe, tl.log(tl.maximum(s, 1e-30)), win, x_t


@triton.jit(do_not_specialize=["B", "V", "CH", "S"])
def _mass_kernel(logits, temperature, kth, done, part_m, part_s, part_key, part_idx, part_mass,
                 B, V, stride, CH, S, SP: tl.constexpr, BR: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk c of each undecided row: the probability mass of its kept tokens more likely than the
    row's race winner."""
    rows, m_r, live, inv_t, b_kth, start, end = _chunk_of_rows(done, temperature, kth, B, V, CH, BR)
    m, log_s, win, x_t = _row_stats(logits, part_m, part_s, part_key, part_idx, rows, live, stride, S, SP)
    p_x = logits + rows[:, None] * stride
    o = tl.arange(0, BLOCK)
    todo = tl.where(tl.max(live.to(tl.int32), 0) > 0, end, start)
    above = tl.zeros((BR,), tl.float32)
    for off in range(start, todo, BLOCK):
        idx = off + o
        mask = live[:, None] & (idx < end)[None, :]
        x = tl.load(p_x + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.where(x >= b_kth[:, None], tl.exp(x * inv_t[:, None] - (m + log_s)[:, None]), 0.0)
        above += tl.sum(tl.where(x > x_t[:, None], p, 0.0), 1)
    tl.store(part_mass + rows * SP + tl.program_id(1), above, mask=m_r)


@triton.jit(do_not_specialize=["B", "S"])
def _decide_kernel(logits, temperature, top_p, min_p, lower, done, out, part_m, part_s, part_key, part_idx,
                   part_mass, B, stride, S, SP: tl.constexpr, BR: tl.constexpr):
    """Each undecided row: its winner accepted (in the nucleus and above min-p) or the bound raised
    to the winner's logit."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    m_r = rows < B
    live = m_r & (tl.load(done + rows, mask=m_r, other=1) == 0)
    inv_t = 1.0 / tl.load(temperature + rows, mask=m_r, other=1.0).to(tl.float32)
    b_top_p = tl.load(top_p + rows, mask=m_r, other=2.0).to(tl.float32)
    b_min_p = tl.load(min_p + rows, mask=m_r, other=0.0).to(tl.float32)
    m, log_s, win, x_t = _row_stats(logits, part_m, part_s, part_key, part_idx, rows, live, stride, S, SP)
    c = tl.arange(0, SP)
    above = tl.sum(tl.load(part_mass + rows[:, None] * SP + c[None, :], mask=live[:, None] & (c < S)[None, :],
                           other=0.0), 1)
    ok = live & (above <= b_top_p) & (tl.exp(x_t * inv_t - m) >= b_min_p)
    tl.store(out + rows, win.to(tl.int64), mask=ok)
    tl.store(done + rows, tl.full((BR,), 1, tl.int32), mask=ok)
    tl.store(lower + rows, x_t, mask=live & ~ok)


SPLIT_ROUNDS = 2  # rounds of the split path before the single-program kernel carries on


def split_chunk(B: int, V: int, block: int, device: torch.device) -> int:
    """The split path's chunk of a row's vocabulary (a multiple of block): about four programs an
    SM over the batch, at least one block a program."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count  # torch keeps the properties
    chunks = max(1, min(triton.cdiv(4 * sms, B), triton.cdiv(V, block)))
    return triton.cdiv(triton.cdiv(V, chunks), block) * block


def launch_shape(B: int, V: int, device: torch.device, block: int = 2048) -> tuple[int, int]:
    """(chunk, SP) of sample_rows's default launch for B rows of V logits on a GPU: the split
    path's chunk and its partials' padded count, a compile-time constant of its kernels (SP 0: the
    single program a row). Batches of one launch shape share the compiled kernels."""
    chunk = split_chunk(B, V, block, device)
    return chunk, triton.next_power_of_2(triton.cdiv(V, chunk)) if chunk < V else 0


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    kth: torch.Tensor,
    seeds: torch.Tensor,
    block: int | None = None,
    max_rounds: int = 32,
    rows_per_program: int | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V] (rows unit-stride): temperature, top_p, min_p, kth (the
    row's k-th largest logit, -inf for no top-k) fp32 [B] and seeds int64 [B] (the row's Philox
    seed) -> int64 [B]. Top-p 1 and min-p 0 switch those off; temperature must be positive.
    chunk: the split path's chunk of the vocabulary (default: split_chunk on a GPU; the single
    program a row elsewhere, and where chunk >= V)."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    for name, t in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p), ("kth", kth), ("seeds", seeds)):
        if t.shape != (B,):
            raise ValueError(f"{name} must be [{B}], got {tuple(t.shape)}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    # the interpreter pays per program, so there many rows share one
    BR = rows_per_program or (1 if logits.is_cuda else 64)
    temperature, top_p, min_p, kth, seeds = (t.contiguous() for t in (temperature, top_p, min_p, kth, seeds))
    if chunk is None and logits.is_cuda:
        block = block or 2048
        chunk = split_chunk(B, V, block, logits.device)
    if chunk is None or chunk >= V:
        BLOCK = block or max(16, min(triton.next_power_of_2(V), 4096 if logits.is_cuda else 1024))
        sample_rows_kernel[(triton.cdiv(B, BR),)](
            logits, temperature, top_p, min_p, kth, seeds, out, out, out, B, V, logits.stride(0), 0, BR=BR,
            BLOCK=BLOCK, BQ=BLOCK // 4, MAX_ROUNDS=max_rounds, HAS_STATE=False,
            num_warps=8 if BR * BLOCK >= 2048 else 4,
        )
        return out
    # the split path: a program a (rows, chunk); partials laid out [B, SP]
    BLOCK = block or min(triton.next_power_of_2(chunk), 1024)
    if chunk % BLOCK:
        raise ValueError(f"chunk {chunk} must be a multiple of the block {BLOCK}")
    S = triton.cdiv(V, chunk)
    SP = triton.next_power_of_2(S)
    # each of the four partials 16-byte aligned for any B (Triton specializes on pointer alignment)
    part = torch.empty((4, -(-B // 4) * 4, SP), dtype=torch.float32, device=logits.device)[:, :B]
    part_m, part_s, part_key, part_mass = part.unbind(0)
    part_idx = torch.empty((B, SP), dtype=torch.int32, device=logits.device)
    lower = torch.full((B,), float("-inf"), dtype=torch.float32, device=logits.device)
    done = torch.zeros((B,), dtype=torch.int32, device=logits.device)
    grid, rows = (triton.cdiv(B, BR), S), (triton.cdiv(B, BR),)
    warps = 8 if BR * BLOCK >= 2048 else 4
    for rnd in range(SPLIT_ROUNDS):
        _race_kernel[grid](logits, temperature, kth, seeds, lower, done, part_m, part_s, part_key, part_idx,
                           B, V, logits.stride(0), chunk, rnd, SP=SP, BR=BR, BLOCK=BLOCK, FIRST=rnd == 0,
                           num_warps=warps)
        _mass_kernel[grid](logits, temperature, kth, done, part_m, part_s, part_key, part_idx, part_mass,
                           B, V, logits.stride(0), chunk, S, SP=SP, BR=BR, BLOCK=BLOCK, num_warps=warps)
        _decide_kernel[rows](logits, temperature, top_p, min_p, lower, done, out, part_m, part_s, part_key,
                             part_idx, part_mass, B, logits.stride(0), S, SP=SP, BR=BR)
    # rows still undecided (a probability below (1 - top_p)^SPLIT_ROUNDS each) carry on in one program
    BLOCK1 = max(16, min(triton.next_power_of_2(V), 4096 if logits.is_cuda else 1024))
    sample_rows_kernel[rows](
        logits, temperature, top_p, min_p, kth, seeds, out, lower, done, B, V, logits.stride(0), SPLIT_ROUNDS,
        BR=BR, BLOCK=BLOCK1, BQ=BLOCK1 // 4, MAX_ROUNDS=max_rounds, HAS_STATE=True,
        num_warps=8 if BR * BLOCK1 >= 2048 else 4,
    )
    return out
