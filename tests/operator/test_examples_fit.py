"""The example resources name only models that fit the GPU pods they ask for.

A combine or scatter worker runs its model on one CUDA device, or split by head over
engine.tensorParallelSize devices (one rank a GPU, its share of the weights), so a rank's weights
in the engine's dtype must fit one GPU of the product the pods select, with room left for entries
and the prefix cache. Model sizes come from the project's presets of the real shapes (random weights of
the same parameter count), built on the meta device.
"""

from pathlib import Path

import pytest
import torch
import yaml
from hybridcache.services.runtime.models.registry import build_model, config_from_dict
from hybridcache.services.runtime.modelzoo import hf_config

REPO = Path(__file__).resolve().parents[2]
# a model directory's name as the examples mount it -> (model_type, preset of that shape)
SHAPES = {
    "Qwen3.5-35B-A3B": ("qwen3_5_moe", "qwen3.5-35b-a3b"),
    "Qwen3.5-9B": ("qwen3_5", "qwen3.5-9b"),
    "Kimi-Linear-48B-A3B-Instruct": ("kimi_linear", "kimi-linear-48b-a3b"),
    "Qwen3-Next-80B-A3B-Instruct": ("qwen3_next", "qwen3-next-80b-a3b"),
}
GPU_BYTES = {"NVIDIA-H200": 141e9, "NVIDIA-H100-80GB-HBM3": 80e9}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
# what the weights may take of one GPU: the rest holds entries, prefix pages and activations
WEIGHT_SHARE = 0.8


def _resources():
    for f in sorted((REPO / "manifests" / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc.get("kind") == "HybridCache":
                yield f"{f.name}:{doc['metadata']['name']}", doc["spec"]
    for f in [REPO / "charts/hybridcache/values.yaml", *sorted((REPO / "charts/hybridcache/ci").glob("*.yaml"))]:
        instance = (yaml.safe_load(f.read_text()) or {}).get("instance") or {}
        if instance.get("spec"):
            yield f"{f.relative_to(REPO)}:instance", instance["spec"]


def _gpu_pods(spec) -> int:
    return sum((spec.get(role) or {}).get("gpusPerPod", 0) or 0 for role in ("combine", "scatter"))


def _weight_bytes(name: str, dtype: str, tp: int = 1) -> int:
    """Bytes of one rank's weights (rank 0's shard at tensor-parallel size tp, split as served)."""
    from hybridcache.services.runtime.tensor_parallel.shard import shard_model

    arch, preset = SHAPES[name]
    with torch.device("meta"):
        model = shard_model(build_model(config_from_dict(hf_config(arch, preset))), 0, tp)
    return sum(p.numel() for p in model.parameters()) * ITEMSIZE[dtype]


GPU_RESOURCES = [(name, spec) for name, spec in _resources() if _gpu_pods(spec)]


def test_there_is_a_gpu_example():
    assert GPU_RESOURCES, "no example asks for GPU pods"


@pytest.mark.parametrize("name,spec", GPU_RESOURCES, ids=[n for n, _ in GPU_RESOURCES])
def test_gpu_example_model_fits_one_gpu(name, spec):
    model = spec["model"]
    where = (model.get("pvc") or {}).get("subPath") or model.get("path") or model.get("uri", "")
    directory = Path(where.rstrip("/")).name
    assert directory in SHAPES, f"{name}: no known shape for model {directory!r}: add it to SHAPES"
    assert SHAPES[directory][0] == model["arch"], f"{name}: {directory} is a {SHAPES[directory][0]} model"
    product = (spec.get("nodeSelector") or {}).get("nvidia.com/gpu.product")
    assert product in GPU_BYTES, f"{name}: the GPU pods must select a known product, not {product!r}"
    dtype = (spec.get("engine") or {}).get("dtype", "float32")
    tp = (spec.get("engine") or {}).get("tensorParallelSize", 1)
    weights = _weight_bytes(directory, dtype, tp)
    budget = WEIGHT_SHARE * GPU_BYTES[product]
    assert weights <= budget, (
        f"{name}: {directory} in {dtype} at tensor-parallel size {tp} is {weights / 1e9:.0f} GB a GPU, "
        f"one {product} allows {budget / 1e9:.0f} GB"
    )


def test_the_check_refuses_a_model_too_large():
    # the 35B shape in fp32 (~140 GB) does not fit one H200, in bf16 it does
    assert _weight_bytes("Qwen3.5-35B-A3B", "float32") > WEIGHT_SHARE * GPU_BYTES["NVIDIA-H200"]
    assert _weight_bytes("Qwen3.5-35B-A3B", "bfloat16") <= WEIGHT_SHARE * GPU_BYTES["NVIDIA-H200"]


def test_a_model_larger_than_one_gpu_fits_split():
    # Qwen3-Next-80B-A3B in bf16 (~160 GB) does not fit one H200; split over two, a rank's share does
    assert _weight_bytes("Qwen3-Next-80B-A3B-Instruct", "bfloat16") > WEIGHT_SHARE * GPU_BYTES["NVIDIA-H200"]
    assert _weight_bytes("Qwen3-Next-80B-A3B-Instruct", "bfloat16", 2) <= WEIGHT_SHARE * GPU_BYTES["NVIDIA-H200"]
