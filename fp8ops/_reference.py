"""Plain-PyTorch references of every fp8ops op, written for clarity. Tests and
benchmarks compare the C and CUDA kernels against these."""
from __future__ import annotations

import torch

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def cast_ref(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, transpose: bool = False):
    """(x.float() * scale).clamp(-max, max).to(out_dtype), its transpose, amax(|x|); an
    infinite x is not clamped: NaN in e4m3fn, which has no inf (its sign kept), inf in e5m2.
    (Set here, not left to torch's conversion: torch 2.15's .to(float8_e4m3fn) saturates an
    inf to +-448, where 2.10 and 2.11 gave NaN.)"""
    fmax = FP8_MAX[out_dtype]
    y = x.float() * scale.float().reshape(())
    inf = x.isinf()
    if out_dtype == torch.float8_e4m3fn:
        y = torch.where(inf, torch.copysign(torch.full_like(y, float("nan")), y), y)
    out = torch.where(inf, y, y.clamp(-fmax, fmax)).to(out_dtype)
    cols = x.shape[-1]
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    out_t = out.reshape(rows, cols).t().contiguous() if transpose else out.new_empty((0,))
    amax = x.float().abs().amax() if x.numel() else torch.zeros((), device=x.device, dtype=torch.float32)
    return out, out_t, amax


def amax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.float().abs().amax() if x.numel() else torch.zeros((), device=x.device, dtype=torch.float32)


def amax_update_ref(amax_history, scale, scale_inv, fp8_max, margin: float = 0.0, algo: str = "max"):
    """Delayed scaling, Transformer Engine's rules, on copies; returns
    (new_history, new_scale, new_scale_inv). History is [H] or [H, n]; row 0 is
    the current step's amax; roll up by one, then zero row 0."""
    h = amax_history.reshape(amax_history.shape[0], -1).clone()
    # amaxes are magnitudes: the reduction is over |h| (NaN propagates)
    if algo == "max":
        # row 0's NaN/inf propagates (that step keeps its scale); an older row's is skipped
        older = h[1:].abs()
        older = torch.where(torch.isfinite(older), older, torch.zeros_like(older))
        a = torch.cat([h[:1].abs(), older]).amax(dim=0)
    else:
        a = h[0].abs()
    s_old = scale.reshape(-1).clone()
    s_new = (fp8_max.reshape(-1) / a) / (2.0 ** margin)
    s_new = torch.where(torch.isinf(s_new), torch.full_like(s_new, torch.finfo(torch.float32).max), s_new)
    # an underflow (to 0, or so small that 1/scale overflows) keeps the old scale
    ok = torch.isfinite(a) & (a > 0) & (s_new > 0) & torch.isfinite(1.0 / s_new)
    s = torch.where(ok, s_new, s_old)
    # a kept scale that came in 0, negative, inf or NaN is not kept either: 1
    s = torch.where(torch.isfinite(s) & (s > 0) & torch.isfinite(1.0 / s), s, torch.ones_like(s))
    h = torch.roll(h, -1, dims=0)
    h[0] = 0
    return h.reshape(amax_history.shape), s.reshape(scale.shape), (1.0 / s).reshape(scale_inv.shape)


def gemm_ref(a, b, a_scale_inv, b_scale_inv, bias=None, out_dtype=torch.bfloat16):
    """Dequantise, fp32 matmul a @ b.T, scale, add bias, round to out_dtype."""
    y = (a.float() @ b.float().t()) * (a_scale_inv.float().reshape(()) * b_scale_inv.float().reshape(()))
    if bias is not None and bias.numel():
        y = y + bias.float()
    return y.to(out_dtype)


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB (torchao's compute_error)."""
    ref, x = ref.detach().double(), x.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm()))
