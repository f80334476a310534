"""chunk_bwd_dqkwg_gated (the gated step of fla's chunked gated-delta-rule backward, in PyTorch)
against autograd of the forward terms it differentiates, chunk by chunk, on odd shapes."""

import math

import pytest
import torch
import torch.nn.functional as F
from hybridcache.kernels.ops.gated_delta_rule.bwd_dqkwg import chunk_bwd_dqkwg_gated


def inputs(B, T, H, HV, K, V, BT, state_v_first, seed=0):
    g = torch.Generator().manual_seed(seed)
    NT = -(-T // BT)
    q = torch.randn(B, T, H, K, generator=g)
    k = F.normalize(torch.randn(B, T, H, K, generator=g), dim=-1)
    v = torch.randn(B, T, HV, V, generator=g)
    do = torch.randn(B, T, HV, V, generator=g)
    dv = torch.randn(B, T, HV, V, generator=g)
    w = torch.randn(B, T, HV, K, generator=g) * 0.3
    step = F.logsigmoid(torch.randn(B, T, HV, generator=g) + 2) / math.log(2)  # log2 gates
    gc = torch.cat([step[:, i : i + BT].cumsum(1) for i in range(0, T, BT)], dim=1)  # chunk-local
    shape = (B * NT, HV, V, K) if state_v_first else (B * NT, HV, K, V)
    h = torch.randn(*shape, generator=g)
    dh = torch.randn(*shape, generator=g)
    return q, k, v, do, h, dh, w, gc, dv


def reference(q, k, v, do, h, dh, w, g, dv, scale, BT, state_v_first):
    B, T, H, K = k.shape
    HV = v.shape[2]
    rep = HV // H
    NT = -(-T // BT)
    qf, kf, wf = (x.clone().requires_grad_() for x in (q, k, w))
    gn = (g * math.log(2)).requires_grad_()  # natural-log cumulative gates
    qe, ke = qf.repeat_interleave(rep, 2), kf.repeat_interleave(rep, 2)
    loss = 0.0
    for b in range(B):
        for t in range(NT):
            s = slice(t * BT, min((t + 1) * BT, T))
            for hv in range(HV):
                Q, Kc, Vc, G = qe[b, s, hv], ke[b, s, hv], v[b, s, hv], gn[b, s, hv]
                Ht, dHt = h[b * NT + t, hv], dh[b * NT + t, hv]
                if state_v_first:
                    Ht, dHt = Ht.T, dHt.T
                n = Q.shape[0]
                tril = torch.ones(n, n, dtype=torch.bool).tril()
                A = (Q @ Kc.T) * torch.where(tril, G[:, None] - G[None, :], float("-inf")).exp()
                o = scale * (Q * G.exp()[:, None]) @ Ht + scale * A @ Vc
                hn = G[-1].exp() * Ht + (Kc * (G[-1] - G).exp()[:, None]).T @ Vc
                vn = -wf[b, s, hv] @ Ht
                loss = loss + (o * do[b, s, hv]).sum() + (hn * dHt).sum() + (vn * dv[b, s, hv]).sum()
    loss.backward()
    return qf.grad, kf.grad, wf.grad, gn.grad


CASES = [
    (2, 77, 2, 4, 32, 48, 64, False),  # partial last chunk, value heads > key heads
    (1, 64, 1, 1, 16, 16, 64, True),  # one full chunk, state stored V-first
    (1, 50, 3, 3, 16, 24, 16, False),  # chunk 16, partial last chunk
]


@pytest.mark.parametrize("B,T,H,HV,K,V,BT,vfirst", CASES, ids=[f"T{c[1]}-H{c[2]}-HV{c[3]}-BT{c[6]}" for c in CASES])
def test_gated_dqkwg_matches_autograd(B, T, H, HV, K, V, BT, vfirst):
    args = inputs(B, T, H, HV, K, V, BT, vfirst)
    scale = K**-0.5
    dq, dk, dw, dg = chunk_bwd_dqkwg_gated(*args, scale, state_v_first=vfirst, chunk_size=BT)
    rq, rk, rw, rg = reference(*args, scale, BT, vfirst)
    assert dq.shape == (B, T, H, K) and dk.shape == (B, T, H, K) and dw.shape == (B, T, HV, K)
    assert dg.shape == (B, T, HV) and dg.dtype == torch.float32
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dw", dw, rw), ("dg", dg, rg)):
        err = ((got - ref).norm() / ref.norm()).item()
        assert err < 1e-5, f"{name}: relative error {err:.2e}"


def test_gated_dqkwg_takes_fla_state_layout():
    """fla-core 0.6.0 passes h and dh as [B, NT, HV, K, V]; the flat [B * NT, ...] form gives the
    same result, and a state of the wrong size is refused."""
    B, T, H, HV, K, V, BT = 2, 45, 2, 4, 8, 12, 16
    args = list(inputs(B, T, H, HV, K, V, BT, False))
    flat = chunk_bwd_dqkwg_gated(*args, 0.3, chunk_size=BT)
    NT = -(-T // BT)
    args[4] = args[4].view(B, NT, HV, K, V)
    args[5] = args[5].view(B, NT, HV, K, V)
    nested = chunk_bwd_dqkwg_gated(*args, 0.3, chunk_size=BT)
    for a, b in zip(flat, nested):
        assert torch.equal(a, b)
    args[4] = args[4][:, :-1]
    with pytest.raises(ValueError, match="expected"):
        chunk_bwd_dqkwg_gated(*args, 0.3, chunk_size=BT)


def test_gated_dqkwg_keeps_input_dtypes():
    args = list(inputs(1, 40, 2, 2, 16, 16, 16, False))
    for i in (0, 1, 2, 3, 6, 8):  # q, k, v, do, w, dv in bf16 as in training
        args[i] = args[i].bfloat16()
    dq, dk, dw, dg = chunk_bwd_dqkwg_gated(*args, 0.25, chunk_size=16)
    assert dq.dtype == dk.dtype == dw.dtype == torch.bfloat16 and dg.dtype == torch.float32
    assert torch.isfinite(dg).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [77, 200])
def test_fla_gated_backward_with_torch_dqkwg_matches_reference_gpu(T):
    """fla's chunked gated delta rule, forward and backward, with the PyTorch dqkwg step installed
    (as train_qa_model.py --fla does on Hopper with Triton < 3.7.1): gradients of every input and
    of the initial state equal autograd through the step-by-step reference (fp32)."""
    pytest.importorskip("fla")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    from hybridcache.kernels.ops.gated_delta_rule import naive_recurrent_gated_delta_rule
    from hybridcache.kernels.ops.gated_delta_rule.bwd_dqkwg import install_for_fla

    install_for_fla()
    torch.manual_seed(0)
    B, H, K, V = 2, 3, 64, 32
    dev = "cuda"
    leaves = [
        F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1),
        F.normalize(torch.randn(B, T, H, K, device=dev), dim=-1),
        torch.randn(B, T, H, V, device=dev),
        F.logsigmoid(torch.randn(B, T, H, device=dev) + 2),
        torch.rand(B, T, H, device=dev),
        torch.randn(B, H, K, V, device=dev),
    ]
    do = torch.randn(B, T, H, V, device=dev)
    dht = torch.randn(B, H, K, V, device=dev)

    def grads(fn):
        xs = [x.clone().requires_grad_() for x in leaves]
        o, ht = fn(*xs)
        ((o * do).sum() + (ht * dht).sum()).backward()
        return [x.grad for x in xs]

    got = grads(lambda q, k, v, g, b, h0: fla_chunk(q, k, v, g, b, initial_state=h0, output_final_state=True))

    def ref(q, k, v, g, b, h0):
        out = naive_recurrent_gated_delta_rule(q, k, v, g, b, initial_state=h0, output_final_state=True)
        return out[0], out[1]

    want = grads(ref)
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        err = ((a - r).norm() / r.norm()).item()
        assert err < 2e-3, f"{name}: relative error {err:.2e}"  # fla's solve runs in TF32 on Hopper
