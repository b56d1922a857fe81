"""Moving a SwiGLU activation into the FP8 linear it feeds.

In a Llama-style MLP with its gate and up projections merged,
c_proj(swiglu(c_fc(x))) with swiglu(x) = silu(gate) * up of x's two halves,
torch writes silu(gate) and the product, and c_proj's cast reads the product
back; the backward makes four more passes over the hidden activation (mul's
two products, silu_backward, the chunk's cat). After fuse_swiglu() c_proj
(fp8_swiglu_input) takes c_fc's output itself: its input cast computes
silu(gate) * up as it loads both halves (linear_fwd(swiglu_input=True)), and
its backward turns the gradient of the product into the gradient of c_fc's
output in one pass (fp8ops::swiglu_backward). A call that does not run the
fused FP8 path (BF16 by policy, delayed scaling's first step, all-E5M2 layers,
torch.compile included) applies the SwiGLU first with fp8ops::swiglu, one pass
each way.

The move is made where the model's own forward shows it is safe, read with
torch.fx in train and eval mode (gelu_fusion.py's tracer): an activation module
that swiglu.is_swiglu recognises (fp8ops.SwiGLU, or a stateless module whose
forward is exactly chunk -> silu -> mul), whose output goes to exactly one
converted Fp8Linear and nowhere else, both called once, neither shared nor
hooked. The activation module becomes an nn.Identity (it has no state: state_dict
keys do not change) that keeps it, and a link to c_proj (fusion_links.py): a hook
registered there makes it compute the activation again. A SwiGLU written inline in a larger
forward is left as it is.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from . import fusion_links
from .gelu_fusion import _roles, candidates
from .swiglu import is_swiglu


class Fused(NamedTuple):
    swiglu: str    # the activation module's fqn (now an nn.Identity: fusion_links.ActivationFusedIntoLinear)
    consumer: str  # the Fp8Linear that applies it (fp8_swiglu_input)


def fuse_swiglu(model: nn.Module) -> list[Fused]:
    """Fuse every eligible SwiGLU activation module of `model` into its consumer, in place."""
    fused: list[Fused] = []
    for prefix, parent, name, calls, uses in candidates(model, is_swiglu, "SwiGLU"):
        roles = {_roles(c, parent, name, uses) for c in calls}
        if len(roles) != 1 or None in roles:
            continue  # not eligible, or routed differently in train and eval mode
        consumer, _ = roles.pop()  # (its producer needs nothing: the gradient is made here)
        lin = parent.get_submodule(consumer)
        if lin.fp8_swiglu_input or lin.fp8_gelu_input or lin.fp8_ln_input is not None \
                or not lin.fp8_config.fuses("swiglu"):  # (converted earlier with the fusion off: kept so)
            continue
        lin.fp8_swiglu_input = True
        stand_in = fusion_links.ActivationFusedIntoLinear(parent._modules[name])
        fusion_links.make(stand_in, lin, "fp8_swiglu_input",
                          f"the SwiGLU {prefix + name} fused into {prefix + consumer}")
        setattr(parent, name, stand_in)
        fused.append(Fused(prefix + name, prefix + consumer))
    return fused
