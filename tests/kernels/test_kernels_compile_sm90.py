"""The planned assembly's Triton kernels compile for an sm90 GPU (H100/H200)
on a machine without one: Triton's own compiler and ptxas, ahead of time, at the specializations
the engine launches (bf16 entries beside fp32 runs, the Qwen3.5 shapes). The interpreter the other
kernel tests run under checks what the kernels compute, not that the GPU compiler takes them.
Runs in a subprocess: the interpreter, set for this session, replaces the kernels' compiled form."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# found without importing triton here: the kernel tests set the interpreter before triton loads
_TRITON = importlib.util.find_spec("triton")
PTXAS = Path(_TRITON.origin).parent / "backends" / "nvidia" / "bin" / "ptxas" if _TRITON else Path("/nonexistent")

SCRIPT = r'''
import sys, warnings
warnings.filterwarnings("ignore")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

def compile_for_sm90(fn, signature, constexprs, **options):
    while not isinstance(fn, JITFunction):
        fn = fn.fn  # under triton.heuristics
    signature = dict(signature, **{k: "constexpr" for k in constexprs})
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"])

from hybridcache.kernels.ops.transition.compose_triton import compose_states_fwd_kernel
from hybridcache.kernels.ops.transition.outputs_triton import run_outputs_kernel
from hybridcache.kernels.ops.rope.triton import spans_into_pages_kernel

for mixed, split in ((True, True), (False, True), (True, False)):
    sig = {"T": "*i64", "S": "*i64", "h0": "*fp32", "ht": "*fp32", "hs": "*fp32", "N": "i32",
           "Tref": "*bf16" if split else "*fp32", "Sref": "*bf16" if split else "*fp32",
           "TRref": "*fp32", "SRref": "*fp32", "count": "*i64"}
    if mixed:
        sig["run_index"] = "*i64"
    cons = dict(G=32, K=128, V=128, BK=128, BV=32, DOT_PRECISION="ieee" if split else "tf32x3",
                USE_INITIAL_STATE=True, STORE_ALL=True, STORE_INITIAL=True, COUNT_ON_DEVICE=True, MIXED=mixed,
                INDIRECT=True, PREFETCH_ADDRESSES=False, SPLIT_STATE=split, GRID_VG=True)
    if not mixed:
        cons["run_index"] = None
    print("compose", mixed, split, compile_for_sm90(compose_states_fwd_kernel, sig, cons, num_warps=8, num_stages=2))
sig = {"o0": "*bf16", "u": "*bf16", "hs": "*fp32", "rows": "*i64", "out": "*bf16", "L": "i32", "s_o0m": "i64",
       "s_o0l": "i64", "s_o0h": "i64", "s_um": "i64", "s_ul": "i64", "s_uh": "i64"}
print("run_outputs", compile_for_sm90(run_outputs_kernel, sig, dict(H=32, K=128, V=128, BL=16, BK=128, BV=64,
                                                                      DOT_PRECISION="tf32"), num_warps=4))
sig = {"tab": "*i64", "tok_span": "*i64", "tok_local": "*i64", "rows_of": "*i64", "cos": "*fp32", "sin": "*fp32",
       "kp": "*bf16", "vp": "*bf16", "kref": "*bf16", "vref": "*bf16", "n_rows": "i32", "m": "i32",
       "s_kpr": "i32", "s_kph": "i32", "s_vpr": "i32", "s_vph": "i32"}
print("spans_into_pages", compile_for_sm90(spans_into_pages_kernel, sig, dict(H=2, D=256, DV=256, R=64, BD=256,
                                                                               BDV=256, BR=8), num_warps=4))
'''


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no NVIDIA backend with ptxas")
def test_planned_assembly_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    run = subprocess.run([sys.executable, "-P", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.split("\n")
    for name in ("compose True True", "compose False True", "compose True False", "run_outputs",
                 "spans_into_pages"):
        line = next((x for x in lines if x.startswith(name + " ")), None)
        assert line is not None and int(line.split()[-1]) > 0, (name, run.stdout)
