"""Moving a SwiGLU activation into the FP8 linear it feeds.

In a Llama-style MLP with its gate and up projections merged,
c_proj(swiglu(c_fc(x))) with swiglu(x) = silu(gate) * up of x's two halves,
torch writes silu(gate) and the product, and c_proj's cast reads the product
back; the backward makes four more passes over the hidden activation (mul's
two products, silu_backward, the chunk's cat). After fuse_swiglu() c_proj
(fp8_swiglu_input) takes c_fc's output itself: its input cast computes
silu(gate) * up as it loads both halves (linear_fwd(swiglu_input=True)), and
c_fc (fp8_swiglu_output) forms the gradient of its output [gate | up] from the
gradient of the product inside its own gradient cast, reading its output beside
it (linear_bwd(swiglu=True)): c_proj's backward hands that gradient over in a
box on c_fc's output, as the fused GELU's does, and gives autograd a stand-in of
no memory. Without such a producer (c_fc not an Fp8Linear, or on another path
this call) c_proj's backward makes the gradient itself in one pass
(fp8ops::swiglu_backward), as it does under torch.compile (no tensor
attributes there). A call that does not run the fused FP8 path (BF16 by policy,
delayed scaling's first step, all-E5M2 layers) applies the SwiGLU first with
fp8ops::swiglu, one pass each way.

The move is made where the model's own forward shows it is safe, read with
torch.fx in train and eval mode (gelu_fusion.py's tracer): an activation module
that swiglu.is_swiglu recognises (fp8ops.SwiGLU, or a stateless module whose
forward is exactly chunk -> silu -> mul), whose output goes to exactly one
converted Fp8Linear and nowhere else, both called once, neither shared nor
hooked. The activation module becomes nn.Identity (it has no state: state_dict
keys do not change). A SwiGLU written inline in a larger forward is left as it is.
"""
from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn

from .gelu_fusion import _roles, candidates
from .swiglu import is_swiglu


class Fused(NamedTuple):
    swiglu: str            # the activation module's fqn (now nn.Identity)
    consumer: str          # the Fp8Linear that applies it (fp8_swiglu_input)
    producer: str | None   # the Fp8Linear that applies its gradient (fp8_swiglu_output), if any


def fuse_swiglu(model: nn.Module) -> list[Fused]:
    """Fuse every eligible SwiGLU activation module of `model` into its consumer, in place."""
    fused: list[Fused] = []
    for prefix, parent, name, calls, uses in candidates(model, is_swiglu, "SwiGLU"):
        roles = {_roles(c, parent, name, uses) for c in calls}
        if len(roles) != 1 or None in roles:
            continue  # not eligible, or routed differently in train and eval mode
        consumer, producer = roles.pop()
        lin = parent.get_submodule(consumer)
        if lin.fp8_swiglu_input or lin.fp8_gelu_input or lin.fp8_ln_input is not None:
            continue
        lin.fp8_swiglu_input = True
        if producer is not None:
            parent.get_submodule(producer).fp8_swiglu_output = True
        setattr(parent, name, nn.Identity())
        fused.append(Fused(prefix + name, prefix + consumer, None if producer is None else prefix + producer))
    return fused
