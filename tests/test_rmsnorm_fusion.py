"""The fused RMSNorm (Llama-style blocks) and the fused norms without parameters:
conversion moves an nn.RMSNorm into the Fp8Linear that consumes it
(layernorm_fusion.py); that linear normalizes inside its input cast
(ln_linear_fwd(rms=True): mean 0, no bias) and runs the RMSNorm's backward on
its input gradient (layernorm_bwd(rms=True), or _rms_norm_backward where that
kernel does not take the shape). A LayerNorm or RMSNorm without a weight or bias
passes empty tensors (ones / zeros in the kernels).

CPU tests run the C reference kernels; the CUDA parametrisations run the
kernels on the device."""
import contextlib
import copy
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops import ops
from fp8ops._reference import sqnr
from fp8ops.layernorm_fusion import RMSNormFusedIntoLinear
from fp8ops.linear import _layer_norm_backward, _rms_norm_backward

from conftest import FP8_DEVICES, assert_compiled_matches_eager, assert_trains_like, convert_as_on_fp8_gpu

E4 = torch.float8_e4m3fn


class LlamaBlock(nn.Module):
    """Pre-RMSNorm attention input (one qkv projection) and a SwiGLU MLP (one gate-up
    projection), no biases: both norms have a single consumer, so both fuse."""

    def __init__(self, d=64, eps=1e-6):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d, eps=eps)
        self.wqkv = nn.Linear(d, 3 * d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = nn.RMSNorm(d, eps=eps)
        self.w13 = nn.Linear(d, 4 * d, bias=False)
        self.w2 = nn.Linear(2 * d, d, bias=False)

    def forward(self, x):
        h = self.attn_norm(x)
        B, T, C = h.shape
        q, k, v = self.wqkv(h).split(C, dim=-1)
        x = x + self.wo(q * torch.sigmoid(k) + v)
        a, b = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.w2(F.silu(a) * b)


class SeparateQkv(nn.Module):
    """The norm feeds three projections: not fused (one consumer only)."""

    def __init__(self, d=32):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x):
        h = self.norm(x)
        return self.wq(h) * self.wk(h) + self.wv(h)


def test_convert_fuses_rmsnorms(monkeypatch):
    model = LlamaBlock()
    keys = list(model.state_dict())
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert type(model.attn_norm) is RMSNormFusedIntoLinear and type(model.mlp_norm) is RMSNormFusedIntoLinear
    assert model.wqkv.fp8_ln_input is model.attn_norm and model.w13.fp8_ln_input is model.mlp_norm
    assert model.wo.fp8_ln_input is None and model.w2.fp8_ln_input is None
    assert list(model.state_dict()) == keys
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert reasons["w13"] == "converted; RMSNorm mlp_norm fused into its input cast"
    assert "input=RMSNorm(x) (fused)" in repr(model.wqkv)
    copy.deepcopy(model)


def test_rmsnorm_with_several_consumers_is_not_fused(monkeypatch):
    model = convert_as_on_fp8_gpu(SeparateQkv(), monkeypatch)
    assert type(model.norm) is nn.RMSNorm and all(m.fp8_ln_input is None for m in (model.wq, model.wk, model.wv))


def _train_like_unfused(base, x, device, monkeypatch):
    """Three steps of the fused model against the same FP8 model with its norms left alone:
    outputs and every gradient (the norms' included) equal to FP8 rounding; the fused
    forward and backward calls (their rms flags) are returned."""
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, fuse_layernorm=False)
    calls, bwd_calls = [], []
    raw, raw_bwd = ops._ln_linear_fwd_raw, ops._layernorm_bwd_raw
    monkeypatch.setattr(ops, "_ln_linear_fwd_raw", lambda *a: (calls.append(a[17]), raw(*a))[1])
    monkeypatch.setattr(ops, "_layernorm_bwd_raw", lambda *a: (bwd_calls.append(a[5]), raw_bwd(*a))[1])
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        assert_trains_like(fused, plain, x)
    return calls, bwd_calls


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_fused_rmsnorm_trains_like_unfused(device, monkeypatch):
    torch.manual_seed(0)
    base = LlamaBlock().to(device)
    calls, bwd_calls = _train_like_unfused(base, torch.randn(4, 32, 64, device=device), device, monkeypatch)
    assert calls == [True] * 4 and bwd_calls == [True] * 4  # steps 2 and 3, two RMSNorms each


