"""Reading a module's forward with torch.fx for the fusions (gelu_fusion.py,
layernorm_fusion.py, swiglu_fusion.py): fx traces it symbolically, never on data.

A forward may route its data differently in train and eval mode (a branch on
self.training), so every read is made in both; train(mode) sets the mode of
every submodule, so each submodule's own mode (a frozen BatchNorm or Dropout in
eval inside a model in training) is restored afterwards.
"""
from __future__ import annotations

import inspect
import re
from collections import OrderedDict, deque
from collections.abc import MutableMapping, MutableSequence, MutableSet

import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree


def hooked(m: nn.Module) -> bool:
    """Has m a hook that fx does not see (forward, pre-forward or backward)?"""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def graphs_in_both_modes(m: nn.Module, tracer: type[torch.fx.Tracer] = torch.fx.Tracer,
                         **tracer_args) -> list[torch.fx.Graph]:
    """m.forward as fx reads it in train mode and in eval mode (raises where fx
    cannot read it); every submodule's mode is left as it was.

    Each graph's `inplace_modules`: the module calls that change their input in
    place (mutated_in_place). Its `escaped_nodes`: the nodes whose values the forward stored on a
    module (self.last_act = h, or self.acts.append(h), for a statistic or a loss
    term). fx records no use for such a store, so a fusion must check that it
    changes none of them. Every module gets its attributes back after each read,
    and a container attribute (list, dict, set, deque, ...) that the read added
    to its entries (tracing stored fx Proxies there, and fx its own tensor
    constants on m). Containers inside containers are not looked into."""
    if _switches_grad_mode(m):
        raise ValueError(f"{type(m).__name__}.forward switches grad mode (no_grad, enable_grad, ...), which fx "
                         "does not record: a fusion could move a computation across it")
    saved = [(s, dict(s.__dict__), [(r, dict(s.__dict__[r])) for r in _REGISTRIES if r in s.__dict__],
              _contents(s.__dict__))
             for s in m.modules()]
    try:
        graphs = []
        for concrete in (None, _defaults(m)):
            if concrete == {}:
                continue
            for mode in (True, False):
                m.train(mode)
                graph = tracer(**tracer_args).trace(m, concrete_args=concrete)
                graph.escaped_nodes = frozenset(_stored_nodes(saved))
                graph.inplace_modules = _inplace_modules(m, graph)
                _restore(saved)
                graphs.append(graph)
        return graphs
    finally:
        _restore(saved)


def _inplace_modules(m: nn.Module, graph: torch.fx.Graph) -> frozenset:
    """The targets of the graph's module calls that change their input in place (torch.nn's
    activations and dropouts built with inplace=True), for mutated_in_place."""
    out = set()
    for node in graph.nodes:
        if node.op == "call_module":
            try:
                if getattr(m.get_submodule(node.target), "inplace", False) is True:
                    out.add(node.target)
            except AttributeError:
                pass
    return frozenset(out)


def _defaults(m: nn.Module) -> dict:
    """The arguments of m.forward that have a plain default (None, a bool, a number, a
    string), at that default. fx reads an argument as a stand-in value, for which
    `context is None` is False: a forward whose default call routes the data another way
    (cross-attention with context=None attending to x itself) is read a second time,
    called with its defaults, and fused only where both reads agree."""
    try:
        params = inspect.signature(m.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in params
            if p.default is not inspect.Parameter.empty and (p.default is None or type(p.default) in (bool, int, float, str))
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}


# what fx does not record: grad mode switched inside a forward (a frozen feature extractor under
# no_grad, a stop-gradient), or a branch on it
_GRAD_MODE_CALLS = ("no_grad", "enable_grad", "set_grad_enabled", "inference_mode", "is_grad_enabled")


def _switches_grad_mode(m: nn.Module) -> bool:
    """Does the source of m's forward name a grad-mode switch? (A source that cannot be
    read is taken as not.)"""
    try:
        src = inspect.getsource(type(m).forward)
    except (OSError, TypeError):
        return False
    return any(w in src for w in _GRAD_MODE_CALLS)


# what makes a view of its first argument (an in-place change of the view changes it)
_VIEW_METHODS = frozenset(("view", "reshape", "view_as", "transpose", "permute", "narrow", "select", "unsqueeze",
                           "squeeze", "flatten", "unflatten", "expand", "expand_as", "t", "split", "chunk",
                           "unbind", "as_strided", "movedim", "contiguous"))


_INPLACE_OPERATORS = frozenset(("iadd", "isub", "imul", "imatmul", "itruediv", "ifloordiv", "imod", "ipow",
                                "iand", "ior", "ixor", "ilshift", "irshift", "setitem"))


def _name(node: torch.fx.Node) -> str:
    return node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")


