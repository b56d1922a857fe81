"""The bias gradient fused into linear_bwd's cast of dy vs torch's separate column sum.

For each shape: GPU ms per backward call of (a) linear_bwd(need_db=False) + gy.sum(0, fp32), what
Fp8Linear did before, and (b) linear_bwd(need_db=True); back to back between two CUDA events, so
host time is hidden behind the GPU work of these large shapes. Also checks db against torch's sum.
    python benchmarks/dev/dbias_bench.py
"""
import torch

from fp8ops import ops

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def gpu_ms(fn, reps=50):
    for _ in range(5):
        fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(reps):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / reps


print(f"{'M x N (K)':>22} | {'bwd + torch sum ms':>18} | {'bwd with db ms':>14} | saved | max rel err vs fp64 sum")
for M, N, K in [(16384, 3072, 768), (16384, 768, 3072), (16384, 6144, 2048), (16384, 8192, 2048),
                (16384, 2048, 8192)]:
    gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 1e-3
    w8t = torch.randn(K, N, device="cuda").to(E4)
    x8t = torch.randn(K, M, device="cuda").to(E4)
    s = torch.ones(1, device="cuda")
    slot = torch.zeros(1, device="cuda")

    def unfused():
        ops.linear_bwd(gy, w8t, x8t, s, slot, s, s, s, E5, torch.bfloat16, torch.float32, True, True)
        gy.sum(0, dtype=torch.float32)

    def fused():
        ops.linear_bwd(gy, w8t, x8t, s, slot, s, s, s, E5, torch.bfloat16, torch.float32, True, True, True)

    a, b = gpu_ms(unfused), gpu_ms(fused)
    db = ops.linear_bwd(gy, w8t, x8t, s, slot, s, s, s, E5, torch.bfloat16, torch.float32, True, True, True)[2]
    ref = gy.double().sum(0)
    err = ((db.double() - ref).abs() / ref.abs().clamp_min(1e-6)).max().item()
    print(f"{f'{M} x {N} ({K})':>22} | {a:18.3f} | {b:14.3f} | {100 * (a - b) / a:4.1f} % | {err:.2e}")
