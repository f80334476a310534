"""Tiny presets of the non-Qwen architectures (registered in modelzoo.PRESETS), for tests and demos.

Each has at least one full-attention layer and pad/eos ids inside the tiny vocabulary.
"""

from __future__ import annotations

_TINY_BASE = dict(
    vocab_size=320,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=256,
    pad_token_id=256,
)

_OLMO_HYBRID_TINY = dict(
    _TINY_BASE,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    linear_allow_neg_eigval=True,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# Nemotron-H blocks hold one mixer each: Mamba2 ("linear_attention"), attention or an MLP
_NEMOTRON_H_TINY = dict(
    _TINY_BASE,
    num_hidden_layers=6,
    layers_block_type=["linear_attention", "mlp", "linear_attention", "full_attention", "mlp", "linear_attention"],
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=16,
    use_conv_bias=True,
    use_bias=False,
    mlp_hidden_act="relu2",
    mamba_hidden_act="silu",
    layer_norm_epsilon=1e-5,
    residual_in_fp32=False,
)

# Kimi-Linear: KDA layers + one NoPE MLA layer; block 0 has a dense MLP, the others a DeepSeek-V3 MoE
_KIMI_LINEAR_TINY = dict(
    {k: v for k, v in _TINY_BASE.items() if k not in ("head_dim", "num_key_value_heads")},
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=4,
    num_experts_per_token=2,
    moe_intermediate_size=32,
    num_shared_experts=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.446,
    norm_topk_prob=True,
    hidden_act="silu",
    rms_norm_eps=1e-5,
)

# Bamba: every block is a Mamba2 or attention mixer (RoPE on half of each head) plus a SwiGLU MLP
_BAMBA_TINY = dict(
    _TINY_BASE,
    attn_layer_indices=[2],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_expand=2,
    mamba_n_groups=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# MiniMax: lightning attention (scalar decay per head) and RoPE softmax attention, a softmax MoE per block
_MINIMAX_TINY = dict(
    _TINY_BASE,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=48,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    block_size=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    linear_attn_alpha_factor=1.5,
    linear_attn_beta_factor=0.75,
    full_attn_alpha_factor=1.25,
    full_attn_beta_factor=1.0,
    mlp_alpha_factor=0.8,
    mlp_beta_factor=1.2,
)

# the MiniMax-Text-01 / MiniMax-M1 shape (their config.json in transformers' names; random weights, for
# entry-size figures); the released config.json sets no eos_token_id and rotates 64 of 128 channels
# (rotary_dim), which transformers' minimax ignores: RoPE on the whole head here (entry size unchanged)
_MINIMAX_TEXT_01 = dict(
    vocab_size=200064,
    hidden_size=6144,
    num_hidden_layers=80,
    layer_types=["full_attention" if i % 8 == 7 else "linear_attention" for i in range(80)],
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=9216,
    num_local_experts=32,
    num_experts_per_tok=2,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    block_size=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0},
    **{f"{p}_{ab}_factor": 3.5565588200778455 if ab == "alpha" else 1.0
       for p in ("full_attn", "linear_attn", "mlp") for ab in ("alpha", "beta")},
    max_position_embeddings=10240000,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

# the released Kimi-Linear-48B-A3B shape (checkpoint-style config.json; random weights for GPU benchmarks)
_KIMI_LINEAR_48B_A3B = dict(
    vocab_size=163840,
    hidden_size=2304,
    num_hidden_layers=27,
    intermediate_size=9216,
    num_attention_heads=32,
    num_key_value_heads=32,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    linear_attn_config={
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    num_experts=256,
    num_experts_per_token=8,
    moe_intermediate_size=1024,
    num_shared_experts=1,
    first_k_dense_replace=1,
    num_expert_group=1,
    topk_group=1,
    moe_renormalize=True,
    routed_scaling_factor=2.446,
    hidden_act="silu",
    rms_norm_eps=1e-5,
    model_max_length=1048576,
    tie_word_embeddings=False,
    bos_token_id=163584,
    eos_token_id=163586,
    pad_token_id=163839,
)

FAMILY_PRESETS: dict[tuple[str, str], dict] = {
    ("olmo_hybrid", "tiny"): _OLMO_HYBRID_TINY,
    ("nemotron_h", "tiny"): _NEMOTRON_H_TINY,
    ("kimi_linear", "tiny"): _KIMI_LINEAR_TINY,
    ("kimi_linear", "kimi-linear-48b-a3b"): _KIMI_LINEAR_48B_A3B,
    ("bamba", "tiny"): _BAMBA_TINY,
    ("minimax", "tiny"): _MINIMAX_TINY,
    ("minimax", "minimax-text-01"): _MINIMAX_TEXT_01,
}
