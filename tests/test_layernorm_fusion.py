"""The fused LayerNorm: conversion moves an nn.LayerNorm into the Fp8Linear that
consumes it (layernorm_fusion.py); that linear normalizes inside its input cast
(ln_linear_fwd) and runs the LayerNorm's backward on its input gradient
(layernorm_bwd, or torch's where that kernel does not take the shape).

CPU tests run the C reference kernels; the CUDA parametrisations run the
statistics and cast kernels on the device."""
import copy
import re

import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops import ops
from fp8ops._reference import sqnr
from fp8ops.layernorm_fusion import LayerNormFusedIntoLinear
from fp8ops.linear import Fp8Linear, _layer_norm_backward

from conftest import FP8_DEVICES, assert_compiled_matches_eager, assert_trains_like, convert_as_on_fp8_gpu

E4 = torch.float8_e4m3fn


class Block(nn.Module):
    """A pre-LayerNorm block: the attention's shape read included (B, T, C = x.shape)."""

    def __init__(self, d=64):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 2 * d)
        self.c_proj = nn.Linear(2 * d, d)

    def forward(self, x):
        h = self.ln_1(x)
        B, T, C = h.shape
        x = x + self.c_attn(h)[..., :C]
        return x + self.c_proj(torch.relu(self.c_fc(self.ln_2(x))))


def test_convert_fuses_pre_layernorms(monkeypatch):
    model = Block()
    keys = list(model.state_dict())
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert type(model.ln_1) is LayerNormFusedIntoLinear and type(model.ln_2) is LayerNormFusedIntoLinear
    assert model.c_attn.fp8_ln_input is model.ln_1 and model.c_fc.fp8_ln_input is model.ln_2
    assert model.c_proj.fp8_ln_input is None
    assert list(model.state_dict()) == keys  # the LayerNorms keep their parameters
    assert "fp8_ln_input" not in dict(model.c_attn.named_children())
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert reasons["c_attn"] == "converted; LayerNorm ln_1 fused into its input cast"
    assert "input=LayerNorm(x) (fused)" in repr(model.c_fc)
    copy.deepcopy(model)  # the reference is not a submodule, and survives a copy


def test_fuse_layernorm_off(monkeypatch):
    model = convert_as_on_fp8_gpu(Block(), monkeypatch, fuse_layernorm=False)
    assert type(model.ln_1) is nn.LayerNorm and model.c_attn.fp8_ln_input is None


