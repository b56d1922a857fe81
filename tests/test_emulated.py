"""fp8_format="e5m2": all-E5M2 layers, casts by the fp8ops ops, GEMMs on the FP8
values widened to BF16 (fp8ops/emulated.py). Checked against a reference built
from the cast op alone, on CPU and on the GPU."""
import copy

import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops import Fp8Config, ops
from fp8ops._reference import sqnr
from fp8ops.emulated import mm_dequant
from fp8ops.linear import G, W, X, Fp8Linear
from fp8ops.scaling import fold_grad_amax

from conftest import requires_fp8

E5 = torch.float8_e5m2


def _layer(device="cpu", recipe="delayed", bias=True, policy="always"):
    torch.manual_seed(0)
    ref = nn.Linear(64, 32, bias=bias, device=device)
    lin = Fp8Linear.from_linear(copy.deepcopy(ref), Fp8Config(recipe=recipe, fp8_format="e5m2", policy=policy))
    lin.fp8_on_cpu = device == "cpu"
    return ref, lin


def _expected(lin, x, g, scales):
    """y, dx, dW from the cast op and fp32 matmuls, with the scales the layer used."""
    s, si = scales
    x8 = ops.cast(x, s[X:X + 1], E5)[0].float()
    w8 = ops.cast(lin.weight.detach(), s[W:W + 1], E5)[0].float()
    g8 = ops.cast(g, s[G:G + 1], E5)[0].float()
    y = (x8 @ w8.t()) * (si[X] * si[W])
    if lin.bias is not None:
        y = y + lin.bias.detach()
    dx = (g8 @ w8) * (si[G] * si[W])
    dw = (g8.t() @ x8) * (si[G] * si[X])
    return y, dx, dw


def test_config_accepts_e5m2_and_every_tensor_is_e5m2():
    cfg = Fp8Config(fp8_format="e5m2")
    assert cfg.dtypes() == (E5, E5, E5)
    assert cfg.gemm_emulated and not Fp8Config().gemm_emulated
    lin = Fp8Linear(32, 16, config=cfg)
    assert lin.fp8_max.tolist() == [57344.0] * 3


@pytest.mark.parametrize("bias", [True, False])
def test_e5m2_layer_matches_the_cast_reference_cpu(bias):
    """Current scaling (the scales are this call's own): y, dx, dW equal a reference
    made of the cast op and fp32 matmuls, and the amaxes went into the history."""
    _, lin = _layer(recipe="current", bias=bias)
    x = torch.randn(48, 64, requires_grad=True)
    y = lin(x)
    g = torch.randn_like(y)
    y.backward(g)
    scales = (lin.fp8_scale.clone(), lin.fp8_scale_inv.clone())
    # current scaling: the scale of each tensor is fp8_max / its amax
    assert scales[0][X].item() == pytest.approx(57344.0 / x.abs().max().item(), rel=1e-6)
    assert scales[0][G].item() == pytest.approx(57344.0 / g.abs().max().item(), rel=1e-6)
    y_ref, dx_ref, dw_ref = _expected(lin, x.detach(), g, scales)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, dx_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lin.weight.grad, dw_ref, rtol=1e-6, atol=1e-6)
    if bias:
        torch.testing.assert_close(lin.bias.grad, g.sum(0))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_e5m2_layer_trains_cpu(recipe):
    """A few optimizer steps: close to fp32 (E5M2's 2-bit mantissa: lower SQNR than
    hybrid), finite, scales updated from the amax history, weight cast cached."""
    ref, lin = _layer(recipe=recipe)
    opt = torch.optim.SGD(lin.parameters(), lr=0.05)
    for step in range(4):
        x = torch.randn(32, 64)
        y = lin(x)
        y_ref = ref(x)
        assert torch.isfinite(y).all()
        assert sqnr(y_ref.detach(), y.detach()) >= 15, step
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            ref.weight.copy_(lin.weight)
            ref.bias.copy_(lin.bias)
    assert lin.fp8_step == 4
    assert (lin.fp8_scale > 1).all() and torch.isfinite(lin.fp8_scale).all()
    torch.testing.assert_close(lin.fp8_scale * lin.fp8_scale_inv, torch.ones(3))
    assert lin.fp8_overflow_count.sum() == 0


