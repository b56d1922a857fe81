"""policy="auto": run a layer in FP8 only where FP8 is faster than BF16 on this
GPU (by at least MIN_SPEEDUP). Each (K, N, dtype) and bucket of row counts M
(rows_bucket: a quarter octave) is measured once
-- fwd+bwd+scale update of a throwaway FP8 layer vs fwd+bwd under BF16
autocast -- and the timings are cached for the process and on disk
(FP8OPS_POLICY_CACHE, default ~/.cache/fp8ops/policy.json, keyed by GPU name
and torch version), so later runs do not measure again.

Each side is timed two ways (Timing): alone (the layer in a loop by itself,
from an idle GPU: whichever of host and GPU is slower sets the pace) and
GPU-bound (the GPU held by a sleep kernel while the host enqueues the whole
loop: pure GPU time, and the host's enqueue time besides). Where both say FP8
is clearly faster, or both say it is not faster, that is the verdict. Otherwise
-- a small layer whose FP8 path is faster on the GPU but costs more host time,
or a gain near the noise -- the answer depends on the user's loop:
loop_trial.py times a few steps of it with such layers in BF16 and in FP8,
and keeps the faster.
"""
from __future__ import annotations

import json
import math
import os
import stat
import tempfile
import threading
import time
import warnings
from typing import NamedTuple

import filelock
import torch
import torch.nn as nn
import torch.nn.functional as F

_lock = threading.Lock()
_timings: dict[str, "Timing"] | None = None


class Timing(NamedTuple):
    """ms per fwd + bwd (+ FP8's scale update) of one layer shape."""
    alone_bf16: float
    alone_fp8: float
    gpu_bf16: float
    gpu_fp8: float
    host_bf16: float
    host_fp8: float

    @property
    def alone_speedup(self) -> float:
        return self.alone_bf16 / self.alone_fp8

    @property
    def gpu_speedup(self) -> float:
        return self.gpu_bf16 / self.gpu_fp8


def _path() -> str:
    return os.path.expanduser(os.environ.get("FP8OPS_POLICY_CACHE") or os.path.join("~", ".cache", "fp8ops",
                                                                                 "policy.json"))


def _umask() -> int:
    """The process's umask, read without setting it (os.umask would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _read(path: str) -> dict:
    """The timings in the file at path: a file that cannot be read or is not fp8ops' (not a
    JSON object of six positive timings per key) counts as empty, an entry that is not as none."""
    out = {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError, RecursionError):  # (RecursionError: deeply nested JSON)
        return out
    for k, v in (data.items() if isinstance(data, dict) else ()):
        if not isinstance(v, list) or not all(type(x) in (int, float) for x in v):
            continue  # (an older fp8ops' (wins, speedup), strings, anything else)
        try:
            t = Timing(*map(float, v))
        except (TypeError, ValueError):
            continue
        if all(x > 0 and math.isfinite(x) for x in t):  # (a 0 would divide by zero in the speedups)
            out[k] = t
    return out


def _load() -> dict:
    """The timings cached on disk, read once per process."""
    global _timings
    if _timings is None:
        _timings = _read(_path())
    return _timings


class _FileLock:
    """An exclusive lock on path + ".lock" (filelock's, a dependency of torch's) for one
    read-merge-write of the cache: processes saving at once (the ranks of a run, runs sharing
    a home) take turns, so none drops what another just wrote. Where none can be had within
    WAIT_S, or at all (a read-only folder, another user's lock file, a filesystem without
    locks), the save goes on unlocked: the cache is re-measured if need be."""

    WAIT_S = 10.0  # (a stopped process holding it, or an NFS lock daemon that never answers)

    def __init__(self, path: str):
        self.lock = filelock.FileLock(path + ".lock", timeout=self.WAIT_S)
        try:
            self.lock.acquire()
        except OSError:  # (filelock.Timeout is one)
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.lock is not None:
            self.lock.release()


def _save() -> None:
    """Write this process's timings, merged into what the file holds now (other processes,
    e.g. the other ranks of a run, may have written since this one read it)."""
    tmp = None
    try:
        folder = os.path.dirname(_path())
        if folder:  # (FP8OPS_POLICY_CACHE=policy.json: the working directory)
            os.makedirs(folder, exist_ok=True)
        with _FileLock(_path()):
            merged = {**_read(_path()), **_timings}
            # a file of this process's own, then one atomic rename: a reader that takes no lock
            # sees the old file or the new one (a name made of the pid alone was shared by
            # processes of two containers, whose writes interleaved)
            fd, tmp = tempfile.mkstemp(dir=folder or ".", prefix=os.path.basename(_path()) + ".", suffix=".tmp")
            try:  # (mkstemp's file is the owner's alone: keep the cache's mode, or a new file's)
                mode = stat.S_IMODE(os.stat(_path()).st_mode)
            except OSError:
                mode = 0o666 & ~_umask()
            os.chmod(tmp, mode)
            with os.fdopen(fd, "w") as f:
                json.dump({k: list(v) for k, v in merged.items()}, f, indent=0, sort_keys=True)
            os.replace(tmp, _path())
            tmp = None
    except OSError:
        pass  # a read-only home only costs a re-measure next run
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)  # (the replace failed: e.g. the path is a directory)
            except OSError:
                pass


# bumped when what is measured changes, so timings of an older fp8ops are not reused
# (4: under tune_policy, version 3 timed its FP8 side on the BF16 path: every verdict BF16;
# 5: the key names the layer's recipe, format, fast accumulation and weight dtype, and the
# sixteenth session's scale update and host path changed FP8's side; 6: the twenty-third
# session's C ops format their messages only on failure, ~25 snprintf less per FP8 call: an
# older cache's host times undercount FP8, which the twenty-ninth session's review found)
_KEY_VERSION = 6


def key(device: torch.device, M: int, K: int, N: int, dtype: torch.dtype, bias: bool, gelu: bool = False,
        swiglu: bool = False, setup: str = "", norm: str = "") -> str:
    """gelu, swiglu: the layer's input is a fused GELU's or SwiGLU's (Fp8Linear.fp8_gelu_input,
    fp8_swiglu_input); norm: a fused LayerNorm's or RMSNorm's (norm_of): timed with it on both
    sides. setup: what else changes the FP8 side's cost (setup_of: recipe, format, fast
    accumulation, the weight's dtype)."""
    return (f"v{_KEY_VERSION}|{torch.cuda.get_device_name(device)}|torch{torch.__version__}|"
            f"{M}x{K}->{N}|{str(dtype).replace('torch.', '')}|bias{int(bias)}" + ("|gelu" if gelu else "")
            + ("|swiglu" if swiglu else "") + (f"|{norm}" if norm else "") + (f"|{setup}" if setup else ""))


