"""A hook registered after convert on a fused norm or activation (fusion_links.py) undoes the
fusion first: the module computes on its own again and the hook sees its output. A probe's
finding (forty-fifth session): a hook on a fused LayerNorm recorded its input (0.2 dB against
the norm's output), and a steering hook on it changed nothing, silently. CPU (the C reference
kernels)."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn as nn

import fp8ops

from fp8ops._reference import sqnr
from fp8ops.fusion_links import ActivationFusedIntoLinear
from fp8ops.layernorm_fusion import LayerNormFusedIntoLinear

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


@pytest.mark.parametrize("where", ["ln", "act"])
def test_a_hook_on_a_fused_norm_or_gelu_undoes_the_fusion_and_sees_its_output(monkeypatch, where):
    ref, fused, x = _pair(monkeypatch)
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = getattr(fused, where).register_forward_hook(lambda m, i, o: seen.update(fused=o.detach()))
    said = [w for w in caught if "undone (a hook was registered on it)" in str(w.message)]
    assert len(said) == 1 and f"fused into {'fc' if where == 'ln' else 'proj'}" in str(said[0].message)
    assert said[0].filename == __file__  # (points at the registration)
    module = getattr(fused, where)
    assert module._forward_hooks and (type(module) is nn.LayerNorm if where == "ln"
                                      else not module._fp8_fused)  # (the hook is on what computes)
    getattr(ref, where).register_forward_hook(lambda m, i, o: seen.update(ref=o.detach()))
    with torch.no_grad():
        y, yr = fused(x), ref(x)
    assert sqnr(seen["ref"], seen["fused"]) > 20 and sqnr(yr, y) > 20  # (0.2 dB before: the norm's input)
    assert fused.fc.fp8_ln_input is None if where == "ln" else not fused.proj.fp8_gelu_input
    handle.remove()
    assert sqnr(ref(x), fused(x)) > 20


@pytest.mark.parametrize("kind", ["register_forward_pre_hook", "register_full_backward_hook",
                                  "register_full_backward_pre_hook", "register_backward_hook"])
def test_every_kind_of_module_hook_on_a_fused_norm_undoes_it(monkeypatch, kind):
    ref, fused, x = _pair(monkeypatch)
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        getattr(fused.ln, kind)(lambda *a: calls.append(1))
    assert type(fused.ln) is nn.LayerNorm and fused.fc.fp8_ln_input is None
    x = x.clone().requires_grad_()
    fused(x).sum().backward()
    assert calls  # (the hook ran on the norm that computes)
    assert _sqnr(ref, fused, x) > 20


def test_a_hook_on_a_gelu_stand_in_moved_to_another_container_still_computes_the_gelu(monkeypatch):
    """A review's finding (the first form put the GELU module back into the parent the fusion
    saw): a stand-in held by a container rebuilt from the model's modules, or by a slice, kept
    passing its input through while the linear stopped applying the GELU (0.59 dB). The
    stand-in computes the GELU itself now, wherever it is held."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(64, 256), nn.GELU(approximate="tanh"), nn.Linear(256, 64))
    f = convert_as_on_fp8_gpu(copy.deepcopy(ref), monkeypatch)
    assert isinstance(f[1], ActivationFusedIntoLinear) and f[2].fp8_gelu_input
    x = torch.randn(32, 64)
    for _ in range(3):
        f(x).sum().backward()
    g, piece = nn.Sequential(*list(f)), f[0:3]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        g[1].register_forward_hook(lambda m, i, o: None)
    for model in (f, g, piece):
        assert _sqnr(ref, model, x) > 20


def test_fused_models_still_copy_and_pickle(monkeypatch):
    ref, fused, x = _pair(monkeypatch)
    buf = io.BytesIO()
    torch.save(fused, buf)
    buf.seek(0)
    for copied in (copy.deepcopy(fused), torch.load(buf, weights_only=False)):
        assert isinstance(copied.ln, LayerNormFusedIntoLinear) and copied.fc.fp8_ln_input is copied.ln
        assert _sqnr(ref, copied, x) > 20
    assert _sqnr(ref, fused, x) > 20
    y, said = _run(fused, x)
    assert not said and isinstance(fused.ln, LayerNormFusedIntoLinear)


def test_the_report_says_a_replaced_fused_layer_left_its_norm_or_gelu_behind(monkeypatch):
    """Replacing a fused linear after convert is not seen by the model (README): its norm or GELU
    then runs nowhere. The report said "call fp8ops.convert(model) again", which does not bring
    it back; it now says what is lost and what to do."""
    ref, fused, x = _pair(monkeypatch)
    plain = nn.Linear(256, 64)
    plain.weight, plain.bias = fused.proj.weight, fused.proj.bias
    fused.proj = plain
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(fused, print_table=False)}
    assert "does not apply GELU act" in reasons["proj"] and "fuse_gelu=False" in reasons["proj"], reasons["proj"]
    assert reasons["fc"].startswith("converted")
