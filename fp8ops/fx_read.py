"""Reading a module's forward with torch.fx for the fusions (gelu_fusion.py,
layernorm_fusion.py, swiglu_fusion.py): fx traces it symbolically, never on data.

A forward may route its data differently in train and eval mode (a branch on
self.training), so every read is made in both; train(mode) sets the mode of
every submodule, so each submodule's own mode (a frozen BatchNorm or Dropout in
eval inside a model in training) is restored afterwards.
"""
from __future__ import annotations

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

    Each graph's `escaped_nodes`: the nodes whose values the forward stored on a
    module (self.last_act = h, or self.acts.append(h), for a statistic or a loss
    term). fx records no use for such a store, so a fusion must check that it
    changes none of them. Every module gets its attributes back after each read,
    and a list, dict or set attribute its contents (tracing stored fx Proxies
    there, and fx its own tensor constants on m)."""
    saved = [(s, dict(s.__dict__), [(r, dict(s.__dict__[r])) for r in _REGISTRIES if r in s.__dict__],
              _contents(s.__dict__))
             for s in m.modules()]
    try:
        graphs = []
        for mode in (True, False):
            m.train(mode)
            graph = tracer(**tracer_args).trace(m)
            graph.escaped_nodes = frozenset(_stored_nodes(saved))
            _restore(saved)
            graphs.append(graph)
        return graphs
    finally:
        _restore(saved)


_CONTAINERS = (list, dict, set)


def _contents(attrs: dict) -> list:
    """(container, a shallow copy) of each list, dict and set attribute: a forward
    may add to one in place (self.acts.append(h))."""
    return [(v, v.copy()) for v in attrs.values() if isinstance(v, _CONTAINERS)]


def _restore(saved) -> None:
    for s, attrs, registries, contents in saved:
        s.__dict__.clear()
        s.__dict__.update(attrs)
        for r, entries in registries:
            attrs[r].clear()
            attrs[r].update(entries)
        for container, copy in contents:  # (refilled, not compared: == on a Proxy is traced)
            if isinstance(container, list):
                container[:] = copy
            else:
                container.clear()
                container.update(copy)


def _stored_nodes(saved):
    """The fx nodes of the Proxies the forward stored in attributes (or registered as
    parameters, buffers, submodules), also inside lists, tuples, dicts and sets, new
    ones or ones it added to in place."""
    for s, attrs, registries, contents in saved:
        now = s.__dict__
        values = [v for k, v in now.items() if k != "training" and (k not in attrs or attrs[k] is not v)]
        values += [list(c) if isinstance(c, set) else c for c, _ in contents]
        for r, entries in registries:
            values += [v for k, v in now[r].items() if entries.get(k) is not v]
        for leaf in pytree.tree_leaves(values):
            if isinstance(leaf, torch.fx.Proxy):
                yield leaf.node
