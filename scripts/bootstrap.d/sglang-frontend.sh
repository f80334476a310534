#!/usr/bin/env bash
# SGLang's frontend (sgl.function, sgl.RuntimeEndpoint) for tests/services: sglang's metadata pins a
# CUDA torch, so it goes in with --no-deps, then the few packages its frontend imports.
set -euo pipefail
cd "$(dirname "$0")/../.."
if .venv/bin/python -c "import sglang" >/dev/null 2>&1; then
    exit 0
fi
.venv/bin/python -m pip install -q -c constraints.txt --no-deps sglang==0.5.23
.venv/bin/python -m pip install -q -c constraints.txt numpy orjson psutil pybase64 requests packaging pillow starlette \
    msgspec pydantic pyzmq tqdm IPython aiohttp
