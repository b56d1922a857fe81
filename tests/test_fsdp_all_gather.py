"""fp8ops.enable_fsdp_fp8_all_gather in one process: which layers it enables, the master
weight still behaving as a tensor, and the gathered FP8 weight as Fp8Linear reads it (the
2-rank FSDP2 runs are in test_distributed.py)."""
import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops import Fp8Config, ops
from fp8ops.fsdp import _Fp8GatheredWeight, _Fp8MasterWeight
from fp8ops.linear import W, Fp8Linear


def _layer(config=None, bias=True):
    torch.manual_seed(0)
    m = Fp8Linear.from_linear(nn.Linear(32, 16, bias=bias), config or Fp8Config())
    m.fp8_on_cpu = True
    return m


def test_enable_wraps_fp8_layers_and_skips_tied_and_emulated():
    model = nn.Module()
    model.a = _layer()
    model.b = _layer(Fp8Config(fp8_format="e5m2"))   # emulated GEMMs: nothing to gather in FP8
    model.c = _layer()
    model.tied = nn.Linear(32, 16)
    model.tied.weight = model.c.weight                 # shared with a plain module: stays plain
    w_a = model.a.weight.detach().clone()
    assert fp8ops.enable_fsdp_fp8_all_gather(model) == ["a"]
    assert isinstance(model.a.weight, nn.Parameter) and type(model.a.weight.data) is _Fp8MasterWeight
    assert type(model.c.weight.data) is not _Fp8MasterWeight and type(model.b.weight.data) is not _Fp8MasterWeight
    assert fp8ops.enable_fsdp_fp8_all_gather(model) == []   # idempotent
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert "all-gathers its weight in FP8" in reasons["a"] and "all-gather" not in reasons["c"]
    # it is still the weight for everything but FSDP2's all-gather: ops see the master values
    assert torch.equal(model.a.weight.detach() * 2, w_a * 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model.a(torch.randn(16, 32)).sum().backward()
    opt.step()
    assert not torch.equal(model.a.weight.detach() * 1, w_a)
    assert type(model.a.weight.data) is _Fp8MasterWeight


def test_state_dict_holds_plain_tensors(tmp_path):
    """A checkpoint of an enabled model is the plain model's: torch.load(weights_only=True)
    reads it, and an nn.Linear model loads it."""
    model = nn.Sequential(_layer(), nn.ReLU(), _layer(bias=False))
    model[2] = Fp8Linear.from_linear(nn.Linear(16, 16, bias=False), Fp8Config())
    assert fp8ops.enable_fsdp_fp8_all_gather(model) == ["0", "2"]
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    torch.save(sd, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    plain = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 16, bias=False))
    plain.load_state_dict(loaded)
    assert torch.equal(plain[0].weight, model[0].weight.detach() * 1)


def test_an_optimizer_built_before_enabling_raises_at_its_step():
    """enable_fsdp_fp8_all_gather gives the layers new Parameters: an optimizer built before it
    stepped the old ones, which get no gradient, so the layers never trained, silently. Its
    step raises; one built after trains."""
    model = nn.Sequential(_layer(), nn.ReLU(), Fp8Linear.from_linear(nn.Linear(16, 16), Fp8Config()))
    model[2].fp8_on_cpu = True
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    early.step()  # (checked before the call too: nothing replaced yet)
    fp8ops.enable_fsdp_fp8_all_gather(model)
    model(torch.randn(16, 32)).sum().backward()
    with pytest.raises(RuntimeError, match=r"holds weights that fp8ops.enable_fsdp_fp8_all_gather replaced \(2 "
                                           r"layer\(s\): 0, 2\).*Build the optimizer after"):
        early.step()
    w = model[0].weight.detach() * 1
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert not torch.equal(model[0].weight.detach() * 1, w)


def test_assign_load_keeps_the_fp8_all_gather():
    """load_state_dict(assign=True) puts the checkpoint's plain tensor in the weight's place:
    the layer wraps it again, so FSDP2 still gathers it in FP8 (it silently stopped)."""
    model = nn.Sequential(_layer(), nn.ReLU(), _layer(bias=False))
    assert fp8ops.enable_fsdp_fp8_all_gather(model) == ["0", "2"]
    sd = {k: torch.randn_like(v) if k.endswith("weight") else v for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    assert all(type(model[i].weight.data) is _Fp8MasterWeight for i in (0, 2))
    assert torch.equal(model[0].weight.detach() * 1, sd["0.weight"]) and model[0].weight.requires_grad
    assert "all-gathers its weight in FP8" in fp8ops.report(model, print_table=False)[0]["reason"]


def _gathered(layer):
    """What fsdp_post_all_gather hands the forward, for an unsharded layer (world size 1)."""
    w = layer.weight.detach()
    layer.fp8_scale[W] = 4.0
    layer.fp8_scale_inv[W] = 0.25
    w8, _, _ = ops.cast(w, layer.fp8_scale[W:W + 1], torch.float8_e4m3fn, False)
    return nn.Parameter(_Fp8GatheredWeight(w8, w.dtype)), w8


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8_path", "plain_path"])
def test_gathered_weight_is_read_as_its_fp8_values(fp8):
    """FP8 path: the same output and gradients as the layer casting its own weight with that
    scale. Plain path (a call that does not run FP8): the dequantized weight, with the weight
    gradient passed through."""
    ref = _layer(Fp8Config(policy="always"))
    ref._fp8_delayed_ready = True
    g = _layer(Fp8Config(policy="always"))
    g._fp8_delayed_ready = True
    param, w8 = _gathered(g)
    _gathered(ref)
    g._parameters["weight"] = param
    g.fp8_on_cpu = ref.fp8_on_cpu = fp8
    x = torch.randn(16, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    y = g(x)
    if fp8:
        yr = ref(xr)
    else:
        yr = nn.functional.linear(xr, (w8.float() * 0.25).requires_grad_(), ref.bias)
    assert torch.equal(y, yr)
    y.sum().backward()
    yr.sum().backward()
    assert torch.equal(x.grad, xr.grad)
    assert param.grad is not None and param.grad.shape == (16, 32)
    if fp8:
        assert torch.equal(param.grad, ref.weight.grad)


def test_gathered_weight_refuses_other_ops():
    param, _ = _gathered(_layer())
    with pytest.raises(RuntimeError, match="FSDP2-gathered FP8 weight.*Fp8Linear"):
        param.sum()
