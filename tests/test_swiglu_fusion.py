"""The SwiGLU: fp8ops::swiglu and swiglu_backward (one pass each), the fused
input cast of the linear a SwiGLU feeds (linear_fwd with swiglu_input), and
the conversion that moves a SwiGLU activation module into that linear
(swiglu_fusion.py).

CPU tests run the C reference kernels; the CUDA parametrisations run the
kernels on the device."""
import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops import ops
from fp8ops._reference import sqnr
from fp8ops.linear import Fp8Linear
from fp8ops.swiglu import SwiGLU, is_swiglu, swiglu

from conftest import (DEVICES, FP8_DEVICES, assert_bitwise, assert_compiled_matches_eager, assert_trains_like,
                      convert_as_on_fp8_gpu)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt2 import GPT, GPTConfig, SiluAndMul  # noqa: E402

E4 = torch.float8_e4m3fn
HP = [torch.bfloat16, torch.float16, torch.float32]


def _torch_swiglu(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ------------------------------------------------------------------ the ops

@pytest.mark.parametrize("dtype", HP)
def test_swiglu_matches_torch_on_cpu(dtype):
    """bf16 / fp16: bit for bit what torch's silu and mul write (both round after each);
    the backward likewise bit for bit for bf16 / fp16 (fp32: to its rounding)."""
    torch.manual_seed(0)
    x = (torch.randn(3, 7, 2 * 40) * 4).to(dtype)
    dh = torch.randn(3, 7, 40).to(dtype)
    ref_x = x.clone().requires_grad_()
    ref = _torch_swiglu(ref_x)
    ref.backward(dh)
    out_x = x.clone().requires_grad_()
    out = ops.swiglu(out_x)
    out.backward(dh)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref)
        torch.testing.assert_close(out_x.grad, ref_x.grad)
    else:
        assert_bitwise(out, ref.detach(), "swiglu")
        assert_bitwise(out_x.grad, ref_x.grad, "swiglu_backward")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", HP)
@pytest.mark.parametrize("cols", [64, 40, 13])
def test_swiglu_cuda_matches_cpu_and_torch(dtype, cols):
    """CUDA (16-byte vectors where cols allows, one element at a time otherwise): the CPU
    reference to expf's rounding, torch's CUDA ops likewise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(1)
    x = (torch.randn(33, 2 * cols) * 4).to(dtype)
    dh = torch.randn(33, cols).to(dtype)
    tol = dict(atol=1e-2, rtol=1e-2) if dtype != torch.float32 else dict(atol=1e-5, rtol=1e-5)
    out = ops.swiglu(x.cuda())
    dx = ops.swiglu_backward(dh.cuda(), x.cuda())
    torch.testing.assert_close(out.cpu(), ops.swiglu(x), **tol)
    torch.testing.assert_close(dx.cpu(), ops.swiglu_backward(dh, x), **tol)
    torch.testing.assert_close(out, _torch_swiglu(x.cuda()), **tol)
    # nearly every element bit for bit (a bf16 / fp16 rounding boundary rarely differs)
    if dtype != torch.float32:
        same = (out.cpu().view(torch.int16) == ops.swiglu(x).view(torch.int16)).float().mean().item()
        assert same > 0.99, same


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_cuda_vector_and_scalar_paths_agree(dtype):
    """An input at an odd offset takes the one-element path: the same bits as the vector path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(2)
    x = (torch.randn(64, 256, device="cuda") * 3).to(dtype)
    dh = torch.randn(64, 128, device="cuda").to(dtype)
    xs = torch.empty(x.numel() + 1, device="cuda", dtype=dtype)[1:].view_as(x).copy_(x)
    dhs = torch.empty(dh.numel() + 1, device="cuda", dtype=dtype)[1:].view_as(dh).copy_(dh)
    assert xs.data_ptr() % 16 != 0
    assert_bitwise(ops.swiglu(xs), ops.swiglu(x), "forward")
    assert_bitwise(ops.swiglu_backward(dhs, xs), ops.swiglu_backward(dh, x), "backward")


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_errors_name_the_argument(device):
    x = torch.randn(4, 6, device=device)
    with pytest.raises(RuntimeError, match=r"fp8ops::swiglu: x \[4, 5\] must have an even last dim"):
        ops.swiglu(torch.randn(4, 5, device=device))
    with pytest.raises(RuntimeError, match=r"dh \[4, 4\] must have x's shape \[4, 6\] with the last dim halved"):
        ops.swiglu_backward(torch.randn(4, 4, device=device), x)
    with pytest.raises(RuntimeError, match=r"dh must have x's dtype float32, found bfloat16"):
        ops.swiglu_backward(torch.randn(4, 3, device=device, dtype=torch.bfloat16), x)
    with pytest.raises(RuntimeError, match=r"x must be contiguous"):
        ops.swiglu(torch.randn(6, 4, device=device).t())
    with pytest.raises(RuntimeError, match=r"x must be float32, bfloat16 or float16, found float64"):
        ops.swiglu(torch.randn(4, 6, device=device, dtype=torch.float64))


