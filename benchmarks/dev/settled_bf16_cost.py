"""Host time of a layer policy "auto" settled BF16 after it had cast (its trial's FP8
steps), rested (scaling.update_scales) or not, against nn.Linear and against a layer that
never cast, at a shape small enough
that the host sets the pace (fwd + bwd under bf16 autocast, + fp8ops.step where named);
then cProfile of the after-trial layer's iterations.
    python benchmarks/dev/settled_bf16_cost.py [--shape 256x256x256] [--rounds 8] [--reps 200]
"""
import argparse
import copy
import cProfile
import pstats
import statistics
import time

import torch

from layer_iteration import layer_and_batch, make_iteration as make, settled_bf16  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="256x256x256")
ap.add_argument("--rounds", type=int, default=8)
ap.add_argument("--reps", type=int, default=200)
args = ap.parse_args()

(M, K, N), base, x, g = layer_and_batch(args.shape)
never, after, kept = (settled_bf16(base, x, g, False), settled_bf16(base, x, g, True),
                      settled_bf16(base, x, g, True, rest=False))
fns = {"nn.Linear": make(copy.deepcopy(base), x, g, False),
       "BF16, never cast, + step": make(never, x, g, True),
       "BF16 after FP8 steps, rested, + step": make(after, x, g, True),
       "BF16 after FP8 steps, not rested, + step": make(kept, x, g, True),
       "BF16 after FP8 steps, no step": make(after, x, g, False)}
host = {k: [] for k in fns}
for _ in range(args.rounds):
    for k, fn in fns.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(args.reps):
            fn()
        host[k].append((time.perf_counter() - t) / args.reps * 1e6)
        torch.cuda.synchronize()
for k, v in host.items():
    print(f"  {k:32} host {statistics.median(v):7.1f} us per iteration (rounds {min(v):.1f}-{max(v):.1f})")
print(f"  pristine (rests, so no update): never cast {never._fp8_pristine}, rested {after._fp8_pristine}, "
      f"not rested {kept._fp8_pristine}", flush=True)
for k in ("nn.Linear", "BF16 after FP8 steps, not rested, + step"):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.reps):
        fns[k]()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\n== cProfile, {k}, {args.reps} iterations")
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
