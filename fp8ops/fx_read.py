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


def graphs_in_both_modes(m: nn.Module, tracer: type[torch.fx.Tracer] = torch.fx.Tracer,
                         **tracer_args) -> list[torch.fx.Graph]:
    """m.forward as fx reads it in train mode and in eval mode (raises where fx
    cannot read it); every submodule's mode is left as it was."""
    modes = [(s, s.training) for s in m.modules()]
    try:
        graphs = []
        for mode in (True, False):
            m.train(mode)
            graphs.append(tracer(**tracer_args).trace(m))
        return graphs
    finally:
        for s, was in modes:
            s.training = was
