"""Shared fixtures: tiny random-weight models in Hugging Face format, built once per session."""

import os
import sys

import pytest

# The repository's top-level kernels/ (installed as hybridcache.kernels) would shadow the `kernels`
# distribution transformers imports, whenever the working directory is on sys.path. `make test`
# runs pytest with -P; this keeps the Python processes the tests start off the working directory too.
os.environ.setdefault("PYTHONSAFEPATH", "1")

# transformers must use its pure-PyTorch paths on CPU: fla, when importable, routes its hybrid
# models to GPU-only kernels.
sys.modules.setdefault("fla", None)

# Every model_type of the Qwen family the runtime serves (tests/runtime/test_models_vs_transformers.py lists them too).
ARCHS = ["qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe"]


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    from hybridcache.services.runtime.modelzoo import init_model_dir

    root = tmp_path_factory.mktemp("models")
    return {arch: init_model_dir(arch, "tiny", root / arch, seed=1, std=0.08) for arch in ARCHS}


@pytest.fixture(scope="session")
def qwen35_dir(model_dirs):
    return model_dirs["qwen3_5_text"]
