"""A pre-norm block's residual adds fused into fp8ops' norm ops, under
torch.compile: an inductor graph pass (ENABLED: on unless set False).

In a pre-norm block, h = x + f(norm(x)), then norm(h) in the next branch: in
fp8ops' compiled graphs the norms are fp8ops' ops (ln_linear_fwd forward,
layernorm_bwd backward), which inductor cannot fuse with the adds around them
as it does with its own norm kernels, so each add ran as a kernel of its own:
GPT-2 small's compiled step ran 48 such adds, ~3.3 ms, against BF16's 12
(benchmarks/RESULTS.md, section 5, thirty-seventh session's profile). Two
rewrites, each with the separate ops' result bit for bit (csrc/fp8ops.h):

- Forward: wherever ln_linear_fwd's x is (a view of) aten.add(a, b) of the
  add's shape, both operands contiguous, one of the add's dtype and the other
  of it or (for fp32) bfloat16 / float16, as is or converted to fp32 (autocast's
  branch output), the call becomes ln_linear_fwd_res(a, b): its statistics pass
  writes the sum, which replaces the add everywhere, as it reads the row.
- Backward: wherever layernorm_bwd's dx goes to nothing but one aten.add
  (through views that only reshape it) whose other operand has the add's shape
  and dtype and is contiguous, the call becomes layernorm_bwd_acc with that
  operand as dres: the kernel adds it as it writes dx. Where the sum is also
  converted to bfloat16 or float16 (under autocast, the gradient of the block's
  branch that the residual stream's fp32 sum feeds), the kernel writes that copy
  too: inductor would have written it in the add's own kernel, and left apart it
  would cost a pass of its own.

Not taken: an add with an alpha, a broadcast, other dtypes, a dx with another
use, a sum converted to two dtypes or through a view, a call whose results are
read other than by index, and a rewrite that would make a cycle (a forward add
that the norm's other arguments are computed from; a residual gradient computed
from the norm's own backward). Every check comes before the graph changes.
Run by gelu_grad_pass's inductor pass, after its two rewrites.
"""
from __future__ import annotations

import contextlib
import logging
import operator

import torch

from .cat_grad_pass import _VIEWS, _fake_reshape, _val  # (the passes' shared graph helpers)

log = logging.getLogger("fp8ops")

ENABLED = True
# How many ln_linear_fwd calls the pass turned into ln_linear_fwd_res in this process
FUSED_ADDS = [0]
# How many layernorm_bwd calls the pass turned into layernorm_bwd_acc in this process
FUSED = [0]
# How many of those also wrote the sum's 16-bit copy
COPIES = [0]

_CONVERSIONS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}
_LOW = (torch.bfloat16, torch.float16)


def fuse_residuals(graph: torch.fx.Graph) -> int:
    """The pass (see the module's docstring); returns how many calls it rewrote."""
    if not ENABLED or not hasattr(torch.ops.fp8ops, "ln_linear_fwd_res"):
        return 0
    done = 0
    for node in list(graph.nodes):
        for fuse in (_fuse_add, _fuse_grad):
            try:
                if fuse(graph, node):
                    done += 1
            except Exception as e:  # noqa: BLE001 -- the graph as it was is correct, only slower
                log.debug("fp8ops: a norm kept apart from its residual add (%s: %s)", type(e).__name__, e)
    if done:
        # (a new op sits before the add's users, which may come before it in the graph's order)
        from torch._inductor.pattern_matcher import stable_topological_sort  # noqa: PLC0415
        stable_topological_sort(graph)
    return done


def _operands(add: torch.fx.Node):
    """(x, res) for ln_linear_fwd_res from add's operands (see the module's docstring), or None."""
    v_add = _val(add)
    if v_add is None or add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
        return None
    ops = []
    for a in add.args:
        if not isinstance(a, torch.fx.Node) or _val(a) is None:
            return None
        src = a
        if a.target in _CONVERSIONS and _plain_conversion(a) and _val(a).dtype == v_add.dtype \
                and _val(a.args[0]) is not None and _val(a.args[0]).dtype in _LOW:
            src = a.args[0]  # (autocast's branch output, read as it is)
        ops.append(src)
    dts = [_val(o).dtype for o in ops]
    if dts[0] == v_add.dtype:
        x, res = ops
    elif dts[1] == v_add.dtype:
        res, x = ops
    else:
        return None
    ok_res = _val(res).dtype == v_add.dtype or (v_add.dtype == torch.float32 and _val(res).dtype in _LOW)
    if not ok_res or any(_val(o).shape != v_add.shape or not _val(o).is_contiguous() for o in (x, res)):
        return None
    return x, res


