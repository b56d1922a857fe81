"""Why a layer that policy "auto" ran BF16 measured slower than nn.Linear in bench_linear
(0.84x at 16384x3072->768 in four runs of one H200): the same BF16 path with its verdict set by
hand (nothing measured, no trial) against one that went through the real decision (policy.measure
and the loop trial, bench_linear's 28 warm-up iterations; the verdict then forced to BF16 if the
trial chose FP8), timed interleaved, then one torch.profiler table of kernels per variant.
    python benchmarks/dev/auto_bf16_gap.py [--shapes 16384x3072x768,4096x4096x4096]
"""
import argparse
import copy
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="16384x3072x768,4096x4096x4096")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--reps", type=int, default=40)
args = ap.parse_args()
dev = "cuda"


def bench(fns):
    gpu = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            for _ in range(8):
                fn()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.reps):
                fn()
            b.record()
            b.synchronize()
            gpu[k].append(a.elapsed_time(b) / args.reps)
    base = statistics.median(gpu["nn.Linear"])
    for k, v in gpu.items():
        ms = statistics.median(v)
        print(f"  {k:44} {ms:.4f} ms ({base / ms:.3f}x of nn.Linear; rounds {min(v):.3f}-{max(v):.3f})", flush=True)


for shape in args.shapes.split(","):
    (M, K, N), base, x, g = layer_and_batch(shape, dev)
    by_hand = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
    by_hand.fp8_policy[(M, torch.bfloat16)] = (False, 1.0)
    decided = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
    it = make(decided, x, g, True)
    for _ in range(28):
        it()
    torch.cuda.synchronize()
    verdict = dict(decided.fp8_policy)
    decided.fp8_policy[(M, torch.bfloat16)] = (False, 1.0)
    decided.__dict__["_fp8_bf16_key"] = None
    print(f"{M}x{K}->{N}: the decision was {verdict}; pristine {decided._fp8_pristine}", flush=True)
    fns = {"nn.Linear": make(copy.deepcopy(base), x, g, False),
           "Fp8Linear BF16, verdict by hand, + step": make(by_hand, x, g, True),
           "Fp8Linear BF16 after measure + trial, + step": it}
    bench(fns)
    for k in ("nn.Linear", "Fp8Linear BF16 after measure + trial, + step"):
        for _ in range(5):
            fns[k]()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fns[k]()
            torch.cuda.synchronize()
        print(f"--- {k}: 10 iterations")
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=14, max_name_column_width=70))
