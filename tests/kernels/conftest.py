"""Triton kernels run under the interpreter on machines without a GPU (CI).

The variable must be set before the kernel modules are imported (triton.jit reads it when a
kernel is decorated); kernel modules are imported only inside these tests and lazily by
services/runtime/backends.py, never at import time of the runtime.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
else:
    import sys

    # tests/conftest.py hides fla so that transformers uses its CPU paths; on a GPU the kernels
    # under test are fla's.
    if "fla" in sys.modules and sys.modules["fla"] is None:
        del sys.modules["fla"]
