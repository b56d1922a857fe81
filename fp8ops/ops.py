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
# checks shared by the fake kernels: the same rules and words as csrc/ops.c, so
# compiled / FakeTensor code fails where eager code fails

_DT_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2"}


def _dname(d: torch.dtype) -> str:
    return _DT_NAMES.get(d, str(d).replace("torch.", ""))


def _require():
    """A RuntimeError that says why, instead of torch.ops' AttributeError, when
    the extension did not load."""
    if not _loader.is_available():
        raise RuntimeError(f"fp8ops ops are unavailable: {_loader.why_unavailable()}")


def _chk(cond, msg):
    torch._check(cond, lambda: msg)


def _chk_contig(op, name, t):
    _chk(t.is_contiguous(), f"{op}: {name} must be contiguous (row-major), found a strided view; "
                            f"call .contiguous() on it first")


def _chk_device(op, name, t, ref_name, ref):
    _chk(t.device == ref.device, f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}; "
                                 f"expected all tensors on one device")


def _chk_scalar_f32(op, name, t, ref_name, ref):
    _chk(t.dtype == torch.float32, f"{op}: {name} must be float32, found {_dname(t.dtype)}")
    _chk(t.numel() == 1, f"{op}: {name} must hold exactly 1 element (a per-tensor fp32 scale), found {t.numel()}")
    _chk_device(op, name, t, ref_name, ref)


# ----------------------------------------------------------------------------
# cast

def cast(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn,
         transpose: bool = False):
    """fp8 = sat(round(x * scale)) in one pass; returns (out, out_t, amax(|x|)).
    out_t is the [cols, rows] transpose of the [rows, cols] view, or empty."""
    _require()
    return torch.ops.fp8ops.cast.default(x, scale, out_dtype, transpose)


def _cast_fake(x, scale, out_dtype, transpose):
    op = "fp8ops::cast"
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    _chk(out_dtype in FP8_DTYPES, f"{op}: out_dtype must be float8_e4m3fn or float8_e5m2, found {_dname(out_dtype)}")
    _chk_contig(op, "x", x)
    _chk_scalar_f32(op, "scale", scale, "x", x)
    _chk(x.dim() >= 1, f"{op}: x must have at least 1 dim, found a 0-dim tensor; use x.reshape(1)")
    cols = x.shape[-1]
    rows = 1
    for d in x.shape[:-1]:
        rows = rows * d
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
    _require()
    return torch.ops.fp8ops.amax.default(x)


def _amax_fake(x):
    op = "fp8ops::amax"
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    _chk_contig(op, "x", x)
    return x.new_empty((), dtype=torch.float32)


# ----------------------------------------------------------------------------
# amax_update

def amax_update(amax_history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                fp8_max: torch.Tensor, margin: float = 0.0, algo: str = "max") -> None:
    """Delayed scaling, in place, for every column of amax_history [H, n] (or
    [H]) in one launch: reduce |history| (max | most_recent), new scale =
    fp8_max / amax / 2**margin (a zero or non-finite amax, or a scale whose
    inverse would overflow, keeps the old scale), scale_inv = 1/scale, roll the
    history up by one and zero row 0."""
    if algo not in AMAX_ALGOS:
        raise ValueError(f"amax_update: algo must be one of {sorted(AMAX_ALGOS)}, found {algo!r}")
    _require()
    torch.ops.fp8ops.amax_update.default(amax_history, scale, scale_inv, fp8_max, float(margin), AMAX_ALGOS[algo])


def _amax_update_fake(amax_history, scale, scale_inv, fp8_max, margin, algo):
    op = "fp8ops::amax_update"
    h = amax_history
    for name, t in (("amax_history", h), ("scale", scale), ("scale_inv", scale_inv), ("fp8_max", fp8_max)):
        _chk(t.dtype == torch.float32, f"{op}: {name} must be float32, found {_dname(t.dtype)}")
    for name, t in (("amax_history", h), ("scale", scale), ("scale_inv", scale_inv), ("fp8_max", fp8_max)):
        _chk_contig(op, name, t)
    for name, t in (("scale", scale), ("scale_inv", scale_inv), ("fp8_max", fp8_max)):
        _chk_device(op, name, t, "amax_history", h)
    _chk(h.dim() in (1, 2), f"{op}: amax_history must be [H] (one tensor) or [H, n] (n tensors), found {h.dim()} dims")
    _chk(h.shape[0] >= 1, f"{op}: amax_history needs at least 1 row (history length), found 0")
    n = h.shape[1] if h.dim() == 2 else 1
    _chk(scale.numel() == n, f"{op}: scale must have {n} elements (one per amax_history column), found {scale.numel()}")
    _chk(scale_inv.numel() == n, f"{op}: scale_inv must have {n} elements, found {scale_inv.numel()}")
    _chk(fp8_max.numel() == n, f"{op}: fp8_max must have {n} elements, found {fp8_max.numel()}")
    _chk(algo in (0, 1), f"{op}: algo must be 0 (max) or 1 (most_recent), found {algo}")
    return None


