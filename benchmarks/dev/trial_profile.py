"""Where the time of policy "auto"'s trial steps goes: torch.profiler over the trial's steps of
one layer (fwd + bwd + fp8ops.step per step, as bench_linear's warm-up runs them) and over the
same number of steps of the layer forced FP8, CPU and GPU tables side by side.
    python benchmarks/dev/trial_profile.py [--shape 4096x4096x4096]
"""
import argparse
import copy

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4096x4096x4096")
ap.add_argument("--rows", type=int, default=22)
args = ap.parse_args()
(M, K, N), base, x, g = layer_and_batch(args.shape)
for name, policy in (("auto (the trial's steps 1-24)", "auto"), ("forced FP8", "always")):
    layer = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy=policy))
    it = make(layer, x, g, True)
    it()  # step 0: policy.measure (auto)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(24):
            it()
        torch.cuda.synchronize()
    print(f"\n== {name}: verdict {dict(layer.fp8_policy)}; pending {list(layer._fp8_pending)}")
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
