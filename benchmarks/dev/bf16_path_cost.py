"""What a layer that policy "auto" left in BF16 costs against the plain nn.Linear, at
host-bound shapes: fwd + bwd (+ fp8ops.step) under bf16 autocast, many interleaved
rounds (bench_linear's table takes few samples per variant; this isolates the one path).
The verdict is set by hand: nothing is measured, no trial runs.
    python benchmarks/dev/bf16_path_cost.py [--rounds 10] [--reps 50]
"""
import argparse
import copy
import statistics
import time

import torch

import fp8ops
from layer_iteration import make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--rounds", type=int, default=10)
ap.add_argument("--reps", type=int, default=50)
args = ap.parse_args()
dev = "cuda"


def bench(fns):
    gpu, host = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            a.record()
            for _ in range(args.reps):
                fn()
            b.record()
            host[k].append((time.perf_counter() - t) / args.reps * 1e3)
            b.synchronize()
            gpu[k].append(a.elapsed_time(b) / args.reps)
    base = statistics.median(gpu["nn.Linear"])
    for k in fns:
        ms = statistics.median(gpu[k])
        print(f"  {k:30} {ms:.4f} ms per iteration ({base / ms:.3f}x of nn.Linear; host "
              f"{statistics.median(host[k]):.4f} ms; rounds {min(gpu[k]):.3f}-{max(gpu[k]):.3f})", flush=True)


for M, K, N in ((2048, 768, 768), (16384, 768, 3072)):
    torch.manual_seed(0)
    base = torch.nn.Linear(K, N, bias=False, device=dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * 1e-3
    auto = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
    auto.fp8_policy[(M, torch.bfloat16)] = (False, 1.0)  # BF16, as policy auto would leave it
    fns = {"nn.Linear": make(copy.deepcopy(base), x, g, False),
           "Fp8Linear (BF16) + fp8ops.step": make(auto, x, g, True),
           "Fp8Linear (BF16), no step": make(auto, x, g, False)}
    print(f"{M}x{K}->{N}", flush=True)
    bench(fns)
    fns["nn.Linear, torch.compile"] = make(torch.compile(copy.deepcopy(base)), x, g, False)
    print(" again, with a compiled module in the rotation (as in bench_linear):", flush=True)
    bench(fns)