def norm_of(layer) -> str:
    """The fused norm before the layer (Fp8Linear.fp8_ln_input), as the key names it: what
    decides its cost on both sides (its kind, affine parameters and their dtype), "" if none."""
    ln = layer.fp8_ln_input
    if ln is None:
        return ""
    kind = "rms" if isinstance(ln, nn.RMSNorm) else "ln"
    w, b = ln.weight, getattr(ln, "bias", None)
    return kind + ("" if w is None else f"-w{str(w.dtype).replace('torch.', '')}") + ("" if b is None else "-b")


def _norm_like(ln: nn.Module, dev: torch.device) -> nn.Module:
    """A fresh norm with ln's shape, eps, affine parameters and dtype, for the timing layers
    (the user's own module is left alone: no hooks run, no parameters shared)."""
    w, b = ln.weight, getattr(ln, "bias", None)
    dtype = w.dtype if w is not None else None
    if isinstance(ln, nn.RMSNorm):
        return nn.RMSNorm(ln.normalized_shape, ln.eps, w is not None, device=dev, dtype=dtype)
    return nn.LayerNorm(ln.normalized_shape, ln.eps, w is not None, bias=b is not None, device=dev, dtype=dtype)


def setup_of(layer) -> str:
    """The parts of a layer's configuration that change what its FP8 step costs: the
    recipe (current scaling adds an amax pass per cast), the format, fast accumulation,
    and the weight's dtype (an fp32 master weight is read twice as wide by its cast)."""
    cfg = layer.fp8_config
    return (f"{cfg.recipe}/{cfg.fp8_format}/acc{'fast' if cfg.fast_accum else 'full'}/"
            f"w{str(layer.weight.dtype).replace('torch.', '')}")


def cached(k: str) -> Timing | None:
    return _load().get(k)


def rows_bucket(M: int) -> int:
    """The row counts one verdict covers, named by their lowest: quarter octaves,
    2^e * {1, 1.25, 1.5, 1.75} <= M (each M below 64 its own). FP8's gain moves
    smoothly with M, and with variable-length batches every distinct M would
    otherwise be measured (a synchronizing timing each) and wait for its own loop
    trial. The lowest M of a bucket is a multiple of 16 from 64 on: what is timed."""
    if M < 64:
        return M
    e = M.bit_length() - 3   # M >> e is 4..7
    return (M >> e) << e


def rows_label(lo: int) -> str:
    """"M=..." of a bucket for reports: its range."""
    if lo < 64:
        return f"M={lo}"
    e = lo.bit_length() - 3
    return f"M={lo}-{((lo >> e) + 1 << e) - 1}"


# FP8 is chosen only when measured at least this much faster: within timing
# noise a layer keeps the plain BF16 path, which is never the slower surprise
MIN_SPEEDUP = 1.03


