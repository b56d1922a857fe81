"""Why policy "auto"'s trial times FP8 steps longer than the same layer forced FP8 runs them.
In bench_linear's full tables (thirty-fourth to fortieth sessions) the trial at 4096^3 read
FP8 steps of 0.60-0.78 ms where the forced layer, timed in the same process, ran 0.41 ms.
Here, in one process, rounds alternate: a layer forced FP8 (warm), then a fresh layer under
policy "auto" sent to the trial (policy.SURE_SPEEDUP = inf), each step a bench_linear
iteration (fwd + bwd under bf16 autocast + fp8ops.step); per step the host time to queue it
and the GPU time between CUDA events, and which path the trial step took. Then cProfile and
torch.profiler (CPU ops) over the trial's counted FP8 steps against as many forced steps.
    python benchmarks/dev/trial_host.py [--shape 4096x4096x4096] [--rounds 3]
"""
import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops
from fp8ops import loop_trial, policy
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shape", default="4096x4096x4096")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--warmup", type=int, default=30)
args = ap.parse_args()
os.environ.setdefault("FP8OPS_POLICY_CACHE", os.path.join(tempfile.mkdtemp(), "policy.json"))
policy.SURE_SPEEDUP = float("inf")  # every shape to the trial
(M, K, N), base, x, g = layer_and_batch(args.shape)
STEPS = loop_trial.DECIDE_AT + 1  # step 0 (measures) .. DECIDE_AT (decides)


def timed(it, n):
    """Host ms to queue each of n iterations, GPU ms between events around each."""
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    host = []
    torch.cuda.synchronize()
    ev[0].record()
    for i in range(n):
        t = time.perf_counter()
        it()
        ev[i + 1].record()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    return host, [ev[i].elapsed_time(ev[i + 1]) for i in range(n)]


def med(v):
    return f"{statistics.median(v):.3f}" if v else "-"


forced = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always"))
it_forced = make(forced, x, g, True)
for _ in range(args.warmup):
    it_forced()
fp8_steps = loop_trial.counted(True)
bf16_steps = loop_trial.counted(False)
for r in range(args.rounds):
    fh, fg = timed(it_forced, len(fp8_steps) + len(bf16_steps))
    auto = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
    it_auto = make(auto, x, g, True)
    calls = auto.__dict__
    paths = []

    def it_tracked():
        before = calls["fp8_fallback_calls"]
        it_auto()
        paths.append(calls["fp8_fallback_calls"] == before)  # FP8 if no fallback call was counted
    ah, ag = timed(it_tracked, STEPS)
    sel = {True: fp8_steps, False: bf16_steps}
    print(f"round {r}: forced FP8 host {med(fh)} GPU {med(fg)} ms | trial FP8 steps host "
          f"{med([ah[s] for s in sel[True]])} GPU {med([ag[s] for s in sel[True]])} | trial BF16 steps host "
          f"{med([ah[s] for s in sel[False]])} GPU {med([ag[s] for s in sel[False]])} | verdict "
          f"{dict(auto.fp8_policy)}", flush=True)
    print("  trial path per step (F = FP8):", "".join("F" if p else "B" for p in paths), flush=True)
    print("  trial host per step:", [round(v, 3) for v in ah], flush=True)
    print("  trial GPU  per step:", [round(v, 3) for v in ag], flush=True)

# profiles of the last round's kind: a fresh trial, its counted FP8 steps against forced steps
auto = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
it_auto = make(auto, x, g, True)
want = set(fp8_steps)
for name, tool in (("cProfile", "cp"), ("torch.profiler", "tp")):
    for label, run in (("trial FP8 steps", None), ("forced FP8", it_forced)):
        if run is None:
            auto = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
            it_auto = make(auto, x, g, True)
        n = len(fp8_steps)
        prof = cProfile.Profile() if tool == "cp" else profile(activities=[ProfilerActivity.CPU])
        torch.cuda.synchronize()
        if tool == "tp":
            prof.__enter__()
        for s in range(STEPS if run is None else n):
            on = run is not None or s in want
            if on and tool == "cp":
                prof.enable()
            (run or it_auto)()
            if on and tool == "cp":
                prof.disable()
        torch.cuda.synchronize()
        if tool == "tp":
            prof.__exit__(None, None, None)
            print(f"\n== {name}: {label} ({'whole trial' if run is None else n} steps)")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
        else:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            print(f"\n== {name}: {label} ({n} steps)\n" + s.getvalue()[-4000:])
