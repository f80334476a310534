"""`hybridcache generate` on a checkpoint of every model type that transformers' `save_pretrained`
wrote, of structures other than the tiny presets' (tests/hf_models.py VARIED: odd head counts,
MLP-only layers among MoE ones, several SSM groups; tied and untied embeddings the other way round
from test_up_families): two prompts of one request file, run together through the scheduler, each
continue greedily for 32 tokens exactly as transformers' greedy `generate` does. The commands run
in one Python process started for them all, each through the function the `hybridcache` script
runs (cli.main: argument parsing, the request file, the JSON lines it prints, its exit status), one
process start-up instead of ten. Those odd head counts cannot be split over two ranks: the command
refuses them at start in one line.
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
PROMPTS = [
    torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist() for n, seed in ((13, 1), (6, 2))
]
# `hybridcache ARGS...` for each ARGS of the list in argv[1], as the console script runs it; before
# each its model directory, after it its exit status
COMMANDS = """
import json, sys
from hybridcache.services.cli import main
for argv in json.loads(sys.argv[1]):
    print(json.dumps({"command_model": argv[2]}), flush=True)
    print(json.dumps({"command_exit": main(argv)}), flush=True)
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{arch: (the command's exit status, its JSON lines, transformers' greedy outputs)} and the
    commands' stderr."""
    root = tmp_path_factory.mktemp("generate_families")
    req = root / "requests.json"
    req.write_text(json.dumps([{"suffix": p, "sampling_params": GREEDY} for p in PROMPTS]))
    paths = {a: save_checkpoint(hf_model(a, tied=i % 2 == 0, seed=23, overrides=VARIED[a]), root / a)
             for i, a in enumerate(FAMILIES)}
    argvs = [["generate", "--model", str(p), "--request", str(req)] for p in paths.values()]
    # one thread: the commands and transformers' references run side by side (two cores in CI)
    proc = subprocess.Popen([sys.executable, "-c", COMMANDS, json.dumps(argvs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        # transformers' answers while the commands run
        expect = {a: [greedy_generate(reference_model(a, p), x, NEW_TOKENS) for x in PROMPTS] for a, p in paths.items()}
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    by_dir = {str(p): a for a, p in paths.items()}
    lines, arch = {}, None
    for line in out.splitlines():
        obj = json.loads(line)
        if "command_model" in obj:
            arch = by_dir[obj["command_model"]]
            lines[arch] = [None, []]
        elif "command_exit" in obj:
            lines[arch][0] = obj["command_exit"]
        else:
            lines[arch][1].append(obj)
    return {a: (*lines.get(a, (None, [])), expect[a]) for a in FAMILIES}, err


@pytest.mark.parametrize("arch", FAMILIES)
def test_generate_equals_transformers_greedy(arch, runs):
    by_arch, err = runs
    code, results, expect = by_arch[arch]
    assert code == 0, err[-3000:]
    assert [r["prompt_ids"] for r in results] == PROMPTS
    assert [r["output_ids"] for r in results] == expect
    assert [r["finish_reason"] for r in results] == ["length", "length"]


def test_a_split_the_heads_do_not_allow_is_refused_in_one_line(tmp_path, capsys):
    """VARIED's kimi_linear has 3 KDA heads (and 3 attention heads): `--tensor-parallel-size 2` exits 2
    with one line naming the count, before any rank starts."""
    path = save_checkpoint(hf_model("kimi_linear", tied=False, seed=23, overrides=VARIED["kimi_linear"]),
                           tmp_path / "kimi")
    req = tmp_path / "request.json"
    req.write_text(json.dumps({"suffix": PROMPTS[0], "sampling_params": GREEDY}))
    capsys.readouterr()  # save_pretrained's progress
    code = cli.main(["generate", "--model", str(path), "--request", str(req), "--tensor-parallel-size", "2"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "tensor-parallel size 2 must divide the 3" in err
