"""Transition operators and their composition, for every linear-attention family (docs/concepts.md, "The math").

A segment C is summarised by the pair (T_C, S(C|0)) with S_end = T_C S_start + S(C|0). T comes
in three kinds, told apart by shape against the state S [B, H, K, V]:

    scalar  [B, H]        (linear / RetNet / Lightning, Mamba2)
    vector  [B, H, K]     (GLA: diagonal)
    matrix  [B, H, K, K]  (DeltaNet, Gated DeltaNet, KDA)

Pairs form a monoid: (T_b, S_b) o (T_a, S_a) = (T_b T_a, T_b S_a + S_b).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def transition_kind(T: torch.Tensor, S: torch.Tensor) -> str:
    """'scalar', 'vector' or 'matrix' for a T that acts on states shaped like S [..., K, V]."""
    lead = S.shape[:-2]
    if T.shape == lead:
        return "scalar"
    if T.shape == (*lead, S.shape[-2]):
        return "vector"
    if T.shape == (*lead, S.shape[-2], S.shape[-2]):
        return "matrix"
    raise ValueError(f"transition of shape {tuple(T.shape)} does not act on a state of shape {tuple(S.shape)}")


def apply_transition(T: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """T S for a state S [..., K, V] (fp32 result)."""
    kind = transition_kind(T, S)
    T, S = T.float(), S.float()
    if kind == "scalar":
        return T[..., None, None] * S
    if kind == "vector":
        return T[..., None] * S
    return T @ S


def apply_segment(T: torch.Tensor, S_body: torch.Tensor, S_start: torch.Tensor, use_transition: bool = True):
    """State after a cached segment: T S_start + S_body. use_transition=False is the naive ablation."""
    if not use_transition:
        return S_start.float() + S_body.float()
    return apply_transition(T, S_start) + S_body.float()


def compose_transitions(T_b: torch.Tensor, T_a: torch.Tensor, S_like: torch.Tensor) -> torch.Tensor:
    """T_b T_a (a then b) for two transitions of the same kind."""
    kind = transition_kind(T_b, S_like)
    if kind in ("scalar", "vector"):
        return T_b.float() * T_a.float()
    return T_b.float() @ T_a.float()


def compose(pair_b, pair_a):
    """(T_b, S_b) o (T_a, S_a) = (T_b T_a, T_b S_a + S_b): segment a followed by segment b."""
    T_b, S_b = pair_b
    T_a, S_a = pair_a
    return compose_transitions(T_b, T_a, S_a), apply_transition(T_b, S_a) + S_b.float()


def compose_many(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """Fold pairs given in sequence order (first segment first) into one pair."""
    if not pairs:
        raise ValueError("compose_many needs at least one pair")
    acc = (pairs[0][0].float(), pairs[0][1].float())
    for pair in pairs[1:]:
        acc = compose(pair, acc)
    return acc
