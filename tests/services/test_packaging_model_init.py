"""`hybridcache model init` writes weights as the hub holds them, shard by shard, never holding the
model whole: the shards and their index equal the one-file write tensor for tensor, load as a
model, and a mid-size model is written within about one shard and one layer of host memory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hybridcache.services.cli import main
from hybridcache.services.runtime.modelzoo import init_model_dir, parse_size
from safetensors import safe_open
from safetensors.torch import load_file


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "minimax"])
def test_shards_and_index_hold_the_one_file_weights(arch, tmp_path, capsys):
    one = init_model_dir(arch, "tiny", tmp_path / "one", seed=3, dtype=torch.bfloat16)
    assert main(["model", "init", "--arch", arch, "--preset", "tiny", "--out", str(tmp_path / "sharded"),
                 "--seed", "3", "--dtype", "bfloat16", "--max-shard-size", "64KB"]) == 0
    assert "writing sharded: 100%" in capsys.readouterr().err  # the progress bar
    sharded = tmp_path / "sharded"
    files = sorted(f.name for f in sharded.glob("*.safetensors"))
    n = len(files)
    assert n > 3 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    a, b = _tensors(one), _tensors(sharded)
    assert a.keys() == b.keys() == index["weight_map"].keys()
    assert all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in b.values())
    for f in files:
        with safe_open(str(sharded / f), "pt") as h:
            names = list(h.keys())
            size = sum(math.prod(h.get_slice(k).get_shape()) for k in names) * 2  # bf16
        assert all(index["weight_map"][k] == f for k in names)
        assert size <= 64_000 or len(names) == 1  # a shard overflows only by a tensor alone in it
    # the loader reads the shards through the index as it reads the one file
    from hybridcache.services.runtime.loader import load_model

    m1, m2 = load_model(one, dtype=torch.bfloat16), load_model(sharded, dtype=torch.bfloat16)
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_parse_size_and_bad_sizes_exit_2(tmp_path, capsys):
    assert parse_size("5GB") == 5 * 10**9 and parse_size("64KiB") == 65536 and parse_size("1000") == 1000
    assert main(["model", "init", "--arch", "qwen3_5", "--preset", "tiny", "--out", str(tmp_path / "m"),
                 "--max-shard-size", "lots"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("hybridcache: error: expected a size such as 5GB")


# hidden 512, 16 layers, vocab 8192: ~62 M parameters, 250 MB in fp32
MID = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 16, "vocab_size": 8192, "head_dim": 64,
       "num_attention_heads": 8, "num_key_value_heads": 2, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
       "linear_key_head_dim": 64, "linear_value_head_dim": 64,
       "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 4}
SHARD = 8 * 10**6

_PROBE = """
import json, sys, threading, time
import torch
from hybridcache.services.runtime.modelzoo import init_model_dir

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

# the first call imports and sets up what every later one uses: not the write's memory
init_model_dir("qwen3_5_text", "tiny", sys.argv[1] + "-tiny", max_shard_bytes=int(sys.argv[3]))
base, peak, done = rss(), [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.002)
t = threading.Thread(target=sample, daemon=True)
t.start()
init_model_dir("qwen3_5_text", "tiny", sys.argv[1], overrides=json.loads(sys.argv[2]), max_shard_bytes=int(sys.argv[3]))
done.set(); t.join()
print(json.dumps({"growth": max(peak[0], rss()) - base}))
"""


def test_a_mid_size_model_is_written_within_a_shard_and_a_layer(tmp_path):
    run = subprocess.run([sys.executable, "-P", "-c", _PROBE, str(tmp_path / "mid"), json.dumps(MID), str(SHARD)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    growth = json.loads(run.stdout.splitlines()[-1])["growth"]
    weights = _tensors(tmp_path / "mid")
    model_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    layer_bytes = max(sum(t.numel() * t.element_size() for k, t in weights.items() if f".layers.{i}." in k)
                      for i in range(MID["num_hidden_layers"]))
    biggest = max(t.numel() * t.element_size() for t in weights.values())
    assert model_bytes > 240 * 10**6 and len(list((tmp_path / "mid").glob("model-*.safetensors"))) >= 30
    # the shard being filled and its serialized bytes as it is written, a layer's values, the
    # largest parameter as it is drawn, and the allocator's slack: far from the whole model
    bound = 2 * SHARD + layer_bytes + biggest + 32 * 2**20
    assert growth < bound < model_bytes / 2.5, (growth, bound, model_bytes)


@pytest.mark.gpu
def test_drawn_on_the_gpu_one_parameter_at_a_time(tmp_path):
    """--device cuda draws each parameter on the GPU and frees it once written: the GPU holds about
    one parameter at a time (a 9B model's write held ~25 GiB cached when it was built there whole)."""
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = init_model_dir("qwen3_5_text", "tiny", tmp_path / "mid", overrides=MID, dtype=torch.bfloat16,
                         device="cuda", max_shard_bytes=SHARD)
    weights = _tensors(out)
    biggest = max(t.numel() for t in weights.values()) * 4  # drawn in fp32
    assert torch.cuda.max_memory_allocated() - before <= 2 * biggest
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    from hybridcache.services.runtime.loader import load_model

    assert load_model(out, dtype=torch.bfloat16).cfg.num_hidden_layers == MID["num_hidden_layers"]