def test_swiglu_function_falls_back_to_torch():
    """swiglu() takes torch's ops where fp8ops' cannot run (float64 here)."""
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(swiglu(x), _torch_swiglu(x))


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_second_derivatives_and_torch_func(device):
    """A gradient penalty through fp8ops.SwiGLU: the op's backward has no derivative of its
    own and the second derivative read 0 (torch's warning the only sign); torch.func's
    transforms failed on the op's autograd formula. Both now give torch's numbers."""
    torch.manual_seed(0)
    x = torch.randn(6, 8, device=device, requires_grad=True)
    for fn in (SwiGLU(), _torch_swiglu):
        (g,) = torch.autograd.grad(fn(x).square().sum(), x, create_graph=True)
        (gg,) = torch.autograd.grad(g.square().sum(), x)
        if fn is _torch_swiglu:
            torch.testing.assert_close(gg, ref)
        ref = gg
    assert ref.abs().sum() > 1
    hess = torch.func.hessian(lambda v: SwiGLU()(v).sum())(x.detach()[0])
    torch.testing.assert_close(hess, torch.func.hessian(lambda v: _torch_swiglu(v).sum())(x.detach()[0]))


# ------------------------------------------------------------ the fused cast

def _linear_fwd(x, w, swiglu_input):
    """linear_fwd with fresh scaling state: (y, x8t, x's amax, w's amax)."""
    dev = x.device
    xs, xa, xsi = torch.tensor([2.0], device=dev), torch.zeros(1, device=dev), torch.tensor([0.5], device=dev)
    ws, wa, wsi = torch.tensor([4.0], device=dev), torch.zeros(1, device=dev), torch.tensor([0.25], device=dev)
    y, x8t, _, _ = ops.linear_fwd(x, w, xs, xa, xsi, wsi, w_scale=ws, w_amax=wa, swiglu_input=swiglu_input)
    return y, x8t, xa, wa


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_fwd_swiglu_input_is_swiglu_then_linear_fwd(device, dtype):
    """The fused cast gives the bits of swiglu(x) cast by the plain linear_fwd: y, x8t and the
    amax (on CUDA the fused cast and fp8ops::swiglu share the device formula)."""
    torch.manual_seed(3)
    M, K, N = 64, 96, 48
    x = (torch.randn(M, 2 * K, device=device) * 3).to(dtype)
    w = torch.randn(N, K, device=device)
    for a, b, what in zip(_linear_fwd(x, w, True), _linear_fwd(ops.swiglu(x), w, False), ("y", "x8t", "amax", "w")):
        assert_bitwise(a, b, what)


