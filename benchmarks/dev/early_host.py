"""Is the host slower in a process's first iterations, and is Python's garbage collector why?
(policy "auto"'s trial runs in a layer's first ~26 steps; in one-layer loops its FP8 steps
took longer than the same path timed later: results/trial_*_s19*.txt.) From a fresh process:
one layer, fwd + bwd (+ fp8ops.step), ITERS iterations back to back, each marked with a CUDA
event and the host clock; gc.callbacks record every collection (generation, host ms) and the
iteration it fell in. Prints host / GPU ms per iteration in blocks of 10, the collections,
and each block's host mean with and without the iterations that collected.
    python benchmarks/dev/early_host.py [--shape 4096x4096x4096] [--plain] [--no-gc] [--iters 200]
"""
import argparse
import gc
import statistics
import time

import torch

import fp8ops
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4096x4096x4096")
ap.add_argument("--iters", type=int, default=200)
ap.add_argument("--plain", action="store_true", help="nn.Linear instead of the layer forced FP8")
ap.add_argument("--no-gc", action="store_true", help="gc.disable() before the first iteration")
args = ap.parse_args()

(M, K, N), base, x, g = layer_and_batch(args.shape)
layer = base if args.plain else fp8ops.convert(base, config=fp8ops.Fp8Config(policy="always"))
it = make(layer, x, g, not args.plain)
collections, now_it, started = [], [0], {}


def on_gc(phase, info):
    if phase == "start":
        started["t"] = time.perf_counter()
    else:
        collections.append((now_it[0], info["generation"], (time.perf_counter() - started["t"]) * 1e3))


gc.callbacks.append(on_gc)
if args.no_gc:
    gc.collect()
    gc.disable()
marks = []
for i in range(args.iters + 1):
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    marks.append((time.perf_counter(), ev))
    now_it[0] = i
    if i < args.iters:
        it()
marks[-1][1].synchronize()
host = [(b[0] - a[0]) * 1e3 for a, b in zip(marks, marks[1:])]
gpu = [a[1].elapsed_time(b[1]) for a, b in zip(marks, marks[1:])]
print(f"{'nn.Linear' if args.plain else 'FP8 forced'} {M}x{K}->{N}, gc {'off' if args.no_gc else 'on'}: "
      f"{len(collections)} collections, by generation "
      f"{[sum(1 for c in collections if c[1] == gen) for gen in range(3)]}, "
      f"longest {max((c[2] for c in collections), default=0):.3f} ms")
gc_its = {c[0] for c in collections}
for b in range(0, args.iters, 10):
    hs = host[b:b + 10]
    clean = [h for j, h in enumerate(hs, b) if j not in gc_its] or [float("nan")]
    print(f"  it {b:3d}-{b + len(hs) - 1:3d} host mean {statistics.fmean(hs):.3f} (no-gc its {statistics.fmean(clean):.3f}) "
          f"GPU mean {statistics.fmean(gpu[b:b + 10]):.3f} | host " + " ".join(f"{h:.2f}" for h in hs)
          + " | gc at " + " ".join(f"{j}:g{gen}:{ms:.2f}" for j, gen, ms in collections if b <= j < b + 10))
