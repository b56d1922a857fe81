"""Shared pytest setup: device parametrisation and GPU gating.

GPU tests carry the `gpu` marker (and `fp8` when they need sm_89+): they run on
the device machine and skip elsewhere, saying why.
"""
import copy
import os

import pytest
import torch

import fp8ops

HAS_CUDA = torch.cuda.is_available() and bool(fp8ops.build_info().get("cuda_kernels_registered"))
HAS_FP8 = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and fp8ops built with nvcc")
requires_fp8 = pytest.mark.skipif(not HAS_FP8, reason="needs an FP8 GPU (sm_89+: Ada, Hopper, Blackwell)")

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]
FP8_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.fp8, requires_fp8])]


def pytest_collection_modifyitems(config, items):
    """Tests marked `timing` assert on wall-clock timings (policy "auto"'s measurements and
    its trial in a real loop). Under pytest-xdist other workers load the same host and GPU and
    move those timings (a host-bound loop read 0.56-4.0 ms per step under 8 workers), so
    there they skip, saying how to run them: alone, `pytest -m timing`
    (benchmarks/dev/device_suite.sh does both)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    skip = pytest.mark.skip(reason="a timing test: other pytest-xdist workers share the host; run `pytest -m timing` "
                                   "without -n")
    for item in items:
        if item.get_closest_marker("timing"):
            item.add_marker(skip)


def convert_as_on_fp8_gpu(model, monkeypatch, device="cpu", **cfg):
    """fp8ops.convert (policy "always") as on an FP8 GPU; on the CPU the converted layers
    run the C reference kernels."""
    from fp8ops.linear import Fp8LinearBase  # noqa: PLC0415
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always", **cfg))
    for m in model.modules():
        if isinstance(m, Fp8LinearBase):
            m.fp8_on_cpu = device == "cpu"
    return model


def train_steps(model, fn, device, steps):
    """Per step (output, input gradient, parameter gradients) of `steps` training steps of fn
    (the converted model, or its torch.compile) on [3, 16, 32] inputs from seed 1, under bf16
    autocast on CUDA, fp8ops.step after each. Inductor's caches off: a cached graph would not
    run fp8ops' inductor passes again."""
    torch.manual_seed(1)
    outs = []
    with torch.compiler.config.patch(force_disable_caches=True):
        for _ in range(steps):
            x = torch.randn(3, 16, 32, device=device, requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
                y = fn(x)
            y.float().square().mean().backward()
            outs.append((y.detach(), x.grad, [p.grad.clone() for p in model.parameters()]))
            fp8ops.step(model)
            model.zero_grad()
    return outs


def assert_steps_match_eager(eager, compiled, device):
    """train_steps' results of compiled code against eager's from step 2 (delayed scaling's
    scales known): bit for bit on the CPU's reference kernels, to FP8's noise on CUDA."""
    from fp8ops._reference import sqnr  # noqa: PLC0415
    for step in (2, 3):
        (y1, dx1, g1), (y2, dx2, g2) = eager[step], compiled[step]
        if device == "cpu":
            for a, b in zip([y1, dx1, *g1], [y2, dx2, *g2]):
                assert torch.equal(a, b), step
        else:
            assert sqnr(y1.float(), y2.float()) >= 40 and sqnr(dx1, dx2) >= 30, step
            for a, b in zip(g1, g2):
                assert sqnr(a, b) >= 30, step


def assert_compiled_matches_eager(base, monkeypatch, input_shape, steps=3):
    """torch.compile(fullgraph=True) of the converted `base` (CPU reference kernels) against
    eager over `steps` steps: outputs and parameter gradients equal to FP8 rounding."""
    from fp8ops._reference import sqnr  # noqa: PLC0415
    runs = []
    for compiled in (False, True):
        model = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
        fn = torch.compile(model, fullgraph=True) if compiled else model
        torch._dynamo.reset()
        torch.manual_seed(1)
        outs = []
        for _ in range(steps):
            y = fn(torch.randn(*input_shape))
            y.square().mean().backward()
            outs.append((y.detach(), [p.grad.clone() for p in model.parameters()]))
            fp8ops.step(model)
            model.zero_grad()
        runs.append(outs)
    for (y1, g1), (y2, g2) in zip(*runs):
        assert sqnr(y1, y2) >= 40
        for a, b in zip(g1, g2):
            assert sqnr(a, b) >= 30


def assert_trains_like(fused, plain, x, steps=3, min_sqnr=25):
    """`steps` SGD steps of two copies of a model on x: outputs (>= 30 dB), the input's
    gradient and every parameter's gradient (>= min_sqnr) equal to FP8 rounding."""
    from fp8ops._reference import sqnr  # noqa: PLC0415
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, plain)]
    for step in range(steps):
        res = []
        for m, opt in zip((fused, plain), opts):
            xi = x.clone().requires_grad_()
            y = m(xi)
            (y.float() ** 2).mean().backward()
            res.append((y.detach().float(), xi.grad, {n: p.grad.clone() for n, p in m.named_parameters()}))
            opt.step()
            opt.zero_grad()
        (y_f, dx_f, g_f), (y_p, dx_p, g_p) = res
        assert sqnr(y_p, y_f) >= 30, step
        assert sqnr(dx_p, dx_f) >= min_sqnr, step
        for n in g_p:
            assert sqnr(g_p[n], g_f[n]) >= min_sqnr, (step, n, sqnr(g_p[n], g_f[n]))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str = ""):
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs {b.shape}/{b.dtype}"
    ab, bb = bits(a.cpu()), bits(b.cpu())
    diff = (ab != bb).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} of {ab.numel()} elements differ, first at {diff[:5].tolist()}"
