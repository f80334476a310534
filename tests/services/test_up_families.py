"""Every model type the engine loads is served by `hybridcache up` (router, cache tier, the combine
worker, and for one model type of each family a scatter worker), from a checkpoint transformers'
`save_pretrained` wrote, of structures other than the tiny presets': greedy output through the
HTTP API equals transformers' own greedy continuation, and documents sent again in another order
after another prefix are folded in from their cached entries."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_models import FAMILIES, VARIED, greedy_reference, hf_model, reference_model, save_checkpoint
from hybridcache.services.launcher import free_port
from serving_helpers import http, stop_up

NEW_TOKENS = 32


# a scatter worker beside the combine worker for one model type of each linear family (Gated
# DeltaNet, KDA, Mamba2, Lightning) and a multimodal wrapper; the others run without, so that the
# whole parametrization stays short on a 2-core CI machine
WITH_SCATTER = {"qwen3_next", "kimi_linear", "nemotron_h", "minimax", "qwen3_5_moe"}


def _start(arch, model_dir, log_dir):
    return subprocess.Popen(
        [sys.executable, "-m", "hybridcache.services.cli", "up", "--model", str(model_dir), "--port",
         str(free_port()), "--scatter-workers", "1" if arch in WITH_SCATTER else "0", "--log-dir", str(log_dir),
         "--ready-timeout-s", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ready(proc, scatter: bool):
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=30)
        pytest.fail(f"`up` exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
    ready = json.loads(line)
    roles = ["cache-tier", "combine", "router"] + (["scatter"] if scatter else [])
    assert ready["ready"] and sorted(s["role"] for s in ready["services"]) == roles
    return ready["http"]


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("arch", FAMILIES)
def test_up_serves_every_model_type(arch, tmp_path):
    # tied and untied embeddings alternate over the families
    # the structures of VARIED (odd head counts, MLP-only layers among MoE ones, several SSM groups)
    model = hf_model(arch, tied=FAMILIES.index(arch) % 2 == 1, seed=21, overrides=VARIED.get(arch))
    path = save_checkpoint(model, tmp_path / arch)
    prompt = _ids(12, seed=4)
    proc = _start(arch, path, tmp_path / "logs")
    try:
        # transformers' answer while the services start
        expect = greedy_reference(reference_model(arch, path), prompt, NEW_TOKENS)
        url = _ready(proc, arch in WITH_SCATTER)
        greedy = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
        status, res = http("POST", f"{url}/generate", {"input_ids": prompt, "sampling_params": greedy})
        assert status == 200, res
        assert res["output_ids"] == expect

        docs = [_ids(40, seed=s) for s in (5, 6, 7)]
        question = _ids(6, seed=8)
        short = {"max_new_tokens": 2, "temperature": 0.0}
        status, cold = http("POST", f"{url}/generate", {"system": _ids(5, seed=9), "segments": docs,
                                                        "input_ids": question, "sampling_params": short})
        assert status == 200, cold
        status, warm = http("POST", f"{url}/generate", {"system": _ids(7, seed=10), "segments": docs[::-1],
                                                        "input_ids": question, "sampling_params": short})
        assert status == 200, warm
        stats = warm["hybridcache"]
        assert [s["hit"] for s in stats["segments"]] == [True, True, True], stats["segments"]
        assert stats["cached_tokens"] >= sum(len(d) for d in docs) - 3 * stats["seam_window"]
    finally:
        stop_up(proc, timeout=60)
