"""What keeps convert's fusions honest after convert: a module whose computation an FP8 linear
took over (a LayerNorm or RMSNorm turned pass-through, the nn.Identity standing where a GELU or
SwiGLU was) holds a link to that linear, checked at each call: is the linear still where convert
found it, and does it still apply the module? A model's user may replace the linear afterwards
(a plain nn.Linear holding the same Parameters, a fresh layer, a LoRA wrapper), and then the norm
or activation ran nowhere: the model computed something else, silently (a probe's finding: 10 dB
logits for a GPT-2 MLP whose c_proj was replaced, -0.1 dB for a replaced c_fc). Where the link is
broken, or a hook is registered on the module (it would see the pass-through's input, not the
norm's output), the fusion is undone: the module computes on its own again, as before convert,
and the linear, if it still exists, stops applying it. A warning says so, once per module.
fp8ops.convert(model) undoes broken links first, then fuses again where it can.

A link is (weakref to the traced parent, the linear's path from it, weakref to the linear, the
linear's flag that applies the module, the direct parent and the module's name in it, a text for
messages). Weak references, so that a replaced linear is freed as it would be without fp8ops (a
replaced FP8 layer kept alive would keep its scaling hooks). Copies (deepcopy, pickle) drop the
link: a copy's fusion is not checked (weak references cannot be pickled, and a copied one would
point at the original model)."""
from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn as nn

LINK = "_fp8_fused_into"  # the module's __dict__ key
SOURCE = "_fp8_fused_from"  # the linear's: a weakref to the module it applies


def make(module: nn.Module, parent: nn.Module, path: str, linear: nn.Module, flag: str, name: str,
         what: str) -> None:
    """Link `module` (parent's child `name`) to `linear` (parent's submodule at `path`), whose
    `flag` applies it."""
    module.__dict__[LINK] = (weakref.ref(parent), tuple(path.split(".")), weakref.ref(linear), flag, name, what)
    linear.__dict__[SOURCE] = weakref.ref(module)


def source_gone(linear: nn.Module, ref) -> bool:
    """The linear's side (Fp8LinearBase.forward, eager calls): is the norm or activation stand-in
    it applies still in its place? One replaced (a new LayerNorm assigned in its place) would
    leave the linear applying the old one's normalization after the new one's. Undoes the
    fusion where it is not; True then."""
    module = ref()
    link = None if module is None else module.__dict__.get(LINK)
    parent = None if link is None else link[0]()
    if parent is not None and parent._modules.get(link[4]) is module:
        return False
    if module is not None and link is not None:
        undo(module, "it was replaced in the model")
    else:  # (a stand-in freed, or its link dropped by a copy: the linear stops applying it)
        linear.__dict__.pop(SOURCE, None)
        for flag in ("fp8_gelu_input", "fp8_swiglu_input"):
            linear.__dict__[flag] = False
        linear.__dict__["fp8_ln_input"] = None
    return True


def broken(module: nn.Module, link: tuple) -> bool:
    """Is the linear gone from its place, or no longer applying `module`? (Two or three dict
    reads per call: this runs in every forward of a fused norm or activation.)"""
    parent_ref, names, linear_ref, flag, _, _ = link
    m = parent_ref()
    for n in names:
        if m is None:
            return True
        m = m._modules.get(n)
    if m is None or m is not linear_ref():
        return True
    applies = m.__dict__.get(flag)
    return applies is not module if flag == "fp8_ln_input" else not applies


def undo(module: nn.Module, why: str | None) -> nn.Module:
    """Undo the fusion of `module` (linked by make): the norm computes again, the activation's
    original module goes back in its place, the linear (if alive) stops applying it. Returns
    the module now in the model (the original activation, or the norm itself). why: the
    warning's reason (None: no warning, convert's own repair)."""
    link = module.__dict__.pop(LINK, None)
    if link is None:
        return module
    parent_ref, _, linear_ref, flag, name, what = link
    linear = linear_ref()
    if linear is not None and (linear.__dict__.get(flag) is module if flag == "fp8_ln_input" else True):
        linear.__dict__[flag] = None if flag == "fp8_ln_input" else False
        linear.__dict__.pop(SOURCE, None)
    restored = module
    original = module.__dict__.pop("_fp8_original", None)
    if original is not None:  # an activation: its module back in the parent
        parent = parent_ref()
        if parent is not None and parent._modules.get(name) is module:
            parent._modules[name] = original
        restored = original
    else:  # a norm: its own class again
        module.__class__ = module._fp8_plain_class
    producer = module.__dict__.pop("_fp8_producer", None)
    producer = producer() if producer is not None else None
    if producer is not None:
        producer.__dict__["fp8_gelu_output"] = False
    if why is not None:
        warnings.warn(f"fp8ops: {what} is undone ({why}): it computes on its own again, as before convert",
                      stacklevel=3)
    return restored


def undo_broken(model: nn.Module) -> None:
    """convert's repair before it fuses: every broken link of model's modules undone."""
    for m in list(model.modules()):
        link = m.__dict__.get(LINK)
        if link is not None and broken(m, link):
            undo(m, None)


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
        target = undo(self, "a hook was registered on it")
        return getattr(nn.Module, method)(target, *args, **kwargs)

    def register_forward_pre_hook(self, *args, **kwargs):
        return self._hooked_now("register_forward_pre_hook", args, kwargs)

    def register_forward_hook(self, *args, **kwargs):
        return self._hooked_now("register_forward_hook", args, kwargs)

    def register_full_backward_pre_hook(self, *args, **kwargs):
        return self._hooked_now("register_full_backward_pre_hook", args, kwargs)

    def register_full_backward_hook(self, *args, **kwargs):
        return self._hooked_now("register_full_backward_hook", args, kwargs)

    def __getstate__(self):
        return without_link(super().__getstate__())


class ActivationFusedIntoLinear(HookUndoesFusion, nn.Identity):
    """Where a fused GELU or SwiGLU module was: passes its input through, the next linear
    applying the activation; keeps the original module (not a submodule: no state_dict keys,
    as the activations have none) to put back if the fusion is undone."""

    def __init__(self, original: nn.Module):
        super().__init__()
        self.__dict__["_fp8_original"] = original

    def forward(self, input):  # noqa: A002 -- nn.Identity's name
        link = self.__dict__.get(LINK)
        if link is not None and broken(self, link):
            original = self.__dict__.get("_fp8_original")
            if not torch.compiler.is_compiling():
                undo(self, "the FP8 layer that applied it is no longer in its place, or no longer applies it")
            return original(input)
        return input

    def extra_repr(self) -> str:
        return f"{type(self.__dict__.get('_fp8_original')).__name__}, applied by the next linear (fused)"

