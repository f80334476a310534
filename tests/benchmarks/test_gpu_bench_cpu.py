"""The parts of benchmarks/gpu_bench.py that are plain model math run on CPU here, so a broken
import or a wrong batched step shows in CI and not first on a lent GPU."""

import importlib.util
from pathlib import Path

import torch


def _gpu_bench():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_batched_decode_step_matches_single_sequence_steps(qwen35_dir):
    from hybridcache.services.runtime.loader import load_model
    from hybridcache.services.runtime.sequence import LiveRun

    gb = _gpu_bench()
    model = load_model(qwen35_dir)
    gen = torch.Generator().manual_seed(0)
    prompt, batch = 21, 3
    singles = []
    with torch.no_grad():
        for _ in range(batch):
            st = model.empty_state()
            lo, _ = model.forward_layout(st, [LiveRun(torch.randint(0, 100, (prompt,), generator=gen), 0)], "last")
            singles.append(st)
        stacked = {}
        for i in singles[0].linear:
            stacked[i] = {
                "ssm": torch.cat([st.linear[i].ssm for st in singles]),
                "conv": torch.cat([st.linear[i].conv for st in singles]),
            }
        for i in singles[0].attn:
            stacked[i] = {
                "k": torch.cat([st.attn[i].k for st in singles]),
                "v": torch.cat([st.attn[i].v for st in singles]),
            }
        toks = torch.tensor([5, 17, 42])
        for step in range(2):
            got = gb.decode_step_batched(model, stacked, toks, prompt + step)
            for b, st in enumerate(singles):
                ref, _ = model.forward_layout(st, [LiveRun(toks[b : b + 1], prompt + step)], "last")
                assert torch.allclose(got[b], ref.view(-1), atol=1e-4, rtol=1e-4), (step, b)
            toks = got.argmax(-1)


def test_gpu_bench_rejects_unknown_sections(capsys):
    gb = _gpu_bench()
    assert gb.main(["--sections", "decode,nope"]) == 2
    assert "nope" in capsys.readouterr().err