# FP8 without a trial only when both timings say it is at least this much faster:
# a one-time timing on a noisy host has been off by more than 1.5x near break-even
SURE_SPEEDUP = 1.3


def verdict(t: Timing) -> tuple[bool | None, float]:
    """(FP8 wins, speedup) where both timings agree clearly: FP8 at least
    SURE_SPEEDUP faster both ways, or less than MIN_SPEEDUP both ways; else
    (None, GPU-bound speedup): a trial in the user's loop decides (loop_trial.py)."""
    alone, gpu = t.alone_speedup, t.gpu_speedup
    if alone >= SURE_SPEEDUP and gpu >= SURE_SPEEDUP:
        return True, alone
    if alone < MIN_SPEEDUP and gpu < MIN_SPEEDUP:
        return False, alone
    return None, gpu


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def _time_alone(fn, reps: int = 20) -> float:
    """ms per call, the loop started on an idle GPU: no earlier queued work
    hides the host's cost (it once did, and a verdict came out wrong)."""
    for _ in range(3):
        fn()
    start, end = _events()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


_sleep_cycles_per_ms: float | None = None


def _cycles_per_ms() -> float:
    """torch.cuda._sleep spins for a number of GPU clock cycles: how many make a ms"""
    global _sleep_cycles_per_ms
    if _sleep_cycles_per_ms is None:
        start, end = _events()
        torch.cuda._sleep(1000)  # its first launch loads the kernel, which must not be timed
        torch.cuda.synchronize()
        start.record()
        torch.cuda._sleep(1_000_000)
        end.record()
        end.synchronize()
        _sleep_cycles_per_ms = 1_000_000 / max(start.elapsed_time(end), 1e-3)
    return _sleep_cycles_per_ms


def _time_queued(fn, host_hint_ms: float, reps: int = 20) -> tuple[float, float] | None:
    """(GPU ms, host ms) per call: a sleep kernel holds the GPU while the host
    enqueues all reps, so the reps then run back to back (pure GPU time) and
    the enqueue loop's own duration is the host's cost. None if the host could
    not finish enqueueing within even the longest sleep (something synced).
    Called right after _time_alone of the same fn, which warmed it up."""
    start, end = _events()
    sleep_ms = 2.0 * host_hint_ms * reps + 1.0
    for _ in range(3):
        torch.cuda.synchronize()
        torch.cuda._sleep(int(sleep_ms * _cycles_per_ms()))
        start.record()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        host_ms = (time.perf_counter() - t0) * 1e3 / reps
        end.record()
        queued = not start.query()  # the GPU was still asleep when the last rep was enqueued
        end.synchronize()
        if queued:
            return start.elapsed_time(end) / reps, host_ms
        sleep_ms *= 4
    return None


