"""One-row matrix-vector products of the decode step (y = x W^T for a single row x): reference
(naive.py) and a Triton kernel (triton.py) that a device takes per weight shape where it measures
faster than cuBLAS (services/runtime/backends.py plan_gemv)."""
