"""Does timing in short bursts after a synchronize (bench_linear's method in the first six
sessions, now its --timing bursts) measure what a training loop (one long run, never
synchronized) sees? For host-bound layers the
two can differ: after a sync the GPU queue is empty and the host may run faster
in a short burst. Per shape: BF16 and FP8 (policy "always"), ms per fwd+bwd+step,
(a) bursts of --burst iterations after a sync, median per-iteration event time
(bench_linear.bench_interleaved's method) and (b) --long iterations back to back,
total event time / iterations; each side measured in alternation, --rounds times.
    python benchmarks/dev/burst_vs_continuous.py [--shapes 4096x4096x4096,16384x768x3072]
"""
import argparse
import copy
import statistics

import torch

import fp8ops
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="4096x4096x4096,16384x768x3072")
ap.add_argument("--burst", type=int, default=6)
ap.add_argument("--long", type=int, default=120)
ap.add_argument("--rounds", type=int, default=4)
args = ap.parse_args()
dev = "cuda"


def burst(fn):
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.burst + 1)]
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(args.burst):
        fn()
        ev[i + 1].record()
    torch.cuda.synchronize()
    return [ev[i].elapsed_time(ev[i + 1]) for i in range(args.burst)]


def continuous(fn):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):  # reach the steady state of a long loop first
        fn()
    a.record()
    for _ in range(args.long):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / args.long


for shape in args.shapes.split(","):
    _, base, x, g = layer_and_batch(shape, dev)
    fp8 = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always"))
    fns = {"bf16": make(copy.deepcopy(base), x, g, False), "fp8ops": make(fp8, x, g, True)}
    for fn in fns.values():
        for _ in range(5):
            fn()
    bursts, longs = {k: [] for k in fns}, {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            bursts[k] += burst(fn)
            longs[k].append(continuous(fn))
    b = {k: statistics.median(v) for k, v in bursts.items()}
    c = {k: statistics.median(v) for k, v in longs.items()}
    print(f"{shape}: bursts of {args.burst}: bf16 {b['bf16']:.3f} ms, fp8ops {b['fp8ops']:.3f} ms "
          f"({b['bf16'] / b['fp8ops']:.2f}x) | {args.long} back to back: bf16 {c['bf16']:.3f} ms, fp8ops "
          f"{c['fp8ops']:.3f} ms ({c['bf16'] / c['fp8ops']:.2f}x; rounds {min(longs['fp8ops']):.3f}-"
          f"{max(longs['fp8ops']):.3f})", flush=True)
