"""Moving a model's GELU into the FP8 linears around it.

In a GPT-style MLP, c_proj(gelu(c_fc(x))), the GELU is two memory passes of the
widest activation (its forward and its backward) between two GEMMs. After
fuse_gelu() neither runs:
  - c_proj (fp8_gelu_input) computes linear(gelu_tanh(h)) from h itself: the
    GELU is applied as its input cast loads h;
  - c_fc (fp8_gelu_output) applies the GELU's gradient as its gradient cast
    loads dL/dgelu(h), reading h beside it. Per call, c_fc offers this with a
    box on its output tensor and c_proj takes it (Fp8Linear.forward); a call
    where either side runs another path (BF16 by policy, current scaling's
    first step) applies the GELU's gradient the usual way. Under torch.compile
    (no boxes there) c_proj's backward applies it, and an inductor pass moves
    it into c_fc's gradient cast where the compiled backward graph shows the
    two side by side (gelu_grad_pass.py).

fuse_gelu() makes that move where the model's own forward shows it is safe,
read with torch.fx (which never runs it) in both train and eval mode: a
tanh-approximate nn.GELU module whose output goes to exactly one converted
Fp8Linear and nowhere else (and, for c_fc's part, whose input is exactly one
converted Fp8Linear's output, used nowhere else), each called once, none
shared or hooked. The GELU module becomes an nn.Identity (it has no state: the
state_dict keys do not change) that keeps it, and a link to c_proj (fusion_links.py):
a hook registered there makes it compute the GELU again. A forward fx cannot read keeps its GELU.
"""
from __future__ import annotations

import logging
import weakref
from typing import NamedTuple

import torch.fx
import torch.nn as nn

from . import fusion_links
from .fx_read import graphs_in_both_modes, hooked, mutated_in_place, used_by_other_methods
from .linear import Fp8LinearBase

log = logging.getLogger("fp8ops")


class Fused(NamedTuple):
    gelu: str              # the GELU module's fqn (now an nn.Identity: fusion_links.ActivationFusedIntoLinear)
    consumer: str          # the Fp8Linear that applies the GELU (fp8_gelu_input)
    producer: str | None   # the Fp8Linear that applies its gradient (fp8_gelu_output), if any


class _Tracer(torch.fx.Tracer):
    """Stops at linears, GELUs, the given modules and hooked modules: only the data flow
    between them matters. (A hooked module read through would run its hooks on fx's
    stand-ins, and a wrapper's hook would see a fused input or keep an output whose
    gradient the fusion changes, unseen: opaque, nothing inside it is fused with anything
    outside.)"""

    def __init__(self, leaves=()):
        super().__init__()
        self._leaves = {id(m) for m in leaves}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return (id(m) in self._leaves or isinstance(m, (nn.Linear, Fp8LinearBase, nn.GELU)) or hooked(m)
                or super().is_leaf_module(m, qualname))


# the key of a calls dict (_trace) holding the nodes whose values the forward stored on a module
# (fx_read: escaped_nodes); not a module name
ESCAPED = "<stored>"


def _trace(parent: nn.Module, leaves=()):
    """{module target: its call nodes} of parent.forward in train and in eval mode (a
    branch on self.training may route the GELU differently), read down to linears, GELUs,
    torch.nn's modules and `leaves`; raises if fx cannot read it."""
    graphs = graphs_in_both_modes(parent, _Tracer, leaves=leaves)
    calls = []
    for graph in graphs:
        c: dict = {ESCAPED: graph.escaped_nodes}
        for node in graph.nodes:
            if node.op == "call_module":
                c.setdefault(node.target, []).append(node)
        calls.append(c)
    return calls


def _single(calls: dict, target: str) -> torch.fx.Node | None:
    nodes = calls.get(target, [])
    return nodes[0] if len(nodes) == 1 else None


