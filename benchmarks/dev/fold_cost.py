"""What the optimizer step's fold of compiled dy amaxes (scaling.fold_grad_amax) costs eager
layers once any FP8 forward was compiled in the process, as in bench_linear, whose compiled
variant runs beside the eager ones: per iteration (fwd + bwd under bf16 autocast +
fp8ops.step) of nn.Linear, an eager Fp8Linear, and a layer policy "auto" settled in BF16
(after FP8 steps, rested), host us and GPU ms, before a compiled trace, then after one
with the record of compiled writes (csrc/amax_writes.c) on and off, interleaved.
    python benchmarks/dev/fold_cost.py [--shape 16384x768x3072] [--rounds 6] [--reps 100] [--profile]
"""
import argparse
import copy
import cProfile
import pstats
import statistics
import time

import torch

import fp8ops
from fp8ops import scaling
from layer_iteration import layer_and_batch, make_iteration as make, settled_bf16  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="16384x768x3072")
ap.add_argument("--rounds", type=int, default=6)
ap.add_argument("--reps", type=int, default=100)
ap.add_argument("--profile", action="store_true", help="then cProfile the BF16 layer's iterations")
args = ap.parse_args()

(M, K, N), base, x, g = layer_and_batch(args.shape)


fp8 = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always"))
auto = settled_bf16(base, x, g, True)
make(auto, x, g, True)()  # (rests at this step)
runs = [0]
auto_it = make(auto, x, g, True)


def counted():
    runs[0] += 1
    auto_it()


fns = {"nn.Linear": make(copy.deepcopy(base), x, g, False),
       "Fp8Linear (FP8) + step": make(fp8, x, g, True),
       "Fp8Linear (auto, BF16) + step": counted}
calls0 = auto.fp8_fallback_calls


def rounds(label: str, setup=None) -> None:
    host = {k: [] for k in fns}
    gpu = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            if setup:
                setup()
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(args.reps):
                fn()
            h = time.perf_counter() - t
            torch.cuda.synchronize()
            host[k].append(h / args.reps * 1e6)
            gpu[k].append((time.perf_counter() - t) / args.reps * 1e3)
    print(f"== {label}")
    for k in fns:
        print(f"  {k:32} host {statistics.median(host[k]):7.1f} us   per iteration "
              f"{statistics.median(gpu[k]):.3f} ms (rounds {min(gpu[k]):.3f}-{max(gpu[k]):.3f})", flush=True)


print(f"shape {M}x{K}x{N}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
print(f"auto layer: verdicts {auto.fp8_policy}, pristine (rested) {auto._fp8_pristine}")
rounds("no FP8 forward compiled in this process")
# a compiled Fp8Linear, trained one step and kept alive (bench_linear's compiled variant)
other = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always"))
cfn = torch.compile(other)
for _ in range(3):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = cfn(x)
    y.backward(g)
    fp8ops.step(other)
assert other.fp8_grad_amax.item() == 0, "the fold read the compiled layer's dy amax"
written = scaling._written_grad_amaxes
for i in range(2):
    rounds(f"after a compiled trace, the record of compiled writes on (pass {i + 1})",
           lambda: setattr(scaling, "_written_grad_amaxes", written))
    rounds(f"after a compiled trace, the record off: every live layer read (pass {i + 1})",
           lambda: setattr(scaling, "_written_grad_amaxes", lambda: None))
scaling._written_grad_amaxes = written
if args.profile:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        fns["Fp8Linear (auto, BF16) + step"]()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\n== cProfile, the BF16 layer + step, {args.reps} iterations")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
print(f"auto layer: {auto.fp8_fallback_calls - calls0} BF16 forwards in {runs[0]} timed iterations, "
      f"pristine {auto._fp8_pristine}")
