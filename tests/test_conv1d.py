"""Hugging Face transformers' Conv1D (GPT-2's projections) converted to Fp8Conv1D: the same
Parameters ([in, out] weights), checkpoints the plain model loads, training like the plain
model, and the report listing every Conv1D (converted or not, with the reason). CPU reference
kernels (conftest.convert_as_on_fp8_gpu) and, on an FP8 GPU, the CUDA path (the transposed
weight made contiguous for its cast, cuBLASLt's GEMMs; training under bf16 autocast); the
whole-model fallback as this machine gives it."""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops._reference import sqnr

from conftest import FP8_DEVICES, assert_compiled_matches_eager, convert_as_on_fp8_gpu

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

from fp8ops.conv1d import Fp8Conv1D  # noqa: E402 -- (made at first use, from transformers' Conv1D)


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


def _with_lora(base, monkeypatch, convert: str):
    """A copy of base with PEFT's LoRA on GPT-2's c_attn and both c_proj (attention, MLP), random B (a merge that adds
    nothing shows nothing), and fp8ops.convert "before" or "after" it, or "never"."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(target_modules=["c_attn", "c_proj"], r=4, init_lora_weights=False, lora_dropout=0.0)
    model = copy.deepcopy(base)
    if convert == "before":
        convert_as_on_fp8_gpu(model, monkeypatch)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, lora)
    if convert == "after":
        convert_as_on_fp8_gpu(model, monkeypatch)
    return model


@pytest.mark.parametrize("convert", ["before", "after"])
def test_a_converted_conv1d_is_a_conv1d_for_peft(monkeypatch, convert):
    """Its weight is [in, out], not nn.Linear's [out, in]: Fp8Conv1D is a transformers Conv1D
    and no nn.Linear. PEFT took it for an nn.Linear while it was one: LoRA added after convert
    merged its update transposed into the square c_proj, silently. Either order now trains as
    LoRA on the plain model does (the LoRA weights' gradients included) and merges the same
    weights."""
    from fp8ops.linear import Fp8LinearBase  # noqa: PLC0415
    base = _gpt2()
    plain, model = _with_lora(base, monkeypatch, "never"), _with_lora(base, monkeypatch, convert)
    proj = model.base_model.model.transformer.h[0].attn.c_proj.base_layer
    assert type(proj) is Fp8Conv1D and isinstance(proj, (Conv1D, Fp8LinearBase)) and not isinstance(proj, nn.Linear)
    assert repr(proj).startswith("Fp8Conv1D(nf=64, nx=64 (HF Conv1D, weight [nx, nf]), bias=True, fp8=")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = [m(ids, labels=ids).loss for m in (model, plain)]
    for loss in losses:
        loss.backward()
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=0.01)
    lora_grads = [[p.grad for n, p in m.named_parameters() if "lora_" in n] for m in (model, plain)]
    assert len(lora_grads[0]) == len(lora_grads[1]) == 12 and all(sqnr(a, b) >= 15 for a, b in zip(*lora_grads))
    merged, ref = model.merge_and_unload().state_dict(), plain.merge_and_unload().state_dict()
    assert merged.keys() == ref.keys() and all(torch.equal(merged[k], ref[k]) for k in ref)


def test_transformers_init_reaches_converted_conv1d_layers(monkeypatch):
    """A model built on the meta device, converted, then materialized and initialized by
    transformers (init_weights, as from_pretrained's missing keys are): every weight is set."""
    with torch.device("meta"):
        model = _gpt2()
    convert_as_on_fp8_gpu(model, monkeypatch)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    model.init_weights()
    assert [n for n, p in model.named_parameters() if p.isnan().any()] == []


def test_a_pickled_conv1d_model_loads_in_a_new_process(monkeypatch, tmp_path):
    """Fp8Conv1D is made at first use: unpickling in a process that made none finds it by name."""
    model = convert_as_on_fp8_gpu(_gpt2(), monkeypatch).eval()
    ids = torch.randint(0, 128, (2, 16))
    torch.save((model, ids, model(ids).logits), tmp_path / "m.pt")
    code = (f"import torch; m, ids, y = torch.load(r'{tmp_path / 'm.pt'}', weights_only=False); "
            "c = m.transformer.h[0].attn.c_proj; "
            "print(type(c).__name__, type(c).__mro__[-3].__name__, torch.equal(m(ids).logits, y))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Fp8Conv1D", "Conv1D", "True"]


def test_conv1d_layers_take_the_fusions_and_a_second_convert(monkeypatch):
    """A model of transformers Conv1D layers (not HF's GPT-2, which torch.fx cannot trace):
    LayerNorm and GELU fuse into them as into nn.Linear layers, and a second convert with
    another config finds them converted (a review found both lost while Fp8Conv1D was being
    taken out of nn.Linear)."""
    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln, self.c_fc, self.act, self.c_proj = (nn.LayerNorm(64), Conv1D(256, 64),
                                                         nn.GELU(approximate="tanh"), Conv1D(64, 256))

        def forward(self, x):
            return x + self.c_proj(self.act(self.c_fc(self.ln(x))))
    model = convert_as_on_fp8_gpu(nn.Sequential(Mlp(), Mlp()), monkeypatch)
    why = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert "LayerNorm 0.ln fused" in why["0.c_fc"] and "GELU 0.act fused" in why["0.c_proj"], why
    kept = r"4 layer\(s\) \(0\.c_fc, 0\.c_proj, 1\.c_fc, \.\.\.\) were already converted"
    with pytest.warns(UserWarning, match=kept):
        fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always", margin=1))


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