def _is_operator(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__module__", "") in ("_operator", "operator")


def _is_view(node: torch.fx.Node) -> bool:
    """A view of its first argument (or, conservatively, a reshape or contiguous that may be one)."""
    return ((node.op == "call_method" and node.target in _VIEW_METHODS)
            or (_is_operator(node) and _name(node) == "getitem"))


def mutated_in_place(node: torch.fx.Node, depth: int = 4) -> bool:
    """Does the forward modify node's value in place (h.mul_(0.5), h += 1, x[..., :16].mul_(2),
    torch.relu_(h), F.relu(h, inplace=True), an nn.ReLU(inplace=True) child, an out= argument),
    itself, through a view of it, or through the tensor it is a view of and that tensor's
    other views? A fused activation or norm reads its input when the consumer casts it,
    after such a change."""
    root = node
    for _ in range(depth):  # (up to the tensor the views were taken of)
        if not (_is_view(root) and root.args and isinstance(root.args[0], torch.fx.Node)):
            break
        root = root.args[0]
    return _changed_below(root, depth)


def _changed_below(node: torch.fx.Node, depth: int) -> bool:
    inplace_modules = getattr(node.graph, "inplace_modules", frozenset())
    for user in node.users:
        if user.kwargs.get("out") is node:
            return True
        if not user.args or user.args[0] is not node:
            continue
        name = _name(user)
        if user.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("__"):
            return True   # h.mul_(0.5), torch.relu_(h)
        if user.kwargs.get("inplace") is True or (user.op == "call_module" and user.target in inplace_modules):
            return True   # F.relu(h, inplace=True), nn.ReLU(inplace=True)
        if _is_operator(user) and name in _INPLACE_OPERATORS:
            return True   # h += 1 (operator.iadd), h[..., :16] = 0 (operator.setitem), ...
        if _is_view(user) and depth and _changed_below(user, depth - 1):
            return True
    return False


# what nn.Module keeps in __dict__ itself (registries, hooks, flags): not user containers
_MODULE_ATTRS = frozenset(nn.Module().__dict__)


def _contents(attrs: dict) -> list:
    """(container, a snapshot of its entries) of each mutable container attribute
    (list, dict, set, deque, any MutableSequence, MutableMapping or MutableSet): a
    forward may add to one in place (self.acts.append(h))."""
    out = []
    for k, v in attrs.items():
        if k in _MODULE_ATTRS or not isinstance(v, (MutableMapping, MutableSequence, MutableSet)):
            continue
        try:
            out.append((v, _entries(v)))
        except Exception:  # noqa: BLE001,S112 -- a container that cannot list itself: not looked into
            continue
    return out


def _entries(container) -> list:
    return list(container.items()) if isinstance(container, MutableMapping) else list(container)


def _changed(container, snapshot: list) -> bool:
    """By identity, never by ==: == on an fx Proxy is traced, on a tensor elementwise."""
    now = _entries(container)
    if len(now) != len(snapshot):
        return True
    if isinstance(container, MutableMapping):
        return any(k is not k0 or v is not v0 for (k, v), (k0, v0) in zip(now, snapshot))
    return any(a is not b for a, b in zip(now, snapshot))


def _refill(container, snapshot: list) -> None:
    """Put the snapshot back in place through the methods of the builtin type the
    container derives from (a subclass's own may refuse, like transformers'
    ModelOutput, and an OrderedDict keeps its order apart from the dict's)."""
    if isinstance(container, OrderedDict):
        OrderedDict.clear(container)
        for k, v in snapshot:
            OrderedDict.__setitem__(container, k, v)
    elif isinstance(container, dict):
        dict.clear(container)
        dict.update(container, snapshot)
    elif isinstance(container, list):
        list.__setitem__(container, slice(None), snapshot)
    elif isinstance(container, set):
        set.clear(container)
        set.update(container, snapshot)
    elif isinstance(container, deque):
        deque.clear(container)
        deque.extend(container, snapshot)
    elif isinstance(container, MutableMapping):
        container.clear()
        container.update(snapshot)
    elif isinstance(container, MutableSet):
        container.clear()
        for v in snapshot:
            container.add(v)
    else:
        container.clear()
        container.extend(snapshot)


def _restore(saved) -> None:
    """Every module's attributes and registries first, then the containers that
    changed (each tried: one that cannot be refilled does not stop the others,
    and the first error is raised at the end)."""
    for s, attrs, registries, _ in saved:
        s.__dict__.clear()
        s.__dict__.update(attrs)
        for r, entries in registries:
            attrs[r].clear()
            attrs[r].update(entries)
    error = None
    for _, _, _, contents in saved:
        for container, snapshot in contents:
            try:
                if _changed(container, snapshot):
                    _refill(container, snapshot)
            except Exception as e:  # noqa: BLE001 -- re-raised below, after the others
                error = error or e
    if error is not None:
        raise error


def _stored_nodes(saved):
    """The fx nodes of the Proxies the forward stored in attributes (or registered as
    parameters, buffers, submodules), also inside lists, tuples, dicts and sets, new
    ones or ones it added to in place."""
    for s, attrs, registries, contents in saved:
        now = s.__dict__
        values = [v for k, v in now.items() if k != "training" and (k not in attrs or attrs[k] is not v)]
        values += [_entries(c) for c, snapshot in contents if _changed(c, snapshot)]
        for r, entries in registries:
            values += [v for k, v in now[r].items() if entries.get(k) is not v]
        for leaf in pytree.tree_leaves(values):
            if isinstance(leaf, torch.fx.Proxy):
                yield leaf.node


def used_by_other_methods(m: nn.Module) -> set[str]:
    """The names x of the calls `self.x(...)` in the source of m's methods other than
    forward (its class and bases up to nn.Module): a fusion must not change a child
    those call."""
    names: set[str] = set()
    for cls in type(m).__mro__:
        if cls in (nn.Module, object):
            break
        for attr, fn in vars(cls).items():
            if attr == "forward" or not inspect.isfunction(fn):
                continue
            try:
                src = inspect.getsource(fn)
                me = next(iter(inspect.signature(fn).parameters), None)  # "self", whatever its name
            except (OSError, TypeError, ValueError):
                continue
            if me is not None:  # (calls only: __init__ assigns the children, an init method sets weights)
                names.update(re.findall(rf"\b{re.escape(me)}\.([A-Za-z_]\w*)\s*\(", src))
    return names
