"""SM clock and power while one layer's fwd + bwd (+ fp8ops.step) runs back to back for
3 seconds, BF16 nn.Linear vs Fp8Linear, each after a 1-second idle gap, twice; and the
time per iteration just after the gap against a few seconds in. nvidia-smi is only read
(--query-gpu), nothing is set.
    python benchmarks/dev/power_clocks.py [MxKxN]
"""
import datetime
import statistics
import subprocess
import sys
import time

import torch

from fp8ops import Fp8Config
from fp8ops.linear import Fp8Linear
from layer_iteration import make_iteration  # this folder

M, K, N = map(int, (sys.argv[1] if len(sys.argv) > 1 else "16384x4096x14336").split("x"))
x = torch.randn(M, K, device="cuda", requires_grad=True)
g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
sides = {"bf16": make_iteration(torch.nn.Linear(K, N, bias=False, device="cuda"), x, g, step=False),
         "fp8": make_iteration(Fp8Linear(K, N, bias=False, device="cuda", config=Fp8Config(policy="always")),
                               x, g, step=True)}
smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
                        "--format=csv,noheader,nounits", "-lms", "50"], stdout=subprocess.PIPE, text=True)
windows = []
for rnd in range(2):
    for name, it in sides.items():
        for _ in range(5):
            it()
        torch.cuda.synchronize()
        time.sleep(1.0)  # idle, as between bursts
        t0, events = time.time(), []
        while time.time() - t0 < 3.0:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            events.append(e)
            for _ in range(5):
                it()
            if len(events) > 4:
                events[-4].synchronize()  # keep the host a few chunks ahead, never further
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append(e)
        e.synchronize()
        per = [events[i].elapsed_time(events[i + 1]) / 5 for i in range(len(events) - 1)]
        windows.append((name, t0 + 0.5, time.time()))
        print(f"round {rnd} {name}: ms/iter first chunks {[round(p, 3) for p in per[:4]]}, "
              f"last chunks {[round(p, 3) for p in per[-4:]]}, median {statistics.median(per):.3f}", flush=True)
smi.terminate()
samples = []
for line in smi.communicate()[0].strip().splitlines():
    ts, clk, pw, temp = (s.strip() for s in line.split(","))
    t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
    samples.append((t, float(clk), float(pw), float(temp)))
for name, a, b in windows:  # from 0.5 s into each loop to its end
    sel = [s for s in samples if a <= s[0] <= b]
    if not sel:
        print(f"{name}: no nvidia-smi samples in the window ({len(samples)} in all)")
        continue
    print(f"{name}: SM clock median {statistics.median(s[1] for s in sel):.0f} MHz (min {min(s[1] for s in sel):.0f}), "
          f"power median {statistics.median(s[2] for s in sel):.0f} W, temp {max(s[3] for s in sel):.0f} C, n={len(sel)}")
