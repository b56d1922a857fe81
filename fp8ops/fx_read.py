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


def hooked(m: nn.Module) -> bool:
    """Has m a hook that fx does not see (forward, pre-forward or backward)?"""
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


_REGISTRIES = ("_parameters", "_buffers", "_modules")


def graphs_in_both_modes(m: nn.Module, tracer: type[torch.fx.Tracer] = torch.fx.Tracer,
                         **tracer_args) -> list[torch.fx.Graph]:
    """m.forward as fx reads it in train mode and in eval mode (raises where fx
    cannot read it); every submodule's mode is left as it was. A forward that
    stores a value on a module (self.last_act = h, for a statistic or a loss
    term) raises too: fx sees no use of what it stores, and a fusion there would
    change what is stored. Its modules get their attributes back (tracing stored
    fx Proxies in them)."""
    saved = [(s, dict(s.__dict__), [(r, dict(s.__dict__[r])) for r in _REGISTRIES if r in s.__dict__])
             for s in m.modules()]
    try:
        graphs = []
        for mode in (True, False):
            m.train(mode)
            graphs.append(tracer(**tracer_args).trace(m))
            written = _written(saved)
            if written:
                raise RuntimeError(f"the forward stores {', '.join(written)}: a use fx does not see")
        return graphs
    finally:
        for s, attrs, registries in saved:
            s.__dict__.clear()
            s.__dict__.update(attrs)
            for r, entries in registries:
                attrs[r].clear()
                attrs[r].update(entries)


def _written(saved) -> list[str]:
    """The attributes (and registered parameters, buffers, submodules) the forward set."""
    out = []
    for s, attrs, registries in saved:
        now = s.__dict__
        out += [f"{type(s).__name__}.{k}" for k, v in now.items()
                if k != "training" and (k not in attrs or attrs[k] is not v)]
        for r, entries in registries:
            out += [f"{type(s).__name__}.{k}" for k, v in now[r].items() if entries.get(k) is not v]
    return out
