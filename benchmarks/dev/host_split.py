"""Where the host time of one Fp8Linear fwd + bwd goes, layer by layer of the
call stack: the module call, Fp8Linear.forward, autograd.Function.apply, the
C ops, the autograd engine, the Python backward. A small shape keeps the GPU
ahead of the host (pure host time); no sync inside the timed loop.
    python benchmarks/dev/host_split.py [--shape 256x256x256] [--iters 200] [--totals ROUNDS]
"""
import argparse
import collections
import time

import torch

import fp8ops
from fp8ops import linear, ops

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="256x256x256")
ap.add_argument("--iters", type=int, default=200)
ap.add_argument("--totals", type=int, default=0, metavar="ROUNDS",
                help="only the host us per iteration of BF16 and fp8ops, each the best of ROUNDS "
                     "alternating rounds (for A/B runs on a noisy host)")
args = ap.parse_args()
M, K, N = (int(v) for v in args.shape.split("x"))
dev = "cuda"
acc = collections.defaultdict(float)


def timed(name, fn):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            acc[name] += time.perf_counter() - t
    return wrapper


torch.manual_seed(0)
ref = torch.nn.Linear(K, N, bias=False, device=dev)
fp8 = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(K, N, bias=False, device=dev)),
                     config=fp8ops.Fp8Config(policy="always"))[0]
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)


def loop(mod, n, step):
    for _ in range(n):
        x.grad = None
        mod.weight.grad = None
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            t1 = time.perf_counter()
            y = mod(x)
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        y.backward(g)
        t4 = time.perf_counter()
        if step:
            fp8ops.step(mod)
        t5 = time.perf_counter()
        acc["autocast enter+exit"] += (t1 - t0) + (t3 - t2)
        acc["module call (forward)"] += t2 - t1
        acc["y.backward (engine + backward)"] += t4 - t3
        acc["fp8ops.step (scale update)"] += t5 - t4


def host_us(mod, step, warmup=5):
    """Host us per iteration of a timed loop (after a few untimed ones), the GPU drained around it."""
    loop(mod, warmup, step)
    torch.cuda.synchronize()
    t = time.perf_counter()
    loop(mod, args.iters, step)
    us = (time.perf_counter() - t) / args.iters * 1e6
    torch.cuda.synchronize()
    return us


if args.totals:
    best = {"bf16": float("inf"), "fp8ops": float("inf")}
    for _ in range(args.totals):
        for name, mod, step in (("bf16", ref, False), ("fp8ops", fp8, True)):
            best[name] = min(best[name], host_us(mod, step))
    print(f"host us per fwd+bwd(+step), best of {args.totals}: bf16 {best['bf16']:.1f}  fp8ops {best['fp8ops']:.1f}  "
          f"(fp8ops - bf16: {best['fp8ops'] - best['bf16']:.1f})")
    raise SystemExit(0)

for name, mod, step in (("bf16 nn.Linear", ref, False), ("fp8ops", fp8, True)):
    if mod is fp8:  # wrap after the warm-up so its first calls are not counted
        print(f"--- fp8ops without the timing wrappers: {host_us(mod, step):.0f} us host per iteration")
        linear.Fp8Linear.forward = timed("  Fp8Linear.forward", linear.Fp8Linear.forward)
        linear._apply = timed("    linear._apply (autograd.Function's C apply)", linear._apply)
        linear._Fp8LinearFn.forward = staticmethod(timed("      _Fp8LinearFn.forward (in apply)",
                                                         linear._Fp8LinearFn.forward))
        linear._Fp8LinearFn.backward = staticmethod(timed("  _Fp8LinearFn.backward (in engine)",
                                                          linear._Fp8LinearFn.backward))
        ops._linear_fwd_raw = timed("        op linear_fwd", ops._linear_fwd_raw)
        ops._linear_bwd_raw = timed("    op linear_bwd", ops._linear_bwd_raw)
        fp8.__dict__.pop("_fp8_fn", None)
        fp8._fp8_fn = linear._Fp8LinearFn
    loop(mod, 5, step)
    acc.clear()
    print(f"--- {name}: {host_us(mod, step, warmup=0):.0f} us host per iteration")
    for k, v in acc.items():
        print(f"  {k:44} {v / args.iters * 1e6:7.1f} us")
