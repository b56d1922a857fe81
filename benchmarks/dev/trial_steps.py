"""Run a benchmark script with policy "auto"'s trial printing every step it timed:
    python benchmarks/dev/trial_steps.py benchmarks/bench_train.py --models 1b ...
Each decision prints the trial's step lengths in order (ms; step 0 first), each
step's host and GPU time apart (its length is their max), the counted steps of
each side, and the verdict with its reason (loop_trial.choose); and what the
other estimate of each side (the larger of its mean host time and mean GPU time)
would have chosen, and how many cudaMalloc segments the trial's steps allocated.
TRIAL_ALWAYS=1 sends every shape to the trial (no verdict from the two timings alone).
"""
import os
import runpy
import statistics
import sys

import torch

from fp8ops import loop_trial, policy

if os.environ.get("TRIAL_ALWAYS") == "1":
    policy.SURE_SPEEDUP = float("inf")

_choose, _step_ms = loop_trial.choose, loop_trial.step_ms
_all_steps: list = []
_split: list = []
_segments: list = []
_mark = loop_trial._mark


def mark(t):
    if not t.marks:
        _segments[:] = [torch.cuda.memory_stats().get("segment.all.allocated", 0)]
    _mark(t)


def step_ms(marks, steps):
    _all_steps[:] = _step_ms(marks, range(len(marks) - 1))
    _split[:] = [((b[0] - a[0]) * 1e3, a[1].elapsed_time(b[1])) for a, b in zip(marks, marks[1:])]
    return _step_ms(marks, steps)


def choose(bf16_ms, fp8_ms):
    out = _choose(bf16_ms, fp8_ms)
    print("TRIAL steps", [round(v, 3) for v in _all_steps], "| BF16", [round(v, 3) for v in bf16_ms],
          "| FP8", [round(v, 3) for v in fp8_ms], "->", out, flush=True)
    print("TRIAL host", [round(h, 3) for h, _ in _split], flush=True)
    print("TRIAL gpu ", [round(g, 3) for _, g in _split], flush=True)
    side = {fp8: [_split[s] for s in loop_trial.counted(fp8)] for fp8 in (False, True)}
    est = {fp8: max(statistics.fmean(h for h, _ in v), statistics.fmean(g for _, g in v)) for fp8, v in side.items()}
    print(f"TRIAL max(mean host, mean GPU): FP8 {est[True]:.3f} vs BF16 {est[False]:.3f} ms -> "
          f"{'FP8' if est[False] >= est[True] * loop_trial.STEP_GAIN else 'BF16'}; cudaMalloc segments "
          f"during the trial: {torch.cuda.memory_stats().get('segment.all.allocated', 0) - _segments[0]}", flush=True)
    return out


loop_trial.choose, loop_trial.step_ms, loop_trial._mark = choose, step_ms, mark
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # its own imports (bench_common)
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