@pytest.mark.gpu
@pytest.mark.fp8
def test_linear_fwd_swiglu_unaligned_input_takes_the_buffer_path():
    """An input at an odd offset cannot take the fused cast: the SwiGLU is computed into a
    buffer first, with the same bits."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)):
        pytest.skip("needs an FP8 GPU")
    torch.manual_seed(4)
    M, K, N = 32, 64, 32
    x = (torch.randn(M, 2 * K, device="cuda") * 3).to(torch.bfloat16)
    xs = torch.empty(x.numel() + 1, device="cuda", dtype=x.dtype)[1:].view_as(x).copy_(x)
    w = torch.randn(N, K, device="cuda")
    for a, b, what in zip(_linear_fwd(xs, w, True), _linear_fwd(x, w, True), ("y", "x8t", "amax", "w")):
        assert_bitwise(a, b, what)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_fwd_swiglu_input_checks_the_width(device):
    x = torch.randn(16, 32, device=device)
    with pytest.raises(RuntimeError, match=r"with swiglu_input, x \[16, 32\] must be \[M, 2K\] .* for w "
                                           r"\[N, K\] = \[16, 32\]"):
        _linear_fwd(x, torch.randn(16, 32, device=device), True)
    with pytest.raises(RuntimeError, match="gelu_input and swiglu_input are exclusive"):
        one = torch.ones(1, device=device)
        ops.linear_fwd(x, torch.randn(16, 16, device=device), one, torch.zeros(1, device=device), one, one,
                       w_scale=one, gelu_input=True, swiglu_input=True)


# ------------------------------------------------------------------ conversion

class MLP(nn.Module):
    """Llama's MLP, gate and up in one projection, with the given activation module."""

    def __init__(self, act, d=32, hidden=64, bias=False):
        super().__init__()
        self.c_fc = nn.Linear(d, 2 * hidden, bias=bias)
        self.act = act
        self.c_proj = nn.Linear(hidden, d, bias=bias)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


class ChunkSiluModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.silu = nn.SiLU()

    def forward(self, x):
        a, b = torch.chunk(x, 2, -1)
        return b * self.silu(a)


class InplaceSilu(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a, inplace=True) * b


class ChunkOnDim0(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2)
        return F.silu(a) * b