def _roles(calls: dict, parent: nn.Module, name: str, uses: dict) -> tuple[str, str | None] | None:
    """(consumer, producer or None) of the activation child `name` (a GELU, or a SwiGLU:
    swiglu_fusion.py) in one traced graph."""
    g = _single(calls, name)
    # (called with one positional argument: the nn.Identity that replaces it takes no other;
    # an output stored on a module would be the activation's input once fused)
    if g is None or len(g.users) != 1 or len(g.args) != 1 or g.kwargs or g in calls[ESCAPED]:
        return None
    if isinstance(g.args[0], torch.fx.Node) and mutated_in_place(g.args[0]):
        return None  # (the consumer would read the input as changed later, not as the activation saw it)
    user = next(iter(g.users))
    if user.op != "call_module" or user.args != (g,) or user.kwargs or _single(calls, user.target) is None:
        return None
    consumer = parent.get_submodule(user.target)
    # (a hook on the consumer would see h instead of gelu(h))
    # (a layer converted earlier with fuse_gelu=False, or on current scaling, keeps its GELU
    # apart: convert again with another config keeps each converted layer's config)
    if not isinstance(consumer, Fp8LinearBase) or uses[id(consumer)] != 1 or hooked(consumer) \
            or not consumer.fp8_config.fuses("gelu"):
        return None
    producer = None
    src = g.args[0]
    # (the producer's output must have no other use: a stored one could take a gradient of its own)
    if (isinstance(src, torch.fx.Node) and src.op == "call_module" and len(src.users) == 1
            and src not in calls[ESCAPED] and _single(calls, src.target) is not None):
        p = parent.get_submodule(src.target)
        # (a hook on its output's gradient would see the gradient of gelu(h), not of h)
        if isinstance(p, Fp8LinearBase) and uses[id(p)] == 1 and not hooked(p) and p.fp8_config.fuses("gelu"):
            producer = src.target
    return user.target, producer


def candidates(model: nn.Module, select, what: str):
    """(prefix, parent, name, calls, uses) for each child module m of the model's modules
    with select(m), unshared and unhooked; calls: its parent's forward as _trace reads it,
    uses: {id(module): how many places hold it}. A parent fx cannot read is skipped."""
    uses: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
    for parent_name, parent in list(model.named_modules()):
        chosen = [(n, m) for n, m in parent.named_children() if select(m)]
        if not chosen:
            continue
        for other in used_by_other_methods(parent):
            # (a child another method of the parent calls, self.ln in a features() say, is
            # used in a place the forward's read does not show: as if held twice)
            child = parent._modules.get(other)
            if child is not None:
                uses[id(child)] = uses.get(id(child), 0) + 1
        prefix = parent_name + "." if parent_name else ""
        try:
            calls = _trace(parent, [m for _, m in chosen])
        except Exception as e:  # noqa: BLE001 -- any forward fx cannot read keeps its modules
            log.debug("fp8ops: %s of %s not fused: torch.fx cannot read %s.forward (%s)",
                      what, prefix + chosen[0][0], type(parent).__name__, e)
            continue
        for name, m in chosen:
            if uses[id(m)] == 1 and not hooked(m):
                yield prefix, parent, name, calls, uses


def fuse_gelu(model: nn.Module) -> list[Fused]:
    """Fuse every eligible GELU of `model` into the linears around it, in place."""
    fused: list[Fused] = []
    for prefix, parent, name, calls, uses in candidates(
            model, lambda m: type(m) is nn.GELU and m.approximate == "tanh", "GELU"):
        roles = {_roles(c, parent, name, uses) for c in calls}
        if len(roles) != 1 or None in roles:
            continue  # not eligible, or routed differently in train and eval mode
        consumer, producer = roles.pop()
        c = parent.get_submodule(consumer)
        if c.fp8_gelu_input:
            continue
        c.fp8_gelu_input = True
        stand_in = fusion_links.ActivationFusedIntoLinear(parent._modules[name])
        fusion_links.make(stand_in, c, "fp8_gelu_input",
                          f"the GELU {prefix + name} fused into {prefix + consumer}")
        if producer is not None:
            p = parent.get_submodule(producer)
            p.fp8_gelu_output = True
            stand_in.__dict__["_fp8_producer"] = weakref.ref(p)
        setattr(parent, name, stand_in)
        fused.append(Fused(prefix + name, prefix + consumer, None if producer is None else prefix + producer))
    return fused