def test_e5m2_weight_cast_once_per_step_cpu():
    _, lin = _layer()
    calls = []
    real = ops._cast_accumulate

    def counting(x, *a, **k):
        calls.append(tuple(x.shape))
        return real(x, *a, **k)

    x = torch.randn(16, 64)
    lin(x).sum().backward()
    fp8ops.step(lin)  # (the weight cast is cached in layers an optimizer step has updated)
    try:
        ops._cast_accumulate = counting
        for _ in range(3):  # three micro-batches, one weight cast
            lin(x).sum().backward()
    finally:
        ops._cast_accumulate = real
    assert calls.count((32, 64)) == 1      # the weight
    assert calls.count((16, 64)) == 3      # x, per micro-batch
    assert calls.count((16, 32)) == 3      # dy, per micro-batch


def test_e5m2_report_and_training_flags():
    from fp8ops.training import add_fp8_args, prepare_model
    import argparse

    p = argparse.ArgumentParser()
    add_fp8_args(p)
    model = nn.Sequential(nn.Linear(32, 32))
    lines = []
    _, info = prepare_model(model, p.parse_args(["--use_fp8", "--fp8_format", "e5m2"]), logger=lines.append)
    assert info["config"].fp8_format == "e5m2"
    lines = []
    _, info = prepare_model(nn.Sequential(nn.Linear(32, 32)),
                            p.parse_args(["--use_fp8", "--fp8_backend", "torchao", "--fp8_format", "e5m2"]),
                            logger=lines.append)
    assert "not available with --fp8_backend torchao" in lines[0]
    _, lin = _layer()
    rows = fp8ops.report(nn.Sequential(lin), print_table=False)
    assert "GEMMs emulated in BF16" in rows[0]["reason"]


def test_e5m2_compiled_matches_eager_cpu():
    torch.manual_seed(0)
    _, base = _layer()
    outs = []
    for compiled in (False, True):
        lin = copy.deepcopy(base)
        torch._dynamo.reset()
        fn = torch.compile(lin, fullgraph=True) if compiled else lin
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
        y = fn(x)
        y.square().mean().backward()
        fold_grad_amax([lin])  # (compiled backward's dy amax reaches the history at the step)
        outs.append((y.detach(), lin.weight.grad.clone(), lin.fp8_amax_history.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------ GPU

@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_mm_dequant_cuda_equals_fp32_reference():
    """BF16 operands, fp32 accumulation: the exact products of the E5M2 values."""
    torch.manual_seed(0)
    a8 = (torch.randn(256, 512, device="cuda") * 100).to(E5)
    b8 = (torch.randn(512, 384, device="cuda") * 0.01).to(E5)
    sa = torch.tensor([0.5], device="cuda")
    sb = torch.tensor([3.0], device="cuda")
    got = mm_dequant(a8, b8, sa, sb)
    want = (a8.double() @ b8.double()) * 1.5
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_e5m2_layer_cuda_matches_cpu_and_stays_fp8_under_auto(recipe):
    """On the GPU under autocast and policy "auto" (which must not move an
    emulated layer to BF16): the same numbers as the CPU path of the same layer."""
    _, lin_gpu = _layer("cuda", recipe=recipe, policy="auto")
    lin_cpu = copy.deepcopy(lin_gpu).cpu()
    lin_cpu.fp8_on_cpu = True
    x = torch.randn(64, 64)
    g = torch.randn(64, 32)
    xg = x.cuda().requires_grad_()
    y_gpu = lin_gpu(xg)
    y_gpu.backward(g.cuda())
    xc = x.clone().requires_grad_()
    y_cpu = lin_cpu(xc)
    y_cpu.backward(g)
    assert lin_gpu.fp8_fallback_calls == 0 and not lin_gpu.fp8_policy
    torch.testing.assert_close(y_gpu.cpu(), y_cpu, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xg.grad.cpu(), xc.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lin_gpu.weight.grad.cpu(), lin_cpu.weight.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(lin_gpu.fp8_amax_history.cpu(), lin_cpu.fp8_amax_history)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin_gpu(xg)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert torch.isfinite(xg.grad).all()
