"""Hugging Face transformers' Conv1D (GPT-2, OpenAI GPT, ImageGPT, ...) in FP8.

Conv1D is a linear layer whose weight is stored transposed: [in, out] (nx, nf),
forward addmm(bias, x, weight). GPT-2's attention and MLP projections are all
Conv1D, so converting nn.Linear alone would leave HF GPT-2 with FP8 in lm_head
only. Fp8Conv1D is Fp8LinearBase computing with the weight's transpose, a view:
the Parameters stay the Conv1D's own (same object, key, shape [in, out] and
dtype), so checkpoints, save_pretrained and optimizers see no change. The FP8
weight cast reads the transpose once per optimizer step (the cast is cached for
the step's other micro-batches); the weight gradient comes back as [out, in] and
autograd's transpose hands the Parameter its [in, out] gradient.

Fp8Conv1D is a subclass of transformers' Conv1D, and not of nn.Linear: code that
dispatches on the layer's type then reads its weight as [in, out], as it is.
(Until the forty-second session it was an nn.Linear subclass, and PEFT's LoRA
added after convert merged its update transposed into a square Conv1D, silently;
transformers' own weight init skipped it after that session's first change.) So
that fp8ops never imports transformers itself, the class is made at first use
(a module __getattr__, which pickle's lookup by name goes through too), when the
model being converted has imported transformers already.

Only transformers' own class is converted (matched by module and name): its
forward is known to be exactly the linear layer above.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .config import Fp8Config
from .linear import Fp8LinearBase, swap_class


def is_hf_conv1d(m: nn.Module) -> bool:
    """Is m transformers.pytorch_utils.Conv1D itself (not a subclass)?"""
    cls = type(m)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


class _Fp8Conv1DLayer(Fp8LinearBase):
    """Fp8Conv1D's own methods; Fp8Conv1D (_make_class) adds transformers' Conv1D as a base."""

    @classmethod
    def from_conv1d(cls, mod: nn.Module, config: Fp8Config) -> "_Fp8Conv1DLayer":
        """Turn the Conv1D `mod` itself into an Fp8Conv1D (as Fp8Linear.from_linear
        does: Parameters, hooks, attributes, nf/nx and every reference kept)."""
        if not is_hf_conv1d(mod):
            raise TypeError(f"Fp8Conv1D.from_conv1d: mod must be transformers' Conv1D, found {type(mod).__name__}")
        w = mod.weight
        if w.dim() != 2 or tuple(w.shape) != (mod.nx, mod.nf):
            raise ValueError(f"Fp8Conv1D.from_conv1d: weight must be [nx, nf] = [{mod.nx}, {mod.nf}], "
                             f"found {list(w.shape)}")
        def init():
            mod.in_features, mod.out_features = mod.nx, mod.nf
            mod._init_fp8_state(config)
        return swap_class(mod, _make_class(), init)

    def _param(self, name: str):
        p = super()._param(name)
        # the [out, in] weight every Fp8LinearBase path computes with: a view of the [in, out] Parameter
        return p.t() if name == "weight" and p is not None else p

    def extra_repr(self) -> str:
        return (f"nf={self.nf}, nx={self.nx} (HF Conv1D, weight [nx, nf]), bias={self.bias is not None}, "
                + super().extra_repr())

    __repr__ = nn.Module.__repr__  # (not Conv1D's, which prints nf and nx only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (transformers' Conv1D names its argument x, nn.Linear input: a call by keyword keeps working)
        return Fp8LinearBase.forward(self, x)


@functools.cache
def _make_class() -> type:
    from transformers.pytorch_utils import Conv1D  # noqa: PLC0415 -- imported already by a model that has one

    class Fp8Conv1D(_Fp8Conv1DLayer, Conv1D):
        """transformers' Conv1D with FP8 forward and backward; weight [in, out] as there."""

    Fp8Conv1D.__module__, Fp8Conv1D.__qualname__ = __name__, "Fp8Conv1D"  # (pickle finds it by this name)
    globals()["Fp8Conv1D"] = Fp8Conv1D
    return Fp8Conv1D


def __getattr__(name: str):
    if name == "Fp8Conv1D":
        return _make_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
