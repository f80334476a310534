"""Triton kernels run under the interpreter on machines without a GPU (CI).

The variable must be set before the kernel modules are imported (triton.jit reads it when a
kernel is decorated); kernel modules are imported only inside these tests and lazily by
services/runtime/backends.py, never at import time of the runtime.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
