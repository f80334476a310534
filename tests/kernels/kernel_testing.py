"""Shared helpers for kernel tests (a plain module: tests/ has no __init__.py and no conftest here,
since a second conftest.py would shadow tests/conftest.py for `from conftest import ...`).

Triton kernels run under the interpreter where there is no GPU (CI). TRITON_INTERPRET must be
set before a kernel is decorated, so test modules import the kernels from here.
"""

import os
import sys

import torch

if torch.cuda.is_available():
    # tests/conftest.py hides fla so that transformers uses its CPU paths; on a GPU the kernels
    # under test are fla's.
    if "fla" in sys.modules and sys.modules["fla"] is None:
        del sys.modules["fla"]
else:
    os.environ["TRITON_INTERPRET"] = "1"

from hybridcache.kernels.ops.activation.triton import sigmoid_gate_heads, silu_mul  # noqa: E402
from hybridcache.kernels.ops.attention.paged_triton import paged_decode  # noqa: E402
from hybridcache.kernels.ops.attention.triton import live_attention, paged_live_attention  # noqa: E402
from hybridcache.kernels.ops.causal_conv.triton import causal_conv1d_fwd, causal_conv1d_update  # noqa: E402
from hybridcache.kernels.ops.checksum.triton import checksum_sums, copy_checksum  # noqa: E402
from hybridcache.kernels.ops.gated_delta_rule.gates import gdn_gates  # noqa: E402
from hybridcache.kernels.ops.gemv.triton import CONFIGS as GEMV_CONFIGS  # noqa: E402
from hybridcache.kernels.ops.gemv.triton import gemv  # noqa: E402
from hybridcache.kernels.ops.moe.triton import (  # noqa: E402
    FusedConfig,
    PairConfig,
    fused_experts,
    pair_experts,
    router_top_k,
    softmax_top_k,
)
from hybridcache.kernels.ops.norm.triton import L2, RMS, add_rms_norm, l2norm_heads, row_norm  # noqa: E402
from hybridcache.kernels.ops.recurrent_step.triton import recurrent_step  # noqa: E402
from hybridcache.kernels.ops.rope.triton import (  # noqa: E402
    norm_rope_into_pages,
    norm_rope_tokens,
    rope_heads,
    spans_into_pages,
)
from hybridcache.kernels.ops.sampling.triton import sample_rows  # noqa: E402
from hybridcache.kernels.ops.transition.compose_triton import (  # noqa: E402
    compose_states_blocks,
    compose_states_fwd,
    compose_states_table,
)
from hybridcache.kernels.ops.transition.outputs_triton import run_outputs, run_outputs_reference  # noqa: E402

__all__ = [
    "L2",
    "RMS",
    "add_rms_norm",
    "causal_conv1d_fwd",
    "causal_conv1d_update",
    "checksum_sums",
    "copy_checksum",
    "compose_states_blocks",
    "compose_states_fwd",
    "compose_states_table",
    "device",
    "GEMV_CONFIGS",
    "gemv",
    "FusedConfig",
    "fused_experts",
    "PairConfig",
    "pair_experts",
    "router_top_k",
    "softmax_top_k",
    "gdn_gates",
    "l2norm_heads",
    "live_attention",
    "norm_rope_into_pages",
    "norm_rope_tokens",
    "paged_decode",
    "paged_live_attention",
    "recurrent_step",
    "rel_rms",
    "rope_heads",
    "run_outputs",
    "run_outputs_reference",
    "spans_into_pages",
    "sample_rows",
    "scattered_blocks",
    "sigmoid_gate_heads",
    "row_norm",
    "silu_mul",
]


def rel_rms(a, b):
    """Relative RMS error of a against the reference b."""
    a, b = a.float(), b.float()
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-12)).item()


def device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def scattered_blocks(T, S):
    """Segments T [N, G, K, K], S [N, G, K, V] as the engine's live scan holds them: odd ones as
    separate [1, G, K, K] entries, even ones as rows (base, i) of one stack of the runs' pairs,
    all in storage of their own. Returns (Ts, Ss, bases); keep the bases alive while in use."""
    runs_T, runs_S = T[0::2].clone(), S[0::2].clone()
    Ts, Ss = [], []
    for i in range(T.shape[0]):
        if i % 2:
            Ts.append(T[i : i + 1].clone())
            Ss.append(S[i : i + 1].clone())
        else:
            Ts.append((runs_T, i // 2))
            Ss.append((runs_S, i // 2))
    return Ts, Ss, (runs_T, runs_S)