class LnAlsoResidual(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(32), nn.Linear(32, 32)

    def forward(self, x):
        h = self.ln(x)
        return self.lin(h) + h


class LnTwoDims(LnAlsoResidual):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm((4, 32))

    def forward(self, x):
        return self.lin(self.ln(x))


class LnThenRelu(LnAlsoResidual):
    def forward(self, x):
        return self.lin(torch.relu(self.ln(x)))


class LnByKeyword(LnAlsoResidual):
    def forward(self, x):  # the pass-through a fused norm becomes takes its input positionally
        return self.lin(self.ln(input=x))


class LnStored(LnAlsoResidual):
    def forward(self, x):
        h = self.ln(x)
        self.normed = h  # fused, it would be x
        return self.lin(h)


class LnOptionalContext(LnAlsoResidual):
    """Cross-attention whose context defaults to its own (normalized) input: fx reads the
    argument as given, where `context is None` is False; called by default, the norm
    also feeds the context's path."""

    def __init__(self):
        super().__init__()
        self.ctx = nn.Linear(32, 32)

    def forward(self, x, context=None):
        h = self.ln(x)
        context = h if context is None else context
        return self.lin(h) + self.ctx(context)


class LnUnderNoGrad(LnAlsoResidual):
    def forward(self, x):  # a frozen feature norm: its parameters take no gradient
        with torch.no_grad():
            h = self.ln(x)
        return self.lin(h)


class LnInputChangedInPlace(LnAlsoResidual):
    def forward(self, x):
        x = x * 1.0
        h = self.ln(x)
        x[..., :16].mul_(-2.0)  # fused, the linear would normalize the changed x
        return self.lin(h) + x


class LnInputChangedByFunction(LnAlsoResidual):
    def forward(self, x):
        x = x * 1.0
        h = self.ln(x)
        torch.relu_(x)  # (torch's in-place function, not the method)
        return self.lin(h) + x


class LnInputChangedByInplaceArgument(LnAlsoResidual):
    def forward(self, x):
        x = x * 1.0
        h = self.ln(x)
        torch.nn.functional.relu(x, inplace=True)
        return self.lin(h) + x


class LnInputChangedByInplaceModule(LnAlsoResidual):
    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        x = x * 1.0
        h = self.ln(x)
        return self.lin(h) + self.act(x)


class LnOfAViewWhoseBaseChanges(LnAlsoResidual):
    def forward(self, x):
        x = x * 1.0
        h = self.ln(x.view(-1, 32))
        x.relu_()  # (the tensor the norm's input is a view of)
        return self.lin(h).view(x.shape) + x


class LnAlsoInAnotherMethod(LnAlsoResidual):
    def features(self, x):  # fused, the norm would be a pass-through here
        return self.ln(x)

    def forward(self, x):
        return self.lin(self.ln(x))


class LnWithConstant(LnAlsoResidual):
    def forward(self, x):  # fx stores the constant on the module while it reads the forward
        return self.lin(self.ln(x)) * torch.tensor(2.0)


def test_layernorm_fused_beside_a_tensor_constant(monkeypatch):
    model = convert_as_on_fp8_gpu(LnWithConstant(), monkeypatch)
    assert model.lin.fp8_ln_input is model.ln and "_tensor_constant0" not in model.__dict__


@pytest.mark.parametrize("cls", [LnAlsoResidual, LnTwoDims, LnThenRelu, LnByKeyword, LnStored, LnOptionalContext,
                                 LnUnderNoGrad, LnInputChangedInPlace, LnInputChangedByFunction,
                                 LnInputChangedByInplaceArgument, LnInputChangedByInplaceModule,
                                 LnOfAViewWhoseBaseChanges, LnAlsoInAnotherMethod])
def test_layernorm_not_fused_where_unsafe(cls, monkeypatch):
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert type(model.ln) is nn.LayerNorm and model.lin.fp8_ln_input is None
    x = torch.randn(8, 4, 32)
    torch.testing.assert_close(model(x), ref(x), rtol=0.1, atol=0.1)


class _Wrapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, x):
        return self.lin(x)


class LnIntoAWrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.proj = nn.LayerNorm(32), _Wrapped()

    def forward(self, x):
        return x + self.proj(self.ln(x))


def test_layernorm_into_a_hooked_wrapper_is_not_fused(monkeypatch):
    """A pre-hook on a module that wraps the consumer (registered before convert) sees the
    norm's output; convert runs no hook. The same model unhooked is fused."""
    seen = []
    model = LnIntoAWrapper()
    model.proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert seen == [] and type(model.ln) is nn.LayerNorm and model.proj.lin.fp8_ln_input is None
    x = torch.randn(16, 32)
    model(x)
    torch.testing.assert_close(seen[0], model.ln(x), rtol=0, atol=0)
    assert convert_as_on_fp8_gpu(LnIntoAWrapper(), monkeypatch).proj.lin.fp8_ln_input is not None


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_fused_layernorm_trains_like_unfused(device, monkeypatch):
    """Three optimizer steps (the first current-scaled: the LayerNorm runs unfused; then
    fused): outputs and every gradient, the LayerNorms' included, match the same FP8
    model with its LayerNorms left alone, to FP8 rounding."""
    torch.manual_seed(0)
    base = Block().to(device)
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, fuse_layernorm=False)
    calls, bwd_calls = [], []
    raw, raw_bwd = ops._ln_linear_fwd_raw, ops._layernorm_bwd_raw
    monkeypatch.setattr(ops, "_ln_linear_fwd_raw", lambda *a: (calls.append(1), raw(*a))[1])
    monkeypatch.setattr(ops, "_layernorm_bwd_raw", lambda *a: (bwd_calls.append(1), raw_bwd(*a))[1])
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        assert_trains_like(fused, plain, torch.randn(4, 32, 64, device=device))
    assert len(calls) == 4 and len(bwd_calls) == 4  # steps 2 and 3, two LayerNorms each


