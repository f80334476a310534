"""rope_cos_sin keeps its last result for the very positions tensor it was given (every attention
layer of a forward rotates at the same positions), and never for another or a modified one."""

import torch
from hybridcache.services.runtime import backends
from hybridcache.services.runtime.models.qwen3_hybrid import rope_cos_sin


def reference(positions, rotary_dim, theta):
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    f = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


def test_same_tensor_hits_other_or_modified_tensors_recompute():
    pos = torch.arange(5, 12)
    cos, sin = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    want = reference(pos, 16, 10000.0)
    assert torch.allclose(cos, want[0]) and torch.allclose(sin, want[1])
    again = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    assert again[0] is cos and again[1] is sin  # the kept result, no recomputation
    # an equal but different tensor, another width, another dtype: computed afresh and right
    other = torch.arange(5, 12)
    assert rope_cos_sin(other, 16, 10000.0, torch.float32)[0] is not cos
    assert torch.allclose(rope_cos_sin(other, 16, 10000.0, torch.float32)[0], want[0])
    assert rope_cos_sin(pos, 8, 10000.0, torch.float32)[0].shape == (7, 8)
    assert rope_cos_sin(pos, 16, 10000.0, torch.bfloat16)[0].dtype == torch.bfloat16
    # the same tensor modified in place: its version moved, so the result is recomputed
    pos2 = torch.arange(3)
    c1, _ = rope_cos_sin(pos2, 16, 10000.0, torch.float32)
    pos2 += 100
    c2, _ = rope_cos_sin(pos2, 16, 10000.0, torch.float32)
    assert c2 is not c1 and torch.allclose(c2, reference(pos2, 16, 10000.0)[0])


def test_inference_mode_tensors_are_never_kept():
    with torch.inference_mode():
        pos = torch.arange(4)
        a = rope_cos_sin(pos, 16, 10000.0, torch.float32)
        b = rope_cos_sin(pos, 16, 10000.0, torch.float32)
    assert a[0] is not b[0] and torch.equal(a[0], b[0])
    assert backends.tensor_version(pos) is None
