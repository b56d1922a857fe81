"""convert_to_fp8_training: turn eligible nn.Linear modules into Fp8Linear (and
transformers' Conv1D into Fp8Conv1D), in place (the same objects), deciding per
layer and recording why (DESIGN.md's fallback order):

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
import re
import warnings
from typing import Callable

import torch
import torch.nn as nn

from . import _loader
from .config import Fp8Config
from .conv1d import _Fp8Conv1DLayer, is_hf_conv1d
from .linear import Fp8Linear, Fp8LinearBase, unswap_class

log = logging.getLogger("fp8ops")

DECISIONS_ATTR = "_fp8ops_decisions"  # {fqn: (backend, reason)} stored on the root module


def fp8_supported_here(device: int | None = None) -> tuple[bool, str]:
    """Can FP8 GEMMs run on this machine's (current) CUDA device? (ok, reason)."""
    if not _loader.is_available():
        return False, f"fp8ops extension not loaded: {_loader.why_unavailable()}"
    info = _loader.build_info()
    if not info.get("built_with_cuda"):
        return False, f"fp8ops was {info.get('cuda_reason') or 'built without CUDA'}"
    if not info.get("cuda_kernels_registered"):
        return False, f"fp8ops CUDA kernels not registered: {info.get('cuda_reason')}"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU visible to torch (torch.cuda.is_available() is False)"
    dev = torch.cuda.current_device() if device is None else device
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 9):
        name = torch.cuda.get_device_name(dev)
        return False, (f"{name} is sm_{major}{minor}; FP8 tensor cores need sm_89+ (Ada, Hopper, Blackwell)")
    archs = info.get("cuda_archs", "")
    if not runs_on(archs, major, minor):
        return False, (f"{torch.cuda.get_device_name(dev)} is sm_{major}{minor}, and fp8ops was compiled for "
                       f"{archs or 'no arch'} only; reinstall with FP8OPS_CUDA_ARCHS=\"{major}{minor}\"")
    status = _loader._C.cublaslt_status()
    if status is not None:
        return False, f"cuBLASLt unusable: {status}"
    return True, "ok"


def runs_on(archs: str, major: int, minor: int) -> bool:
    """Does a build for archs (build_info's "89 90a 100 120 ptx": cubins, then "ptx": the last
    one's PTX) have code for an sm_<major><minor> GPU? A cubin runs on its own major at its
    minor or above ("a": that exact GPU only); PTX is compiled by the driver for any GPU at
    or above its arch."""
    items = archs.split()
    cubins = [a for a in items if a != "ptx"]
    for a in cubins:
        m = re.fullmatch(r"(\d+?)(\d)([af]?)", a)
        if not m:
            continue
        a_major, a_minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
        if a_major == major and (a_minor == minor if suffix == "a" else a_minor <= minor):
            return True
    if "ptx" in items and cubins:
        m = re.fullmatch(r"(\d+?)(\d)[af]?", cubins[-1])
        if m and (major, minor) >= (int(m.group(1)), int(m.group(2))):
            return True
    return False


# a forward set on the module object (accelerate's hooks wrap it so): it calls nn.Linear's own
# forward, which would keep running BF16 in a layer reported as FP8
_INSTANCE_FORWARD = "forward replaced on the module object (e.g. accelerate's hooks): it would keep running BF16"


def _layer_reason(mod: nn.Module) -> str | None:
    """Why a linear layer (an nn.Linear or HF's Conv1D: nx -> nf) stays as it is, or None."""
    if "forward" in mod.__dict__:
        return _INSTANCE_FORWARD
    conv = is_hf_conv1d(mod)
    (a, k), (b, n) = (("nx", mod.nx), ("nf", mod.nf)) if conv else \
        (("in_features", mod.in_features), ("out_features", mod.out_features))
    if k % 16 or n % 16:
        return f"{a}={k}, {b}={n}: FP8 GEMMs need multiples of 16"
    if mod.weight.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"weight dtype {mod.weight.dtype} is not float32/bfloat16/float16"
    if not conv and type(mod) is not nn.Linear:
        return f"{type(mod).__name__} is a subclass of nn.Linear; only plain nn.Linear is converted"
    return None