def test_current_recipe_and_bf16_fallback_apply_the_layernorm(monkeypatch):
    torch.manual_seed(0)
    base = Block()
    x = torch.randn(2, 16, 64)
    cur = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, recipe="current")
    cur_plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, recipe="current", fuse_layernorm=False)
    torch.testing.assert_close(cur(x), cur_plain(x), rtol=0, atol=0)
    # current scaling runs no fused cast: convert fuses nothing, and the report says no fusion
    assert type(cur.ln_1) is nn.LayerNorm and cur.c_attn.fp8_ln_input is None
    assert all("fused" not in r["reason"] for r in fp8ops.report(cur, print_table=False))
    # converted again (delayed): each layer's fusion notes stay in the report
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    before = {r["name"]: r["reason"] for r in fp8ops.report(fused, print_table=False)}
    convert_as_on_fp8_gpu(fused, monkeypatch)
    after = {r["name"]: r["reason"] for r in fp8ops.report(fused, print_table=False)}
    assert before["c_attn"] == "converted; LayerNorm ln_1 fused into its input cast"
    assert after["c_attn"] == "already converted; LayerNorm ln_1 fused into its input cast"
    # a block converted on its own, read from a model that holds it: the notes name the norm from
    # the model (they said "ln_1", relative to the block)
    outer = nn.Sequential(convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch))
    assert {r["name"]: r["reason"] for r in fp8ops.report(outer, print_table=False)}["0.c_attn"] == \
        "converted; LayerNorm 0.ln_1 fused into its input cast"
    bf = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    for m in bf.modules():
        if isinstance(m, Fp8Linear):
            m.fp8_on_cpu = False  # CPU input without the reference kernels: the nn.Linear path
    torch.testing.assert_close(bf(x), base(x), rtol=0, atol=0)


def test_fused_layernorm_compiles(monkeypatch):
    torch.manual_seed(0)
    base = Block()
    assert_compiled_matches_eager(base, monkeypatch, (2, 24, 64))


