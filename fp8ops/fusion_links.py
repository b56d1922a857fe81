"""A hook on a module whose computation an FP8 linear took over at convert (a LayerNorm or
RMSNorm turned pass-through, the nn.Identity standing where a GELU or SwiGLU was) would see the
pass-through's input, not the norm's or activation's output, and a hook that changes that output
would change nothing (a probe's finding: a hook on a fused LayerNorm recorded its input, 0.2 dB
against the norm's output, silently). So registering one undoes the fusion first: the module
computes on its own again, as before convert, the linear stops applying it, a warning says so,
and then the hook is registered.

Each fused module holds a link for that: (weakref to the linear, the linear's flag that applies
the module, a text for messages). A weak reference, so that a linear replaced later is freed as
it would be without fp8ops. Nothing is moved: an activation's stand-in starts computing where
it is (a container rebuilt from the model's modules holds the same stand-in).
Copies (deepcopy, pickle) drop the link (weak references cannot be pickled, and a copied one
would point at the original model): a hook on a copy's fused module undoes nothing. A fused
linear or norm replaced after convert is not seen (README; a check in every call was tried and
taken out: it broke the copies PEFT's modules_to_save makes of a fused linear or norm)."""
from __future__ import annotations

import warnings
import weakref

import torch.nn as nn

LINK = "_fp8_fused_into"  # the module's __dict__ key


def make(module: nn.Module, linear: nn.Module, flag: str, what: str) -> None:
    """Link `module` to `linear`, whose `flag` applies it."""
    module.__dict__[LINK] = (weakref.ref(linear), flag, what)


def undo(module: nn.Module, why: str) -> None:
    """Undo the fusion of `module` (linked by make): the norm gets its own class again, the
    activation's stand-in computes with the module it keeps (in every container that holds
    it: nothing is moved), the linear (if alive) stops applying it. why: the warning's reason."""
    link = module.__dict__.pop(LINK, None)
    if link is None:
        return
    linear_ref, flag, what = link
    linear = linear_ref()
    if linear is not None and (linear.__dict__.get(flag) is module if flag == "fp8_ln_input" else True):
        linear.__dict__[flag] = None if flag == "fp8_ln_input" else False
    if isinstance(module, ActivationFusedIntoLinear):
        module.__dict__["_fp8_fused"] = False
    else:  # a norm: its own class again
        module.__class__ = module._fp8_plain_class
    producer = module.__dict__.pop("_fp8_producer", None)
    producer = producer() if producer is not None else None
    if producer is not None:
        producer.__dict__["fp8_gelu_output"] = False
    warnings.warn(f"fp8ops: {what} is undone ({why}): it computes on its own again, as before convert",
                  stacklevel=4)  # (the user's registration: undo, _hooked_now, register_*)


def without_link(state: dict) -> dict:
    """A module's __getstate__ without its link and its producer's weak reference (see the
    module docstring)."""
    if LINK in state or "_fp8_producer" in state:
        state = dict(state)
        state.pop(LINK, None)
        state.pop("_fp8_producer", None)
    return state


class HookUndoesFusion:
    """Hook registrations on a fused norm or activation: the fusion is undone first (a hook
    would see the pass-through's input, and a hook that changes the output would change
    nothing), then the hook goes on the module that now computes."""

    def _hooked_now(self, method: str, args, kwargs):
        undo(self, "a hook was registered on it")
        return getattr(nn.Module, method)(self, *args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        return self._hooked_now("register_forward_pre_hook", args, kwargs)

    def register_forward_hook(self, *args, **kwargs):
        return self._hooked_now("register_forward_hook", args, kwargs)

    def register_full_backward_pre_hook(self, *args, **kwargs):
        return self._hooked_now("register_full_backward_pre_hook", args, kwargs)

    def register_full_backward_hook(self, *args, **kwargs):
        return self._hooked_now("register_full_backward_hook", args, kwargs)

    def register_backward_hook(self, *args, **kwargs):  # (deprecated in torch, still used)
        return self._hooked_now("register_backward_hook", args, kwargs)

    def __getstate__(self):
        return without_link(super().__getstate__())


class ActivationFusedIntoLinear(HookUndoesFusion, nn.Identity):
    """Where a fused GELU or SwiGLU module was: passes its input through, the next linear
    applying the activation, until the fusion is undone; then it computes with the module it
    keeps (not a submodule: no state_dict keys, as the activations have none)."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.__dict__["_fp8_original"] = original
        self.__dict__["_fp8_fused"] = True

    def forward(self, input):  # noqa: A002 -- nn.Identity's name
        d = self.__dict__
        return input if d.get("_fp8_fused", True) else d["_fp8_original"](input)

    def extra_repr(self) -> str:
        d = self.__dict__
        fused = ", applied by the next linear (fused)" if d.get("_fp8_fused", True) else ""
        return type(d["_fp8_original"]).__name__ + fused
