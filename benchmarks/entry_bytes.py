"""Bytes per token of a segment entry, per linear-attention family, and logit fidelity of the
linear-state policies (exact composition, single state, naive addition) on tiny random models.

Real shapes (qwen3.5-9b etc.) are computed from the config (entry size is known before an entry
is built); tiny models are measured on built entries and checked against that formula.
Prints one JSON object; `--out FILE` also writes it.

    python benchmarks/entry_bytes.py --out benchmarks/results/entry_bytes.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.modules.setdefault("fla", None)

from hybridcache.services.runtime.cache import MemoryEntryStore, expected_entry_nbytes  # noqa: E402
from hybridcache.services.runtime.cache.single_state import SingleStateStore  # noqa: E402
from hybridcache.services.runtime.engine import Engine, EngineConfig  # noqa: E402
from hybridcache.services.runtime.loader import load_model  # noqa: E402
from hybridcache.services.runtime.models.registry import config_from_dict  # noqa: E402
from hybridcache.services.runtime.modelzoo import hf_config, init_model_dir  # noqa: E402
from hybridcache.services.runtime.tokenizer import Tokenizer  # noqa: E402

TINY = ["qwen3_5_text", "olmo_hybrid", "nemotron_h", "bamba", "kimi_linear", "minimax"]
REAL = [
    ("qwen3_5_text", "qwen3.5-9b"),
    ("qwen3_5_moe_text", "qwen3.5-35b-a3b"),
    ("kimi_linear", "kimi-linear-48b-a3b"),
    ("minimax", "minimax-text-01"),
]


def per_layer_state_bytes(family: str, H: int, K: int, V: int) -> dict:
    """fp32 bytes of one linear layer's (T, S(C|0)) for a reference-op family (kernels/ops)."""
    t = {"scalar": H, "vector": H * K, "matrix": H * K * K}[
        {"simple_gla": "scalar", "lightning": "scalar", "mamba2": "scalar", "gla": "vector",
         "gated_delta_rule": "matrix", "kda": "matrix"}[family]
    ]
    return {"T_bytes": 4 * t, "S_bytes": 4 * H * K * V}


def policy_fidelity(model_dir: Path, seg_len: int = 48, n_segments: int = 4, w: int = 8) -> dict:
    model = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    g = torch.Generator().manual_seed(11)
    segs = [torch.randint(0, 256, (seg_len,), generator=g).tolist() for _ in range(n_segments)]
    obj = {"segments": segs, "suffix": [10, 11, 12, 13, 14, 15, 16, 17]}

    def run(mode, single=False):
        store = MemoryEntryStore(1 << 30)
        e = Engine(model, tok, EngineConfig(mode=mode, seam_window=w), SingleStateStore(store) if single else store)
        return e.prefill(e.parse_request(obj)).logits, e

    ref, _ = run("full")
    out = {}
    for name, mode, single in (("pic_exact", "pic", False), ("single_state", "pic", True), ("naive", "naive", False)):
        logits, eng = run(mode, single)
        entry, _ = eng.get_or_build_entry(segs[1])
        out[name] = {
            "max_abs_logit_diff_vs_full": round((logits - ref).abs().max().item(), 6),
            "same_argmax_as_full": bool(logits.argmax() == ref.argmax()),
            "entry_bytes_per_token": round(entry.nbytes / entry.data.num_tokens, 1),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--body-tokens", type=int, default=1024, help="body length for the real-shape figures")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    L = args.body_tokens
    figures, detail = {}, {"real_shapes": {}, "tiny_models": {}, "reference_ops": {}}

    for arch, preset in REAL:
        cfg = config_from_dict(hf_config(arch, preset))
        n = expected_entry_nbytes(cfg, L, torch.bfloat16)
        n16 = expected_entry_nbytes(cfg, L, torch.bfloat16, torch.bfloat16)
        detail["real_shapes"][preset] = {
            "entry_bytes": n,
            "entry_bytes_bf16_states": n16,
            "body_tokens": L,
            "dtype": "bfloat16",
        }
        figures[f"{preset}_entry_bytes_per_token_L{L}"] = round(n / L, 1)
        # EngineConfig(entry_state_dtype="bfloat16"): T and S in bf16 as well
        figures[f"{preset}_entry_bytes_per_token_L{L}_bf16_states"] = round(n16 / L, 1)

    # one layer, 16 heads, K = V = 128: what T costs against S by family
    for fam in ("simple_gla", "lightning", "mamba2", "gla", "gated_delta_rule", "kda"):
        b = per_layer_state_bytes(fam, 16, 128, 128)
        detail["reference_ops"][fam] = b
        figures[f"{fam}_layer_T_over_S"] = round(b["T_bytes"] / b["S_bytes"], 5)

    with tempfile.TemporaryDirectory() as tmp:
        for arch in TINY:
            d = init_model_dir(arch, "tiny", Path(tmp) / arch, seed=1, std=0.08)
            cfg = load_model(d).cfg
            fid = policy_fidelity(d)
            detail["tiny_models"][arch] = {
                "expected_entry_bytes_per_token_L40": round(expected_entry_nbytes(cfg, 40, torch.float32) / 40, 1),
                "policies": fid,
            }
            for pol, vals in fid.items():
                figures[f"tiny_{arch}_{pol}_max_abs_logit_diff"] = vals["max_abs_logit_diff_vs_full"]
                figures[f"tiny_{arch}_{pol}_entry_bytes_per_token"] = vals["entry_bytes_per_token"]

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "entry_bytes",
        "gpu": None,
        "device": "cpu",
        "commit": commit,
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/entry_bytes.py" + (f" --body-tokens {L}" if L != 1024 else ""),
        "figures": figures,
        "detail": detail,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