def measure(layer, M: int, cdtype: torch.dtype) -> Timing:
    """Timing of BF16 and FP8 fwd+bwd for this layer's shape at M rows."""
    from .linear import Fp8Linear, _normalize  # noqa: PLC0415
    from . import ops  # noqa: PLC0415
    from .swiglu import swiglu as swiglu_op  # noqa: PLC0415

    dev = layer.weight.device
    gelu, swiglu = layer.fp8_gelu_input, layer.fp8_swiglu_input
    k = key(dev, M, layer.in_features, layer.out_features, cdtype, layer.bias is not None, gelu, swiglu,
            setup_of(layer), norm_of(layer))
    # (the first forward may come under inference_mode, e.g. a validation sanity check:
    # the timing layers and tensors below must be ordinary ones, which autograd takes; and
    # making them draws random numbers, which must not move the user's generators: the same
    # seed gives the same run whether or not the timings were on disk)
    rng_devices = [dev] if dev.type == "cuda" else []
    with _lock, torch.inference_mode(False), torch.random.fork_rng(devices=rng_devices):
        hit = _load().get(k)
        if hit is not None:
            return hit
        K, N = layer.in_features, layer.out_features
        ref = nn.Linear(K, N, bias=layer.bias is not None, device=dev, dtype=layer.weight.dtype)
        fp8 = Fp8Linear(K, N, bias=layer.bias is not None, device=dev, dtype=layer.weight.dtype,
                        config=layer.fp8_config)
        fp8.fp8_policy_measuring = True
        fp8.fp8_gelu_input = gelu
        fp8.fp8_swiglu_input = swiglu
        ln = None if layer.fp8_ln_input is None else _norm_like(layer.fp8_ln_input, dev)
        fp8.__dict__["fp8_ln_input"] = ln  # (as layernorm_fusion sets it: not a submodule)
        # time the steady state: delayed casts from the history's scales (not the
        # first step's current scaling, which costs an extra amax pass per cast)
        fp8._fp8_delayed_ready = True
        cfg = fp8.fp8_config
        x = torch.randn(M, 2 * K if swiglu else K, device=dev, dtype=cdtype, requires_grad=True)
        g = torch.randn(M, N, device=dev, dtype=cdtype)

        def run(mod):
            def step():
                with torch.autocast("cuda", dtype=cdtype, enabled=cdtype != torch.float32):
                    if mod is fp8:
                        y = mod(x)
                    else:  # the plain path: the activation or norm (as Fp8Linear._plain_forward runs it), the linear
                        h = F.gelu(x, approximate="tanh") if gelu else swiglu_op(x) if swiglu else x
                        y = F.linear(h if ln is None else _normalize(ln, h), mod.weight, mod.bias)
                y.backward(g)
                if mod is fp8:
                    # what an optimizer step costs FP8: the scale update (one
                    # launch, no all-reduce: this layer is rank-local), and the
                    # weight cast again in the next forward (no reuse)
                    ops._amax_update(fp8.fp8_amax_history, fp8.fp8_scale, fp8.fp8_scale_inv, fp8.fp8_max,
                                     cfg.margin, cfg.amax_compute_algo, fp8.fp8_overflow_count)
                    fp8.fp8_step += 1
            return step

        with torch.enable_grad(), torch.cuda.device(dev):  # the first forward may come under no_grad (eval)
            # interleaved, best of two each: a busy moment hurts neither side alone
            alone, gpu, host = {ref: [], fp8: []}, {ref: [], fp8: []}, {ref: [], fp8: []}
            for _ in range(2):
                for mod in (ref, fp8):
                    alone[mod].append(_time_alone(run(mod)))
                    q = _time_queued(run(mod), alone[mod][-1])
                    # could not queue (e.g. a sync in the loop): the alone time stands for both
                    gpu[mod].append(alone[mod][-1] if q is None else q[0])
                    host[mod].append(alone[mod][-1] if q is None else q[1])
        t = Timing(min(alone[ref]), min(alone[fp8]), min(gpu[ref]), min(gpu[fp8]), min(host[ref]),
                   min(host[fp8]))
        del ref, fp8, ln, x, g
        _timings[k] = t
        _save()
        return t


def tune_policy(model: nn.Module, *args, **kwargs) -> dict:
    """Settle policy "auto" for every Fp8Linear of `model` before torch.compile.

    Compiled code cannot time anything, so a compiled layer with no verdict yet
    runs FP8 even where FP8 loses. Call this once, eagerly, before compiling,
    with an input of the training shape and under the training's autocast:
    `model(*args, **kwargs)` runs once under no_grad, every layer makes its
    decision (measured, or read from the disk cache) and computes the plain
    BF16 result; no scaling state, weight cast or counter changes. The compiled
    layers then follow the verdicts. A layer whose verdict depends on the host
    (FP8 faster on the GPU, slower alone) is settled as GPU-bound: compiled
    code spends far less host time per layer than eager code. Under DDP / FSDP2
    every rank calls it, and the ranks agree on the verdicts before it returns
    (FP8 only where every rank chose it). Returns {layer name: {(M bucket, dtype): (fp8 wins,
    speedup)}} (rows_bucket: the lowest M of the bucket)."""
    from . import linear, policy_ranks  # noqa: PLC0415 -- linear imports this module lazily
    from .linear import Fp8LinearBase  # noqa: PLC0415

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8LinearBase)]
    calls = {m: m.fp8_fallback_calls for _, m in layers}
    linear._POLICY_ONLY = True
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        linear._POLICY_ONLY = False
        for m, n in calls.items():
            m.fp8_fallback_calls = n
    unsettled = [name for name, m in layers if m.fp8_config.policy == "auto" and not m.fp8_policy]
    if unsettled:
        warnings.warn(
            f"fp8ops.tune_policy: {len(unsettled)} of {len(layers)} FP8 layers ({', '.join(unsettled[:3])}"
            f"{', ...' if len(unsettled) > 3 else ''}) settled no verdict: this forward did not reach their FP8 "
            "path (an input off the GPU, a row count not a multiple of 16, a model compiled already, no "
            "autocast where training has one) or did not call them; compiled code runs them FP8 without "
            "one. Call it before torch.compile, on the GPU, with a batch of the training shape under the "
            "training's autocast", stacklevel=2)
    # the ranks agree now rather than at the first step: the compiled code reads the verdicts;
    # each scaling group among its own ranks (set_scaling_group: a pipeline stage's, or none
    # for a model this rank alone trains, whose other ranks never call this)
    from .scaling import _is_local, by_scaling_group  # noqa: PLC0415 -- scaling imports this module
    for group, members in by_scaling_group([m for _, m in layers]):
        if not _is_local(group):
            policy_ranks.agree_now(members, group)
    return {name: dict(m.fp8_policy) for name, m in layers}
