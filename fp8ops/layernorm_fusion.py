"""Moving a LayerNorm or RMSNorm into the FP8 linear that consumes it.

In a pre-LayerNorm transformer block, c_attn(ln_1(x)) and c_fc(ln_2(x)), the
LayerNorm writes its fp32 output and the linear's cast reads it back: two
passes of 4 bytes per element. After fuse_layernorm() the linear normalizes x
inside its cast (ln_linear_fwd: per-row statistics in a small pass, then
gamma * (rstd * (x - mean)) + beta as each element is loaded), and its backward
turns the linear's input gradient into the LayerNorm's gradients in one pass
over x and it (layernorm_bwd; torch's LayerNorm backward, which makes two, for
rows wider than 2048). An nn.RMSNorm (Llama-style blocks) takes the same path
with mean 0 and no bias (ln_linear_fwd(rms=True); above 2048 columns its
backward is _rms_norm_backward's formula). A call that does not run the fused
FP8 path (BF16 by policy, delayed scaling's first step, all-E5M2 layers)
applies the norm first, as the model did.

The move is made where the model's own forward shows it is safe, read with
torch.fx in train and eval mode (gelu_fusion.py's tracer): an nn.LayerNorm
over the last dimension (or nn.RMSNorm) whose output goes to exactly one
converted Fp8Linear and nowhere else, both called once, neither shared nor
hooked: a block whose norm feeds separate q, k and v projections keeps it. The
norm module stays in the model with its parameters (state_dict keys
unchanged) and becomes a pass-through (its class is swapped to
LayerNormFusedIntoLinear or RMSNormFusedIntoLinear); the linear holds a
reference to it, and the norm a link to the linear (fusion_links.py): a hook registered on
the norm gives it back its own class.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.fx
import torch.nn as nn

from . import fusion_links
from .fx_read import hooked, mutated_in_place
from .gelu_fusion import ESCAPED, _single, candidates
from .linear import Fp8LinearBase


class _AppliedByNextLinear(fusion_links.HookUndoesFusion):
    """A norm module whose normalization the next (FP8) linear applies: its
    forward passes x through unchanged (a hook registered on it gives it back its
    own class first: fusion_links.py). Same parameters and state_dict keys."""

    def forward(self, x):
        return x

    def extra_repr(self) -> str:
        return super().extra_repr() + ", applied by the next linear (fused)"


class LayerNormFusedIntoLinear(_AppliedByNextLinear, nn.LayerNorm):
    """An nn.LayerNorm the next linear applies (_AppliedByNextLinear)."""
    _fp8_plain_class = nn.LayerNorm


class RMSNormFusedIntoLinear(_AppliedByNextLinear, nn.RMSNorm):
    """An nn.RMSNorm the next linear applies (_AppliedByNextLinear)."""
    _fp8_plain_class = nn.RMSNorm


_FUSED_CLASS = {nn.LayerNorm: LayerNormFusedIntoLinear, nn.RMSNorm: RMSNormFusedIntoLinear}


class Fused(NamedTuple):
    layernorm: str  # the LayerNorm's or RMSNorm's fqn (now a pass-through)
    consumer: str   # the Fp8Linear that applies it


def _shape_only(node) -> bool:
    """A use of the LayerNorm's output that reads only its shape (the same as its input's)."""
    return ((node.op == "call_function" and node.target is getattr and node.args[1:] in (("shape",), ("ndim",)))
            or (node.op == "call_method" and node.target in ("size", "dim")))


def _consumer(calls: dict, parent: nn.Module, name: str, uses: dict) -> str | None:
    node = _single(calls, name)
    # (called with one positional argument: the pass-through forward takes no other; an output
    # stored on a module would be the norm's input once fused)
    if node is None or len(node.args) != 1 or node.kwargs or node in calls[ESCAPED]:
        return None
    if isinstance(node.args[0], torch.fx.Node) and mutated_in_place(node.args[0]):
        return None  # (the consumer would normalize the input as changed later)
    users = [u for u in node.users if not _shape_only(u)]  # e.g. attention's B, T, C = x.shape
    if len(users) != 1:
        return None
    user = users[0]
    if user.op != "call_module" or user.args != (node,) or user.kwargs or _single(calls, user.target) is None:
        return None
    lin = parent.get_submodule(user.target)
    if not isinstance(lin, Fp8LinearBase) or uses[id(lin)] != 1 or hooked(lin) or not lin.fp8_config.fuses("layernorm"):
        return None  # (a layer converted earlier with the fusion off, or on current scaling, keeps it off)
    return user.target


def fuse_layernorm(model: nn.Module) -> list[Fused]:
    """Fuse every eligible LayerNorm and RMSNorm of `model` into its consumer, in place."""
    fused: list[Fused] = []
    for prefix, parent, name, calls, uses in candidates(
            model, lambda m: type(m) in _FUSED_CLASS and len(m.normalized_shape) == 1, "LayerNorm"):
        targets = {_consumer(c, parent, name, uses) for c in calls}
        if len(targets) != 1 or None in targets:
            continue  # not eligible, or routed differently in train and eval mode
        target = targets.pop()
        lin, ln = parent.get_submodule(target), parent.get_submodule(name)
        if (lin.fp8_ln_input is not None or lin.fp8_gelu_input or lin.fp8_swiglu_input
                or lin.in_features != ln.normalized_shape[0]):
            continue
        lin.__dict__["fp8_ln_input"] = ln  # not a submodule: the LayerNorm stays where it is
        kind = "RMSNorm" if isinstance(ln, nn.RMSNorm) else "LayerNorm"
        ln.__class__ = _FUSED_CLASS[type(ln)]
        fusion_links.make(ln, lin, "fp8_ln_input",
                          f"the {kind} {prefix + name} fused into {prefix + target}")
        fused.append(Fused(prefix + name, prefix + target))
    return fused
