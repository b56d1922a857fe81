"""How far the host runs ahead of the GPU in the user's own loop: what decides
policy "auto" for a layer whose FP8 path is faster on the GPU but slower alone
(policy.verdict() returned None; small layers on a slow host). In a GPU-bound
loop the host runs ahead of the GPU and FP8's extra host time hides in that
lead; in a host-bound loop it adds to every step.

One round, per device:
  1. Pending layers report in (decision()) and run BF16; the first is the anchor.
  2. At the anchor's next forward the GPU is drained (one synchronize) and an
     event E0 marks time zero on both clocks. From there on, every forward of a
     pending layer, and through a gradient hook the start of its backward,
     records a CUDA event and the host's time.
  3. At the anchor's next forward after that, one iteration later, the lead at
     each point is when the GPU reached the event minus when the host recorded
     it. The pending layers are taken in call order: a layer runs FP8 if it is
     faster on the GPU and its extra host time per call, added to that of the
     layers taken before it, leaves a lead of at least LEAD_MARGIN_MS at every
     later point (and there is a later point).
An anchor not seen for STALE_CALLS calls of the other pending layers (a model
no longer called, or freed) ends the round unfinished, and the next pending
layer starts a new one. Every step of this is a function of the call sequence,
which is the same on every data-parallel rank: ranks stay in step, and the
caller all-reduces each decision.

The approximations err toward BF16, the layer's plain path: the lead right
after the drain understates a steady state in which the host had run several
steps ahead; in a loop that synchronizes every step (loss.item()) the lead is
small early in the step; a measurement of a new shape inside the window (its
syncs) zeroes the lead after it.
"""
from __future__ import annotations

import time

import torch

from . import policy

LEAD_MARGIN_MS = 0.05   # lead kept at every point, against timing noise
MAX_SAMPLES = 8192      # a sampling window this long ends the round
STALE_CALLS = 1024      # calls of other pending layers without the anchor: a new round


class _Round:
    def __init__(self) -> None:
        self.pending: dict[tuple, policy.Timing] = {}  # (id(layer), key) -> its timing
        self.decided: dict[tuple, tuple[bool, str]] = {}  # -> (FP8, why), until the layer picks it up
        self.anchor: tuple | None = None
        self.sampling = False
        self.e0: torch.cuda.Event | None = None
        self.t0 = 0.0
        self.samples: list[tuple[float, torch.cuda.Event]] = []  # (host s, event)
        self.first_fwd: dict[tuple, int] = {}  # (id(layer), key) -> its first forward sample
        self.since_anchor = 0  # calls of other pending layers since the anchor's last one


_rounds: dict[int, _Round] = {}


def _round(device: torch.device) -> _Round:
    i = device.index if device.index is not None else torch.cuda.current_device()
    r = _rounds.get(i)
    if r is None:
        r = _rounds[i] = _Round()
    return r


def forget(layer, key=None) -> None:
    """Drop what layer has pending (for key, or for every key: the layer moved)."""
    def mine(lk):
        return lk[0] == id(layer) and (key is None or lk[1] == key)
    for r in _rounds.values():
        for d in (r.pending, r.decided, r.first_fwd):
            for lk in [lk for lk in d if mine(lk)]:
                del d[lk]
        if r.anchor is not None and mine(r.anchor):
            _reset(r)


def _reset(r: _Round) -> None:
    r.anchor, r.sampling, r.e0, r.samples, r.first_fwd, r.since_anchor = None, False, None, [], {}, 0


def _sample(r: _Round) -> None:
    ev = torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    ev.record()
    r.samples.append((t, ev))


def decision(layer, key, timing: policy.Timing) -> tuple[bool, str] | None:
    """At each forward of a layer whose verdict for key (its (M, dtype)) waits on
    the host's lead: (FP8 or not, why) once decided, else None (run BF16 for now)."""
    dev = layer.weight.device
    r = _round(dev)
    lk = (id(layer), key)
    if lk in r.decided:
        return r.decided.pop(lk)
    r.pending.setdefault(lk, timing)
    if r.anchor is None:
        r.anchor = lk
        return None
    if lk == r.anchor:
        r.since_anchor = 0
        if not r.sampling:
            torch.cuda.synchronize(dev)
            r.e0 = torch.cuda.Event(enable_timing=True)
            r.e0.record()
            r.t0 = time.perf_counter()
            r.sampling = True
        else:
            _finish(r, dev)
            return r.decided.pop(lk, None)
    else:
        r.since_anchor += 1
        if r.since_anchor > STALE_CALLS:
            _reset(r)
            r.anchor = lk
            return None
    if r.sampling and lk in r.pending:
        r.first_fwd.setdefault(lk, len(r.samples))
        _sample(r)
        if len(r.samples) >= MAX_SAMPLES:
            _finish(r, dev)
    return None


def watch(layer, key, y: torch.Tensor) -> None:
    """While sampling: a point at the start of the backward of y (layer's output)."""
    r = _round(layer.weight.device)
    if r.sampling and y.requires_grad and (id(layer), key) in r.pending:
        e0 = r.e0

        def hook(_grad):
            if r.sampling and r.e0 is e0:  # still the same round
                _sample(r)
        y.register_hook(hook)


def choose(leads: list[float], layers: list[tuple[object, int, policy.Timing]]) -> dict:
    """The decision from one round's samples. leads: ms at each sample point, in
    order; layers: (id, index of its first forward sample, Timing), in call
    order. Returns {id: (FP8, why)}. A layer taken for FP8 adds its extra host
    time to every later point (all of it at its forward: the backward's share
    is charged early, which errs toward BF16)."""
    charged = [0.0] * len(leads)
    out = {}
    for lk, i, t in sorted(layers, key=lambda e: e[1]):
        extra = t.extra_host_ms
        later = range(i + 1, len(leads))
        room = min((leads[p] - charged[p] for p in later), default=None)
        fits = t.gpu_speedup >= policy.MIN_SPEEDUP and room is not None and room - extra >= LEAD_MARGIN_MS
        if fits:
            for p in later:
                charged[p] += extra
        lead = "no later point" if room is None else f"{room:.3f} ms"
        out[lk] = (fits, f"GPU {t.gpu_speedup:.2f}x, alone {t.alone_speedup:.2f}x; host lead {lead} "
                         f"vs FP8's extra host time {extra:.3f} ms per call")
    return out


def _finish(r: _Round, dev: torch.device) -> None:
    torch.cuda.synchronize(dev)  # every sample's event has completed
    leads = [r.e0.elapsed_time(ev) - (t - r.t0) * 1e3 for t, ev in r.samples]
    r.decided.update(choose(leads, [(lk, i, r.pending.pop(lk)) for lk, i in r.first_fwd.items()]))
    # layers not called in the sampled iteration stay pending for the next round
    _reset(r)
