"""Python face of the fp8ops dispatcher ops: a typed wrapper per op, its fake
(meta) kernel for torch.compile / FakeTensor, and its autograd formula.

The ops themselves (schemas and CPU/CUDA kernels) are registered from C when
fp8ops._C is imported; see csrc/ops.c. The fake kernels' checks mirror the C
checks one for one, so compiled code fails the same way eager code does.
"""
from __future__ import annotations

import torch

from . import _loader

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
AMAX_ALGOS = {"max": 0, "most_recent": 1}


def _bias_dtype(out_dtype: torch.dtype) -> torch.dtype:
    # cuBLASLt's FP8 rule (and torch._scaled_mm's): bf16 bias for an fp32 output
    return torch.bfloat16 if out_dtype == torch.float32 else out_dtype


# ----------------------------------------------------------------------------
# cast

def cast(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn,
         transpose: bool = False):
    """fp8 = sat(round(x * scale)) in one pass; returns (out, out_t, amax(|x|)).
    out_t is the [cols, rows] transpose of the [rows, cols] view, or empty."""
    return torch.ops.fp8ops.cast.default(x, scale, out_dtype, transpose)


def _cast_fake(x, scale, out_dtype, transpose):
    torch._check(x.dtype in HP_DTYPES, lambda: f"fp8ops::cast: x must be float32, bfloat16 or float16, found {x.dtype}")
    torch._check(out_dtype in FP8_DTYPES, lambda: f"fp8ops::cast: out_dtype must be float8_e4m3fn or float8_e5m2, found {out_dtype}")
    torch._check(x.dim() >= 1, lambda: "fp8ops::cast: x must have at least 1 dim")
    torch._check(scale.dtype == torch.float32 and scale.numel() == 1,
                 lambda: "fp8ops::cast: scale must be a 1-element float32 tensor")
    torch._check(scale.device == x.device, lambda: "fp8ops::cast: scale and x must be on one device")
    cols = x.shape[-1]
    rows = x.numel() // cols if cols != 0 else 0
    out = x.new_empty(x.shape, dtype=out_dtype)
    out_t = x.new_empty((cols, rows) if transpose else (0,), dtype=out_dtype)
    return out, out_t, x.new_empty((), dtype=torch.float32)


def _cast_setup(ctx, inputs, output):
    x, scale, _, transpose = inputs
    ctx.save_for_backward(scale)
    ctx.x_dtype, ctx.x_shape, ctx.transpose = x.dtype, x.shape, transpose


def _cast_backward(ctx, g_out, g_out_t, g_amax):
    # straight-through: d(x * scale)/dx = scale; rounding and saturation are
    # treated as identity (the usual estimator for quantisers)
    (scale,) = ctx.saved_tensors
    g = torch.zeros(ctx.x_shape, dtype=torch.float32, device=scale.device)
    if g_out is not None:
        g = g + g_out.float()
    if ctx.transpose and g_out_t is not None:
        g = g + g_out_t.float().t().reshape(ctx.x_shape)
    return (g * scale.float().reshape(())).to(ctx.x_dtype), None, None, None


# ----------------------------------------------------------------------------
# amax

def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor (NaN if any element is NaN, 0 if empty)."""
    return torch.ops.fp8ops.amax.default(x)


def _amax_fake(x):
    torch._check(x.dtype in HP_DTYPES, lambda: f"fp8ops::amax: x must be float32, bfloat16 or float16, found {x.dtype}")
    return x.new_empty((), dtype=torch.float32)


# ----------------------------------------------------------------------------
# amax_update

def amax_update(amax_history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                fp8_max: torch.Tensor, margin: float = 0.0, algo: str = "max") -> None:
    """Delayed scaling, in place, for every column of amax_history [H, n] (or
    [H]) in one launch: reduce history (max | most_recent), new scale =
    fp8_max / amax / 2**margin (zero or non-finite amax keeps the old scale),
    scale_inv = 1/scale, roll the history up by one and zero row 0."""
    if algo not in AMAX_ALGOS:
        raise ValueError(f"amax_update: algo must be one of {sorted(AMAX_ALGOS)}, found {algo!r}")
    torch.ops.fp8ops.amax_update.default(amax_history, scale, scale_inv, fp8_max, float(margin), AMAX_ALGOS[algo])


def _amax_update_fake(amax_history, scale, scale_inv, fp8_max, margin, algo):
    torch._check(amax_history.dtype == torch.float32, lambda: "fp8ops::amax_update: amax_history must be float32")
    torch._check(amax_history.dim() in (1, 2), lambda: "fp8ops::amax_update: amax_history must be [H] or [H, n]")
    return None


# ----------------------------------------------------------------------------
# gemm

def gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
         use_fast_accum: bool = False) -> torch.Tensor:
    """out[M, N] = (a[M, K] @ b[N, K].T) * a_scale_inv * b_scale_inv (+ bias), fp32
    accumulation; a, b fp8 and K-major (the TN layout cuBLASLt FP8 needs)."""
    if bias is None:
        bias = a.new_empty((0,), dtype=_bias_dtype(out_dtype))
    return torch.ops.fp8ops.gemm.default(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum)


def _gemm_fake(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum):
    torch._check(a.dtype in FP8_DTYPES, lambda: f"fp8ops::gemm: a must be float8_e4m3fn or float8_e5m2, found {a.dtype}")
    torch._check(b.dtype in FP8_DTYPES, lambda: f"fp8ops::gemm: b must be float8_e4m3fn or float8_e5m2, found {b.dtype}")
    torch._check(not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2),
                 lambda: "fp8ops::gemm: a and b are both float8_e5m2")
    torch._check(a.dim() == 2 and b.dim() == 2, lambda: "fp8ops::gemm: a and b must be 2-D")
    torch._check(a.shape[1] == b.shape[1], lambda: f"fp8ops::gemm: a {tuple(a.shape)} and b {tuple(b.shape)} must share K")
    torch._check(out_dtype in HP_DTYPES, lambda: f"fp8ops::gemm: out_dtype must be float32, bfloat16 or float16, found {out_dtype}")
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def _gemm_setup(ctx, inputs, output):
    a, b, sa, sb, bias, out_dtype, _ = inputs
    ctx.save_for_backward(a, b, sa, sb)
    ctx.has_bias, ctx.bias_dtype = bias.numel() > 0, bias.dtype


def _gemm_backward(ctx, g):
    # exact derivatives of the dequantised product, in fp32; autograd casts
    # them to the inputs' dtypes. Training does not go through this: Fp8Linear
    # has its own FP8 backward.
    a, b, sa, sb = ctx.saved_tensors
    s = (sa.float() * sb.float()).reshape(())
    gf = g.float() * s
    ga = gf @ b.float() if ctx.needs_input_grad[0] else None
    gb = gf.t() @ a.float() if ctx.needs_input_grad[1] else None
    gbias = g.float().sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[4] else None
    return ga, gb, None, None, gbias, None, None


# ----------------------------------------------------------------------------
# registration (only when the C core loaded: otherwise the ops do not exist)

def _register() -> None:
    torch.library.register_fake("fp8ops::cast")(_cast_fake)
    torch.library.register_autograd("fp8ops::cast", _cast_backward, setup_context=_cast_setup)
    torch.library.register_fake("fp8ops::amax")(_amax_fake)
    torch.library.register_fake("fp8ops::amax_update")(_amax_update_fake)
    torch.library.register_fake("fp8ops::gemm")(_gemm_fake)
    torch.library.register_autograd("fp8ops::gemm", _gemm_backward, setup_context=_gemm_setup)


if _loader.is_available():
    _register()