def convert_to_fp8_training(model: nn.Module, *, config: Fp8Config | None = None,
                            module_filter_fn: Callable[[nn.Module, str], bool] | None = None) -> nn.Module:
    """Turn eligible nn.Linear layers of `model` into FP8 ones, in place (the
    same module objects: hooks, attributes and shared modules stay as they
    were); returns the model. Never raises for environment reasons: where FP8
    cannot run, the model is left as it is and the reason is logged once and
    kept for fp8ops.report(model). Raises TypeError for arguments of the wrong
    kind. A root-level nn.Linear is converted and returned.

    Args:
        config: Fp8Config (recipe, format, margin, interval, history, policy).
        module_filter_fn: (module, fqn) -> bool; False keeps that layer as is (a module
            shared under several names is asked under each: False for any keeps it).
    """
    if config is None:
        config = Fp8Config()
    if not isinstance(config, Fp8Config):
        raise TypeError(f"convert: config must be an fp8ops.Fp8Config, found {type(config).__name__}; "
                        "pass config=fp8ops.Fp8Config(...)")
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(f"convert: module_filter_fn must be a callable (module, fqn) -> bool, found "
                        f"{type(module_filter_fn).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert: model must be an nn.Module, found {type(model).__name__}")
    decisions: dict[str, tuple[str, str]] = {}
    # every name of a module shared by several parents: each sees the one converted module;
    # HF transformers' Conv1D (GPT-2's projections) is a linear layer too
    linears = [(n, m) for n, m in model.named_modules(remove_duplicate=False)
               if isinstance(m, (nn.Linear, Fp8LinearBase)) or is_hf_conv1d(m)]
    ok, env_reason = fp8_supported_here()
    if not ok:
        for name, m in linears:
            if not isinstance(m, Fp8LinearBase):
                decisions[name] = ("bf16", env_reason)
        msg = f"fp8ops: FP8 is OFF for this model, training runs in BF16/FP32 as before. Reason: {env_reason}"
        warnings.warn(msg, stacklevel=2)
        _store(model, decisions)
        return model

    decided: dict[int, tuple[str, str]] = {}  # id(module) -> its decision, for its other names
    names_of: dict[int, list[str]] = {}  # id(module) -> every name it has (a shared module: several)
    for name, m in linears:
        names_of.setdefault(id(m), []).append(name)
    earlier = decisions_of(model)  # (a layer converted again keeps the notes of its fusions)

    done: list = []  # (module, its class, attribute and buffer names) before conversion: to undo

    def convert_one(name: str, mod: nn.Module) -> None:
        if id(mod) in decided:  # another name of a module already decided
            decisions[name] = decided[id(mod)]
            return
        decisions[name] = decided[id(mod)] = _decide(name, mod)
        if decisions[name] == ("fp8ops", "converted"):
            # in place: the same module object, under every name it has
            before = (mod, type(mod), set(mod.__dict__), set(mod._buffers))
            if is_hf_conv1d(mod):
                _Fp8Conv1DLayer.from_conv1d(mod, config)
            else:
                Fp8Linear.from_linear(mod, config)
            done.append(before)

    kept_config: list[str] = []  # layers converted before with another config, which they keep

    def _decide(name: str, mod: nn.Module) -> tuple[str, str]:
        if isinstance(mod, Fp8LinearBase):
            notes = _fusion_notes(earlier.get(name))
            if mod.fp8_config != config:
                kept_config.append(name)
                return "fp8ops", f"already converted (keeps its config {mod.fp8_config.short_str()}){notes}"
            return "fp8ops", f"already converted{notes}"
        reason = _layer_reason(mod)
        if reason is None and module_filter_fn is not None:
            # a module shared by several parents is one layer under each name: converted only if
            # the filter accepts it under every one (a refusal by any name is the user's word)
            names = names_of[id(mod)]
            refused = [n for n in names if not module_filter_fn(mod, n)]
            if refused:
                reason = "excluded by module_filter_fn"
                if len(names) > 1:
                    others = ", ".join(repr(n) for n in names if n != refused[0])
                    reason += f" (as {refused[0]!r}; the same module is also {others})"
        return ("bf16", reason) if reason is not None else ("fp8ops", "converted")

    try:
        for name, mod in linears:
            convert_one(name, mod)
    except BaseException:
        # (module_filter_fn raised, or a layer's state could not be made): no layer half-done
        for before in reversed(done):
            unswap_class(*before)
        raise
    if kept_config:
        warnings.warn(f"fp8ops.convert: {len(kept_config)} layer(s) ({', '.join(kept_config[:3])}"
                      f"{', ...' if len(kept_config) > 3 else ''}) were already converted with another config, "
                      f"which they keep; this call's {config.short_str()} does not apply to them. Convert the "
                      "original nn.Linear model to change the config", stacklevel=2)
    if isinstance(model, (nn.Linear, Fp8LinearBase)):  # a root-level layer (converted in place): nothing to fuse
        _store(model, decisions)
        return model
    if config.recipe != "delayed" or config.gemm_emulated:
        # the fused casts run only on delayed scaling's steady path with real FP8 GEMMs (current
        # scaling's amax pass comes first; emulated GEMMs take BF16): nothing would use a fusion
        log.info("fp8ops: no fusion for %s (the fused casts need delayed scaling and FP8 GEMMs)",
                 config.short_str())
    else:
        _fuse(model, config, decisions)
    n_fp8 = sum(1 for b, _ in decisions.values() if b == "fp8ops")
    log.info("fp8ops: %d of %d linear layers converted to FP8 (%s)", n_fp8, len(decisions), config.short_str())
    if n_fp8 == 0 and decisions:
        warnings.warn("fp8ops: no layer was converted to FP8; see fp8ops.report(model) for the reasons", stacklevel=2)
    elif not decisions:
        scripted = isinstance(model, torch.jit.ScriptModule)
        warnings.warn("fp8ops: the model has no nn.Linear (or transformers Conv1D) layer; nothing was converted"
                      + (" (a TorchScript module's layers are compiled code: convert the model before "
                         "torch.jit.script)" if scripted else ""), stacklevel=2)
    _store(model, decisions)
    return model


