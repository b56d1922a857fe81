"""A bench_linear-style loop of one layer for a sampling profiler: fwd + bwd under bf16
autocast (+ fp8ops.step for the FP8 layer, as bench_linear steps it), for SECONDS after 30
warm-up iterations; prints ms per iteration by the wall clock and by CUDA events.
Python puts the script's own directory first on sys.path: run it where it is (its directory
holds no fp8ops), never as a copy at the checkout's root, where `import fp8ops` would find
the source tree, which has no _C.
    python benchmarks/dev/spy_loop.py {fp8,bf16} [--shape 4096x4096x4096] [--seconds 15]
    py-spy record --native -r 300 -f raw -o prof.txt -- python benchmarks/dev/spy_loop.py fp8
    python benchmarks/dev/spy_summary.py prof.txt      (where the main thread's time goes)
"""
import argparse
import time

import torch
import torch.nn as nn

import fp8ops

ap = argparse.ArgumentParser()
ap.add_argument("variant", choices=("fp8", "bf16"))
ap.add_argument("--shape", default="4096x4096x4096")
ap.add_argument("--seconds", type=float, default=15.0)
args = ap.parse_args()
M, K, N = (int(v) for v in args.shape.split("x"))
torch.manual_seed(0)
mod = nn.Linear(K, N, bias=False, device="cuda")
layer = None
if args.variant == "fp8":
    mod = layer = fp8ops.convert(mod, config=fp8ops.Fp8Config(policy="always"))
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 1e-3
params = list(mod.parameters())


def step():
    x.grad = None
    for p in params:
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = mod(x)
    y.backward(g)
    if layer is not None:
        fp8ops.step(layer)  # = one optimizer step, as in bench_linear


for _ in range(30):
    step()
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
n, t = 0, time.perf_counter()
start.record()
while time.perf_counter() - t < args.seconds:
    for _ in range(50):
        step()
    n += 50
end.record()
torch.cuda.synchronize()
print(f"{args.variant} {args.shape}: {n} iterations, {(time.perf_counter() - t) / n * 1e3:.3f} ms each (wall), "
      f"{start.elapsed_time(end) / n:.3f} ms each (CUDA events)")