# ----------------------------------------------------------------------------
# gemm

def gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
         use_fast_accum: bool = False) -> torch.Tensor:
    """out[M, N] = (a[M, K] @ b[N, K].T) * a_scale_inv * b_scale_inv (+ bias), fp32
    accumulation; a, b fp8 and K-major (the TN layout cuBLASLt FP8 needs)."""
    _require()
    if bias is None:
        bias = a.new_empty((0,), dtype=_bias_dtype(out_dtype))
    return torch.ops.fp8ops.gemm.default(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum)


def _gemm_fake(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum):
    op = "fp8ops::gemm"
    _chk(a.dtype in FP8_DTYPES, f"{op}: a must be float8_e4m3fn or float8_e5m2, found {_dname(a.dtype)}")
    _chk(b.dtype in FP8_DTYPES, f"{op}: b must be float8_e4m3fn or float8_e5m2, found {_dname(b.dtype)}")
    _chk(out_dtype in HP_DTYPES, f"{op}: out_dtype must be float32, bfloat16 or float16, found {_dname(out_dtype)}")
    _chk(not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2),
         f"{op}: a and b are both float8_e5m2; FP8 tensor cores need at least one float8_e4m3fn operand")
    _chk(a.dim() == 2, f"{op}: a must be 2-D [M, K], found {a.dim()} dims")
    _chk(b.dim() == 2, f"{op}: b must be 2-D [N, K], found {b.dim()} dims")
    _chk(a.shape[1] == b.shape[1], f"{op}: a {list(a.shape)} and b {list(b.shape)} must share the inner dim K "
                                   f"(a is [M, K], b is [N, K]: out = a @ b.T)")
    _chk_contig(op, "a", a)
    _chk_contig(op, "b", b)
    _chk_device(op, "b", b, "a", a)
    _chk_scalar_f32(op, "a_scale_inv", a_scale_inv, "a", a)
    _chk_scalar_f32(op, "b_scale_inv", b_scale_inv, "a", a)
    if bias.numel() > 0:
        N = b.shape[0]
        _chk(bias.dim() == 1 and bias.numel() == N,
             f"{op}: bias must be 1-D [N] = [{N}], found {bias.numel()} elements in {bias.dim()} dims")
        want = _bias_dtype(out_dtype)
        _chk(bias.dtype == want, f"{op}: bias must be {_dname(want)} for out_dtype {_dname(out_dtype)} "
                                 f"(cuBLASLt's FP8 bias rule), found {_dname(bias.dtype)}")
        _chk_contig(op, "bias", bias)
        _chk_device(op, "bias", bias, "a", a)
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
# internal fast path for Fp8Linear: the ops without the Python autograd layer
#
# Fp8Linear does its own autograd (an autograd.Function), so inside it the ops'
# registered autograd formulas are never needed; going through them still costs
# a Python round trip per call (~10 us each, about a dozen calls per layer and
# step), which is what made small layers CPU-bound. In eager mode these call
# the kernels directly below the autograd dispatch keys; under torch.compile
# they are the plain ops, which the compiler traces.

_below_autograd = torch._C._AutoDispatchBelowAutograd
_empty_bias: dict = {}


def _cast_raw(x, scale, out_dtype, transpose):
    if torch.compiler.is_compiling():
        return torch.ops.fp8ops.cast.default(x, scale, out_dtype, transpose)
    with _below_autograd():
        return torch.ops.fp8ops.cast.default(x, scale, out_dtype, transpose)


def _amax_raw(x):
    if torch.compiler.is_compiling():
        return torch.ops.fp8ops.amax.default(x)
    with _below_autograd():
        return torch.ops.fp8ops.amax.default(x)


def _gemm_raw(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum):
    if bias is None:
        if torch.compiler.is_compiling():
            bias = a.new_empty((0,), dtype=_bias_dtype(out_dtype))
        else:
            key = (a.device, out_dtype)
            bias = _empty_bias.get(key)
            if bias is None:
                bias = _empty_bias[key] = a.new_empty((0,), dtype=_bias_dtype(out_dtype))
    if torch.compiler.is_compiling():
        return torch.ops.fp8ops.gemm.default(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum)
    with _below_autograd():
        return torch.ops.fp8ops.gemm.default(a, b, a_scale_inv, b_scale_inv, bias, out_dtype, use_fast_accum)


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
