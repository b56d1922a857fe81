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
either order of the product count too). A SwiGLU written inline in a larger
forward runs as written: fp8ops never rewrites a forward.

swiglu(x) is the same computation in one pass forward and one backward
(fp8ops::swiglu), bit for bit what torch's silu and mul give in bf16 / fp16.
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from . import _loader, ops


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] along the last dim: fp8ops' one-pass
    op where it runs (a cpu or cuda tensor of a float dtype with the C core
    loaded), torch's ops otherwise."""
    if (_loader.is_available() and x.dtype in ops.HP_DTYPES and x.device.type in ("cpu", "cuda")
            and x.dim() >= 1 and x.shape[-1] % 2 == 0):
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


def is_swiglu(m: nn.Module) -> bool:
    """Is m an activation module computing exactly silu(gate) * up of its input's
    two halves, with no state (fp8ops.SwiGLU, or a module of the user's own whose
    forward torch.fx reads as that, in train and eval mode)?"""
    if type(m) is SwiGLU:
        return True
    if type(m).__module__.startswith("torch."):
        return False  # (torch's own modules: none is a SwiGLU, and tracing each would cost time)
    if any(True for _ in m.parameters()) or any(True for _ in m.buffers()):
        return False
    was_training = m.training
    try:
        for mode in (True, False):
            m.train(mode)
            if not _traced_is_swiglu(torch.fx.Tracer().trace(m), m):
                return False
    except Exception:  # noqa: BLE001 -- a forward fx cannot read is not recognised
        return False
    finally:
        m.train(was_training)
    return True