class GeluGate(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.gelu(a) * b


class ScaledSwiGLU(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b * 2


class WithParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.g = nn.Parameter(torch.ones(1))

    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b


@pytest.mark.parametrize("act,expected", [
    (SwiGLU(), True), (SiluAndMul(), True), (ChunkSiluModule(), True), (InplaceSilu(), False),
    (ChunkOnDim0(), False), (GeluGate(), False), (ScaledSwiGLU(), False), (WithParameter(), False),
    (nn.SiLU(), False), (nn.Identity(), False)])
def test_is_swiglu_recognises_exactly_the_pattern(act, expected):
    assert is_swiglu(act) is expected


def test_convert_fuses_the_swiglu(monkeypatch):
    model = nn.Sequential(MLP(SiluAndMul()), MLP(SwiGLU()))
    keys = list(model.state_dict())
    convert_as_on_fp8_gpu(model, monkeypatch)
    for mlp in model:
        assert isinstance(mlp.act, nn.Identity)
        assert mlp.c_proj.fp8_swiglu_input and not mlp.c_fc.fp8_swiglu_input
    assert list(model.state_dict()) == keys
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert reasons["0.c_proj"] == "converted; SwiGLU 0.act fused into its input cast"
    assert "input=silu(gate)*up of x=[gate|up] (fused)" in repr(model[0].c_proj)
    copy.deepcopy(model)


def test_fuse_swiglu_off_keeps_the_module(monkeypatch):
    model = convert_as_on_fp8_gpu(MLP(SiluAndMul()), monkeypatch, fuse_swiglu=False)
    assert type(model.act) is SiluAndMul and not model.c_proj.fp8_swiglu_input


class SwiGLUAlsoResidual(MLP):
    def forward(self, x):
        h = self.act(self.c_fc(x))
        return self.c_proj(h) + h.mean()


class InlineSwiGLU(MLP):
    def forward(self, x):
        return self.c_proj(_torch_swiglu(self.c_fc(x)))


class ConsumerNotConverted(MLP):
    def __init__(self):
        super().__init__(SiluAndMul())
        self.c_proj = nn.Linear(64, 30, bias=False)  # 30 % 16 != 0: stays nn.Linear


@pytest.mark.parametrize("model", [SwiGLUAlsoResidual(SiluAndMul()), InlineSwiGLU(SiluAndMul()),
                                   ConsumerNotConverted()])
def test_swiglu_that_is_not_safe_to_move_stays(model, monkeypatch):
    act = model.act
    x = torch.randn(3, 32)
    want = model(x)
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert model.act is act and not getattr(model.c_proj, "fp8_swiglu_input", False)
    torch.testing.assert_close(model(x), want, atol=0.5, rtol=0.2)  # FP8 rounding, not a wrong wiring


def test_the_llama_example_fuses_every_swiglu(monkeypatch):
    from gpt2 import LM_HEAD_FILTER  # noqa: PLC0415
    model = GPT(GPTConfig.preset("tiny", arch="llama"))
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    fp8ops.convert(model, module_filter_fn=LM_HEAD_FILTER)
    blocks = model.transformer.h
    assert all(isinstance(b.mlp.act, nn.Identity) and b.mlp.c_proj.fp8_swiglu_input for b in blocks)


# ------------------------------------------------------------------- training

def _swiglu_flags(monkeypatch):
    """The swiglu_input flag of every linear_fwd call."""
    seen = []
    raw = ops._linear_fwd_raw
    monkeypatch.setattr(ops, "_linear_fwd_raw", lambda *a: (seen.append(a[16]), raw(*a))[1])
    return seen


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_fused_swiglu_trains_like_unfused(device, bias, monkeypatch):
    """Three SGD steps of the fused MLP against the same FP8 MLP with the module left alone:
    outputs and every gradient equal to FP8 rounding; from the second step on (delayed
    scaling's first step casts with current scales, unfused) c_proj casts the SwiGLU itself."""
    torch.manual_seed(5)
    base = MLP(SiluAndMul(), d=64, hidden=128, bias=bias).to(device)
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, fuse_swiglu=False)
    seen = _swiglu_flags(monkeypatch)

    class Stepped(nn.Module):  # each step ends with the scale update, as a training loop's
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            fp8ops.step(self.m)
            return self.m(x)

    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        assert_trains_like(Stepped(fused), Stepped(plain), torch.randn(4, 32, 64, device=device))
    # per step: fused c_fc, c_proj, then plain c_fc, c_proj; step 1 runs current scaling (unfused)
    assert seen[4:] == [False, True, False, False] * 2 and not any(seen[:4])


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_current_scaling_runs_the_swiglu_unfused(device, monkeypatch):
    """recipe "current" needs the SwiGLU's amax before its cast: c_proj applies fp8ops::swiglu
    first and then casts its output, and trains like the model with the module kept."""
    torch.manual_seed(6)
    base = MLP(SiluAndMul(), d=64, hidden=128).to(device)
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, recipe="current")
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, recipe="current", fuse_swiglu=False)
    seen = _swiglu_flags(monkeypatch)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        assert_trains_like(fused, plain, torch.randn(4, 32, 64, device=device))
    assert seen and not any(seen)


def test_bf16_path_applies_the_swiglu(monkeypatch):
    """A call off the FP8 path (here: a CPU input, FP8 on the CPU not enabled) computes
    c_proj(swiglu(x)) as the model did."""
    torch.manual_seed(7)
    base = MLP(SiluAndMul())
    model = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.fp8_on_cpu = False
    x = torch.randn(5, 32, requires_grad=True)
    y = model(x)
    x_ref = x.detach().clone().requires_grad_()
    y_ref = base(x_ref)
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert model.c_proj.fp8_fallback_calls == 1