class NormLinear(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.lin = norm, nn.Linear(64, 48)

    def forward(self, x):
        return self.lin(self.norm(x))


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("norm", ["layernorm_plain", "layernorm_no_bias", "rmsnorm_plain", "rmsnorm_eps_none"])
def test_fused_norms_without_parameters(device, norm, monkeypatch):
    """A LayerNorm without weight and bias, one without bias, an RMSNorm without weight, and
    one with eps=None (the input dtype's eps, as F.rms_norm): fused, they train as unfused."""
    torch.manual_seed(0)
    mod = {"layernorm_plain": lambda: nn.LayerNorm(64, elementwise_affine=False),
           "layernorm_no_bias": lambda: nn.LayerNorm(64, bias=False),
           "rmsnorm_plain": lambda: nn.RMSNorm(64, elementwise_affine=False),
           "rmsnorm_eps_none": lambda: nn.RMSNorm(64)}[norm]()
    base = NormLinear(mod).to(device)
    calls, bwd_calls = _train_like_unfused(base, torch.randn(2, 48, 64, device=device) * 3 + 1, device,
                                           monkeypatch)
    assert calls == [norm.startswith("rms")] * 2 and bwd_calls == [norm.startswith("rms")] * 2


def test_fused_rmsnorm_compiles(monkeypatch):
    torch.manual_seed(0)
    assert_compiled_matches_eager(LlamaBlock(), monkeypatch, (2, 24, 64))


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("M, K, offset", [(256, 128, 0), (48, 2048, 0), (64, 96, 1)])
def test_ln_linear_fwd_rms_is_linear_of_rms_norm(device, dtype, with_weight, M, K, offset):
    """ln_linear_fwd(rms=True) == linear_fwd(F.rms_norm(x) in x's dtype), to rounding; mean
    comes back zero and rstd = 1 / sqrt(mean(x^2) + eps). K=2048: the widest vector row;
    offset 1: a misaligned x (the scalar statistics kernel)."""
    torch.manual_seed(0)
    N = 64
    x = (torch.randn(M * K + offset, device=device) * 3 + 1).to(dtype)[offset:].view(M, K)
    lw = torch.randn(K, device=device) * 0.5 + 1 if with_weight else None
    w8 = (torch.randn(N, K, device=device) * 0.1).to(E4)
    sx = torch.tensor([16.0], device=device)
    one = torch.ones(1, device=device)
    amax, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    y, x8t, _, _, mean, rstd = ops.ln_linear_fwd(x, lw, None, 1e-6, w8, sx, amax, 1 / sx, one, rms=True)
    xn = F.rms_norm(x.float(), [K], lw, 1e-6)
    r_ref = torch.rsqrt(x.double().square().mean(1) + 1e-6)
    y_ref, x8t_ref, _, _ = ops.linear_fwd(xn.to(dtype), w8, sx, amax_ref, 1 / sx, one)
    assert torch.equal(mean, torch.zeros_like(mean))
    torch.testing.assert_close(rstd.double(), r_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(amax, amax_ref, rtol=1e-3, atol=0)
    assert sqnr(y_ref.float(), y.float()) >= 35
    a, b = x8t.view(torch.uint8).int(), x8t_ref.view(torch.uint8).int()
    assert (a != b).float().mean() <= 0.02 and (a - b).abs().max() <= 1


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_ln_linear_fwd_rms_refuses_a_bias(device):
    x = torch.randn(32, 64, device=device)
    w8 = torch.zeros(16, 64, device=device, dtype=E4)
    one = torch.ones(1, device=device)
    with pytest.raises(RuntimeError, match="an RMSNorm has no bias; pass ln_bias=None"):
        ops.ln_linear_fwd(x, None, torch.zeros(64, device=device), 1e-6, w8, one, torch.zeros(1, device=device),
                          one, one, rms=True)
    # the op itself (and its fake) refuse it too (it applied the bias, whose gradient layernorm_bwd never makes),
    # and an eps that is not a finite float (1e300 is inf as a float: every output was 0)
    none, e4, f32 = torch.empty(0, device=device), ops.ST[E4], ops.ST[torch.float32]

    def raw(ln_bias, eps, rms):
        return torch.ops.fp8ops.ln_linear_fwd.default(x, none, ln_bias, eps, w8, one, torch.zeros(1, device=device),
                                                      one, one, torch.zeros(1, device=device), one, none, e4, e4, f32,
                                                      False, False, rms)
    for mode in ("real", "fake"):
        ctx = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True) if mode == "fake" \
            else contextlib.nullcontext()
        with ctx, pytest.raises(RuntimeError, match="an RMSNorm has no bias \\(rms=True\\), found ln_bias with 64"):
            raw(torch.zeros(64, device=device), 1e-6, True)
        for eps in (float("inf"), 1e300):
            with ctx, pytest.raises(RuntimeError, match="eps must be a finite float >= 0"):
                raw(none, eps, False)


def _rms_inputs(M, K, dtype, device, eps=1e-6):
    x = (torch.randn(M, K, device=device) * 3 + 1).to(dtype)
    dy = torch.randn(M, K, device=device).to(dtype)
    gamma = torch.randn(K, device=device) * 0.5 + 1
    rstd = torch.rsqrt(x.float().square().mean(1) + eps)
    return dy, x, torch.zeros(M, device=device), rstd, gamma


def _rms_reference(dy, x, gamma, eps=1e-6):
    """dx and dweight by autograd through F.rms_norm in float64."""
    xd = x.double().requires_grad_()
    wd = None if gamma is None else gamma.double().requires_grad_()
    F.rms_norm(xd, [x.shape[1]], wd, eps).backward(dy.double())
    return xd.grad, None if wd is None else wd.grad


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("M, K", [(256, 768), (1000, 64), (8, 1024), (300, 2048), (100, 4096)])
def test_layernorm_bwd_rms_matches_autograd(device, dtype, with_weight, M, K):
    """layernorm_bwd(rms=True) against autograd through F.rms_norm in float64: dx, and
    dgamma in dweight_bias[0]. K=2048: two warps per row, 4096 four. On CUDA: the same bits
    twice and the CPU kernel's values to rounding."""
    torch.manual_seed(0)
    dy, x, mean, rstd, gamma = _rms_inputs(M, K, dtype, device)
    g = gamma if with_weight else None
    dx, dgb = ops.layernorm_bwd(dy, x, mean, rstd, g, rms=True)
    rdx, rdw = _rms_reference(dy, x, g)
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(dx.double(), rdx, rtol=tol, atol=tol)
    if with_weight:
        torch.testing.assert_close(dgb[0].double(), rdw, rtol=1e-4, atol=1e-5 * M ** 0.5)
    if device == "cuda":
        dx2, dgb2 = ops.layernorm_bwd(dy, x, mean, rstd, g, rms=True)
        assert torch.equal(dx.view(-1).view(torch.uint8), dx2.view(-1).view(torch.uint8))
        assert torch.equal(dgb.view(torch.int32), dgb2.view(torch.int32))
        dx_c, dgb_c = ops.layernorm_bwd(dy.cpu(), x.cpu(), mean.cpu(), rstd.cpu(), None if g is None else g.cpu(),
                                        rms=True)
        torch.testing.assert_close(dx.cpu().double(), dx_c.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(dgb.cpu(), dgb_c, rtol=1e-4, atol=1e-5 * M ** 0.5)


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("K", [2064, 100])
def test_rms_backward_outside_the_kernel(device, K):
    """Rows layernorm_bwd does not take on CUDA (wider than 2048; bf16 rows of 100 columns,
    not whole vectors) take _rms_norm_backward's formula, which matches autograd; so does
    _layer_norm_backward's choice on any device."""
    torch.manual_seed(0)
    dy, x, mean, rstd, gamma = _rms_inputs(32, K, torch.bfloat16, device)
    if device == "cuda":
        assert not ops.layernorm_bwd_fusable(dy, x)
    rdx, rdw = _rms_reference(dy, x, gamma)
    for dx, dw, db in (_rms_norm_backward(dy, x, rstd, gamma, (True, True, False)),
                       _layer_norm_backward(dy, x, mean, rstd, gamma, None, gamma, (True, True, False), True)):
        assert db is None and dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
        torch.testing.assert_close(dx.double(), rdx, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(dw.double(), rdw, rtol=1e-4, atol=1e-4)


def test_compiled_fused_rmsnorm_backward_is_fp8ops(monkeypatch):
    """Under torch.compile the fused RMSNorm's backward is fp8ops' one-pass op with rms set."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    model = convert_as_on_fp8_gpu(LlamaBlock(), monkeypatch)
    x = torch.randn(2, 24, 64)
    model(x).square().mean().backward()
    fp8ops.step(model)  # delayed scales known: the RMSNorms fuse
    model.zero_grad()
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True)
    _, code = run_and_get_code(lambda: fn(x).square().mean().backward())
    # (layernorm_bwd_acc: with the residual gradient added, residual_pass.py; rms is the sixth argument)
    calls = [line for c in code for line in c.splitlines()
             if re.search(r"= torch\.ops\.fp8ops\.layernorm_bwd(_acc)?\.default\(", line)]
    assert len(calls) == 2 and all(re.search(r"\.default\((?:[^,()]+, ){5}True[,)]", line) for line in calls), calls


def test_example_llama_arch_fuses_its_rmsnorms(monkeypatch):
    """examples/gpt2.py with arch="llama": RMSNorm, SwiGLU, no biases; conversion fuses both
    RMSNorms of every block (ln_f feeds the tied lm_head, which stays nn.Linear), and a few
    FP8 steps on the CPU reference kernels train."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "examples"))
    from gpt2 import GPT, LM_HEAD_FILTER, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", arch="llama"))
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always"), module_filter_fn=LM_HEAD_FILTER)
    for m in model.modules():
        if hasattr(m, "fp8_on_cpu"):
            m.fp8_on_cpu = True
    fused = [m for m in model.modules() if type(m) is RMSNormFusedIntoLinear]
    assert len(fused) == 2 * model.config.n_layer and type(model.transformer.ln_f) is nn.RMSNorm
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    idx = torch.randint(0, 256, (2, 64))
    losses = []
    for _ in range(6):
        _, loss = model(idx, idx)
        loss.backward()
        opt.step()  # (its hook updates the scales)
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    with pytest.raises(ValueError, match="arch must be one of"):
        GPTConfig(arch="mamba")


def test_norm_without_weight_first_called_under_inference_mode_then_trains(monkeypatch):
    """The fused norm's "no weight" argument is an empty tensor cached per device: made
    first under torch.inference_mode, it must not be saved for a later training backward
    (inference tensors cannot be)."""
    torch.manual_seed(0)
    ops._empty.clear()
    model = convert_as_on_fp8_gpu(NormLinear(nn.RMSNorm(64, elementwise_affine=False)), monkeypatch)
    x = torch.randn(2, 16, 64)
    model(x).sum().backward()
    fp8ops.step(model)  # delayed scales known: the norm fuses from here on
    ops._empty.clear()
    with torch.inference_mode():
        model(x)
    xi = x.clone().requires_grad_()
    model(xi).square().mean().backward()
    assert xi.grad is not None and torch.isfinite(xi.grad).all()


def test_rmsnorm_eps_none_in_bfloat16_is_torchs(monkeypatch):
    """nn.RMSNorm(eps=None) on bf16 activations: F.rms_norm then adds float32's epsilon, not
    bfloat16's (2^-7, which would visibly shrink rows of small values); the fused norm adds the
    same."""
    torch.manual_seed(0)
    base = NormLinear(nn.RMSNorm(64)).to(torch.bfloat16)
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, fuse_layernorm=False)
    x = (torch.randn(32, 64) * 0.02).to(torch.bfloat16)  # mean(x^2) ~ 4e-4: eps 2^-7 would matter
    for m in (fused, plain):  # past the first (current-scaled) step
        m(x).float().sum().backward()
        fp8ops.step(m)
    calls = []
    raw = ops._ln_linear_fwd_raw
    monkeypatch.setattr(ops, "_ln_linear_fwd_raw", lambda *a: (calls.append(a[3]), raw(*a))[1])
    y_f, y_p = fused(x).float(), plain(x).float()
    assert calls == [torch.finfo(torch.float32).eps]
    assert sqnr(y_p, y_f) >= 30


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("K", [4096, 4112])
def test_rmsnorm_fuses_only_where_its_backward_kernel_runs(device, K, monkeypatch):
    """On CUDA an RMSNorm runs fused only for rows layernorm_bwd takes (4096 columns, not
    4112): elsewhere torch's RMSNorm kernels beat the fallback formula. The CPU kernels take
    any row. Either way the layer trains as the unfused one."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.RMSNorm(K), nn.Linear(K, 32, bias=False)).to(device)
    calls, _ = _train_like_unfused(base, torch.randn(16, K, device=device), device, monkeypatch)
    assert len(calls) == (0 if device == "cuda" and K == 4112 else 2)
