"""Moving a model's GELU into the FP8 linear that consumes it.

In a GPT-style MLP, c_proj(gelu(c_fc(x))), the GELU is two memory passes of the
widest activation (its forward and its backward) between two GEMMs. An
Fp8Linear with fp8_gelu_input computes linear(gelu_tanh(h)) from h itself: the
GELU is applied as its cast loads h, and its gradient is applied by the dgrad
GEMM's epilogue, so neither pass runs (see linear.py, csrc/gelu.h).

fuse_gelu() does that move where the model's own forward shows it is safe: a
tanh-approximate nn.GELU module whose output goes to exactly one converted
Fp8Linear and nowhere else, both called once in their parent's forward (read
with torch.fx, which never runs it), and neither shared nor hooked. The GELU
module is replaced by nn.Identity (it has no state, so state_dict keys are
unchanged) and the linear applies the GELU; a forward fx cannot read keeps its
GELU.
"""
from __future__ import annotations

import logging

import torch.fx
import torch.nn as nn

from .linear import Fp8Linear

log = logging.getLogger("fp8ops")


class _Tracer(torch.fx.Tracer):
    """Stops at linears and GELUs: only the data flow between them matters."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, (nn.Linear, nn.GELU)) or super().is_leaf_module(m, qualname)


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


def fuse_gelu(model: nn.Module) -> dict[str, str]:
    """Fuse every eligible GELU of `model` into its consumer, in place.
    Returns {linear fqn: GELU fqn} of what was fused."""
    uses: dict[int, int] = {}
    for _, m in model.named_modules(remove_duplicate=False):
        uses[id(m)] = uses.get(id(m), 0) + 1
    fused: dict[str, str] = {}
    for parent_name, parent in list(model.named_modules()):
        gelus = {n: m for n, m in parent.named_children() if type(m) is nn.GELU and m.approximate == "tanh"}
        if not gelus:
            continue
        prefix = parent_name + "." if parent_name else ""
        try:
            graph = _Tracer().trace(parent)
        except Exception as e:  # noqa: BLE001 -- any forward fx cannot read keeps its GELU
            log.debug("fp8ops: GELU of %s not fused: torch.fx cannot read %s.forward (%s)",
                      prefix + next(iter(gelus)), type(parent).__name__, e)
            continue
        calls: dict[str, list[torch.fx.Node]] = {}
        for node in graph.nodes:
            if node.op == "call_module":
                calls.setdefault(node.target, []).append(node)
        for name, gelu in gelus.items():
            nodes = calls.get(name, [])
            if len(nodes) != 1 or len(nodes[0].users) != 1 or uses[id(gelu)] != 1 or _hooked(gelu):
                continue
            user = next(iter(nodes[0].users))
            if user.op != "call_module" or user.args != (nodes[0],) or user.kwargs:
                continue
            lin = parent.get_submodule(user.target)
            # (a hook on the linear would see h instead of gelu(h))
            if (not isinstance(lin, Fp8Linear) or lin.fp8_gelu_input or len(calls[user.target]) != 1
                    or uses[id(lin)] != 1 or _hooked(lin)):
                continue
            lin.fp8_gelu_input = True
            setattr(parent, name, nn.Identity())
            fused[prefix + user.target] = prefix + name
    return fused
