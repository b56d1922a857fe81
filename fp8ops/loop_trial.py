"""A trial in the user's own training loop: what decides policy "auto" for the
layers whose two timings do not settle it (policy.verdict() returned None:
faster in FP8 on the GPU but slower alone -- small layers on a slow host -- or
a gain too small to trust a one-time timing). Whether FP8 pays for them depends
on the loop: where the GPU is the bottleneck, FP8's extra host time hides
behind it; where the host is, it adds to every step. Neither can be read off
one layer timed alone, and a short drain-and-sample of the host's lead misses
the lead a loop builds up over several steps (tried: in a GPU-bound GPT-2 run
it saw none in the forward and kept every layer BF16, 13 % slower than FP8).
So the trial times the loop itself, both ways.

One trial per device, for all the layers waiting on it:
  - the first of them to report (decision()) is the anchor; each call of the
    anchor starts a "step" and is marked with a CUDA event and the host time;
  - step 0 (the one that measured the shapes) runs BF16 and is not counted;
    then eight blocks of BLOCK steps run the waiting layers in BF16 or FP8 in
    the order B F F B F B B F (Thue-Morse): the counted steps of both sides
    have the same mean position, and the same mean square, so a drift of the
    loop's speed that is linear or quadratic in the step cancels in the means
    instead of favouring the side that runs later, as B F B F does. A
    transient that fades within a step or two lands on step 0 and the
    uncounted first steps (the runs so far showed none past step 0); a longer
    one would count against block 0, BF16. The first step of each block is not
    counted (the launch queue refills or drains after a switch). The shorter
    form before it (B F B F, 2 counted steps per block, medians) kept a 1B
    model's attention-output layers BF16 in both of its runs; this one chose
    FP8 there in all three, as fast as running every layer FP8 (H200);
  - each counted step lasts max(host time, GPU time) between two marks: the GPU
    time where the host runs ahead of it, the host time where it does not;
  - at the anchor's call that starts step DECIDE_AT (one synchronize): FP8 if
    the mean FP8 step is at least STEP_GAIN shorter than the mean BF16 step,
    else BF16, for every layer that waited. Means, because only means cancel
    the drift; each side's longest step is left out of them if it is over
    OUTLIER x the median (an evaluation, a checkpoint save).
Where an optimizer steps (fp8ops' step hook, update_scales, tells note_optimizer_step),
a trial step is an optimizer step: the first call of any waiting layer after one marks
it, and the calls until the next (gradient accumulation's micro-batches, a layer called
several times, other row-count buckets, evaluation batches in between) take its path, so
the optimizer step's own time falls once into every step and activation checkpointing
recomputes each call on the path it took.
A trial that met several anchor calls before the first optimizer step (micro-batches)
restarts at it. In a loop without one, each anchor call is a step.
A forward that runs inside a backward (activation checkpointing's recomputation)
takes the path of its step and marks nothing. So does a forward without autograd (no_grad,
inference_mode) of a layer with a trainable weight before the process's first optimizer step:
an evaluation before training (nanoGPT evaluates at iteration 0, 400 batches) would otherwise
be the whole trial, timing forward-only steps for a verdict that then holds for training.
(Reentrant activation checkpointing also runs its forward without autograd; that is a training
forward, which the rule then treats alike until the first optimizer step: its recomputation
takes the same path. A frozen layer, whose weight no optimizer steps, is not held back: for it
the first optimizer step may never come.) A loop that only ever evaluates (inference) is let
through after EVAL_ONLY_CALLS such calls of one layer with no training call between them: its
calls are then the steps. An anchor not seen for
STALE_CALLS calls of the other waiting layers (its model is no longer called, or
was freed) restarts the trial with the next caller. Every step of this depends
on this rank's call sequence only and issues no collective: data-parallel ranks
run their trials on their own and agree on the verdicts at the next optimizer
step (policy_ranks.py).
"""
from __future__ import annotations

import logging
import statistics
import time
import weakref

import torch

from . import policy

BLOCK = 3                                  # steps per block; the first of each settles
SCHEDULE = (False, True, True, False, True, False, False, True)  # the blocks after step 0: FP8 or not
DECIDE_AT = 1 + BLOCK * len(SCHEDULE)      # the anchor's call that starts this step decides
STEP_GAIN = 1.005        # FP8 must shorten the step by 0.5 % (timing noise): else the plain path
OUTLIER = 1.5            # a step this many times the median is not a training step like the others
STALE_CALLS = 1024       # calls of other waiting layers without the anchor: a new trial
EVAL_ONLY_CALLS = 4096   # no-autograd calls of one layer, no training call between: an inference loop

