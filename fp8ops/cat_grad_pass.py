"""The q, k, v gradients' concatenation under torch.compile: an inductor graph pass.

An attention block splits one projection's output into q, k and v
(`c_attn(x).split(C, dim=2)`), so in backward autograd concatenates their three
gradients into that layer's dy before its FP8 cast reads it: one more write and
read of a [tokens, 3C] tensor per block. Inductor does that concatenation as a
Triton kernel of its own (with the gradients' transposes), which ran at about
60 % of the H200's bandwidth: 2.8 ms of a 1B model's compiled step, 1.35 ms of
GPT-2 small's (benchmarks/RESULTS.md, section 5, twenty-sixth session's
profile). Eager code cannot avoid it (autograd writes the cat before the layer's
backward runs).

This pass takes it from the compiled backward graph: wherever an
fp8ops.linear_bwd_sink (compiled code's Fp8Linear backward) applies no GELU and
its gy is nothing but aten.cat of three tensors along their last dim (through
views that flatten the leading dims), that call becomes fp8ops.linear_bwd_cat
of the three pieces, each viewed as [tokens, n_i]: the cast reads them where
the attention's backward wrote them (csrc/ops.c). The results are the same bit
for bit. Not taken: a cat whose result has another use (current scaling reads
dy's amax first; a hook), any other number of pieces, pieces of other dtypes,
and pieces not laid out as the op takes them, adjacent columns and rows that do
not overlap (a manual attention's k gradient, transposed, at batch 1; the
gradient of an expand).

Run by gelu_grad_pass's inductor pass, after the GELU rewrite (see install()
there: one post_grad_custom_post_pass slot for its, this and residual_pass.py's
rewrites).
"""
from __future__ import annotations

import contextlib
import logging
import math

import torch

log = logging.getLogger("fp8ops")

# How many linear_bwd_sink calls the pass turned into linear_bwd_cat in this process
# (graphs compiled by the pass only: one taken from inductor's cache counts nothing)
FUSED = [0]

_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default}
_PIECES = 3  # linear_bwd_cat's gy_a, gy_b, gy_c
_GY, _GELU_INPUT = 0, 8  # places in linear_bwd_sink's arguments


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _sink_args(node) -> list | None:
    """linear_bwd_sink's arguments (positional, as linear.py calls it), or None."""
    sink = getattr(torch.ops.fp8ops, "linear_bwd_sink", None)
    if sink is None or node.op != "call_function" or node.target is not sink.default or node.kwargs:
        return None
    n = len(sink.default._schema.arguments)  # (need_db, the last, has a default)
    return list(node.args) if len(node.args) in (n - 1, n) else None


def fuse_cat_grads(graph: torch.fx.Graph) -> int:
    """The pass (see the module's docstring); returns how many calls it rewrote."""
    if not hasattr(torch.ops.fp8ops, "linear_bwd_cat"):
        return 0
    done = 0
    for node in list(graph.nodes):
        try:
            if _fuse_one(graph, node):
                done += 1
        except Exception as e:  # noqa: BLE001 -- the graph as it was is correct, only slower
            log.debug("fp8ops: linear_bwd_sink kept with its gy concatenated (%s: %s)", type(e).__name__, e)
    FUSED[0] += done
    return done


def _fuse_one(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    args = _sink_args(node)
    if args is None:
        return False
    gy, gelu_input = args[_GY], args[_GELU_INPUT]
    v_gy, v_gi = _val(gy), _val(gelu_input)
    if v_gy is None or v_gi is None or v_gi.numel() != 0 or v_gy.dim() != 2 or not v_gy.is_contiguous():
        return False
    # gy <- views with no other user <- cat with no other user
    chain, cur = [], gy
    while isinstance(cur, torch.fx.Node) and cur.target in _VIEWS and len(cur.users) == 1:
        chain.append(cur)
        cur = cur.args[0]
    if not isinstance(cur, torch.fx.Node) or cur.target is not torch.ops.aten.cat.default or len(cur.users) != 1:
        return False
    cat = cur
    pieces = cat.args[0]
    dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    v_cat = _val(cat)
    if v_cat is None or len(pieces) != _PIECES or not v_cat.is_contiguous():
        return False
    if dim % v_cat.dim() != v_cat.dim() - 1:
        return False
    M, N = v_gy.shape
    if math.prod(v_cat.shape[:-1]) != M or v_cat.shape[-1] != N:
        return False
    vals = [_val(p) for p in pieces]
    if any(v is None or v.dtype != v_gy.dtype or v.shape[:-1] != v_cat.shape[:-1] for v in vals):
        return False
    # [..., n] -> [M, n]: a view where the leading dims collapse, else a copy
    flat_vals = [v if v.dim() == 2 else _fake_reshape(v, (M, v.shape[-1])) for v in vals]
    # inductor hands a custom op its inputs with exactly these strides, and the op wants adjacent
    # columns and rows that do not overlap (csrc/ops.c): a transposed view (a manual attention's k
    # gradient at batch 1) or a broadcast (an expand's gradient) stays concatenated
    if not all(_op_layout(f) for f in flat_vals):
        return False
    with graph.inserting_before(node):
        flat = []
        for p, v, f in zip(pieces, vals, flat_vals):
            if v.dim() == 2:
                flat.append(p)
                continue
            r = graph.call_function(torch.ops.aten.reshape.default, (p, [M, v.shape[-1]]))
            r.meta["val"] = f
            flat.append(r)
        new_args = (*flat, *args[1:_GELU_INPUT], *args[_GELU_INPUT + 1:])
        new = graph.call_function(torch.ops.fp8ops.linear_bwd_cat.default, new_args)
    new.meta.update(node.meta)
    if "eager_input_vals" in node.meta:
        # (inductor lowers the op with the strides these fake inputs have)
        new.meta["eager_input_vals"] = (tuple(_val(a) if isinstance(a, torch.fx.Node) else a for a in new_args), {})
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    for n in (*chain, cat):
        if not n.users:
            graph.erase_node(n)
    return True


def _op_layout(f: torch.Tensor) -> bool:
    """Is the [M, n] fake tensor f laid out as linear_bwd_cat takes a block (adjacent columns,
    rows at least n apart)? Only when provably so: no guard is added on symbolic sizes."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known  # noqa: PLC0415
    (m, n), (s0, s1) = f.shape, f.stride()
    return (known(n <= 1) or known(s1 == 1)) and (known(m <= 1) or known(n == 0) or known(s0 >= n))


def _fake_reshape(v: torch.Tensor, shape: tuple) -> torch.Tensor:
    """v.reshape(shape) as a fake tensor, in the fake mode v belongs to."""
    mode = getattr(v, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return v.reshape(shape)
