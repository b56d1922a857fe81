"""A fusion after convert (fusion_links.py): a norm or activation that a converted linear
applies computes on its own again when that linear leaves its place, when the norm or
activation itself is replaced, or when a hook is registered on it; convert again fuses anew.
A probe's findings (forty-fifth session): a GPT-2 MLP whose c_proj was swapped for a plain
nn.Linear after convert ran without its GELU (10 dB logits against the same swap on the
unconverted model), a swapped c_fc without its LayerNorm (-0.1 dB), and a hook on a fused
LayerNorm recorded its input (0.2 dB), silently. CPU (the C reference kernels)."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

from fp8ops._reference import sqnr
from fp8ops.fusion_links import ActivationFusedIntoLinear
from fp8ops.layernorm_fusion import LayerNormFusedIntoLinear
from fp8ops.linear import Fp8LinearBase

from conftest import convert_as_on_fp8_gpu


class Block(nn.Module):
    """A pre-LayerNorm MLP block: x + proj(gelu(fc(ln(x))))."""

    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(self.act(self.fc(self.ln(x))))


def _pair(monkeypatch):
    """(the plain block, its converted copy, an input): the norm's parameters far from 1 and 0,
    so that a norm applied twice, or not at all, shows."""
    torch.manual_seed(0)
    ref = Block()
    with torch.no_grad():
        ref.ln.weight.uniform_(0.5, 2.0)
        ref.ln.bias.uniform_(-1.0, 1.0)
    fused = convert_as_on_fp8_gpu(copy.deepcopy(ref), monkeypatch)
    assert isinstance(fused.ln, LayerNormFusedIntoLinear) and isinstance(fused.act, ActivationFusedIntoLinear)
    assert fused.fc.fp8_ln_input is fused.ln and fused.proj.fp8_gelu_input
    x = torch.randn(32, 64)
    for _ in range(3):  # (delayed scaling's steady path, where the fused casts run)
        fused(x).sum().backward()
    return ref, fused, x


def _run(model, x):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = model(x)
    return y, [str(w.message) for w in caught if "fp8ops" in str(w.message)]


def _sqnr(ref, model, x) -> float:
    with torch.no_grad():
        return sqnr(ref(x), model(x))


@pytest.mark.parametrize("swap", ["proj by a plain nn.Linear with its Parameters", "fc by a fresh nn.Linear"])
def test_a_fused_linear_replaced_after_convert_gives_its_norm_or_gelu_back(monkeypatch, swap):
    ref, fused, x = _pair(monkeypatch)
    if swap.startswith("proj"):
        plain = nn.Linear(256, 64)
        plain.weight, plain.bias = fused.proj.weight, fused.proj.bias
        ref.proj.weight, ref.proj.bias = fused.proj.weight, fused.proj.bias
        fused.proj = plain
    else:
        torch.manual_seed(5)
        ref.fc = nn.Linear(64, 256)
        fused.fc = copy.deepcopy(ref.fc)
    y, said = _run(fused, x)
    kind, back = ("GELU", fused.act) if swap.startswith("proj") else ("LayerNorm", fused.ln)
    assert type(back) in (nn.GELU, nn.LayerNorm), type(back)
    assert len(said) == 1 and f"the {kind}" in said[0] and "undone" in said[0], said
    with torch.no_grad():
        assert sqnr(ref(x), y) > 20  # (10 dB and -0.1 dB before: the GELU or the norm was lost)
    assert _sqnr(ref, fused, x) > 20


def test_a_fused_norm_or_gelu_replaced_after_convert_is_no_longer_applied_by_the_linear(monkeypatch):
    ref, fused, x = _pair(monkeypatch)
    new = nn.LayerNorm(64)
    with torch.no_grad():
        new.weight.uniform_(0.5, 2.0)
        new.bias.uniform_(-1.0, 1.0)
    ref.ln, fused.ln = copy.deepcopy(new), copy.deepcopy(new)
    old_fc = fused.fc
    y, said = _run(fused, x)
    assert old_fc.fp8_ln_input is None and len(said) == 1 and "replaced in the model" in said[0], said
    with torch.no_grad():
        assert sqnr(ref(x), y) > 20  # (the old norm would have run after the new one)
    ref.act, fused.act = nn.ReLU(), nn.ReLU()
    assert _sqnr(ref, fused, x) > 20 and not fused.proj.fp8_gelu_input


@pytest.mark.parametrize("where", ["ln", "act"])
def test_a_hook_on_a_fused_norm_or_gelu_undoes_the_fusion_and_sees_its_output(monkeypatch, where):
    ref, fused, x = _pair(monkeypatch)
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = getattr(fused, where).register_forward_hook(lambda m, i, o: seen.update(fused=o.detach()))
    assert any("undone (a hook was registered on it)" in str(w.message) for w in caught)
    module = getattr(fused, where)
    assert type(module) in (nn.LayerNorm, nn.GELU) and module._forward_hooks  # (the hook is on what computes)
    getattr(ref, where).register_forward_hook(lambda m, i, o: seen.update(ref=o.detach()))
    with torch.no_grad():
        y, yr = fused(x), ref(x)
    assert sqnr(seen["ref"], seen["fused"]) > 20 and sqnr(yr, y) > 20  # (0.2 dB before: the norm's input)
    assert fused.fc.fp8_ln_input is None if where == "ln" else not fused.proj.fp8_gelu_input
    handle.remove()


def test_convert_again_after_a_replacement_fuses_the_new_layer(monkeypatch):
    ref, fused, x = _pair(monkeypatch)
    plain = nn.Linear(64, 256)
    plain.weight, plain.bias = fused.fc.weight, fused.fc.bias
    fused.fc = plain  # (what fp8ops.report's "call fp8ops.convert(model) again" is for)
    convert_as_on_fp8_gpu(fused, monkeypatch)
    assert isinstance(fused.fc, Fp8LinearBase) and isinstance(fused.ln, LayerNormFusedIntoLinear)
    assert fused.fc.fp8_ln_input is fused.ln
    for _ in range(3):
        fused(x).sum().backward()
    assert _sqnr(ref, fused, x) > 20


def test_fused_models_still_copy_and_pickle(monkeypatch):
    ref, fused, x = _pair(monkeypatch)
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(fused), torch.load(buf, weights_only=False)):
        assert isinstance(copied.ln, LayerNormFusedIntoLinear) and copied.fc.fp8_ln_input is copied.ln
        assert _sqnr(ref, copied, x) > 20
    assert _sqnr(ref, fused, x) > 20  # (the original keeps its links)
    y, said = _run(fused, x)
    assert not said and isinstance(fused.ln, LayerNormFusedIntoLinear)
