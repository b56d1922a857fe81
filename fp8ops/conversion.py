"""convert_to_fp8_training: swap eligible nn.Linear modules for Fp8Linear, in
place, deciding per layer and recording why (DESIGN.md's fallback order):

    extension not loaded -> no CUDA -> compute capability < 8.9      (whole model)
    -> in/out features not multiples of 16, or unsupported dtype     (per layer)
    -> user module_filter_fn says no                                  (per layer)
    -> policy "auto": FP8 measured slower than BF16 for the layer's shape
       (decided at the layer's first CUDA forward, see policy.py)

Layers left as nn.Linear train exactly as before (under BF16 autocast if the
script uses it); a whole-model fallback is announced once, loudly.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable

import torch
import torch.nn as nn

from . import _loader
from .config import Fp8Config
from .linear import Fp8Linear

log = logging.getLogger("fp8ops")

DECISIONS_ATTR = "_fp8ops_decisions"  # {fqn: (backend, reason)} stored on the root module


def fp8_supported_here(device: int | None = None) -> tuple[bool, str]:
    """Can FP8 GEMMs run on this machine's (current) CUDA device? (ok, reason)."""
    if not _loader.is_available():
        return False, f"fp8ops extension not loaded: {_loader.why_unavailable()}"
    info = _loader.build_info()
    if not info.get("built_with_cuda"):
        return False, "fp8ops was built without CUDA (no nvcc at install time); reinstall with the CUDA toolkit on PATH"
    if not info.get("cuda_kernels_registered"):
        return False, f"fp8ops CUDA kernels not registered: {info.get('cuda_reason')}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch (torch.cuda.is_available() is False)"
    dev = torch.cuda.current_device() if device is None else device
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(dev)
        return False, (f"{name} is sm_{major}{minor}; FP8 tensor cores need sm_89+ (Ada, Hopper, Blackwell)")
    status = _loader._C.cublaslt_status()
    if status is not None:
        return False, f"cuBLASLt unusable: {status}"
    return True, "ok"


def _layer_reason(mod: nn.Linear) -> str | None:
    if mod.in_features % 16 or mod.out_features % 16:
        return (f"in_features={mod.in_features}, out_features={mod.out_features}: FP8 GEMMs need "
                f"multiples of 16")
    if mod.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {mod.weight.dtype} is not float32/bfloat16/float16"
    if type(mod) is not nn.Linear:
        return f"{type(mod).__name__} is a subclass of nn.Linear; only plain nn.Linear is swapped"
    return None


def convert_to_fp8_training(model: nn.Module, *, config: Fp8Config | None = None,
                            module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Swap eligible nn.Linear layers of `model` for FP8 ones, in place; returns
    the model. Never raises for environment reasons: where FP8 cannot run, the
    model is left as it is and the reason is logged once and kept for
    fp8ops.report(model). A root-level nn.Linear is converted and returned.

    Args:
        config: Fp8Config (recipe, format, margin, interval, history, policy).
        module_filter_fn: (module, fqn) -> bool; False keeps that layer as is.
    """
    config = config or Fp8Config()
    decisions: dict[str, tuple[str, str]] = {}
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ok, env_reason = fp8_supported_here()
    if not ok:
        for name, m in linears:
            if not isinstance(m, Fp8Linear):
                decisions[name] = ("bf16", env_reason)
        msg = f"fp8ops: FP8 is OFF for this model, training runs in BF16/FP32 as before. Reason: {env_reason}"
        warnings.warn(msg, stacklevel=2)
        _store(model, decisions)
        return model

    def swap(name: str, mod: nn.Linear) -> nn.Module:
        if isinstance(mod, Fp8Linear):
            decisions[name] = ("fp8ops", "already converted")
            return mod
        reason = _layer_reason(mod)
        if reason is None and module_filter_fn is not None and not module_filter_fn(mod, name):
            reason = "excluded by module_filter_fn"
        if reason is not None:
            decisions[name] = ("bf16", reason)
            return mod
        decisions[name] = ("fp8ops", "converted")
        return Fp8Linear.from_linear(mod, config)

    if isinstance(model, nn.Linear):
        new = swap("", model)
        _store(new, decisions)
        return new
    for name, mod in linears:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, swap(name, mod))
    if config.fuse_gelu:
        from .gelu_fusion import fuse_gelu  # noqa: PLC0415 -- gelu_fusion imports torch.fx
        for f in fuse_gelu(model):
            for lin, what in ((f.consumer, f"GELU {f.gelu} fused into its input cast"),
                              (f.producer, f"GELU {f.gelu}'s gradient fused into its gradient cast")):
                if lin is not None:
                    backend, reason = decisions.get(lin, ("fp8ops", "converted"))
                    decisions[lin] = (backend, f"{reason}; {what}")
    if config.fuse_swiglu:
        from .swiglu_fusion import fuse_swiglu  # noqa: PLC0415 -- imports torch.fx
        for f in fuse_swiglu(model):
            backend, reason = decisions.get(f.consumer, ("fp8ops", "converted"))
            decisions[f.consumer] = (backend, f"{reason}; SwiGLU {f.swiglu} fused into its input cast")
    if config.fuse_layernorm:
        from .layernorm_fusion import fuse_layernorm  # noqa: PLC0415 -- imports torch.fx
        for f in fuse_layernorm(model):
            backend, reason = decisions.get(f.consumer, ("fp8ops", "converted"))
            norm = "RMSNorm" if isinstance(model.get_submodule(f.layernorm), nn.RMSNorm) else "LayerNorm"
            decisions[f.consumer] = (backend, f"{reason}; {norm} {f.layernorm} fused into its input cast")
    n_fp8 = sum(1 for b, _ in decisions.values() if b == "fp8ops")
    log.info("fp8ops: %d of %d linear layers converted to FP8 (%s)", n_fp8, len(decisions), config.short_str())
    if n_fp8 == 0 and decisions:
        warnings.warn("fp8ops: no layer was converted to FP8; see fp8ops.report(model) for the reasons", stacklevel=2)
    _store(model, decisions)
    return model


def _store(model: nn.Module, decisions: dict) -> None:
    old = getattr(model, DECISIONS_ATTR, {})
    old.update(decisions)
    object.__setattr__(model, DECISIONS_ATTR, old)
    # DDP must not broadcast the FP8 scaling buffers (see scaling.exclude_from_ddp_broadcast)
    from .scaling import exclude_from_ddp_broadcast  # noqa: PLC0415 -- scaling imports linear
    exclude_from_ddp_broadcast(model)


convert = convert_to_fp8_training
