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
gelu_input = h: the GELU's gradient formed in its cast's pass, eager code's
fused call. The math is the same; the rounding differs as eager code's
fused and unfused paths do (the cast forms g * gelu'(h) in fp32 with its own
formula; torch's op uses its own and rounds to the gradient's dtype). It may fire
where eager code does not fuse (fuse_gelu refuses a producer whose output
has another use, say a detached copy): the pair in the graph is then still
exactly the GELU's gradient feeding that cast. Where the graph does not show
the pair (a graph break between them, c_fc in BF16 or not converted, a
second use of the gradient), gelu_tanh_backward is put back as torch's own
pointwise decomposition of gelu_backward, which inductor fuses as it did
before this pass existed. (Current scaling, and delayed scaling's first
step, run the GELU unfused and never reach this.)

Installed as inductor's post_grad_custom_post_pass while dynamo traces an
Fp8Linear, and left there for the process; the same pass then runs
cat_grad_pass.py's rewrite (the q, k, v gradients' concatenation read in
place by the cast) and residual_pass.py's (the residual adds beside fp8ops'
fused norms run inside them). It changes only graphs that hold
gelu_tanh_backward, fp8ops.linear_bwd_sink or fp8ops' norm ops, but other
graphs' cache keys change with it (one cache miss each). Where the user has a
pass of their own there, theirs is kept, gelu_tanh_backward stays an opaque op
(torch's kernel, as in eager code), the concatenation stays inductor's, the
residual adds run as kernels of their own, and a warning says so once.
"""
from __future__ import annotations

import contextlib
import logging

import torch

from . import cat_grad_pass, residual_pass

log = logging.getLogger("fp8ops")

# How many linear_bwd calls the pass has given a GELU's gradient, and how many
# gelu_tanh_backward calls it put back as pointwise code, in this process (graphs
# compiled by the pass only: one taken from inductor's cache counts nothing)
FUSED = [0]
DECOMPOSED = [0]


@torch.library.custom_op("fp8ops::gelu_tanh_backward", mutates_args=())
def gelu_tanh_backward(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """torch's gelu_backward(g, h, approximate="tanh"), as an op inductor does not
    decompose: the pass below finds it by name in the compiled backward graph."""
    return torch.ops.aten.gelu_backward(g, h, approximate="tanh")


@gelu_tanh_backward.register_fake
def _(g, h):
    # (torch's own meta kernel: its shape, dtype and broadcasting checks, and the real op's strides)
    return torch.ops.aten.gelu_backward(g, h, approximate="tanh")


# ops that only reinterpret a contiguous tensor's shape (a chain of them back to the same
# shape and strides is the same tensor)
_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


# gy's and gelu_input's places in linear_bwd's (and linear_bwd_sink's) arguments
_GY, _GELU_INPUT = 0, 8


def _is_linear_bwd(node) -> bool:
    """Does node call fp8ops.linear_bwd or linear_bwd_sink? linear_bwd (eager code's) mutates
    g_amax, so after functionalization (where this pass runs) it is wrapped in
    auto_functionalized(_v2), with keywords; linear_bwd_sink (compiled code's, linear.py)
    declares no write and is called as it is."""
    if node.op != "call_function":
        return False
    sink = getattr(torch.ops.fp8ops, "linear_bwd_sink", None)
    if sink is not None and node.target is sink.default:
        return len(node.args) + len(node.kwargs) > _GELU_INPUT
    hop = torch.ops.higher_order
    return (node.target in (getattr(hop, "auto_functionalized", None), getattr(hop, "auto_functionalized_v2", None))
            and bool(node.args) and node.args[0] is torch.ops.fp8ops.linear_bwd.default
            and "gy" in node.kwargs and "gelu_input" in node.kwargs)


def _gy_args(node) -> tuple:
    """(gy, gelu_input) of the linear_bwd call `node`."""
    args, kwargs = node.args, node.kwargs
    return (kwargs["gy"] if "gy" in kwargs else args[_GY],
            kwargs["gelu_input"] if "gelu_input" in kwargs else args[_GELU_INPUT])


def _with_gy(new: tuple, args, kwargs) -> tuple[tuple, dict]:
    """(args, kwargs) of a linear_bwd call with its gy and gelu_input replaced by new."""
    args, kwargs = list(args), dict(kwargs)
    for name, pos, value in (("gy", _GY, new[0]), ("gelu_input", _GELU_INPUT, new[1])):
        if name in kwargs:
            kwargs[name] = value
        else:
            args[pos] = value
    return tuple(args), kwargs


def _decompose(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    """Replace the gelu_tanh_backward call `node` by torch's decomposition of
    gelu_backward, traced on its inputs' fake values as inductor's own pattern
    matcher does (pattern_matcher.fwd_only); False (node kept) if that fails."""
    try:
        from torch._inductor.pattern_matcher import fwd_only  # noqa: PLC0415
        from torch._inductor.virtualized import NullHandler, V  # noqa: PLC0415
        g, h = node.args
        # (inductor's fake mode, as pattern_matcher's replace_by_example enters it)
        fake = V.fake_mode if not isinstance(V.fake_mode, NullHandler) and V.fake_mode is not None \
            else contextlib.nullcontext()
        with fake:
            gm = fwd_only(lambda a, b: torch.ops.aten.gelu_backward(a, b, approximate="tanh"),
                          [g.meta["val"], h.meta["val"]])
        nodes = list(gm.graph.nodes)
        if any(n.op not in ("placeholder", "call_function", "output") for n in nodes):
            return False  # (a constant held by the module: not worth copying)
        env = dict(zip([n for n in nodes if n.op == "placeholder"], (g, h)))
        with graph.inserting_before(node):
            for n in nodes:
                if n.op == "call_function":
                    env[n] = graph.node_copy(n, lambda a: env[a])
                elif n.op == "output":
                    out = n.args[0][0] if isinstance(n.args[0], (tuple, list)) else n.args[0]
                    node.replace_all_uses_with(env[out])
    except Exception as e:  # noqa: BLE001 -- the opaque op is correct, only slower
        log.debug("fp8ops: gelu_tanh_backward kept as an op (%s: %s)", type(e).__name__, e)
        return False
    graph.erase_node(node)
    return True


def fuse_gelu_grads(graph: torch.fx.Graph) -> int:
    """The pass (see the module's docstring); returns how many linear_bwd calls it gave
    a GELU's gradient."""
    if not hasattr(torch.ops.fp8ops, "linear_bwd"):
        return 0
    done = 0
    for gelu in list(graph.nodes):
        if gelu.op != "call_function" or gelu.target is not torch.ops.fp8ops.gelu_tanh_backward.default:
            continue
        if _fuse_one(graph, gelu):
            done += 1
        elif _decompose(graph, gelu):
            DECOMPOSED[0] += 1
    FUSED[0] += done
    return done


def _fuse_one(graph: torch.fx.Graph, gelu: torch.fx.Node) -> bool:
    """Hand the gelu_tanh_backward call `gelu` to the linear_bwd that takes its result,
    if the graph shows that pair (see the module's docstring)."""
    g, h = gelu.args if len(gelu.args) == 2 and not gelu.kwargs else (None, None)
    v_out, v_g, v_h = _val(gelu), _val(g), _val(h)
    if v_out is None or v_g is None or v_h is None or v_out.dim() != 2:
        return False
    # follow views with no other user down to the one user of the result
    chain, cur = [gelu], gelu
    while len(cur.users) == 1 and next(iter(cur.users)).target in _VIEWS:
        cur = next(iter(cur.users))
        chain.append(cur)
    if len(cur.users) != 1:
        return False
    user = next(iter(cur.users))
    if not _is_linear_bwd(user):
        return False
    gy, gelu_input = _gy_args(user)
    v_gy, v_gi = _val(cur), _val(gelu_input)
    if gy is not cur or v_gy is None or v_gi is None or v_gi.numel() != 0:
        return False
    # the same tensor as linear_bwd wants it: [M, N], contiguous, g's and h's shape and dtype
    if not (v_gy.shape == v_out.shape == v_g.shape == v_h.shape and v_gy.dtype == v_g.dtype == v_h.dtype
            and v_gy.is_contiguous() and v_g.is_contiguous() and v_h.is_contiguous()):
        return False
    user.args, user.kwargs = _with_gy((g, h), user.args, user.kwargs)
    # (inductor lowers the op with the strides these fake inputs have: they must be the new ones)
    if "eager_input_vals" in user.meta:
        user.meta["eager_input_vals"] = _with_gy((v_g, v_h), *user.meta["eager_input_vals"])
    for n in reversed(chain):
        graph.erase_node(n)
    return True


def _pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: PLC0415

    class FuseGeluGrads(CustomGraphPass):
        def __call__(self, graph: torch.fx.Graph) -> None:
            fuse_gelu_grads(graph)
            cat_grad_pass.fuse_cat_grads(graph)
            residual_pass.fuse_residuals(graph)

        def uuid(self):
            # (inductor's cache key: the passes' text, and whether the residual pass is on)
            return get_hash_for_files((__file__, cat_grad_pass.__file__, residual_pass.__file__),
                                      extra=f"residual {residual_pass.ENABLED}")

        def __reduce__(self):
            # every torch.compile wrapper made after install() keeps inductor's config, this pass
            # in it, and torch.save(wrapper) pickles it: by the module-level maker, as a class
            # local to a function cannot be pickled ("Can't pickle local object")
            return (_new_pass, ())

    return FuseGeluGrads


_STATE = {"cls": None, "warned": False}


def _new_pass():
    """An instance of the pass's class, made on first use (importing inductor then, not when
    fp8ops is imported)."""
    if _STATE["cls"] is None:
        _STATE["cls"] = _pass_class()
    return _STATE["cls"]()


def install() -> bool:
    """Make fuse_gelu_grads inductor's post_grad_custom_post_pass unless another pass is
    there; True if it is installed. Run by dynamo while it traces (see Fp8Linear.forward),
    not by compiled code."""
    from torch._inductor import config  # noqa: PLC0415
    current = config.post_grad_custom_post_pass
    if _STATE["cls"] is not None and isinstance(current, _STATE["cls"]):
        return True
    if current is None:
        config.post_grad_custom_post_pass = _new_pass()
        return True
    if not _STATE["warned"]:
        _STATE["warned"] = True
        log.warning("fp8ops: torch._inductor.config.post_grad_custom_post_pass holds another pass (%r), so "
                    "fp8ops leaves it there: under torch.compile the fused GELU's gradient then runs as an op "
                    "of its own instead of inside the producer's gradient cast, and a split projection's "
                    "gradients (q, k, v) are concatenated before its cast instead of read in place, and the residual "
                    "adds beside fused norms run as kernels of their own instead of inside the norms", current)
    return False


# what torch.compiler.assume_constant_result does (dynamo calls it while tracing and keeps
# the result), without importing dynamo at import time
install._dynamo_marked_constant = True
