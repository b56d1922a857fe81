"""Fast accumulation on and off for each of the three FP8 GEMMs of a linear layer's
fwd + bwd (fp8ops.ops.gemm, operands pre-cast), timed back to back, median of 3 rounds.
fp8ops uses it in the forward GEMM only (Fp8Config.fast_accum).
    python benchmarks/dev/gemm_fast_accum.py
"""
import torch

from fp8ops import ops

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
SHAPES = [(16384, 4096, 14336), (16384, 14336, 4096), (16384, 4096, 4096), (16384, 8192, 8192),
          (16384, 2048, 8192), (4096, 4096, 4096), (16384, 768, 3072), (16384, 3072, 768)]


def to_fp8(t, dt):
    s = t.abs().max().float() / torch.finfo(dt).max
    return (t.float() / s).to(dt), s


def ms_per_call(fn, n=30, rounds=3):
    times = []
    for _ in range(rounds):
        for _ in range(5):
            fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return sorted(times)[rounds // 2]


for M, K, N in SHAPES:
    x8, sx = to_fp8(torch.randn(M, K, device="cuda"), E4)
    w8, sw = to_fp8(torch.randn(N, K, device="cuda"), E4)
    g8, sg = to_fp8(torch.randn(M, N, device="cuda"), E5)
    w8t, g8t, x8t = w8.t().contiguous(), g8.t().contiguous(), x8.t().contiguous()
    gemms = {  # y = x W^T, dx = dy W, dW = dy^T x
        "fwd": lambda fa: ops.gemm(x8, w8, sx, sw, None, torch.bfloat16, fa),
        "dgrad": lambda fa: ops.gemm(g8, w8t, sg, sw, None, torch.bfloat16, fa),
        "wgrad": lambda fa: ops.gemm(g8t, x8t, sg, sx, None, torch.float32, fa),
    }
    res = [f"{name} fa={int(fa)} {ms_per_call(lambda: fn(fa)):.3f}" for name, fn in gemms.items()
           for fa in (True, False)]
    print(f"{M}x{K}->{N}: " + ", ".join(res), flush=True)
