"""Where one layer's fwd+bwd(+fp8ops.step) goes at a shape whose FP8 speedup swings between
runs (GPT-2's 16384x768->3072 measured 1.18x in one bench_linear run and 0.51x in another, on
H200s): nn.Linear and the layer forced FP8, as bench_linear builds and steps them, in rounds
of back-to-back iterations after a lead-in, each iteration marked with a CUDA event and the
host clock (host ms and GPU ms apart); one round with Python's garbage collector off; then
torch.profiler over a few iterations of each (CPU ops by total time, GPU kernels by time).
    python benchmarks/dev/shape_split.py [--shapes 16384x768x3072,16384x3072x768]
"""
import argparse
import copy
import gc
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="16384x768x3072,16384x3072x768")
ap.add_argument("--iters", type=int, default=12)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--lead-in", type=int, default=8)
ap.add_argument("--rows", type=int, default=14)
args = ap.parse_args()


def loop(it, n: int, lead_in: int) -> tuple[list[tuple[float, float]], float]:
    """((host ms, GPU ms) per iteration, GPU ms per iteration over the whole loop)."""
    torch.cuda.synchronize()
    for _ in range(lead_in):
        it()
    marks = []
    for i in range(n + 1):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((time.perf_counter(), ev))
        if i < n:
            it()
    marks[-1][1].synchronize()
    per = [((b[0] - a[0]) * 1e3, a[1].elapsed_time(b[1])) for a, b in zip(marks, marks[1:])]
    return per, marks[0][1].elapsed_time(marks[-1][1]) / n


def show(name: str, per, whole: float) -> None:
    host, gpu = [h for h, _ in per], [g for _, g in per]
    print(f"  {name}: {whole:.3f} ms/iter over the loop; host mean {statistics.fmean(host):.3f} "
          f"median {statistics.median(host):.3f}; GPU mean {statistics.fmean(gpu):.3f}")
    print("    host " + " ".join(f"{h:.2f}" for h in host))
    print("    gpu  " + " ".join(f"{g:.2f}" for g in gpu), flush=True)


for shape in args.shapes.split(","):
    (M, K, N), base, x, g = layer_and_batch(shape)
    print(f"== {M}x{K}->{N}", flush=True)
    forced = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always"))
    its = {"nn.Linear": make(copy.deepcopy(base), x, g, False), "FP8 forced": make(forced, x, g, True)}
    for it in its.values():
        for _ in range(28):  # bench_linear's warm-up
            it()
    for rnd in range(args.rounds + 1):
        off = rnd == args.rounds
        if off:
            gc.collect()
            gc.disable()
        for name, it in its.items():
            show(f"{name} (round {rnd + 1}{', gc off' if off else ''})", *loop(it, args.iters, args.lead_in))
        if off:
            gc.enable()
    for name, it in its.items():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(6):
                it()
            torch.cuda.synchronize()
        print(f"\n-- profile {name}, 6 iterations")
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.rows), flush=True)
    del its, forced, base, x, g
    torch.cuda.empty_cache()
