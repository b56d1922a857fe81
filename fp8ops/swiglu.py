"""The SwiGLU activation: silu(gate) * up, gate and up the two halves of one
projection's output (Llama's MLP with its gate and up projections merged:
c_proj(swiglu(c_fc(x)))).

    class MLP(nn.Module):
        def __init__(self, d, hidden):
            super().__init__()
            self.c_fc = nn.Linear(d, 2 * hidden, bias=False)    # gate and up in one GEMM
            self.act = fp8ops.SwiGLU()                           # or a module of your own, below
            self.c_proj = nn.Linear(hidden, d, bias=False)

        def forward(self, x):
            return self.c_proj(self.act(self.c_fc(x)))

fp8ops.convert fuses such an activation module into the FP8 linear it feeds
(swiglu_fusion.py): that linear casts silu(gate) * up straight from c_fc's
output, and the product is never written. It recognises fp8ops.SwiGLU and any
module without state whose forward is exactly `g, u = x.chunk(2, dim=-1);
return F.silu(g) * u` (torch.fx reads it; `nn.SiLU()(g)`, `torch.chunk` and
either order of the product count too) and that does nothing else fx would not
see (hooks, a grad-mode context, attributes written: is_swiglu). A SwiGLU
written inline in a larger forward runs as written: fp8ops never rewrites a
forward.

swiglu(x) is the same computation in one pass forward and one backward
(fp8ops::swiglu): on the CPU bit for bit what torch's silu and mul give in bf16
/ fp16, on CUDA the same to the rounding of the GPU's fast exp (swiglu.h).
"""
from __future__ import annotations

import inspect
import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from . import _loader, ops
from .fx_read import graphs_in_both_modes, hooked

# the devices fp8ops' kernels run on: the CPU with the C core loaded, CUDA when it was built with nvcc
_DEVICES = (("cpu", "cuda") if _loader.build_info().get("cuda_kernels_registered") else ("cpu",)) \
    if _loader.is_available() else ()


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] along the last dim: fp8ops' one-pass
    op where it runs (a float tensor on a device in _DEVICES), torch's ops otherwise and under
    torch.func's transforms (vmap, grad, jacrev: which the op's autograd formula does not take)."""
    if x.device.type in _DEVICES and x.dtype in ops.HP_DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0 \
            and not torch._C._are_functorch_transforms_active():
        return ops.swiglu(x.contiguous())
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """silu(gate) * up of its input's two halves along the last dim
    ([..., 2H] -> [..., H]). fp8ops.convert fuses it into the FP8 linear it
    feeds; unfused it runs fp8ops.swiglu.swiglu (one pass each way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x)


def _is_chunk_in_two(node: torch.fx.Node, x: torch.fx.Node) -> bool:
    """node is x.chunk(2, dim=-1) or torch.chunk(x, 2, -1), however the arguments are spelled."""
    if not ((node.op == "call_method" and node.target == "chunk")
            or (node.op == "call_function" and node.target is torch.chunk)):
        return False
    args = (*node.args, None, None)[:3]
    chunks = node.kwargs.get("chunks", args[1])
    dim = node.kwargs.get("dim", 0 if args[2] is None else args[2])
    return args[0] is x and chunks == 2 and dim == -1


def _is_silu(node: torch.fx.Node, m: nn.Module) -> bool:
    """node is F.silu(.) or an nn.SiLU child of m, not in place."""
    if node.op == "call_function" and node.target is F.silu:
        return not node.kwargs.get("inplace", False) and not (len(node.args) > 1 and node.args[1])
    if node.op == "call_module":
        sub = m.get_submodule(node.target)
        return type(sub) is nn.SiLU and not sub.inplace
    return False


def _traced_is_swiglu(graph: torch.fx.Graph, m: nn.Module) -> bool:
    nodes = [n for n in graph.nodes]
    ops_ = [n for n in nodes if n.op not in ("placeholder", "output")]
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outputs = [n for n in nodes if n.op == "output"]
    if len(placeholders) != 1 or len(outputs) != 1 or len(ops_) != 5:
        return False
    x = placeholders[0]
    chunk = next((n for n in ops_ if _is_chunk_in_two(n, x)), None)
    if chunk is None:
        return False
    items = {n.args[1]: n for n in ops_
             if n.op == "call_function" and n.target is operator.getitem and n.args[0] is chunk}
    if set(items) != {0, 1}:
        return False
    silu = next((n for n in ops_ if _is_silu(n, m)), None)
    if silu is None or silu.args[:1] != (items[0],):
        return False
    mul = next((n for n in ops_ if n.op == "call_function" and n.target in (operator.mul, torch.mul)), None)
    if mul is None or mul.kwargs or set(mul.args) != {silu, items[1]} or len(mul.args) != 2:
        return False
    return outputs[0].args == (mul,)


# what a recognised forward may name (globals and attributes): the ops of the pattern, the
# modules they live in, and m's own children (an nn.SiLU); anything else (a grad-mode context,
# an attribute written, another call) could do what fx does not record
_NAMES = {"torch", "nn", "functional", "F", "chunk", "silu", "mul", "operator"}


def _reads_plainly(m: nn.Module) -> bool:
    """Does fx see all that m's call does? No hook anywhere in it, the stock __call__, a
    forward of the class itself (not wrapped, not set on the instance) that names only
    _NAMES and m's children and defines no inner function."""
    if type(m).__call__ is not nn.Module.__call__ or "forward" in m.__dict__:
        return False
    if any(hooked(s) for s in m.modules()):
        return False
    fwd = type(m).forward
    if inspect.unwrap(fwd) is not fwd or not hasattr(fwd, "__code__"):
        return False
    code = fwd.__code__
    allowed = _NAMES | {name for name, _ in m.named_children()}
    return set(code.co_names) <= allowed and not any(inspect.iscode(c) for c in code.co_consts)


def is_swiglu(m: nn.Module) -> bool:
    """Is m an activation module computing exactly silu(gate) * up of its input's
    two halves, with no state (fp8ops.SwiGLU, or a module of the user's own whose
    forward torch.fx reads as that in train and eval mode, and which does nothing fx
    cannot see: _reads_plainly)? Its forward is read only once that is known, so
    reading it runs no code of the user's beyond the pattern's."""
    if type(m) is SwiGLU:
        return True
    if type(m).__module__.startswith("torch."):
        return False  # (torch's own modules: none is a SwiGLU, and tracing each would cost time)
    if any(True for _ in m.parameters()) or any(True for _ in m.buffers()) or not _reads_plainly(m):
        return False
    try:
        graphs = graphs_in_both_modes(m)
    except Exception:  # noqa: BLE001 -- a forward fx cannot read is not recognised
        return False
    return all(_traced_is_swiglu(g, m) for g in graphs)