def _nodes_in(value) -> list:
    """The nodes in an argument (a node, or lists / tuples / dicts of them)."""
    found = []
    torch.fx.node.map_arg(value, found.append)
    return found


def _ancestors(roots) -> set:
    seen, todo = set(), _nodes_in(roots)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return seen


def _ln_fwd_x(node: torch.fx.Node):
    """x if node calls ln_linear_fwd: as it is (no keywords), or, since the op writes x_amax, as
    functionalization leaves it for inductor: auto_functionalized(_v2)(op, **arguments);
    else None."""
    if node.op != "call_function":
        return None
    op = torch.ops.fp8ops.ln_linear_fwd.default
    if node.target is op:
        return node.args[0] if not node.kwargs and len(node.args) in (17, 18) else None  # (rms has a default)
    hop = torch.ops.higher_order
    if node.target in (getattr(hop, "auto_functionalized", None), getattr(hop, "auto_functionalized_v2", None)) \
            and len(node.args) == 1 and node.args[0] is op and "x" in node.kwargs:
        return node.kwargs["x"]
    return None


def _fuse_add(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    x_arg = _ln_fwd_x(node)
    if not isinstance(x_arg, torch.fx.Node):
        return False
    chain, cur = [], x_arg
    while isinstance(cur, torch.fx.Node) and cur.target in _VIEWS:
        chain.append(cur)
        cur = cur.args[0]
    add, v_x = cur, _val(x_arg)
    if not isinstance(add, torch.fx.Node) or v_x is None or not isinstance(node.meta.get("val"), tuple):
        return False
    found = _operands(add)
    if found is None:
        return False
    x, res = found
    hop = node.target is not torch.ops.fp8ops.ln_linear_fwd.default
    others = ({k: v for k, v in node.kwargs.items() if k != "x"} if hop else node.args[1:])
    # the new op's inputs must not depend on the add (no cycle); its results are read by index
    if add in _ancestors([x, res, others]) or any(u.target is not operator.getitem for u in node.users):
        return False
    # (the new nodes' fake values first: nothing below may fail once the graph is changing)
    old_val, shape = node.meta["val"], list(v_x.shape)
    v_x2, v_r2 = _fake_reshape(_val(x), tuple(shape)), _fake_reshape(_val(res), tuple(shape))
    v_total = _fake_like(v_x, v_x.dtype, v_x.shape)
    v_total_view = _fake_reshape(v_total, tuple(_val(add).shape))
    with graph.inserting_before(node):
        x2 = graph.call_function(torch.ops.aten.reshape.default, (x, shape))
        r2 = graph.call_function(torch.ops.aten.reshape.default, (res, shape))
        if hop:  # (the op's 6 results, then the bases it wrote: the sum goes between)
            new = graph.call_function(node.target, (torch.ops.fp8ops.ln_linear_fwd_res.default,),
                                      {**node.kwargs, "x": x2, "res": r2})
        else:
            new = graph.call_function(torch.ops.fp8ops.ln_linear_fwd_res.default, (x2, r2, *node.args[1:]))
        total = graph.call_function(operator.getitem, (new, 6))
        total_view = graph.call_function(torch.ops.aten.reshape.default, (total, list(_val(add).shape)))
    x2.meta["val"], r2.meta["val"] = v_x2, v_r2
    new.meta.update(node.meta)
    new.meta["val"] = (*old_val[:6], v_total, *old_val[6:])
    if "eager_input_vals" in node.meta:
        # (inductor lowers the op with the strides these fake inputs have)
        if hop:
            ea, ek = node.meta["eager_input_vals"]
            new.meta["eager_input_vals"] = ((new.args[0], *ea[1:]), {**ek, "x": v_x2, "res": v_r2})
        else:
            new.meta["eager_input_vals"] = (tuple(_val(a) if isinstance(a, torch.fx.Node) else a
                                                  for a in new.args), {})
    total.meta["val"], total_view.meta["val"] = v_total, v_total_view
    for u in list(node.users):  # (getitems: results 0-5 stay where they were, the bases move by one)
        i = u.args[1]
        u.args = (new, i if i < 6 else i + 1)
    graph.erase_node(node)
    add.replace_all_uses_with(total_view)
    graph.erase_node(add)
    for a in add.args:  # (a conversion only the add read)
        if isinstance(a, torch.fx.Node) and a.target in _CONVERSIONS and not a.users:
            graph.erase_node(a)
    for v in chain:  # (views that only the old call read; x_arg first)
        if not v.users:
            graph.erase_node(v)
    FUSED_ADDS[0] += 1
    return True


def _fuse_grad(graph: torch.fx.Graph, node: torch.fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.fp8ops.layernorm_bwd.default or node.kwargs:
        return False
    if len(node.args) not in (5, 6):  # (rms, the last, has a default there)
        return False
    if any(u.target is not operator.getitem for u in node.users):
        return False  # (its results are read by index, or the rewrite's tuple would reach a reader)
    dxs = [u for u in node.users if u.args[1] == 0]
    if len(dxs) != 1 or len(dxs[0].users) != 1:
        return False
    dx = dxs[0]
    # dx -> views with one user each -> add
    chain, cur = [], dx
    while True:
        (user,) = cur.users
        if user.target in _VIEWS and len(user.users) == 1:
            chain.append(user)
            cur = user
            continue
        break
    add = user
    if add.target is not torch.ops.aten.add.Tensor or add.kwargs or len(add.args) != 2:
        return False
    other = add.args[1] if add.args[0] is cur else add.args[0]
    if other is cur or not isinstance(other, torch.fx.Node):
        return False
    v_dx, v_cur, v_other, v_add = _val(dx), _val(cur), _val(other), _val(add)
    if any(v is None for v in (v_dx, v_cur, v_other, v_add)):
        return False
    copies = [u for u in add.users if u.target in _CONVERSIONS]
    copy_dtype = v_dx.dtype  # (none)
    if copies:
        dtypes = {_val(u).dtype if _val(u) is not None else None for u in copies}
        if len(dtypes) != 1 or v_dx.dtype != torch.float32 or not all(_plain_conversion(u) for u in copies):
            return False
        (copy_dtype,) = dtypes
        if copy_dtype not in (torch.bfloat16, torch.float16):
            return False
    if v_other.shape != v_cur.shape or v_other.dtype != v_dx.dtype or v_add.dtype != v_dx.dtype \
            or v_add.shape != v_cur.shape or not v_other.is_contiguous():
        return False
    if node in _ancestors([other]):
        return False  # (dres computed from this call's results: the rewrite would make a cycle)
    # (the new nodes' fake values first: nothing below may fail once the graph is changing)
    v_dx2, v_dgb = node.meta["val"]
    v_dres = _fake_reshape(v_other, tuple(v_dx.shape)) if v_other.shape != v_dx.shape else v_other
    v_copy = _fake_like(v_dx2, copy_dtype, v_dx2.shape if copies else (0,))
    v_copy_view = _fake_reshape(v_copy, tuple(v_add.shape)) if copies else None
    with graph.inserting_before(add):  # (after both of its operands)
        dres = other
        if v_other.shape != v_dx.shape:
            dres = graph.call_function(torch.ops.aten.reshape.default, (other, list(v_dx.shape)))
            dres.meta["val"] = v_dres
        new_args = (*node.args, *(() if len(node.args) == 6 else (False,)), dres, copy_dtype)
        new = graph.call_function(torch.ops.fp8ops.layernorm_bwd_acc.default, new_args)
        if copies:
            copy = graph.call_function(operator.getitem, (new, 2))
            copy_view = graph.call_function(torch.ops.aten.reshape.default, (copy, list(v_add.shape)))
    new.meta.update(node.meta)
    new.meta["val"] = (v_dx2, v_dgb, v_copy)
    if "eager_input_vals" in node.meta:
        # (inductor lowers the op with the strides these fake inputs have)
        new.meta["eager_input_vals"] = (tuple(_val(a) if isinstance(a, torch.fx.Node) else a for a in new_args), {})
    if copies:
        copy.meta["val"], copy_view.meta["val"] = v_copy, v_copy_view
        for u in copies:
            u.replace_all_uses_with(copy_view)
            graph.erase_node(u)
        COPIES[0] += 1
    # the layernorm_bwd's results now come from the new op; dx (and its views) now carry the sum
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    add.replace_all_uses_with(cur)
    graph.erase_node(add)
    FUSED[0] += 1
    return True


def _plain_conversion(node: torch.fx.Node) -> bool:
    """A conversion to another dtype and nothing else (no device, layout or memory format)."""
    if node.target is torch.ops.prims.convert_element_type.default:
        return len(node.args) == 2 and not node.kwargs
    return len(node.args) == 1 and set(node.kwargs) <= {"dtype"}


def _fake_like(v: torch.Tensor, dtype: torch.dtype, shape) -> torch.Tensor:
    """An empty tensor of this dtype and shape in v's fake mode, on v's device."""
    mode = getattr(v, "fake_mode", None)
    with mode if mode is not None else contextlib.nullcontext():
        return torch.empty(shape, dtype=dtype, device=v.device)

