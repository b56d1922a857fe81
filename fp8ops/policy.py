"""policy="auto": run a layer in FP8 only where FP8 is faster than BF16 on this
GPU (by at least MIN_SPEEDUP). Each distinct (M, K, N, dtype) is measured once
-- fwd+bwd+scale update of a throwaway FP8 layer vs fwd+bwd under BF16
autocast -- and the verdict is cached for the process and on disk
(FP8OPS_POLICY_CACHE, default ~/.cache/fp8ops/policy.json, keyed by GPU name
and torch version), so later runs do not measure again.
"""
from __future__ import annotations

import json
import os
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

_lock = threading.Lock()
_verdicts: dict[str, tuple[bool, float]] | None = None  # key -> (fp8 wins, speedup)


def _path() -> str:
    return os.environ.get("FP8OPS_POLICY_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fp8ops", "policy.json")


def _load() -> dict:
    global _verdicts
    if _verdicts is None:
        try:
            with open(_path()) as f:
                _verdicts = {k: (bool(v[0]), float(v[1])) for k, v in json.load(f).items()}
        except (OSError, ValueError, TypeError, IndexError):
            _verdicts = {}
    return _verdicts


def _save() -> None:
    try:
        os.makedirs(os.path.dirname(_path()), exist_ok=True)
        tmp = _path() + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(_verdicts, f, indent=0, sort_keys=True)
        os.replace(tmp, _path())
    except OSError:
        pass  # a read-only home only costs a re-measure next run


# bumped when what is measured changes, so verdicts of an older fp8ops are not reused
_KEY_VERSION = 2


def key(device: torch.device, M: int, K: int, N: int, dtype: torch.dtype, bias: bool) -> str:
    return (f"v{_KEY_VERSION}|{torch.cuda.get_device_name(device)}|torch{torch.__version__}|"
            f"{M}x{K}->{N}|{str(dtype).replace('torch.', '')}|bias{int(bias)}")


def cached(k: str) -> tuple[bool, float] | None:
    return _load().get(k)


# FP8 is chosen only when measured at least this much faster: within timing
# noise a layer keeps the plain BF16 path, which is never the slower surprise
MIN_SPEEDUP = 1.03


def _time(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def measure(layer, M: int, cdtype: torch.dtype) -> tuple[bool, float]:
    """fwd+bwd time of BF16 over FP8 for this layer's shape at M rows."""
    from .linear import Fp8Linear  # noqa: PLC0415
    from . import ops  # noqa: PLC0415

    dev = layer.weight.device
    k = key(dev, M, layer.in_features, layer.out_features, cdtype, layer.bias is not None)
    with _lock:
        hit = _load().get(k)
        if hit is not None:
            return hit
        K, N = layer.in_features, layer.out_features
        ref = nn.Linear(K, N, bias=layer.bias is not None, device=dev, dtype=layer.weight.dtype)
        fp8 = Fp8Linear(K, N, bias=layer.bias is not None, device=dev, dtype=layer.weight.dtype,
                        config=layer.fp8_config)
        fp8.fp8_policy_measuring = True
        # time the steady state: delayed casts from the history's scales (not the
        # first step's current scaling, which costs an extra amax pass per cast)
        fp8._fp8_delayed_ready = True
        cfg = fp8.fp8_config
        x = torch.randn(M, K, device=dev, dtype=cdtype, requires_grad=True)
        g = torch.randn(M, N, device=dev, dtype=cdtype)

        def run(mod):
            def step():
                with torch.autocast("cuda", dtype=cdtype, enabled=cdtype != torch.float32):
                    y = mod(x) if mod is fp8 else F.linear(x, mod.weight, mod.bias)
                y.backward(g)
                if mod is fp8:
                    # what an optimizer step costs FP8: the scale update (one
                    # launch, no all-reduce: this layer is rank-local), and the
                    # weight cast again in the next forward (no reuse)
                    ops.amax_update(fp8.fp8_amax_history, fp8.fp8_scale, fp8.fp8_scale_inv, fp8.fp8_max,
                                    cfg.margin, cfg.amax_compute_algo, fp8.fp8_overflow_count)
                    fp8.fp8_step += 1
            return step

        with torch.enable_grad():  # the first forward may come under no_grad (eval)
            # interleaved, best of two each: a busy moment hurts neither side alone
            times = {ref: [], fp8: []}
            for _ in range(2):
                for mod in (ref, fp8):
                    times[mod].append(_time(run(mod)))
            t_bf16, t_fp8 = min(times[ref]), min(times[fp8])
        del ref, fp8, x, g, times
        speedup = t_bf16 / t_fp8
        verdict = (speedup >= MIN_SPEEDUP, speedup)
        _verdicts[k] = verdict
        _save()
        return verdict


def tune_policy(model: nn.Module, *args, **kwargs) -> dict:
    """Settle policy "auto" for every Fp8Linear of `model` before torch.compile.

    Compiled code cannot time anything, so a compiled layer with no verdict yet
    runs FP8 even where FP8 loses. Call this once, eagerly, before compiling,
    with an input of the training shape and under the training's autocast:
    `model(*args, **kwargs)` runs once under no_grad, every layer makes its
    decision (measured, or read from the disk cache) and computes the plain
    BF16 result; no scaling state, weight cast or counter changes. The compiled
    layers then follow the verdicts. Under DDP / FSDP2 every rank calls it.
    Returns {layer name: {(M, dtype): (fp8 wins, speedup)}}."""
    from . import linear  # noqa: PLC0415 -- linear imports this module lazily
    from .linear import Fp8Linear  # noqa: PLC0415

    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, Fp8Linear)]
    calls = {m: m.fp8_fallback_calls for _, m in layers}
    linear._POLICY_ONLY = True
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        linear._POLICY_ONLY = False
        for m, n in calls.items():
            m.fp8_fallback_calls = n
    return {name: dict(m.fp8_policy) for name, m in layers}
