"""Bamba specifics beyond tests/runtime/test_families_models.py: partial RoPE parsed as transformers does,
cached K re-rotated by the shift, and config errors."""

import pytest
import torch
from hybridcache.services.runtime.config import ModelConfigError
from hybridcache.services.runtime.models.bamba import RopeAttention
from hybridcache.services.runtime.models.registry import config_from_dict
from hybridcache.services.runtime.modelzoo import hf_config


def test_rotary_dim_follows_partial_rotary_factor():
    raw = hf_config("bamba", "tiny")
    assert config_from_dict(raw).rotary_dim == raw["head_dim"] // 2  # transformers' default factor 0.5
    full = dict(
        raw, rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}
    )
    cfg = config_from_dict(full)
    assert (cfg.rotary_dim, cfg.rope_theta) == (raw["head_dim"], 500.0)
    assert config_from_dict(dict(raw, attn_layer_indices=[0, 3])).attention_layers == [0, 3]


def test_rerotation_equals_rotation_at_absolute_positions():
    cfg = config_from_dict(dict(hf_config("bamba", "tiny"), rope_parameters={"rope_theta": 100.0}))
    attn = RopeAttention(cfg)
    k = torch.randn(1, cfg.num_key_value_heads, 7, cfg.head_dim, generator=torch.Generator().manual_seed(0))
    local = attn.rotate(k, torch.arange(7))
    shifted = attn.rotate(local, torch.full((7,), 40))
    assert (shifted - attn.rotate(k, torch.arange(40, 47))).abs().max().item() <= 1e-5
    assert (shifted - local).abs().max().item() > 1e-2
    # channels past the rotary dim pass through untouched
    assert torch.equal(shifted[..., cfg.rotary_dim :], k[..., cfg.rotary_dim :])


@pytest.mark.parametrize(
    "override, message",
    [
        ({"mamba_d_head": 12}, "mamba_expand"),
        ({"time_step_limit": [0.0, 0.1]}, "time_step_limit"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "rope_type"),
    ],
)
def test_bad_configs(override, message):
    with pytest.raises(ModelConfigError, match=message):
        config_from_dict(dict(hf_config("bamba", "tiny"), **override))
