"""Hugging Face transformers' Conv1D (GPT-2's projections) converted to Fp8Conv1D: the same
Parameters ([in, out] weights), checkpoints the plain model loads, training like the plain
model, and the report listing every Conv1D (converted or not, with the reason). CPU reference
kernels (conftest.convert_as_on_fp8_gpu) and, on an FP8 GPU, the CUDA path (the transposed
weight made contiguous for its cast, cuBLASLt's GEMMs; training under bf16 autocast); the
whole-model fallback as this machine gives it."""
import copy

import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops._reference import sqnr
from fp8ops.conv1d import Fp8Conv1D

from conftest import FP8_DEVICES, assert_compiled_matches_eager, convert_as_on_fp8_gpu

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402


def _gpt2(n_embd=64):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=n_embd, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def test_gpt2_conv1d_layers_are_converted_with_their_parameters(monkeypatch):
    plain = _gpt2()
    model = copy.deepcopy(plain)
    weights = {n: p for n, p in model.named_parameters()}
    convert_as_on_fp8_gpu(model, monkeypatch)
    conv = [n for n, m in plain.named_modules() if isinstance(m, Conv1D)]
    assert len(conv) == 8
    assert all(type(model.get_submodule(n)) is Fp8Conv1D for n in conv)
    assert all(p is weights[n] for n, p in model.named_parameters())        # the same Parameters
    sd, ref = model.state_dict(), plain.state_dict()
    assert sd.keys() == ref.keys() and all(sd[k].shape == ref[k].shape for k in ref)
    rows = {r["name"]: r for r in fp8ops.report(model, print_table=False)}
    assert rows["transformer.h.0.mlp.c_fc"]["shape"] == "64->256"
    assert all(rows[n]["backend"] == "fp8ops" for n in conv) and rows["lm_head"]["backend"] == "fp8ops"
    fc, x = model.transformer.h[0].mlp.c_fc, torch.randn(16, 64)
    assert torch.equal(fc(x=x), fc(x))       # Conv1D names its argument x (nn.Linear: input)


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_gpt2_trains_like_the_plain_model(monkeypatch, device):
    """On the GPU both models train under bf16 autocast, as Hugging Face's Trainer runs them."""
    plain = _gpt2().to(device)
    model = convert_as_on_fp8_gpu(copy.deepcopy(plain), monkeypatch, device=device)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain)]
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 128, (4, 32), generator=g).to(device)
        losses, grads = [], []
        for m, opt in zip((model, plain), opts):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = m(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
            opt.step()
            opt.zero_grad()
        assert losses[0] == pytest.approx(losses[1], rel=0.01), step
        for n in grads[1]:
            assert grads[0][n].shape == grads[1][n].shape
            assert sqnr(grads[0][n], grads[1][n]) >= 15, (step, n)   # FP8 noise: 17-27 dB measured; a wrong transpose ~0
    assert model.transformer.h[0].attn.c_attn.fp8_step == 3               # its scales follow the steps
    convs = [m for m in model.modules() if isinstance(m, Fp8Conv1D)]
    assert len(convs) == 8 and all(m.fp8_scale.device.type == device for m in convs)
    assert all(m.fp8_fallback_calls == 0 for m in convs)  # (every call of every Conv1D ran FP8)


def test_checkpoint_loads_into_plain_gpt2(monkeypatch, tmp_path):
    model = convert_as_on_fp8_gpu(_gpt2(), monkeypatch)
    model(torch.randint(0, 128, (2, 16))).logits.sum().backward()
    model.save_pretrained(tmp_path)
    plain = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(p.detach(), q.detach()), n


def test_a_converted_conv1d_is_no_nn_linear(monkeypatch):
    """Its weight is [in, out], not nn.Linear's [out, in]: a tool that dispatches on nn.Linear
    must not take it for one. PEFT did, while Fp8Conv1D was an nn.Linear subclass: LoRA added
    after convert merged its update transposed into the square c_proj, silently. It now refuses
    the layer (its own error), and LoRA added before convert merges as on the plain model."""
    from fp8ops.linear import Fp8LinearBase  # noqa: PLC0415
    model = convert_as_on_fp8_gpu(_gpt2(), monkeypatch)
    proj = model.transformer.h[0].attn.c_proj
    assert isinstance(proj, Fp8LinearBase) and not isinstance(proj, nn.Linear)
    assert repr(proj).startswith("Fp8Conv1D(nf=64, nx=64 (HF Conv1D, weight [nx, nf]), bias=True, fp8=")
    assert all(fp8ops.report(model, print_table=False)[i]["backend"] == "fp8ops" for i in range(9))
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(target_modules=["c_attn", "c_proj"], r=4, init_lora_weights=False)
    with pytest.raises(ValueError, match="Target module Fp8Conv1D"):
        peft.get_peft_model(model, lora)
    torch.manual_seed(1)
    plain = peft.get_peft_model(_gpt2(), lora)
    converted = convert_as_on_fp8_gpu(copy.deepcopy(plain), monkeypatch)
    assert type(converted.base_model.model.transformer.h[0].attn.c_proj.base_layer) is Fp8Conv1D
    merged, ref = converted.merge_and_unload().state_dict(), plain.merge_and_unload().state_dict()
    assert merged.keys() == ref.keys() and all(torch.equal(merged[k], ref[k]) for k in ref)


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_conv1d_computes_what_the_linear_with_its_transpose_does(monkeypatch, device):
    """Fp8Conv1D gives Fp8Linear's bits (output, input and weight gradients, scales) for the
    transposed weight, over training steps; compiled as eager (on the CPU kernels)."""
    torch.manual_seed(0)
    lin = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(device)
    base = nn.Sequential(Conv1D(64, 32), nn.ReLU(), Conv1D(32, 64)).to(device)
    with torch.no_grad():
        for i in (0, 2):
            base[i].weight.copy_(lin[i].weight.t())
            base[i].bias.copy_(lin[i].bias)
    conv, lin8 = (convert_as_on_fp8_gpu(copy.deepcopy(m), monkeypatch, device=device) for m in (base, lin))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 32, generator=g).to(device)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [m(xi) for m, xi in zip((conv, lin8), xs)]
        assert torch.equal(ys[0], ys[1]) and sqnr(ys[0], base(x)) >= 20
        for y in ys:
            y.square().mean().backward()
        assert torch.equal(xs[0].grad, xs[1].grad)
        for i in (0, 2):
            assert conv[i].weight.grad.shape == (conv[i].nx, conv[i].nf)
            assert torch.equal(conv[i].weight.grad, lin8[i].weight.grad.t())
            assert torch.equal(conv[i].bias.grad, lin8[i].bias.grad)
        for m in (conv, lin8):
            fp8ops.step(m)
            m.zero_grad()
        assert torch.equal(conv[0].fp8_scale, lin8[0].fp8_scale)
    assert all(m.fp8_fallback_calls == 0 for m in (conv[0], conv[2]))  # (FP8 ran: no BF16 call matched)
    if device == "cpu":
        assert_compiled_matches_eager(base, monkeypatch, (16, 32))


def test_conv1d_not_a_multiple_of_16_stays_with_the_reason(monkeypatch):
    model = nn.Sequential(Conv1D(64, 40))
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert type(model[0]) is Conv1D
    (row,) = fp8ops.report(model, print_table=False)
    assert row["backend"] == "bf16" and row["reason"].startswith("nx=40, nf=64") and row["shape"] == "40->64"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only fallback")
def test_without_a_gpu_the_report_lists_every_conv1d():
    model = _gpt2()
    with pytest.warns(UserWarning, match="FP8 is OFF"):
        fp8ops.convert(model)
    rows = fp8ops.report(model, print_table=False)
    why = fp8ops.fp8_supported_here()[1]  # (no GPU; or a build without nvcc says that first)
    assert len(rows) == 9 and all(r["backend"] == "bf16" and why in r["reason"] for r in rows)
