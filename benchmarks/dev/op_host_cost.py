"""Host microseconds per call of each fp8ops C op (through the dispatcher), next to
torch ops of the same shapes: which call holds the FP8 path's host time.

A small shape keeps the GPU ahead of the host, so the time per call is the
host's (enqueue only: no sync inside the timed loop).
    python benchmarks/dev/op_host_cost.py [--shape 256x256x256] [--calls 100]
"""
import argparse
import time

import torch

from fp8ops import Fp8Config, ops
from fp8ops.linear import G, V_H, V_S, V_SI, W, X, Fp8Linear

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="256x256x256")
ap.add_argument("--calls", type=int, default=100)
args = ap.parse_args()
M, K, N = (int(v) for v in args.shape.split("x"))
dev = "cuda"
torch.manual_seed(0)
lin = Fp8Linear(K, N, bias=False, device=dev, config=Fp8Config(policy="always"))
views = lin._fp8_views(False)
x_dt, w_dt, g_dt = lin.fp8_dtypes
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
w = lin.weight.detach()
wb = w.to(torch.bfloat16)
b_lp = ops._empty_bias_for(x, torch.bfloat16)
no_gelu = ops._empty_for(g, torch.bfloat16)  # linear_bwd's gelu_input: none


def fwd(w_in):
    return ops._linear_fwd_raw(x, w_in, views[V_S + X], views[V_H + X], views[V_SI + X], views[V_S + W],
                               views[V_H + W], views[V_SI + W], b_lp, x_dt, w_dt, torch.bfloat16, True, True, True)


y, x8t, w8, w8t = fwd(w)


def bwd(need_dx, need_dw):
    return ops._linear_bwd_raw(g, w8t, x8t, views[V_S + G], views[V_H + G], views[V_SI + G], views[V_SI + W],
                               views[V_SI + X], no_gelu, g_dt, torch.bfloat16, torch.float32, need_dx, need_dw, False)


cases = {
    "torch.empty (1 allocation)": lambda: torch.empty(M, N, device=dev, dtype=torch.bfloat16),
    "torch.add (1 launch)": lambda: x.add(1),
    "torch.mm bf16 (1 GEMM)": lambda: torch.mm(x, wb.t()),
    "linear_fwd, weight cast inside (2 casts + GEMM)": lambda: fwd(w),
    "linear_fwd, cached FP8 weight (1 cast + GEMM)": lambda: fwd(w8),
    "linear_bwd dx + dW (1 cast + 2 GEMMs)": lambda: bwd(True, True),
    "linear_bwd dx only (1 cast + 1 GEMM)": lambda: bwd(True, False),
    "linear_bwd dW only (1 cast + 1 GEMM)": lambda: bwd(False, True),
    "amax_update (1 launch)": lambda: ops.amax_update(lin.fp8_amax_history, lin.fp8_scale, lin.fp8_scale_inv,
                                                      lin.fp8_max, 0, "max", lin.fp8_overflow_count),
}
for name, fn in cases.items():
    best = float("inf")
    for _ in range(5):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.calls):
            fn()
        best = min(best, (time.perf_counter() - t) / args.calls * 1e6)
    torch.cuda.synchronize()
    print(f"{name:52} {best:7.1f} us host per call (best of 5 x {args.calls})")