def _fuse(model: nn.Module, config: Fp8Config, decisions: dict) -> None:
    """The fusions config asks for, each noted in its layers' decisions."""
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


def _fusion_notes(decision: tuple[str, str] | None) -> str:
    """The "; ... fused into ..." notes of an earlier decision's reason."""
    if decision is None:
        return ""
    return "".join(f"; {part}" for part in decision[1].split("; ")[1:] if " fused into " in part)


def decisions_of(model: nn.Module) -> dict[str, tuple[str, str]]:
    """convert()'s {name: (backend, reason)} for every module that convert() was
    called on, keyed by the names in `model`: the same whether `model` is the
    converted module itself or wraps it (torch.compile, DDP, a parent module)."""
    out = {}
    for name, m in model.named_modules():
        for k, (backend, reason) in m.__dict__.get(DECISIONS_ATTR, {}).items():
            out[f"{name}.{k}" if name and k else name or k] = (backend, _notes_named_from(reason, name))
    return out


# a fusion note's module name (see _fuse): "<kind> <name> fused into ..." or "GELU <name>'s gradient ..."
_NOTE_NAME = re.compile(r"^((?:GELU|SwiGLU|LayerNorm|RMSNorm) )(\S+?)((?:'s gradient)? fused into )")


def _notes_named_from(reason: str, prefix: str) -> str:
    """reason with its fusion notes' module names (relative to the module convert was called
    on, e.g. model.blocks[0]) named from the model that holds it (prefix: that module's name)."""
    if not prefix or " fused into " not in reason:
        return reason
    return "; ".join(_NOTE_NAME.sub(lambda m: f"{m[1]}{prefix}.{m[2]}{m[3]}", part) for part in reason.split("; "))


def _store(model: nn.Module, decisions: dict) -> None:
    old = getattr(model, DECISIONS_ATTR, {})
    old.update(decisions)
    object.__setattr__(model, DECISIONS_ATTR, old)
    # DDP must not broadcast the FP8 scaling buffers (see scaling.exclude_from_ddp_broadcast)
    from .scaling import exclude_from_ddp_broadcast  # noqa: PLC0415 -- scaling imports linear
    exclude_from_ddp_broadcast(model)


convert = convert_to_fp8_training
