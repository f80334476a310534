"""Sampling a token per row of logits under temperature, top-k, top-p and min-p without sorting
the vocabulary (Triton); the distribution it draws from: naive.py.

A program samples its rows (one on a GPU), in passes over their logits:

1. the row's maximum and softmax normalizer over the tokens top-k keeps (logits at or above the
   row's k-th largest, found by torch.topk beforehand; -inf keeps all);
2. a draw by the Gumbel-max race (argmax of log p + G, G standard Gumbel from Philox noise of the
   row's seed) among the kept tokens more likely than a lower bound (none at first);
3. the mass of the tokens more likely than the drawn one (a larger logit): it is in the nucleus
   when that mass is at most top_p and its probability at least min_p times the largest. Otherwise
   every token at most as likely is outside it too: the bound rises to its logit and step 2 draws
   again.

The nucleus is the set of tokens more likely than a threshold, so a draw conditioned on landing in
it follows p restricted to it whatever the bound: the accepted token has the reference's
distribution. A rejection happens with probability at most 1 - top_p a draw. Rows sharing a seed
draw the same noise: a seeded request's picks do not depend on the batch.
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


@triton.jit(do_not_specialize=["B", "V"])
def sample_rows_kernel(
    logits,
    temperature,
    top_p,
    min_p,
    kth,
    seeds,
    out,
    B,
    V,
    stride,
    BR: tl.constexpr,
    BLOCK: tl.constexpr,
    BQ: tl.constexpr,
    MAX_ROUNDS: tl.constexpr,
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

    # 1. maximum and normalizer of the kept tokens (online softmax)
    m = tl.full((BR,), float("-inf"), tl.float32)
    s = tl.zeros((BR,), tl.float32)
    for off in range(0, V, BLOCK):
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

    lower = tl.full((BR,), float("-inf"), tl.float32)  # logits at or below it are out
    chosen = tl.zeros((BR,), tl.int32)
    done = tl.where(m_r, 0, 1)
    rnd = tl.program_id(0) * 0  # an int32 scalar tensor: the loop carries it
    while (tl.min(done, 0) == 0) & (rnd < MAX_ROUNDS):
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
) -> torch.Tensor:
    """One token per row of logits [B, V] (rows unit-stride): temperature, top_p, min_p, kth (the
    row's k-th largest logit, -inf for no top-k) fp32 [B] and seeds int64 [B] (the row's Philox
    seed) -> int64 [B]. Top-p 1 and min-p 0 switch those off; temperature must be positive."""
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    for name, t in (("temperature", temperature), ("top_p", top_p), ("min_p", min_p), ("kth", kth), ("seeds", seeds)):
        if t.shape != (B,):
            raise ValueError(f"{name} must be [{B}], got {tuple(t.shape)}")
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    # on a GPU a program a row (the rows in parallel, each over its whole vocabulary); the
    # interpreter pays per program, so there many rows share one
    BR = rows_per_program or (1 if logits.is_cuda else 64)
    BLOCK = block or max(16, min(triton.next_power_of_2(V), 4096 if logits.is_cuda else 1024))
    sample_rows_kernel[(triton.cdiv(B, BR),)](
        logits, temperature.contiguous(), top_p.contiguous(), min_p.contiguous(), kth.contiguous(),
        seeds.contiguous(), out, B, V, logits.stride(0), BR=BR, BLOCK=BLOCK, BQ=BLOCK // 4, MAX_ROUNDS=max_rounds,
        num_warps=8 if BR * BLOCK >= 2048 else 4,
    )
    return out
