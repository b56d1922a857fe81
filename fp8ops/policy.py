"""policy="auto": run a layer in FP8 only where FP8 is faster than BF16 on this
GPU. Each distinct (M, K, N, dtype) is measured once -- fwd+bwd of a throwaway
FP8 layer vs the same under BF16 autocast -- and the verdict is cached for the
process and on disk (FP8OPS_POLICY_CACHE, default ~/.cache/fp8ops/policy.json,
keyed by GPU name and torch version), so later runs do not measure again.
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


def key(device: torch.device, M: int, K: int, N: int, dtype: torch.dtype, bias: bool) -> str:
    return (f"{torch.cuda.get_device_name(device)}|torch{torch.__version__}|"
            f"{M}x{K}->{N}|{str(dtype).replace('torch.', '')}|bias{int(bias)}")


def cached(k: str) -> tuple[bool, float] | None:
    return _load().get(k)


def _time(fn, reps: int = 10) -> float:
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
        x = torch.randn(M, K, device=dev, dtype=cdtype, requires_grad=True)
        g = torch.randn(M, N, device=dev, dtype=cdtype)

        def run(mod):
            def step():
                with torch.autocast("cuda", dtype=cdtype, enabled=cdtype != torch.float32):
                    y = mod(x) if mod is fp8 else F.linear(x, mod.weight, mod.bias)
                y.backward(g)
                fp8.fp8_step += 1  # emulate an optimizer step: no weight-cast reuse
            return step

        with torch.enable_grad():  # the first forward may come under no_grad (eval)
            t_bf16 = _time(run(ref))
            t_fp8 = _time(run(fp8))
        del ref, fp8, x, g
        verdict = (t_fp8 < t_bf16, t_bf16 / t_fp8)
        _verdicts[k] = verdict
        _save()
        return verdict
