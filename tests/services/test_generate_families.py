"""`hybridcache generate`, the command itself, on a checkpoint of every model type that transformers'
`save_pretrained` wrote, of structures other than the tiny presets' (tests/hf_models.py VARIED: odd
head counts, MLP-only layers among MoE ones, several SSM groups; tied and untied embeddings the
other way round from test_up_families): two prompts of one request file, run together through the
scheduler, each continue greedily for 32 tokens exactly as transformers' greedy `generate` does.
Those odd head counts cannot be split over two ranks: the command refuses them at start in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from hf_models import FAMILIES, VARIED, greedy_generate, hf_model, reference_model, save_checkpoint
from hybridcache.services import cli

NEW_TOKENS = 32
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(model_dir, request_file) -> subprocess.Popen:
    # one thread: the command and transformers' reference run side by side (two cores in CI)
    return subprocess.Popen(
        [sys.executable, "-m", "hybridcache.services.cli", "generate", "--model", str(model_dir), "--request",
         str(request_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, OMP_NUM_THREADS="1"))


@pytest.mark.parametrize("arch", FAMILIES)
def test_generate_equals_transformers_greedy(arch, tmp_path):
    model = hf_model(arch, tied=FAMILIES.index(arch) % 2 == 0, seed=23, overrides=VARIED[arch])
    path = save_checkpoint(model, tmp_path / arch)
    prompts = [_ids(13, seed=1), _ids(6, seed=2)]
    req = tmp_path / "requests.json"
    req.write_text(json.dumps([{"suffix": p, "sampling_params": GREEDY} for p in prompts]))
    proc = _generate(path, req)
    try:
        # transformers' answers while the command starts
        ref = reference_model(arch, path)
        expect = [greedy_generate(ref, p, NEW_TOKENS) for p in prompts]
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    results = [json.loads(line) for line in out.splitlines()]
    assert [r["prompt_ids"] for r in results] == prompts
    assert [r["output_ids"] for r in results] == expect
    assert [r["finish_reason"] for r in results] == ["length", "length"]


def test_a_split_the_heads_do_not_allow_is_refused_in_one_line(tmp_path, capsys):
    """VARIED's kimi_linear has 3 KDA heads (and 3 attention heads): `--tensor-parallel-size 2` exits 2
    with one line naming the count, before any rank starts (the command's main, in this process)."""
    path = save_checkpoint(hf_model("kimi_linear", tied=False, seed=23, overrides=VARIED["kimi_linear"]),
                           tmp_path / "kimi")
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"suffix": _ids(5, seed=3), "sampling_params": GREEDY}))
    capsys.readouterr()  # save_pretrained's progress
    code = cli.main(["generate", "--model", str(path), "--request", str(req), "--tensor-parallel-size", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "tensor-parallel size 2 must divide the 3" in err
