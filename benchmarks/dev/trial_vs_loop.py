"""Why policy "auto"'s trial, in bench_linear's warm-up, times steps about twice as long as
the same layer's iterations in the timed loop after it (e.g. 0.632 ms BF16 steps in the trial,
then 0.349 ms per iteration timed: results/linear_quick_h200_s17a.json), and chose BF16 where
FP8 then measured 1.17x. One layer under policy "auto", iterations one after another (no
synchronize), each marked with a CUDA event and the host clock:
  - the first trial, from the layer's first call (policy.measure at step 0);
  - the same trial re-armed twice more on the warm loop (its timing kept, its verdict dropped);
  - the references, back to back: nn.Linear and the layer forced FP8.
For every iteration it prints host ms and GPU ms (event to event), and for each trial the
step lists it counted and its verdict.
    python benchmarks/dev/trial_vs_loop.py [--shapes 16384x768x3072,16384x3072x768] [--iters 40]
"""
import argparse
import copy
import statistics
import time

import torch

import fp8ops
from fp8ops import loop_trial, policy
from layer_iteration import layer_and_batch, make_iteration as make  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="16384x768x3072,16384x3072x768")
ap.add_argument("--iters", type=int, default=40, help="iterations per phase (a trial needs 26)")
ap.add_argument("--trials", type=int, default=3)
args = ap.parse_args()

_choose = loop_trial.choose
chosen: list = []


def choose(bf16_ms, fp8_ms):
    out = _choose(bf16_ms, fp8_ms)
    chosen.append((list(bf16_ms), list(fp8_ms), out))
    return out


loop_trial.choose = choose


def run(it, n: int) -> list[tuple[float, float]]:
    """(host ms, GPU ms) of each of n iterations run back to back."""
    marks = []
    for _ in range(n + 1):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        marks.append((time.perf_counter(), ev))
        if len(marks) <= n:
            it()
    marks[-1][1].synchronize()
    return [((b[0] - a[0]) * 1e3, a[1].elapsed_time(b[1])) for a, b in zip(marks, marks[1:])]


def show(name: str, per_it: list[tuple[float, float]]) -> None:
    host, gpu = [h for h, _ in per_it], [g for _, g in per_it]
    print(f"  {name}: median host {statistics.median(host):.3f} ms, GPU {statistics.median(gpu):.3f} ms "
          f"(mean of the last half: host {statistics.fmean(host[len(host) // 2:]):.3f}, "
          f"GPU {statistics.fmean(gpu[len(gpu) // 2:]):.3f})")
    print("    host " + " ".join(f"{h:.2f}" for h in host))
    print("    gpu  " + " ".join(f"{g:.2f}" for g in gpu), flush=True)


for shape in args.shapes.split(","):
    (M, K, N), base, x, g = layer_and_batch(shape)
    print(f"== {M}x{K}->{N}", flush=True)
    layer = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
    it = make(layer, x, g, True)
    key = (M, torch.bfloat16)
    for trial in range(args.trials):
        chosen.clear()
        show(f"trial {trial + 1} ({'from the first call' if trial == 0 else 're-armed'})", run(it, args.iters))
        for b, f, (fp8, why) in chosen:
            print(f"    verdict {'FP8' if fp8 else 'BF16'}: {why}")
            print("    BF16 steps " + " ".join(f"{v:.3f}" for v in b))
            print("    FP8 steps  " + " ".join(f"{v:.3f}" for v in f))
        if not chosen:
            print(f"    no trial verdict: {layer.fp8_policy_why.get(key) or layer.fp8_policy.get(key)}")
        if chosen:  # re-arm: the verdict dropped, the shape pending again (as after policy.measure)
            layer.fp8_policy.pop(key, None)
            layer.__dict__["_fp8_bf16_key"] = None
            layer._fp8_pending[key] = policy.Timing(1.0, 1.0, 1.0, 1.0, 0.0, 0.0)
    forced = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="always"))
    refs = {"nn.Linear": make(copy.deepcopy(base), x, g, False), "FP8 forced": make(forced, x, g, True)}
    for rnd in range(2):
        for name, fn in refs.items():
            show(f"{name} (round {rnd + 1})", run(fn, args.iters))
