"""Run a benchmark script with policy "auto"'s trial printing every step it timed:
    python benchmarks/dev/trial_steps.py benchmarks/bench_train.py --models 1b ...
Each decision prints the trial's step lengths in order (ms; step 0 first), the
counted steps of each side, and the verdict with its reason (loop_trial.choose)."""
import os
import runpy
import sys

from fp8ops import loop_trial

_choose, _step_ms = loop_trial.choose, loop_trial.step_ms
_all_steps: list = []


def step_ms(marks, steps):
    _all_steps[:] = _step_ms(marks, range(len(marks) - 1))
    return _step_ms(marks, steps)


def choose(bf16_ms, fp8_ms):
    out = _choose(bf16_ms, fp8_ms)
    print("TRIAL steps", [round(v, 3) for v in _all_steps], "| BF16", [round(v, 3) for v in bf16_ms],
          "| FP8", [round(v, 3) for v in fp8_ms], "->", out, flush=True)
    return out


loop_trial.choose, loop_trial.step_ms = choose, step_ms
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))  # its own imports (bench_common)
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
