"""Load a model directory in Hugging Face format: config.json, *.safetensors (sharded or not), tokenizer.json.

Tensor names are those of the Hugging Face hub's checkpoints (as transformers' save_pretrained
writes them), mapped onto the runtime's modules by hub_names: multimodal checkpoints
(`model.language_model.*`) load their text model, vision towers and multi-token-prediction heads
are skipped, per-expert MoE tensors are fused into the 3-D expert tensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

import torch
from hybridcache.services.runtime.config import ModelConfig, ModelConfigError
from hybridcache.services.runtime.hub_names import Assembler
from hybridcache.services.runtime.models.qwen3_hybrid import HybridLM
from hybridcache.services.runtime.models.registry import build_model, config_from_dir
from hybridcache.services.runtime.tensor_parallel import slices
from hybridcache.services.runtime.tensor_parallel.slices import Reads, Source
from safetensors import safe_open


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded: the message names the file or tensor."""


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


def read_checkpoint(path: Path, model_type: str, lazy: Reads | None = None
                    ) -> tuple[dict[str, torch.Tensor | Source], dict[str, str]]:
    """All tensors of the checkpoint the text model uses, under the runtime's names (hub_names),
    and for each the checkpoint name it came from. With `lazy` (counting the bytes read), none is
    read: each is a Source (tensor_parallel/slices.py) to read the slices of."""
    if lazy is not None:
        assembler = Assembler(model_type, stack=slices.stack, cat=slices.cat)
    else:
        assembler = Assembler(model_type)
    for f in _checkpoint_files(path):
        try:
            if lazy is not None:
                sf = slices.SafetensorsFile(f, lazy)
                for raw in sf.names():
                    assembler.add(raw, lambda raw=raw, sf=sf: slices.Leaf(sf, raw))
                continue
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"cannot read {f.name}: {e}") from None
        with handle:
            for raw in handle.keys():
                assembler.add(raw, lambda raw=raw, handle=handle: handle.get_tensor(raw))
    try:
        return assembler.finish(), assembler.source
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None


def _check_names(path: Path, model_type: str, expected: dict, tensors: dict, source: dict[str, str]) -> None:
    """One error for a checkpoint whose names do not map onto the model: the first tensor it
    cannot map (under its checkpoint name) and the first missing one, with counts."""
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected))
    if not missing and not unknown:
        return
    parts = []
    if unknown:
        parts.append(f"{len(unknown)} tensor(s) it cannot map, the first {source.get(unknown[0], unknown[0])!r}")
    if missing:
        parts.append(f"{len(missing)} missing tensor(s), the first {missing[0]!r}")
    raise ModelLoadError(
        f"checkpoint in {path} does not match a {model_type} model of its config.json: " + "; ".join(parts)
    )


def model_fingerprint(cfg: ModelConfig, tensors: dict[str, torch.Tensor | Source]) -> str:
    """A stable id of the weights: config plus every tensor's name, shape, dtype and a strided
    sample (of a Source, only the sampled elements are read: the same id)."""
    h = hashlib.sha256(json.dumps(cfg.raw, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if isinstance(t, Source):
            sample = t.sample(256)
        else:
            flat = t.reshape(-1)
            sample = flat[::max(1, flat.numel() // 256)][:256].float()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


_INITS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "xavier_uniform_",
          "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_")


@contextlib.contextmanager
def _no_weight_init():
    """torch.nn.init's initialisers as no-ops while a model is built on the meta device: every
    weight is replaced from the checkpoint, and initialising meta tensors runs torch's reference
    decompositions, whose first use imports torch._dynamo (about a second of every load)."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS if hasattr(torch.nn.init, name)}
    try:
        for name in saved:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def load_model(
    path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32, tp_rank: int = 0, tp_size: int = 1
) -> HybridLM:
    """The model in `path` on `device`; with tp_size > 1 rank tp_rank's shard of it
    (tensor_parallel/shard.py), of which only the rank's slices of each weight are read from the
    checkpoint (tensor_parallel/slices.py; `checkpoint_bytes_read` on the model says how much)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    try:
        cfg = config_from_dir(path)
    except ModelConfigError as e:
        raise ModelLoadError(str(e)) from None
    reads = Reads()
    tensors, source = read_checkpoint(path, cfg.model_type, reads if tp_size > 1 else None)
    with torch.device("meta"), _no_weight_init():
        model = build_model(cfg)
    expected = dict(model.state_dict())
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        # save_pretrained leaves out a tied LM head: it is the token embedding
        embed = next(f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding))
        if embed in tensors:
            tensors["lm_head.weight"] = tensors[embed]
    _check_names(path, cfg.model_type, expected, tensors, source)
    for name, ref in expected.items():
        got = tensors[name]
        if tuple(got.shape) != tuple(ref.shape):
            raise ModelLoadError(
                f"tensor {name} has shape {tuple(got.shape)} in the checkpoint, config expects {tuple(ref.shape)}"
            )
    fingerprint = model_fingerprint(cfg, tensors)
    if tp_size > 1:
        from hybridcache.services.runtime.tensor_parallel.shard import install_sources, read_rest, shard_model

        # The meta model holds the checkpoint's tensors unread; the split reads the rank's slices
        # of each, then what no split took is read whole; only the rank's tensors go to the device.
        model = model.to(dtype)
        install_sources(model, {k: v.to(dtype) for k, v in tensors.items()})
        del tensors
        try:
            model = shard_model(model.eval(), tp_rank, tp_size)
        except ModelConfigError as e:
            raise ModelLoadError(str(e)) from None
        read_rest(model)
        model = model.to(device)
    else:
        # cast on the meta device first: the device then holds the weights once, in `dtype`
        # (to_empty in float32 and then a cast would reserve twice their memory at the peak)
        model = model.to(dtype).to_empty(device=device)
        model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
        reads.bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
    model.checkpoint_bytes_read = reads.bytes
    model.eval()
    if hasattr(model, "merge_projections"):
        model.merge_projections()  # one GEMM per group of projections that read the same input
    model.fingerprint = fingerprint
    model.path = str(path)
    if torch.device(device).type == "cuda":
        # the loads' and merges' freed blocks go back to the device, so the memory a worker
        # budgets from (devices.memory_pool) and the GPU's other workers see them
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    return model