_log = logging.getLogger("fp8ops")


def step_fp8(s: int) -> bool:
    """Does step s of the trial run the waiting layers in FP8?"""
    return s >= 1 and SCHEDULE[min((s - 1) // BLOCK, len(SCHEDULE) - 1)]


def counted(fp8: bool) -> list[int]:
    """The steps whose length counts for one side."""
    return [s for s in range(1, DECIDE_AT) if (s - 1) % BLOCK and step_fp8(s) == fp8]


# optimizer steps so far, i.e. scale updates (update_scales calls note_optimizer_step; scaling.py
# also reads this count for its once-per-step rule): where the loop has them, they delimit
# the trial's steps
_optimizer_steps = 0


def note_optimizer_step() -> int:
    global _optimizer_steps
    _optimizer_steps += 1
    return _optimizer_steps


def optimizer_steps() -> int:
    return _optimizer_steps


class _Trial:
    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device  # (the layers' GPU: its stream is the one timed)
        self.pending: dict[tuple, policy.Timing] = {}        # (id(layer), key) -> its timing
        self.decided: dict[tuple, tuple[bool, str]] = {}     # -> (FP8, why), until picked up
        self.anchor: tuple | None = None
        self.marks: list[tuple[float, torch.cuda.Event]] = []  # (host s, event) at each counted anchor call
        self.since_anchor = 0
        self.at_step: int | None = None   # _optimizer_steps at the last mark
        self.by_step = False               # steps are optimizer steps (one was seen during the trial)
        self.eval_calls: dict[tuple, int] = {}  # (id(layer), key) -> no-autograd calls since a training call

    @property
    def fp8_now(self) -> bool:
        return step_fp8(len(self.marks) - 1)  # the anchor marked the current step

    def reset(self) -> None:
        # (eval_calls stays: an inference loop whose anchor went stale keeps its count)
        self.anchor, self.marks, self.since_anchor, self.at_step, self.by_step = None, [], 0, None, False


_trials: dict[int, _Trial] = {}


def _trial(device: torch.device) -> _Trial:
    i = device.index if device.index is not None else torch.cuda.current_device()
    t = _trials.get(i)
    if t is None:
        t = _trials[i] = _Trial(device if device.type == "cuda" and device.index is not None else None)
    return t


def forget(layer, key=None) -> None:
    """Drop what layer waits on (for key, or for every key: the layer moved)."""
    _forget_id(id(layer), key)


def _forget_id(layer_id: int, key=None) -> None:
    def mine(lk):
        return lk[0] == layer_id and (key is None or lk[1] == key)
    for t in _trials.values():
        waited = bool(t.pending)
        for d in (t.pending, t.decided, t.eval_calls):
            for lk in [lk for lk in d if mine(lk)]:
                del d[lk]
        if (t.anchor is not None and mine(t.anchor)) or (waited and not t.pending):
            # (its anchor, or the last layer that waited on it: a trial left unfinished, e.g. a
            # model deleted before its 25th step, does not go on counting the next model's steps)
            t.reset()


def _watch(layer) -> None:
    """Forget layer's entries when it dies (its id may be a new layer's then)."""
    d = layer.__dict__
    if "_fp8_trial_watch" not in d:
        try:
            f = weakref.finalize(layer, _forget_id, id(layer))
            f.atexit = False  # (nothing to forget at the interpreter's exit)
        except TypeError:  # (an object without weak references: a test's stand-in)
            f = None
        d["_fp8_trial_watch"] = f


def _mark(t: _Trial) -> None:
    ev = torch.cuda.Event(enable_timing=True)
    if t.device is not None and t.device.index != torch.cuda.current_device():
        with torch.cuda.device(t.device):  # (the layers' GPU, not the current one: its stream)
            ev.record()
    else:
        ev.record()
    t.marks.append((time.perf_counter(), ev))
    t.at_step = _optimizer_steps


def step_ms(marks: list, steps) -> list[float]:
    """Each step's length: max(host time, GPU time) between its mark and the next."""
    return [max((marks[s + 1][0] - marks[s][0]) * 1e3, marks[s][1].elapsed_time(marks[s + 1][1])) for s in steps]


def choose(bf16_ms: list[float], fp8_ms: list[float]) -> tuple[bool, str]:
    """(FP8, why) from the counted steps of each side: their means, each side's
    longest step left out if it is an outlier. One at most: an evaluation or a
    save comes once in a trial, while a stall that recurs is a cost of that side."""
    limit = OUTLIER * statistics.median(bf16_ms + fp8_ms)

    def kept(ms):
        out = list(ms)
        if len(out) > 1 and max(out) > limit:
            out.remove(max(out))
        return out
    kept_b, kept_f = kept(bf16_ms), kept(fp8_ms)
    b, f = statistics.fmean(kept_b), statistics.fmean(kept_f)
    left_out = len(bf16_ms) + len(fp8_ms) - len(kept_b) - len(kept_f)
    return b >= f * STEP_GAIN, (f"trial in your loop: step {f:.3f} ms with FP8 vs {b:.3f} ms with BF16 "
                                f"(means of {len(kept_f)} and {len(kept_b)} steps; FP8 "
                                f"{min(kept_f):.3f}-{max(kept_f):.3f}, BF16 {min(kept_b):.3f}-{max(kept_b):.3f}"
                                + (f"; outlier steps left out: {left_out}" if left_out else "") + ")")


def progress(layer, key) -> str:
    """Where the trial that layer's verdict for key waits on stands (fp8ops.report)."""
    for t in _trials.values():
        if (id(layer), key) in t.decided:
            fp8 = t.decided[(id(layer), key)][0]
            return f"the trial in your loop chose {'FP8' if fp8 else 'BF16'}; applied at its next call"
        if (id(layer), key) in t.pending:
            if not t.marks:
                break
            return (f"waiting on the trial in your loop: step {len(t.marks) - 1} of {DECIDE_AT}, "
                    f"BF16 and FP8 in turns ({len(t.pending)} layers wait on it)")
    return "waiting on the trial in your loop: not started"


def decision(layer, key, timing: policy.Timing) -> tuple[bool, str | None]:
    """At each forward of a layer whose verdict for key (its (M, dtype)) waits on
    the trial: (run FP8 now, why) -- why is None while the trial runs, and
    otherwise says how the final verdict was reached."""
    t = _trial(layer.weight.device)
    lk = (id(layer), key)
    if lk in t.decided:
        return t.decided.pop(lk)
    if lk not in t.pending:
        t.pending[lk] = timing
        _watch(layer)
    if torch._C._current_graph_task_id() != -1:
        # a forward inside a backward: activation checkpointing's recomputation. It must take the
        # path the step's forward took (checkpoint checks the saved tensors match), and is no step
        return t.fp8_now, None
    if _optimizer_steps == 0:
        if not torch.is_grad_enabled() and layer.weight.requires_grad:
            # an evaluation before the first optimizer step: no trial step (see the docstring)
            n = t.eval_calls[lk] = t.eval_calls.get(lk, 0) + 1
            if n <= EVAL_ONLY_CALLS:
                return t.fp8_now, None
        elif t.eval_calls:
            t.eval_calls = {}  # training calls: the evaluation before them was one
    if t.by_step:
        if _optimizer_steps == t.at_step:
            return t.fp8_now, None  # the same optimizer step: one step, one path
        # the first call of a waiting layer after an optimizer step starts the next step
        return _next_step(t, lk)
    if t.anchor is None:
        t.anchor = lk
    if lk == t.anchor:
        t.since_anchor = 0
        if t.marks and _optimizer_steps != t.at_step:
            # an optimizer step: from here on the trial's steps are optimizer steps; calls
            # before the first (micro-batches of one step) do not count: it restarts
            t.by_step = True
            if len(t.marks) > 1:
                t.marks = []
        return _next_step(t, lk)
    t.since_anchor += 1
    if t.since_anchor > STALE_CALLS:
        t.reset()
        t.anchor = lk
        _mark(t)
    return t.fp8_now, None


def _next_step(t: _Trial, lk: tuple) -> tuple[bool, str | None]:
    """Mark the start of the trial's next step; at step DECIDE_AT, decide (one
    synchronize) for every waiting layer."""
    _mark(t)
    if len(t.marks) <= DECIDE_AT:
        return t.fp8_now, None
    t.marks[-1][1].synchronize()  # every mark's event has completed
    fp8, why = choose(step_ms(t.marks, counted(False)), step_ms(t.marks, counted(True)))
    from .policy_ranks import world  # noqa: PLC0415
    _log.info("fp8ops policy auto: the trial in your loop chose %s for %d layers (%s)%s",
              "FP8" if fp8 else "BF16", len(t.pending), why,
              "; the ranks agree at the next optimizer step: FP8 only where every rank chose it"
              if world() > 1 else "")
    for other, tm in t.pending.items():
        t.decided[other] = (fp8, f"{why} ({len(t.pending)} layers waited on it; GPU "
                                 f"{tm.gpu_speedup:.2f}x, alone {tm.alone_speedup:.2f}x)")
    t.pending.clear()
    t.reset()
    return t.decided.pop(lk)