def test_compiled_fused_layernorm_backward_is_fp8ops(monkeypatch):
    """Under torch.compile the fused LayerNorm's backward is fp8ops' one-pass op,
    as in eager mode (inductor's code calls it), with the gradients of eager."""
    from torch._inductor.utils import run_and_get_code
    torch.manual_seed(0)
    model = convert_as_on_fp8_gpu(Block(), monkeypatch)
    x = torch.randn(2, 24, 64)
    model(x).square().mean().backward()
    fp8ops.step(model)                             # delayed scales known: the LayerNorms fuse
    model.zero_grad()
    model(x).square().mean().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True)
    _, code = run_and_get_code(lambda: fn(x).square().mean().backward())
    # two LayerNorms (layernorm_bwd_acc: with the residual gradient added, residual_pass.py)
    assert sum(len(re.findall(r"= torch\.ops\.fp8ops\.layernorm_bwd(_acc)?\.default\(", c)) for c in code) == 2
    assert sum(c.count("native_layer_norm_backward") for c in code) == 0
    for a, p in zip(eager, model.parameters()):
        assert sqnr(a, p.grad) >= 30


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, offset", [(256, 0), (48, 0), (64, 1)])
def test_ln_linear_fwd_is_linear_of_layernorm(device, dtype, M, offset):
    """ln_linear_fwd(x) == linear_fwd(torch's layer_norm(x) in x's dtype), to rounding; mean and
    rstd as torch's native_layer_norm returns them. M=48: a partial tile; offset 1: x at a
    misaligned address (the general kernel)."""
    torch.manual_seed(0)
    K, N = 128, 64
    x = (torch.randn(M * K + offset, device=device) * 3 + 1).to(dtype)[offset:].view(M, K)
    lw = torch.randn(K, device=device) * 0.5 + 1
    lb = torch.randn(K, device=device) * 0.1
    w8 = (torch.randn(N, K, device=device) * 0.1).to(E4)
    sx = torch.tensor([16.0], device=device)
    one = torch.ones(1, device=device)
    amax, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    y, x8t, _, _, mean, rstd = ops.ln_linear_fwd(x, lw, lb, 1e-5, w8, sx, amax, 1 / sx, one)
    xn, m_ref, r_ref = torch.native_layer_norm(x.float(), [K], lw, lb, 1e-5)
    y_ref, x8t_ref, _, _ = ops.linear_fwd(xn.to(dtype), w8, sx, amax_ref, 1 / sx, one)
    torch.testing.assert_close(mean, m_ref.view(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rstd, r_ref.view(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(amax, amax_ref, rtol=1e-3, atol=0)
    assert sqnr(y_ref.float(), y.float()) >= 35
    a, b = x8t.view(torch.uint8).int(), x8t_ref.view(torch.uint8).int()
    assert (a != b).float().mean() <= 0.02 and (a - b).abs().max() <= 1


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype, K, offset", [(torch.float32, 2048, 0), (torch.bfloat16, 1008, 0),
                                              (torch.float16, 96, 0), (torch.float32, 2064, 0),
                                              (torch.bfloat16, 1008, 1)])
def test_ln_linear_fwd_statistics_match_torch(device, dtype, K, offset):
    """mean and rstd for rows the vector kernel holds (up to 2048 columns of whole 16-byte
    vectors) and for the others (2064 columns; a misaligned row: the scalar kernel)."""
    torch.manual_seed(0)
    M = 48
    x = (torch.randn(M * K + offset, device=device) * 2 - 1).to(dtype)[offset:].view(M, K)
    w8 = torch.zeros(16, K, device=device, dtype=E4)
    one = torch.ones(1, device=device)
    ones, zeros = torch.ones(K, device=device), torch.zeros(K, device=device)
    _, _, _, _, mean, rstd = ops.ln_linear_fwd(x, ones, zeros, 1e-5, w8, one, torch.zeros(1, device=device), one,
                                               one)
    _, m_ref, r_ref = torch.native_layer_norm(x.double(), [K], None, None, 1e-5)
    torch.testing.assert_close(mean.double(), m_ref.view(-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double(), r_ref.view(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_ln_linear_fwd_checks_its_layernorm_arguments(device):
    x = torch.randn(32, 64, device=device)
    w8 = torch.zeros(16, 64, device=device, dtype=E4)
    one = torch.ones(1, device=device)
    good = torch.ones(64, device=device)
    with pytest.raises(RuntimeError, match=r"ln_weight must be float32 \[K\] = \[64\]"):
        ops.ln_linear_fwd(x, good[:32], good, 1e-5, w8, one, torch.zeros(1, device=device), one, one)
    with pytest.raises(RuntimeError, match=r"ln_bias must be float32 \[K\] = \[64\]"):
        ops.ln_linear_fwd(x, good, good.to(torch.bfloat16), 1e-5, w8, one, torch.zeros(1, device=device), one, one)


def _ln_linear_fwd_raw_args(M, K, N=16):
    """ln_linear_fwd's schema arguments, the weight cast in the op (w_amax starts at 0)."""
    one, e4 = torch.ones(1), torch.float8_e4m3fn
    return [torch.randn(M, K), torch.empty(0), torch.empty(0), 1e-5, torch.randn(N, K) * 100, one,
            torch.zeros(1), one, one, torch.zeros(1), one, torch.empty(0), e4, e4, torch.bfloat16,
            False, True, False]


def test_ln_linear_fwd_empty_batch_and_zero_width():
    """M = 0 (an empty batch) returns empty outputs; K = 0 is refused by name before the
    weight's amax (an in-place input) is touched."""
    args = _ln_linear_fwd_raw_args(0, 64)
    y, x8t, w8, w8t, mean, rstd = torch.ops.fp8ops.ln_linear_fwd.default(*args)
    assert y.shape == (0, 16) and x8t.shape == (64, 0) and mean.shape == rstd.shape == (0,)
    assert args[9].item() > 0                                   # the weight was still cast
    args = _ln_linear_fwd_raw_args(4, 0)
    with pytest.raises(RuntimeError, match=r"x \[4, 0\] has no features to normalize \(K = 0\)"):
        torch.ops.fp8ops.ln_linear_fwd.default(*args)
    assert args[9].item() == 0.0


def test_linear_bwd_bias_gradient_of_zero_outputs():
    """N = 0 with the bias gradient asked for: an empty bias gradient, not an internal error."""
    one, e4, e5 = torch.ones(1), torch.float8_e4m3fn, torch.float8_e5m2
    dx, dw, db = torch.ops.fp8ops.linear_bwd.default(
        torch.randn(4, 0), torch.randn(8, 0).to(e4), torch.randn(8, 4).to(e4), one, torch.zeros(1), one, one,
        one, torch.empty(0), e5, torch.bfloat16, torch.float32, False, False, True)
    assert db.shape == (0,) and dx.numel() == 0 and dw.numel() == 0


class LnLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(64), nn.Linear(64, 32)

    def forward(self, x):
        return self.lin(self.ln(x))


def test_input_dtype_other_than_the_layernorms_runs_it_unfused(monkeypatch):
    """bf16 activations into an fp32 LayerNorm: torch's LayerNorm (which computes in fp32)
    runs first, exactly as with the fusion off. (Under autocast, as training runs it: outside
    autocast the Linear after it refuses the bf16 input, as nn.Linear does.)"""
    torch.manual_seed(0)
    base = LnLinear()
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, fuse_layernorm=False)
    assert fused.lin.fp8_ln_input is fused.ln
    calls = []
    raw = ops._ln_linear_fwd_raw
    monkeypatch.setattr(ops, "_ln_linear_fwd_raw", lambda *a: (calls.append(1), raw(*a))[1])
    x = torch.randn(32, 64).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for m in (fused, plain):  # past the first (current-scaled) step
            m(x).float().sum().backward()
            fp8ops.step(m)
        torch.testing.assert_close(fused(x), plain(x), rtol=0, atol=0)
    assert calls == []


def _ln_bwd_inputs(M, K, dtype, device, offset=0):
    x = (torch.randn(M * K + offset, device=device) * 3 + 1).to(dtype)[offset:].view(M, K)
    dy = torch.randn(M, K, device=device).to(dtype)
    gamma = torch.randn(K, device=device) * 0.5 + 1
    _, mean, rstd = torch.native_layer_norm(x.float(), [K], gamma, None, 1e-5)
    return dy, x, mean.view(-1), rstd.view(-1), gamma


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M, K", [(256, 768), (1000, 64), (20000, 96), (8, 1024), (37, 8), (0, 64), (300, 1040),
                                  (4100, 2048), (40, 3072), (300, 4096)])
def test_layernorm_bwd_matches_torch(device, dtype, M, K):
    """dx, dgamma and dbeta against torch's LayerNorm backward in float64, from the same
    mean and rstd. M=1000: a partial CTA; 20000: more rows per warp (fp8ops.h); K=1024 the
    widest row one warp holds, 1040 and 2048 rows two warps share, 3072 and 4096 (the widest)
    rows four warps share, in 48 KB of shared memory at 4096; M=0:
    zero column sums. On CUDA: the same bits twice, and the CPU kernel's values to rounding."""
    torch.manual_seed(0)
    dy, x, mean, rstd, gamma = _ln_bwd_inputs(M, K, dtype, device)
    dx, dgb = ops.layernorm_bwd(dy, x, mean, rstd, gamma)
    assert dx.dtype == dtype and dx.shape == x.shape and dgb.shape == (2, K) and dgb.dtype == torch.float32
    rdx, rdw, rdb = torch.ops.aten.native_layer_norm_backward(
        dy.double(), x.double(), [K], mean.double().view(-1, 1), rstd.double().view(-1, 1), gamma.double(),
        gamma.double(), [True, True, True])
    tol = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(dx.double(), rdx, rtol=tol, atol=tol)
    scale = max(M, 1) ** 0.5  # column sums over M rows
    torch.testing.assert_close(dgb[0].double(), rdw, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(dgb[1].double(), rdb, rtol=1e-4, atol=1e-5 * scale)
    if device == "cuda":
        dx2, dgb2 = ops.layernorm_bwd(dy, x, mean, rstd, gamma)
        assert torch.equal(dx.view(-1).view(torch.uint8), dx2.view(-1).view(torch.uint8))
        assert torch.equal(dgb.view(torch.int32), dgb2.view(torch.int32))
        dx_c, dgb_c = ops.layernorm_bwd(dy.cpu(), x.cpu(), mean.cpu(), rstd.cpu(), gamma.cpu())
        torch.testing.assert_close(dx.cpu().double(), dx_c.double(), rtol=tol, atol=tol)
        torch.testing.assert_close(dgb.cpu(), dgb_c, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_layernorm_bwd_shapes_outside_the_kernel_take_torchs(device):
    """Rows the CUDA kernel does not hold (4112: too wide; 2052: four slices of 513 floats,
    1028: two of 514, not whole 16-byte vectors; 100 bf16 not whole vectors) fail the
    fusable test on CUDA, so
    the fused LayerNorm's backward runs torch's there; called anyway, the op says why and
    what to use. The CPU kernel takes them."""
    torch.manual_seed(0)
    cases = [(torch.float32, 4112, 0), (torch.float32, 2052, 0), (torch.float32, 1028, 0), (torch.bfloat16, 100, 0)]
    for dtype, K, offset in cases:
        dy, x, mean, rstd, gamma = _ln_bwd_inputs(16, K, dtype, device, offset)
        assert ops.layernorm_bwd_fusable(dy, x) == (device == "cpu")
        if device == "cpu":
            dx, dgb = ops.layernorm_bwd(dy, x, mean, rstd, gamma)
            rdx = torch.ops.aten.native_layer_norm_backward(
                dy.double(), x.double(), [K], mean.double().view(-1, 1), rstd.double().view(-1, 1),
                gamma.double(), gamma.double(), [True, False, False])[0]
            torch.testing.assert_close(dx.double(), rdx, rtol=1e-2, atol=1e-2)
            continue
        with pytest.raises(RuntimeError, match=r"layernorm_bwd: on CUDA, K must be a multiple of .*"
                                               r"native_layer_norm_backward"):
            ops.layernorm_bwd(dy, x, mean, rstd, gamma)
        need = (True, True, True)
        g = gamma.to(dtype)  # the fusion's guard: the LayerNorm's weight has x's dtype
        dx, dw, db = _layer_norm_backward(dy, x, mean, rstd, g, g, g.float(), need, False)
        ref = torch.ops.aten.native_layer_norm_backward(dy, x, [K], mean.view(-1, 1), rstd.view(-1, 1), g, g,
                                                        list(need))
        for a, b in zip((dx, dw, db), ref):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    dy, x, mean, rstd, gamma = _ln_bwd_inputs(16, 64, torch.bfloat16, device)
    assert ops.layernorm_bwd_fusable(dy, x) and not ops.layernorm_bwd_fusable(dy.float(), x)
    assert not ops.layernorm_bwd_fusable(dy.t(), x.t())


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layernorm_bwd_misaligned_views(device, dtype):
    """x or dy at an offset that is not a whole 16-byte vector: the op reads an aligned
    copy (CUDA), with the bits of the aligned call."""
    torch.manual_seed(0)
    dy, x, mean, rstd, gamma = _ln_bwd_inputs(40, 64, dtype, device, offset=1)
    assert x.storage_offset() == 1 and ops.layernorm_bwd_fusable(dy, x)
    dy_off = torch.empty(40 * 64 + 3, device=device, dtype=dtype)[3:].view(40, 64).copy_(dy)
    ref = ops.layernorm_bwd(dy, x.clone(), mean, rstd, gamma)
    for args in ((dy, x), (dy_off, x.clone()), (dy_off, x)):
        out = ops.layernorm_bwd(*args, mean, rstd, gamma)
        for a, b in zip(out, ref):
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_layernorm_bwd_checks_its_arguments(device):
    dy, x, mean, rstd, gamma = _ln_bwd_inputs(32, 64, torch.float32, device)
    with pytest.raises(RuntimeError, match=r"dy must have x's dtype float32, found bfloat16; convert it"):
        ops.layernorm_bwd(dy.bfloat16(), x, mean, rstd, gamma)
    with pytest.raises(RuntimeError, match=r"mean must be float32 \[32\], found float32 \[31\]"):
        ops.layernorm_bwd(dy, x, mean[:31], rstd, gamma)
    with pytest.raises(RuntimeError, match=r"rstd must be float32 \[32\], found float32 \[1, 32\]"):
        ops.layernorm_bwd(dy, x, mean, rstd.reshape(1, 32), gamma)
    with pytest.raises(RuntimeError, match=r"weight must be float32 \[64\] or empty \(none\), found bfloat16"):
        ops.layernorm_bwd(dy, x, mean, rstd, gamma.bfloat16())
    with pytest.raises(RuntimeError, match=r"dy \[32, 32\] must have x's shape \[32, 64\]"):
        ops.layernorm_bwd(dy[:, :32].contiguous(), x, mean, rstd, gamma)
    torch.library.opcheck(torch.ops.fp8ops.layernorm_bwd.default, (dy, x, mean, rstd, gamma))
