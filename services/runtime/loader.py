"""Load a model directory in Hugging Face format: config.json, *.safetensors (sharded or not), tokenizer.json.

Tensor names are the checkpoint's own. Multimodal checkpoints (`model.language_model.*`) load
their text model; vision towers and multi-token-prediction heads are skipped; per-expert MoE
tensors (`experts.E.gate_proj.weight`, ...) are fused into the 3-D expert tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch
from hybridcache.services.runtime.config import ModelConfig, ModelConfigError
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.models.registry import build_model, config_from_dir
from safetensors import safe_open


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded: the message names the file or tensor."""


_SKIP = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.vision_tower\.|.*rotary_emb\.inv_freq$)")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shard(s) listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors in {path}")
    return files


def _canonical_name(name: str) -> str:
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model.") :]
    if name.startswith("language_model.model."):
        return "model." + name[len("language_model.model.") :]
    if name.startswith("language_model.lm_head."):
        return name[len("language_model.") :]
    return name


def read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint under the runtime's names (experts fused)."""
    tensors: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for f in _checkpoint_files(path):
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {f.name}: {e}") from None
        with handle:
            for raw in handle.keys():
                name = _canonical_name(raw)
                if _SKIP.match(name):
                    continue
                m = _EXPERT.match(name)
                if m:
                    per_expert = experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})
                    per_expert[m.group(3)] = handle.get_tensor(raw)
                    continue
                tensors[name] = handle.get_tensor(raw)
    for prefix, per_expert in experts.items():
        n = max(per_expert) + 1
        missing = [e for e in range(n) if set(per_expert.get(e, {})) != {"gate_proj", "up_proj", "down_proj"}]
        if missing:
            raise ModelLoadError(f"checkpoint is missing tensors of expert(s) {missing[:5]} under {prefix}")
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([per_expert[e]["gate_proj"], per_expert[e]["up_proj"]], 0) for e in range(n)]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack([per_expert[e]["down_proj"] for e in range(n)])
    return tensors


def model_fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> str:
    """A stable id of the weights: config plus every tensor's name, shape, dtype and a strided sample."""
    h = hashlib.sha256(json.dumps(cfg.raw, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.reshape(-1)
        step = max(1, flat.numel() // 256)
        h.update(flat[::step][:256].float().numpy().tobytes())
    return h.hexdigest()[:16]


def load_model(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32) -> HybridLM:
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    try:
        cfg = config_from_dir(path)
    except ModelConfigError as e:
        raise ModelLoadError(str(e)) from None
    tensors = read_checkpoint(path)
    if "lm_head.weight" not in tensors and cfg.tie_word_embeddings and "model.embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = build_model(cfg)
    expected = dict(model.state_dict())
    missing = sorted(set(expected) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"checkpoint in {path} is missing tensor(s) {', '.join(missing[:3])}{more}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        more = f" (and {len(unexpected) - 3} more)" if len(unexpected) > 3 else ""
        raise ModelLoadError(f"checkpoint in {path} has unexpected tensor(s) {', '.join(unexpected[:3])}{more}")
    for name, ref in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(got.shape)} in the checkpoint, config expects {tuple(ref.shape)}"
            )
    fingerprint = model_fingerprint(cfg, tensors)
    model = model.to_empty(device=device).to(dtype)
    model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    model.eval()
    if hasattr(model, "merge_projections"):
        model.merge_projections()  # one GEMM per group of projections that read the same input
    model.fingerprint = fingerprint
    model.path = str(path)
    return model