def test_compiled_fused_swiglu_matches_eager(monkeypatch):
    torch.manual_seed(8)
    assert_compiled_matches_eager(MLP(SiluAndMul(), d=64, hidden=128), monkeypatch, (32, 64))


def test_swiglu_op_under_compile():
    """fp8ops::swiglu and its backward under torch.compile(fullgraph=True): eager's bits."""
    torch.manual_seed(9)
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    fn = torch.compile(lambda t: ops.swiglu(t) * 2, fullgraph=True)
    xe, xc = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ops.swiglu(xe) * 2).float().sum().backward()
    fn(xc).float().sum().backward()
    assert_bitwise(xc.grad, xe.grad, "grad")
    assert sqnr(fn(x), ops.swiglu(x) * 2) > 200


# ------------------------------------------------- what fx cannot see is not fused

class HookedSilu(ChunkSiluModule):
    def __init__(self):
        super().__init__()
        self.silu.register_forward_hook(lambda mod, inp, out: out * 0)


class GateWithoutGradient(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        with torch.no_grad():
            s = F.silu(a)
        return s * b


class NoGradForward(nn.Module):
    @torch.no_grad()
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        return F.silu(a) * b


class CallOverride(SiluAndMul):
    def __call__(self, x):
        return super().__call__(x) * 2


class KeepsUp(nn.Module):
    def forward(self, x):
        a, b = x.chunk(2, dim=-1)
        self.last_up = b
        return F.silu(a) * b


@pytest.mark.parametrize("act", [HookedSilu(), GateWithoutGradient(), NoGradForward(), CallOverride(), KeepsUp()])
def test_is_swiglu_refuses_what_fx_cannot_see(act):
    assert not is_swiglu(act)
    assert not hasattr(act, "last_up")  # (its forward was not run to find out)


def test_instance_forward_or_hook_on_the_module_is_not_fused(monkeypatch):
    m1 = MLP(SiluAndMul())
    m1.act.forward = lambda x: x[..., :64] * 2
    m2 = MLP(SiluAndMul())
    m2.act.register_forward_hook(lambda mod, inp, out: out * 0)
    for m in (m1, m2):
        act = m.act
        convert_as_on_fp8_gpu(m, monkeypatch)
        assert m.act is act and not m.c_proj.fp8_swiglu_input


class ActByKeyword(MLP):
    def forward(self, x):
        return self.c_proj(self.act(x=self.c_fc(x)))


def test_activation_called_by_keyword_is_not_fused(monkeypatch):
    """nn.Identity, which replaces a fused activation, takes its input as `input`: an
    activation called another way keeps its module (and the model keeps working)."""
    model = convert_as_on_fp8_gpu(ActByKeyword(SiluAndMul()), monkeypatch)
    assert type(model.act) is SiluAndMul
    model(torch.randn(2, 32))


class FrozenParts(MLP):
    """An MLP whose SwiGLU fuses, with a BatchNorm the user froze in eval mode, and a stateless
    wrapper (in training) of a Dropout the user froze: reading the MLP's forward, and the
    wrapper's (is it a SwiGLU?), in both modes must leave each as it was."""

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x)

    def __init__(self):
        super().__init__(SiluAndMul())
        self.bn = nn.BatchNorm1d(32)
        self.wrap = self.Wrapper()

    def forward(self, x):
        return self.wrap(self.bn(self.c_proj(self.act(self.c_fc(x)))))


def test_convert_keeps_each_submodule_train_or_eval(monkeypatch):
    model = FrozenParts().train()
    model.bn.eval()
    model.wrap.drop.eval()
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert model.c_proj.fp8_swiglu_input
    assert model.training and model.wrap.training
    assert not model.bn.training and not model.wrap.drop.training
