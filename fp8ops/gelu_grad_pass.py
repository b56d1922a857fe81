"""The fused GELU's gradient under torch.compile: an inductor graph pass.

Eager code fuses the GELU's gradient into the producer's gradient cast
(gelu_fusion.py): per call, c_fc offers it with a box on its output tensor
and c_proj takes it. Compiled code cannot carry a box, and each layer's
backward is fixed when its forward is traced, before the other layer is
seen; so under torch.compile the consumer (c_proj) applies the GELU's
gradient itself, with gelu_tanh_backward below, and the producer (c_fc)
casts the result: one more read and write of the widest activation per MLP.

This pass takes the pairing from the compiled backward graph itself, where
it is plain data flow: wherever gelu_tanh_backward(g, h)'s result goes to
nothing but the gy of an fp8ops.linear_bwd (through views that change
nothing) that applies no GELU yet, that linear_bwd gets gy = g and
gelu_input = h: the GELU's gradient formed in its cast's pass, as eager
code does. A graph where the two are apart (a graph break between them,
the producer in BF16 or under current scaling, which reads the gradient's
amax first) does not match and keeps gelu_tanh_backward, which computes the
same thing on its own. So the pass never changes what is computed, only
where.

Installed, once per process, as inductor's post_grad_custom_post_pass while
dynamo traces a fused-GELU consumer; where the user has a pass of their own
there, theirs is kept and the GELU's gradient stays unfused (logged once).
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("fp8ops")

# How many linear_bwd calls the pass has given a GELU's gradient, in this process (the tests read it).
FUSED = [0]


@torch.library.custom_op("fp8ops::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """torch's gelu_backward(g, h, approximate="tanh"), as an op inductor does not
    decompose: the pass below finds it by name in the compiled backward graph."""
    return torch.ops.aten.gelu_backward(g, h, approximate="tanh")


@gelu_tanh_backward.register_fake
def _(g, h):
    return torch.empty_like(g)


# ops that only reinterpret a contiguous tensor's shape (a chain of them back to the same
# shape and strides is the same tensor)
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _linear_bwd_call(node):
    """(how to read and set gy and gelu_input) if node calls fp8ops.linear_bwd, else None.
    After functionalization a mutating op is wrapped in auto_functionalized(_v2), by keyword."""
    hop = torch.ops.higher_order
    op = torch.ops.fp8ops.linear_bwd.default
    if node.op != "call_function":
        return None
    if node.target in (getattr(hop, "auto_functionalized", None), getattr(hop, "auto_functionalized_v2", None)):
        if node.args and node.args[0] is op and "gy" in node.kwargs and "gelu_input" in node.kwargs:
            return "kwargs"
        return None
    if node.target is op and len(node.args) > 8 and not node.kwargs:
        return "args"
    return None


def _with_gy(how: str, new: tuple, args, kwargs) -> tuple[tuple, dict]:
    """(args, kwargs) of a linear_bwd call with its gy and gelu_input replaced by new."""
    args, kwargs = list(args), dict(kwargs)
    if how == "kwargs":
        kwargs["gy"], kwargs["gelu_input"] = new
    else:
        args[0], args[8] = new
    return tuple(args), kwargs


def fuse_gelu_grads(graph: torch.fx.Graph) -> int:
    """The pass (see the module's docstring); returns how many calls it changed."""
    if not hasattr(torch.ops.fp8ops, "linear_bwd"):
        return 0
    done = 0
    for gelu in list(graph.nodes):
        if gelu.op != "call_function" or gelu.target is not torch.ops.fp8ops.gelu_tanh_backward.default:
            continue
        g, h = gelu.args if len(gelu.args) == 2 and not gelu.kwargs else (None, None)
        v_out, v_g, v_h = _val(gelu), _val(g), _val(h)
        if v_out is None or v_g is None or v_h is None or v_out.dim() != 2:
            continue
        # follow views with no other user down to the one user of the result
        chain, cur = [gelu], gelu
        while len(cur.users) == 1 and next(iter(cur.users)).target in _VIEWS:
            cur = next(iter(cur.users))
            chain.append(cur)
        if len(cur.users) != 1:
            continue
        user = next(iter(cur.users))
        how = _linear_bwd_call(user)
        if how is None:
            continue
        gy, gi = (user.kwargs["gy"], user.kwargs["gelu_input"]) if how == "kwargs" else (user.args[0], user.args[8])
        v_gy, v_gi = _val(cur), _val(gi)
        if gy is not cur or v_gy is None or v_gi is None or v_gi.numel() != 0:
            continue
        # the same tensor as linear_bwd wants it: [M, N], contiguous, g's and h's shape and dtype
        if not (v_gy.shape == v_out.shape == v_g.shape == v_h.shape and v_gy.dtype == v_g.dtype == v_h.dtype
                and v_gy.is_contiguous() and v_g.is_contiguous() and v_h.is_contiguous()):
            continue
        user.args, user.kwargs = _with_gy(how, (g, h), user.args, user.kwargs)
        # (inductor lowers the op with the strides these fake inputs have: they must be the new ones)
        if "eager_input_vals" in user.meta:
            user.meta["eager_input_vals"] = _with_gy(how, (v_g, v_h), *user.meta["eager_input_vals"])
        for n in reversed(chain):
            if not n.users:
                graph.erase_node(n)
        if not gi.users and gi.op == "call_function":
            graph.erase_node(gi)  # (the empty tensor that said "no GELU")
        done += 1
    FUSED[0] += done
    return done


def _pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: PLC0415

    class FuseGeluGrads(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fuse_gelu_grads(graph)

        def uuid(self):
            # (inductor's cache key: this file's text)
            return get_hash_for_files((__file__,))

    return FuseGeluGrads


_STATE = {"cls": None, "warned": False}


def install() -> bool:
    """Make fuse_gelu_grads inductor's post_grad_custom_post_pass unless another pass is
    there; True if it is installed. Run by dynamo while it traces (see Fp8Linear.forward),
    not by compiled code."""
    from torch._inductor import config  # noqa: PLC0415
    if _STATE["cls"] is None:
        _STATE["cls"] = _pass_class()
    current = config.post_grad_custom_post_pass
    if isinstance(current, _STATE["cls"]):
        return True
    if current is None:
        config.post_grad_custom_post_pass = _STATE["cls"]()
        return True
    if not _STATE["warned"]:
        _STATE["warned"] = True
        log.info("fp8ops: torch._inductor.config.post_grad_custom_post_pass holds another pass (%r): under "
                 "torch.compile the fused GELU's gradient runs as a pass of its own", current)
    return False


# what torch.compiler.assume_constant_result does (dynamo calls it while tracing and keeps
# the result), without importing dynamo at import time
install._dynamo_marked_constant = True
