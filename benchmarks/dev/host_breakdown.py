"""Where the host time of one FP8 linear training iteration goes, on the GPU.

For one layer shape (default GPT-2's 16384x768->3072, bf16 activations, fp32
master weight, autocast): the host microseconds spent in forward, backward and
fp8ops.step per iteration (perf_counter around each phase, no sync inside the
timed loop: a phase that synchronises shows the GPU's backlog), the GPU time
per iteration, a cProfile of each (which Python functions and which C calls
hold the host time), and a torch.profiler table of the ops by self CPU time.
    python benchmarks/dev/host_breakdown.py [--shape 16384x768x3072] [--iters 50]
"""
import argparse
import time

import torch

import fp8ops

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="16384x768x3072")
ap.add_argument("--iters", type=int, default=50)
args = ap.parse_args()
M, K, N = (int(v) for v in args.shape.split("x"))
dev = "cuda"
torch.manual_seed(0)
base = torch.nn.Linear(K, N, bias=False).to(dev)
fp8 = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(K, N, bias=False).to(dev)),
                     config=fp8ops.Fp8Config(policy="always"))
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)


def run(model, n, step):
    phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t_all = time.perf_counter()
    for _ in range(n):
        x.grad = None
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        t1 = time.perf_counter()
        y.backward(g)
        t2 = time.perf_counter()
        if step:
            fp8ops.step(model)
        t3 = time.perf_counter()
        phases["forward"] += t1 - t0
        phases["backward"] += t2 - t1
        phases["step"] += t3 - t2
    host = time.perf_counter() - t_all
    e1.record()
    e1.synchronize()
    return {k: v / n * 1e6 for k, v in phases.items()}, host / n * 1e6, e0.elapsed_time(e1) / n * 1e3


for name, model, step in (("bf16", base, False), ("fp8ops (step each iteration)", fp8, True),
                          ("fp8ops (no step: cached weight cast)", fp8, False)):
    run(model, 5, step)
    phases, host, gpu = run(model, args.iters, step)
    parts = ", ".join(f"{k} {v:.0f}" for k, v in phases.items())
    print(f"{name:38} host {host:6.0f} us/iter ({parts}); GPU {gpu:6.0f} us/iter")

import cProfile  # noqa: E402
import pstats  # noqa: E402

small = torch.zeros(16, device=dev)
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(1000):
    small.add_(1)
print(f"one tiny torch op (add_): {(time.perf_counter() - t) * 1e3:.1f} us host per call")
for name, model, step in (("bf16", base, False), ("fp8ops", fp8, True)):
    pr = cProfile.Profile()
    pr.enable()
    run(model, 200, step)
    pr.disable()
    print(f"--- cProfile, {name}, 200 iterations (tottime: the function's own time, C calls included)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(14)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    run(fp8, 10, True)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
