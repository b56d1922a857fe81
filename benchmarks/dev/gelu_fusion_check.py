"""The fused GELU on the GPU: which kernels run, and what it saves per MLP.

GPT-2's MLP c_proj(gelu(c_fc(x))) at M rows, fwd + bwd, three ways in one run:
BF16 (nn.Linear + nn.GELU under autocast), fp8ops with the GELU left to torch
(Fp8Config(fuse_gelu=False)), fp8ops fused (the default). Prints the CUDA
kernel times of both fp8ops variants (torch.profiler, 5 steps) and the median
ms per step of each.

    python3 benchmarks/dev/gelu_fusion_check.py [--M 32768] [--d 768]
"""
import argparse
import copy
import statistics

import torch
import torch.nn as nn

import fp8ops


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


def step_fn(model, x, g):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.backward(g)
    return step


def time_ms(fn, reps=50):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--M", type=int, default=32768)
    ap.add_argument("--d", type=int, default=768)
    args = ap.parse_args()
    torch.manual_seed(0)
    base = MLP(args.d).cuda()
    models = {"bf16": base}
    for name, fuse in (("fp8ops unfused", False), ("fp8ops fused", True)):
        m = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always", fuse_gelu=fuse))
        models[name] = m
    assert models["fp8ops fused"].c_proj.fp8_gelu_input
    x = torch.randn(args.M, args.d, device="cuda", requires_grad=True)
    g = torch.randn(args.M, args.d, device="cuda")
    for name in ("fp8ops unfused", "fp8ops fused"):
        fn = step_fn(models[name], x, g)
        for _ in range(3):  # past delayed scaling's first step (current scales, GELU unfused)
            fn()
            fp8ops.step(models[name])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        per = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name] = per.get(e.name, 0.0) + e.device_time_total / 1e3 / 5
        print(f"{name}: CUDA kernels, ms per step (total {sum(per.values()):.3f})")
        for n, t in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"  {t:7.3f}  {n[:120]}")
    res = {}
    for _ in range(2):  # interleaved, best of two
        for name, m in models.items():
            res.setdefault(name, []).append(time_ms(step_fn(m, x, g)))
    print(f"MLP {args.d}->{4 * args.d}->{args.d}, M={args.M}, fwd+bwd, median ms (best of 2 runs):")
    best = {k: min(v) for k, v in res.items()}
    for name, t in best.items():
        print(f"  {name:16s} {t:8.3f} ms  {best['bf16'] / t:5.2f}x of bf16")
    print(f"  fused saves {best['fp8ops unfused'] - best['fp8ops fused']:.3f} ms per MLP "
          f"({best['fp8ops unfused'] / best['fp8ops fused']:.3f}x)")


if __name__ == "__main__":
    main()
