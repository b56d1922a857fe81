"""Python face of the fp8ops dispatcher ops: a typed wrapper per op, its fake
(meta) kernel for torch.compile / FakeTensor, and its autograd formula.

The ops themselves (schemas and CPU/CUDA kernels) are registered from C when
fp8ops._C is imported; see csrc/ops.c. The fake kernels' checks mirror the C
checks one for one, so compiled code fails the same way eager code does.
"""
from __future__ import annotations

import functools
import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _loader

HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
AMAX_ALGOS = {"max": 0, "most_recent": 1}


# torch.ops takes a ScalarType argument as a torch.dtype or as its int code (c10::ScalarType:
# the numbers the stable ABI's aoti_torch_dtype_* return). A dtype costs each call a failed
# __torch_function__ lookup, an AttributeError built and dropped (~0.6 us per argument on a
# 2-core host); an int costs nothing. Fp8Linear's calls pass codes (ST[dtype]), checked here
# once; should torch ever refuse them, ST maps each dtype to itself.
_ST_CODES = {torch.float16: 5, torch.float32: 6, torch.bfloat16: 15, torch.float8_e5m2: 23,
             torch.float8_e4m3fn: 24}


def _scalar_type_codes() -> dict:
    try:
        ok = all(torch.ops.aten.empty.memory_format([0], dtype=c).dtype == d for d, c in _ST_CODES.items())
    except (RuntimeError, TypeError):
        ok = False
    return dict(_ST_CODES) if ok else {d: d for d in _ST_CODES}


ST = _scalar_type_codes()
_DTYPE_OF_CODE = {c: d for d, c in _ST_CODES.items()}


def _as_dtype(d):
    """A fake kernel's ScalarType argument as a torch.dtype (traced code may pass ST's codes)."""
    return d if isinstance(d, torch.dtype) else _DTYPE_OF_CODE.get(d, d)


def _dtypes(op, **kw):
    """The wrappers' dtype arguments: torch.dtypes or ST's int codes. (torch.ops takes any int
    as a ScalarType code, and an op with Python kernels crashes the process on one it does
    not know.)"""
    for name, d in kw.items():
        if not (isinstance(d, torch.dtype) or (type(d) is int and d in _DTYPE_OF_CODE)):
            raise TypeError(f"{op}: {name} must be a torch.dtype (e.g. torch.float8_e4m3fn), found {d!r}")


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


def _raise_if_oom(e: RuntimeError) -> None:
    """A C op's failed allocation (csrc/ops.c raises RuntimeError through the shim, its message
    naming an fp8ops op and saying "out of memory") as torch.OutOfMemoryError, which training
    loops and batch-size finders catch; the caller re-raises anything else as it was."""
    msg = str(e)
    if not isinstance(e, torch.OutOfMemoryError) and "out of memory" in msg and "fp8ops" in msg:
        raise torch.OutOfMemoryError(msg) from e


def _oom_as_such(fn):
    """A public wrapper whose C op's failed allocation raises torch.OutOfMemoryError."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except RuntimeError as e:
            _raise_if_oom(e)
            raise
    return wrapper


def _written(*ts) -> None:
    """Bump autograd's version counter of the tensors a public op wrote in place (the C ops
    write through data pointers, which autograd does not see): a caller's graph that saved one
    of them for backward then raises instead of computing with the new value. Fp8Linear and
    the other internal callers take the unbumped calls (_amax_update, _cast_accumulate, the
    _raw ops): they check their own scaling state, which changes between micro-batches."""
    torch.autograd.graph.increment_version([t for t in ts if t is not None])


def _writable(op, **written) -> None:
    """Refuse, before the op runs, a tensor it would write in place that requires grad while
    grad mode is on (torch's in-place ops refuse a leaf that does; on a non-leaf the graph
    would not record the write, and its gradients would come out silently wrong): amax slots,
    histories and scales are state, not parameters."""
    if torch.is_grad_enabled():
        for name, t in written.items():
            if t is not None and t.requires_grad:  # (not torch._check: dynamo refuses its message's closure)
                raise RuntimeError(
                    f"fp8ops.{op}: {name} requires grad, but the op writes it in place, which autograd does "
                    f"not record; pass a tensor that does not require grad ({name}.detach(), or one made "
                    f"with requires_grad=False), or call the op under torch.no_grad()")


def _chk(cond, msg):
    torch._check(cond, lambda: msg)


def _chk_ndim(op, name, t):
    _chk(t.dim() <= 8, f"{op}: {name} has {t.dim()} dims; at most 8 are supported")


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


def _chk_gemm_dims(op, t, M, N, K):
    # the C kernels' CUDA-only rule (cuBLASLt FP8), so compiled code fails where eager does
    if t.device.type == "cuda":
        _chk(M % 16 == 0 and N % 16 == 0 and K % 16 == 0 and M > 0 and N > 0 and K > 0,
             f"{op}: FP8 GEMM on CUDA needs M, N and K to be positive multiples of 16 (got M={M}, N={N}, "
             f"K={K}); pad the tensors or exclude this layer via module_filter_fn")


def _chk_bias(op, bias, N, out_dtype, ref, ref_name):
    if bias.numel() == 0:
        return
    _chk(bias.dim() == 1 and bias.numel() == N,
         f"{op}: bias must be 1-D [N] = [{N}], found {bias.numel()} elements in {bias.dim()} dims")
    want = _bias_dtype(out_dtype)
    _chk(bias.dtype == want, f"{op}: bias must be {_dname(want)} for out_dtype {_dname(out_dtype)} "
                             f"(cuBLASLt's FP8 bias rule), found {_dname(bias.dtype)}")
    _chk_contig(op, "bias", bias)
    _chk_device(op, "bias", bias, ref_name, ref)


# ----------------------------------------------------------------------------
# cast

@_oom_as_such
def cast(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.float8_e4m3fn,
         transpose: bool = False):
    """fp8 = sat(round(x * scale)) in one pass; returns (out, out_t, amax(|x|)).
    out_t is the [cols, rows] transpose of the [rows, cols] view, or empty."""
    _require()
    _dtypes("cast", out_dtype=out_dtype)
    return torch.ops.fp8ops.cast.default(x, scale, out_dtype, transpose)


def _cast_fake(x, scale, out_dtype, transpose, op="fp8ops::cast"):
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    _chk(out_dtype in FP8_DTYPES, f"{op}: out_dtype must be float8_e4m3fn or float8_e5m2, found {_dname(out_dtype)}")
    _chk_ndim(op, "x", x)
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
    if ctx.needs_input_grad[1]:
        raise RuntimeError("fp8ops.cast: no gradient with respect to scale (the rounding gives none worth "
                           "using); pass scale.detach(), or learn a scale with an estimator of your own")
    g = torch.zeros(ctx.x_shape, dtype=torch.float32, device=scale.device)
    if g_out is not None:
        g = g + g_out.float()
    if ctx.transpose and g_out_t is not None:
        g = g + g_out_t.float().t().reshape(ctx.x_shape)
    return (g * scale.float().reshape(())).to(ctx.x_dtype), None, None, None


# ----------------------------------------------------------------------------
# amax

@_oom_as_such
def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim float32 tensor (NaN if any element is NaN, 0 if empty)."""
    _require()
    return torch.ops.fp8ops.amax.default(x)


def _amax_fake(x):
    op = "fp8ops::amax"
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    _chk_ndim(op, "x", x)
    _chk_contig(op, "x", x)
    return x.new_empty((), dtype=torch.float32)


# ----------------------------------------------------------------------------
# amax_update

@_oom_as_such
def amax_update(amax_history: torch.Tensor, scale: torch.Tensor, scale_inv: torch.Tensor,
                fp8_max: torch.Tensor, margin: float = 0.0, algo: str = "max",
                overflow_count: torch.Tensor | None = None) -> None:
    """Delayed scaling, in place, for every column of amax_history [H, n] (or
    [H]) in one launch: reduce |history| (max | most_recent), new scale =
    fp8_max / amax / 2**margin (a zero or non-finite amax, or a scale whose
    inverse would overflow, keeps the old scale), scale_inv = 1/scale, roll the
    history up by one and zero row 0. overflow_count: optional [n] int64
    counters, +1 for each column whose row 0 (this step's amax) is NaN/inf."""
    _writable("amax_update", amax_history=amax_history, scale=scale, scale_inv=scale_inv,
              overflow_count=overflow_count)
    _amax_update(amax_history, scale, scale_inv, fp8_max, margin, algo, overflow_count)
    _written(amax_history, scale, scale_inv, overflow_count)


def _amax_update(amax_history, scale, scale_inv, fp8_max, margin=0.0, algo="max", overflow_count=None) -> None:
    """amax_update without the version counters' bump (_written): fp8ops' own updates."""
    if algo not in AMAX_ALGOS:
        raise ValueError(f"amax_update: algo must be one of {sorted(AMAX_ALGOS)}, found {algo!r}")
    _require()
    if overflow_count is None:
        overflow_count = _no_counts(amax_history)
    torch.ops.fp8ops.amax_update.default(amax_history, scale, scale_inv, fp8_max, float(margin), AMAX_ALGOS[algo],
                                         overflow_count)


def _no_counts(like: torch.Tensor) -> torch.Tensor:
    # amax_update's "no overflow counters" argument (schemas avoid T?)
    return torch.empty(0, dtype=torch.int64, device=like.device)


def _amax_update_fake(amax_history, scale, scale_inv, fp8_max, margin, algo, overflow_count):
    op = "fp8ops::amax_update"
    h = amax_history
    for name, t in (("amax_history", h), ("scale", scale), ("scale_inv", scale_inv), ("fp8_max", fp8_max)):
        _chk(t.dtype == torch.float32, f"{op}: {name} must be float32, found {_dname(t.dtype)}")
    for name, t in (("amax_history", h), ("scale", scale)):
        _chk_contig(op, name, t)
    _chk(scale_inv.is_contiguous() or (scale_inv.dim() == 1 and scale_inv.stride(0) >= 1),
         f"{op}: scale_inv must be contiguous or a 1-D view with a positive stride, found a strided "
         f"{scale_inv.dim()}-D view; call .contiguous() on it first")
    _chk_contig(op, "fp8_max", fp8_max)
    for name, t in (("scale", scale), ("scale_inv", scale_inv), ("fp8_max", fp8_max)):
        _chk_device(op, name, t, "amax_history", h)
    _chk(h.dim() in (1, 2), f"{op}: amax_history must be [H] (one tensor) or [H, n] (n tensors), found {h.dim()} dims")
    _chk(h.shape[0] >= 1, f"{op}: amax_history needs at least 1 row (history length), found 0")
    n = h.shape[1] if h.dim() == 2 else 1
    _chk(scale.numel() == n, f"{op}: scale must have {n} elements (one per amax_history column), found {scale.numel()}")
    _chk(scale_inv.numel() == n, f"{op}: scale_inv must have {n} elements, found {scale_inv.numel()}")
    _chk(fp8_max.numel() == n, f"{op}: fp8_max must have {n} elements, found {fp8_max.numel()}")
    _chk(algo in (0, 1), f"{op}: algo must be 0 (max) or 1 (most_recent), found {algo}")
    _chk(-64 < margin < 64, f"{op}: margin must be a number in (-64, 64), found {margin}")
    o = overflow_count
    if o.numel() > 0:
        _chk(o.dtype == torch.int64, f"{op}: overflow_count must be int64, found {_dname(o.dtype)}")
        _chk_contig(op, "overflow_count", o)
        _chk_device(op, "overflow_count", o, "amax_history", h)
        _chk(o.numel() == n, f"{op}: overflow_count must have {n} elements (one per amax_history column) or none, "
                             f"found {o.numel()}")
    return None


# ----------------------------------------------------------------------------
# gemm

@_oom_as_such
def gemm(a: torch.Tensor, b: torch.Tensor, a_scale_inv: torch.Tensor, b_scale_inv: torch.Tensor,
         bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
         use_fast_accum: bool = False) -> torch.Tensor:
    """out[M, N] = (a[M, K] @ b[N, K].T) * a_scale_inv * b_scale_inv (+ bias), fp32
    accumulation; a, b fp8 and K-major (the TN layout cuBLASLt FP8 needs)."""
    _require()
    _dtypes("gemm", out_dtype=out_dtype)
    if bias is None:
        bias = a.new_empty((0,), dtype=_bias_dtype(_as_dtype(out_dtype)))
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
    _chk_bias(op, bias, b.shape[0], out_dtype, a, "a")
    _chk_gemm_dims(op, a, a.shape[0], b.shape[0], a.shape[1])
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
    gsa = gsb = None
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        # the scales multiply the product: d/d(sa) = sum(g * a @ b.T) * sb, and the other way round
        gp = (g.float() * (a.float() @ b.float().t())).sum()
        gsa = (gp * sb.float()).reshape(sa.shape) if ctx.needs_input_grad[2] else None
        gsb = (gp * sa.float()).reshape(sb.shape) if ctx.needs_input_grad[3] else None
    gbias = g.float().sum(0).to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[4] else None
    return ga, gb, gsa, gsb, gbias, None, None


# ----------------------------------------------------------------------------
# Fp8Linear's fused calls: one dispatcher call per forward (the weight's cast
# included, once per optimizer step), one per backward (the host's per-op cost
# is what bounds small layers). cast_accumulate is the cast alone.
# No autograd formulas: Fp8Linear's autograd.Function calls them.

@_oom_as_such
def cast_accumulate(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                    out_dtype: torch.dtype = torch.float8_e4m3fn, transpose: bool = False):
    """cast() that folds max |x| into the 1-element fp32 `amax` in place
    (amax = max(amax, max |x|), NaN wins) instead of returning it; e.g. amax is
    row 0 of an amax history, collecting a step's maximum. Returns (out, out_t)."""
    _writable("cast_accumulate", amax=amax)
    out = _cast_accumulate(x, scale, amax, out_dtype, transpose)
    _written(amax)
    return out


def _cast_accumulate(x, scale, amax, out_dtype=torch.float8_e4m3fn, transpose=False):
    """cast_accumulate without the version counter's bump (_written): fp8ops' own casts."""
    _require()
    _dtypes("cast_accumulate", out_dtype=out_dtype)
    return torch.ops.fp8ops.cast_accumulate.default(x, scale, amax, out_dtype, transpose)


def _cast_accumulate_fake(x, scale, amax, out_dtype, transpose):
    op = "fp8ops::cast_accumulate"
    out, out_t, _ = _cast_fake(x, scale, out_dtype, transpose, op)
    _chk_scalar_f32(op, "amax", amax, "x", x)
    return out, out_t


@_oom_as_such
def linear_fwd(x, w, x_scale, x_amax, x_scale_inv, w_scale_inv, bias=None,
               x_fp8_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, use_fast_accum=False,
               save_xt=True, w_scale=None, w_amax=None, w_fp8_dtype=torch.float8_e4m3fn, save_wt=False,
               gelu_input=False, swiglu_input=False):
    """Fp8Linear's forward: x8 = cast(x * x_scale) (x's amax folded into
    x_amax), y = (x8 @ w8.T) * x_scale_inv * w_scale_inv + bias. x [M, K] hp.
    w [N, K] is FP8 (used as is) or high precision: then w8 = cast(w * w_scale)
    in the same call (its amax folded into w_amax). gelu_input: x is a GELU's
    input h and the layer computes linear(gelu_tanh(h)); the cast reads h and
    casts its GELU (rounded to x's dtype), whose amax and x8t come back.
    swiglu_input: x is [M, 2K], a SwiGLU's input (gate | up), and the layer
    computes linear(silu(gate) * up) (as swiglu(x) computes it). Returns
    (y [M, N], x8t [K, M] if save_xt, w8 [N, K] and w8t [K, N] if save_wt when
    w was cast here); what was not made comes back empty."""
    _require()
    _dtypes("linear_fwd", x_fp8_dtype=x_fp8_dtype, w_fp8_dtype=w_fp8_dtype, out_dtype=out_dtype)
    bias, w_scale, w_amax = _fwd_defaults("linear_fwd", x, w, bias, out_dtype, w_scale, w_amax, w_scale_inv)
    _writable("linear_fwd", x_amax=x_amax, w_amax=w_amax if w.dtype in HP_DTYPES else None)
    out = torch.ops.fp8ops.linear_fwd.default(x, w, x_scale, x_amax, x_scale_inv, w_scale, w_amax, w_scale_inv,
                                              bias, x_fp8_dtype, w_fp8_dtype, out_dtype, use_fast_accum, save_xt,
                                              save_wt, gelu_input, swiglu_input)
    _written(x_amax, w_amax if w.dtype in HP_DTYPES else None)
    return out


def _fwd_defaults(op, x, w, bias, out_dtype, w_scale, w_amax, w_scale_inv):
    """The forward ops' optional arguments as the ops take them: (bias, w_scale, w_amax)."""
    if bias is None:
        bias = x.new_empty((0,), dtype=_bias_dtype(_as_dtype(out_dtype)))
    if w_scale is None:
        if w.dtype in HP_DTYPES:
            raise ValueError(f"{op}: w is in high precision and is cast here, so w_scale (the scale "
                             "to cast it with) is required; pass w_scale=..., or an FP8 w")
        w_scale = w_scale_inv  # unused for an FP8 w (and checked nowhere for a bad dtype)
    if w_amax is None:
        w_amax = x.new_zeros((1,), dtype=torch.float32)
    return bias, w_scale, w_amax


def _linear_fwd_fake(x, w, x_scale, x_amax, x_scale_inv, w_scale, w_amax, w_scale_inv, bias, x_fp8_dtype,
                     w_fp8_dtype, out_dtype, use_fast_accum, save_xt, save_wt, gelu_input=False,
                     swiglu_input=False, op="fp8ops::linear_fwd"):
    x_fp8_dtype, w_fp8_dtype, out_dtype = _as_dtype(x_fp8_dtype), _as_dtype(w_fp8_dtype), _as_dtype(out_dtype)
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    cast_w = w.dtype not in FP8_DTYPES
    if cast_w:
        _chk(w.dtype in HP_DTYPES, f"{op}: w must be float8_e4m3fn or float8_e5m2 (already cast), or float32, "
                                   f"bfloat16 or float16 (cast here), found {_dname(w.dtype)}")
        _chk(w_fp8_dtype in FP8_DTYPES,
             f"{op}: w_fp8_dtype must be float8_e4m3fn or float8_e5m2, found {_dname(w_fp8_dtype)}")
    w8_dtype = w_fp8_dtype if cast_w else w.dtype
    _chk(x_fp8_dtype in FP8_DTYPES,
         f"{op}: x_fp8_dtype must be float8_e4m3fn or float8_e5m2, found {_dname(x_fp8_dtype)}")
    _chk(out_dtype in HP_DTYPES, f"{op}: out_dtype must be float32, bfloat16 or float16, found {_dname(out_dtype)}")
    _chk(not (x_fp8_dtype == torch.float8_e5m2 and w8_dtype == torch.float8_e5m2),
         f"{op}: x and w would both be float8_e5m2; FP8 tensor cores need at least one float8_e4m3fn operand")
    _chk(x.dim() == 2, f"{op}: x must be 2-D [M, K], found {x.dim()} dims; reshape it to (-1, in_features)")
    _chk(w.dim() == 2, f"{op}: w must be 2-D [N, K], found {w.dim()} dims")
    _chk(not (gelu_input and swiglu_input), f"{op}: gelu_input and swiglu_input are exclusive")
    if swiglu_input:
        _chk(x.shape[1] == 2 * w.shape[1], f"{op}: with swiglu_input, x {list(x.shape)} must be [M, 2K] (the "
                                           f"SwiGLU's gate and up halves) for w [N, K] = {list(w.shape)}")
    else:
        _chk(x.shape[1] == w.shape[1], f"{op}: x {list(x.shape)} and w {list(w.shape)} must share the inner "
                                       f"dim K (x is [M, K], w is [N, K]: y = x @ w.T)")
    _chk_contig(op, "x", x)
    _chk_contig(op, "w", w)
    _chk_device(op, "w", w, "x", x)
    scalars = [("x_scale", x_scale), ("x_amax", x_amax), ("x_scale_inv", x_scale_inv)]
    if cast_w:
        scalars += [("w_scale", w_scale), ("w_amax", w_amax)]
    for name, t in scalars + [("w_scale_inv", w_scale_inv)]:
        _chk_scalar_f32(op, name, t, "x", x)
    M, K, N = x.shape[0], w.shape[1], w.shape[0]
    _chk_bias(op, bias, N, out_dtype, x, "x")
    _chk_gemm_dims(op, x, M, N, K)
    x8t = x.new_empty((K, M) if save_xt else (0,), dtype=x_fp8_dtype)
    w8 = x.new_empty((N, K) if cast_w else (0,), dtype=w8_dtype)
    w8t = x.new_empty((K, N) if cast_w and save_wt else (0,), dtype=w8_dtype)
    return x.new_empty((M, N), dtype=out_dtype), x8t, w8, w8t


@_oom_as_such
def ln_linear_fwd(x, ln_weight, ln_bias, eps, w, x_scale, x_amax, x_scale_inv, w_scale_inv, bias=None,
                  x_fp8_dtype=torch.float8_e4m3fn, out_dtype=torch.bfloat16, use_fast_accum=False, w_scale=None,
                  w_amax=None, w_fp8_dtype=torch.float8_e4m3fn, save_wt=False, rms=False, res=None):
    """linear_fwd of LayerNorm(x) (normalized over x's last dim, ln_weight and
    ln_bias float32 [K], or None for none) without writing the LayerNorm's
    output: the cast normalizes x as it loads it. rms: RMSNorm(x) instead
    (ln_bias must then be None). Returns (y, x8t, w8, w8t, mean [M], rstd [M]);
    mean (zeros for an RMSNorm) and rstd are what layernorm_bwd takes. res (x's
    shape; x's dtype, or bfloat16 or float16 for float32 x): the norm's input is
    x + res instead, what torch's add writes, returned as a seventh result
    (ln_linear_fwd_res: a residual stream's add fused into the norm's pass)."""
    _require()
    op = "ln_linear_fwd" if res is None else "ln_linear_fwd_res"
    _chk(not (rms and ln_bias is not None), f"{op}: an RMSNorm has no bias; pass ln_bias=None with rms=True")
    _dtypes(op, x_fp8_dtype=x_fp8_dtype, w_fp8_dtype=w_fp8_dtype, out_dtype=out_dtype)
    bias, w_scale, w_amax = _fwd_defaults(op, x, w, bias, out_dtype, w_scale, w_amax, w_scale_inv)
    _writable(op, x_amax=x_amax, w_amax=w_amax if w.dtype in HP_DTYPES else None)
    none = _empty_for(x, torch.float32)
    args = (none if ln_weight is None else ln_weight, none if ln_bias is None else ln_bias, float(eps), w, x_scale,
            x_amax, x_scale_inv, w_scale, w_amax, w_scale_inv, bias, x_fp8_dtype, w_fp8_dtype, out_dtype,
            use_fast_accum, save_wt, rms)
    if res is None:
        out = torch.ops.fp8ops.ln_linear_fwd.default(x, *args)
    else:
        out = torch.ops.fp8ops.ln_linear_fwd_res.default(x, res, *args)
    _written(x_amax, w_amax if w.dtype in HP_DTYPES else None)
    return out


def _ln_linear_fwd_res_fake(x, res, *args):
    op = "fp8ops::ln_linear_fwd_res"
    _chk(res.shape == x.shape, f"{op}: res {list(res.shape)} must have x's shape {list(x.shape)}")
    _chk(res.dtype == x.dtype or (x.dtype == torch.float32 and res.dtype in (torch.bfloat16, torch.float16)),
         f"{op}: res must have x's dtype {_dname(x.dtype)} (or, with x float32, be bfloat16 or float16), found "
         f"{_dname(res.dtype)}; convert it with .to(x.dtype)")
    _chk_contig(op, "res", res)
    _chk_device(op, "res", res, "x", x)
    return *_ln_linear_fwd_fake(x, *args, op=op), torch.empty_like(x)


def _ln_linear_fwd_fake(x, ln_weight, ln_bias, eps, w, x_scale, x_amax, x_scale_inv, w_scale, w_amax, w_scale_inv,
                        bias, x_fp8_dtype, w_fp8_dtype, out_dtype, use_fast_accum, save_wt, rms=False,
                        op="fp8ops::ln_linear_fwd"):
    y, x8t, w8, w8t = _linear_fwd_fake(x, w, x_scale, x_amax, x_scale_inv, w_scale, w_amax, w_scale_inv, bias,
                                       x_fp8_dtype, w_fp8_dtype, out_dtype, use_fast_accum, True, save_wt, op=op)
    K = x.shape[1]
    for name, t in (("ln_weight", ln_weight), ("ln_bias", ln_bias)):
        if t.numel() == 0 and K > 0:
            continue  # none: ones / zeros
        _chk(t.dim() == 1 and t.shape[0] == K and t.dtype == torch.float32,
             f"{op}: {name} must be float32 [K] = [{K}] (the LayerNorm's, as float32) or empty (none), found "
             f"{_dname(t.dtype)} with {t.numel()} elements")
        _chk_contig(op, name, t)
        _chk_device(op, name, t, "x", x)
    # (eps as the kernels take it, a float32: 1e300 is inf there)
    _chk(eps >= 0 and math.isfinite(float(torch.tensor(eps, dtype=torch.float32))),
         f"{op}: eps must be a finite float >= 0, found {eps}")
    _chk(not rms or ln_bias.numel() == 0, f"{op}: an RMSNorm has no bias (rms=True), found ln_bias with "
                                          f"{ln_bias.numel()} elements; pass an empty ln_bias with rms=True")
    _chk(K > 0, f"{op}: x {list(x.shape)} has no features to normalize (K = 0); a LayerNorm needs K > 0")
    M = x.shape[0]
    return y, x8t, w8, w8t, x.new_empty((M,), dtype=torch.float32), x.new_empty((M,), dtype=torch.float32)


# the CUDA layernorm_bwd's limits (csrc/fp8ops.h): at most this many columns, in slices of whole
# 16-byte vectors, one slice per warp: one up to 1024 columns, two up to 2048, four above
LN_BWD_MAX_COLS = 4096


def layernorm_bwd_cols_ok(K: int, dtype: torch.dtype) -> bool:
    """Whether the CUDA layernorm_bwd takes rows of K elements of this dtype."""
    slices = 4 if K > 2048 else 2 if K > 1024 else 1
    return 0 < K <= LN_BWD_MAX_COLS and (K * dtype.itemsize) % (16 * slices) == 0


def layernorm_bwd_fusable(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether layernorm_bwd takes these tensors: one dtype, 2-D, contiguous;
    on CUDA also rows of at most LN_BWD_MAX_COLS columns whose slices (one,
    two above 1024 columns, four above 2048) are whole 16-byte vectors
    (layernorm_bwd_cols_ok; the CPU kernel takes any row). Shapes, dtypes and
    strides only, so torch.compile can decide it while tracing: a view at a
    misaligned offset is copied by the op itself."""
    if (dy.dtype != x.dtype or x.dtype not in HP_DTYPES or x.dim() != 2 or dy.shape != x.shape
            or not x.is_contiguous() or not dy.is_contiguous() or x.shape[1] == 0):
        return False
    if not x.is_cuda:
        return True
    return layernorm_bwd_cols_ok(x.shape[1], x.dtype)


@_oom_as_such
def layernorm_bwd(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                  weight: torch.Tensor | None, rms: bool = False, dres: torch.Tensor | None = None,
                  copy_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """The backward of LayerNorm over x's last dim from ln_linear_fwd's mean and
    rstd ([M] fp32), weight the LayerNorm's gamma as float32 [K] (None: ones).
    Returns (dx in x's dtype, dweight_bias fp32 [2, K] = (dgamma, dbeta)):
    torch's native_layer_norm_backward with one read of x and dy instead of
    two. rms: an RMSNorm's backward, from ln_linear_fwd(rms=True)'s statistics
    (dweight_bias[1] is then of no use). dres (x's shape and dtype, contiguous):
    returned dx is dx + dres, what a separate add gives, bit for bit
    (layernorm_bwd_acc: the gradient reaching x from a residual stream); with
    copy_dtype too (torch.bfloat16 or torch.float16, x float32) a third result,
    that sum converted to copy_dtype, bit for bit .to(copy_dtype) of it. On CUDA
    the shapes must pass layernorm_bwd_fusable."""
    _require()
    if copy_dtype is not None:
        _dtypes("fp8ops.layernorm_bwd", copy_dtype=copy_dtype)
        copy_dtype = _as_dtype(copy_dtype)  # (an ST code: the same as its dtype below)
    w = _empty_for(x, torch.float32) if weight is None else weight
    if copy_dtype == x.dtype:
        copy_dtype = None  # (a copy in x's own dtype would be dx itself: none, as the op reads it)
    if dres is not None:
        dx, dgb, dx_copy = torch.ops.fp8ops.layernorm_bwd_acc.default(dy, x, mean, rstd, w, rms, dres,
                                                                      copy_dtype or x.dtype)
        return (dx, dgb) if copy_dtype is None else (dx, dgb, dx_copy)
    _chk(copy_dtype is None, "fp8ops::layernorm_bwd: copy_dtype is a copy of dx + dres; pass dres too")
    return torch.ops.fp8ops.layernorm_bwd.default(dy, x, mean, rstd, w, rms)


def _layernorm_bwd_acc_fake(dy, x, mean, rstd, weight, rms, dres, copy_dtype):
    op = "fp8ops::layernorm_bwd_acc"
    _chk(dres.shape == x.shape, f"{op}: dres {list(dres.shape)} must have x's shape {list(x.shape)}")
    _chk(dres.dtype == x.dtype, f"{op}: dres must have x's dtype {_dname(x.dtype)}, found {_dname(dres.dtype)}; "
                                f"convert it with .to(x.dtype)")
    _chk_contig(op, "dres", dres)
    _chk_device(op, "dres", dres, "x", x)
    copy = copy_dtype != x.dtype
    _chk(not copy or (x.dtype == torch.float32 and copy_dtype in (torch.bfloat16, torch.float16)),
         f"{op}: copy_dtype must be x's dtype {_dname(x.dtype)} (no copy), or bfloat16 or float16 with x "
         f"float32; found {_dname(copy_dtype)}")
    dx, dgb = _layernorm_bwd_fake(dy, x, mean, rstd, weight, rms, op=op)
    return dx, dgb, torch.empty_like(x, dtype=copy_dtype) if copy else x.new_empty((0,))


def _layernorm_bwd_fake(dy, x, mean, rstd, weight, rms=False, op="fp8ops::layernorm_bwd"):
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    _chk(x.dim() == 2, f"{op}: x must be 2-D [M, K], found {x.dim()} dims; reshape it to (-1, normalized_shape)")
    _chk(dy.shape == x.shape, f"{op}: dy {list(dy.shape)} must have x's shape {list(x.shape)}")
    _chk(dy.dtype == x.dtype, f"{op}: dy must have x's dtype {_dname(x.dtype)}, found {_dname(dy.dtype)}; "
                              f"convert it with .to(x.dtype)")
    _chk_contig(op, "dy", dy)
    _chk_contig(op, "x", x)
    _chk_device(op, "dy", dy, "x", x)
    M, K = x.shape
    _chk(K > 0, f"{op}: x has no columns")
    _chk(layernorm_bwd_fusable(dy, x),
         f"{op}: on CUDA, K must be a multiple of {4 if x.dtype == torch.float32 else 8} (of twice that above "
         f"1024, four times that above 2048) and at most {LN_BWD_MAX_COLS}; found K = {K}. Use "
         f"torch.ops.aten.native_layer_norm_backward for this shape")
    for name, t, n in (("mean", mean, M), ("rstd", rstd, M), ("weight", weight, K)):
        if name == "weight" and t.numel() == 0:
            continue  # none: ones
        _chk(t.dim() == 1 and t.numel() == n and t.dtype == torch.float32,
             f"{op}: {name} must be float32 [{n}]{' or empty (none)' if name == 'weight' else ''}, found "
             f"{_dname(t.dtype)} with {t.numel()} elements")
        _chk_contig(op, name, t)
        _chk_device(op, name, t, "x", x)
    return torch.empty_like(x), x.new_empty((2, K), dtype=torch.float32)


@_oom_as_such
def linear_bwd(gy, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv, x_scale_inv,
               g_fp8_dtype=torch.float8_e5m2, dx_dtype=torch.bfloat16, dw_dtype=torch.float32,
               need_dx=True, need_dw=True, need_db=False, gelu_input=None):
    """Fp8Linear's backward: g8, g8t = cast(gy * g_scale) (gy's amax folded
    into g_amax); dx = (g8 @ w8t.T) * g_scale_inv * w_scale_inv [M, K],
    dw = (g8t @ x8t.T) * g_scale_inv * x_scale_inv [N, K], db = gy.sum(0) in
    fp32 [N] (the bias gradient, summed in one fixed order on CPU and CUDA; on
    CUDA in the same pass over gy as the cast). gy [M, N], w8t [K, N], x8t
    [K, M]. gelu_input: the layer's output h [M, N] (gy's dtype) when its GELU
    was fused into the next layer (gy is then the gradient of gelu_tanh(h)):
    all of the above use dy = gy * gelu_tanh'(h), formed in the cast's pass.
    Returns (dx, dw, db); an output not asked for comes back empty."""
    _require()
    _dtypes("linear_bwd", g_fp8_dtype=g_fp8_dtype, dx_dtype=dx_dtype, dw_dtype=dw_dtype)
    _writable("linear_bwd", g_amax=g_amax)
    if gelu_input is None:
        gelu_input = gy.new_empty((0,))
    out = torch.ops.fp8ops.linear_bwd.default(gy, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv,
                                              x_scale_inv, gelu_input, g_fp8_dtype, dx_dtype, dw_dtype, need_dx,
                                              need_dw, need_db)
    _written(g_amax)
    return out


def _chk_bwd_operand(op, name, t, g_fp8_dtype):
    e5 = torch.float8_e5m2
    _chk(t.dtype in FP8_DTYPES, f"{op}: {name} must be float8_e4m3fn or float8_e5m2, found {_dname(t.dtype)}")
    _chk(not (g_fp8_dtype == e5 and t.dtype == e5),
         f"{op}: g_fp8_dtype and {name} are both float8_e5m2; FP8 tensor cores need at least one "
         f"float8_e4m3fn operand")


def _linear_bwd_fake(gy, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv, x_scale_inv, gelu_input,
                     g_fp8_dtype, dx_dtype, dw_dtype, need_dx, need_dw, need_db=False, op="fp8ops::linear_bwd"):
    g_fp8_dtype, dx_dtype, dw_dtype = _as_dtype(g_fp8_dtype), _as_dtype(dx_dtype), _as_dtype(dw_dtype)
    _chk(gy.dtype in HP_DTYPES, f"{op}: gy must be float32, bfloat16 or float16, found {_dname(gy.dtype)}")
    _chk(g_fp8_dtype in FP8_DTYPES,
         f"{op}: g_fp8_dtype must be float8_e4m3fn or float8_e5m2, found {_dname(g_fp8_dtype)}")
    _chk(gy.dim() == 2, f"{op}: gy must be 2-D [M, N], found {gy.dim()} dims; reshape it to (-1, out_features)")
    _chk_contig(op, "gy", gy)
    for name, t in (("g_scale", g_scale), ("g_amax", g_amax), ("g_scale_inv", g_scale_inv)):
        _chk_scalar_f32(op, name, t, "gy", gy)
    for name, d in (("dx_dtype", dx_dtype), ("dw_dtype", dw_dtype)):  # needed or not, as the C op checks
        _chk(d in HP_DTYPES, f"{op}: {name} must be float32, bfloat16 or float16, found {_dname(d)}")
    M, N = gy.shape
    if gelu_input.numel() > 0:
        _chk(tuple(gelu_input.shape) == (M, N), f"{op}: gelu_input must be [M, N] = {list(gy.shape)} like gy (the "
                                                f"layer's output, the fused GELU's input), found {list(gelu_input.shape)}")
        _chk(gelu_input.dtype == gy.dtype,
             f"{op}: gelu_input must have gy's dtype {_dname(gy.dtype)}, found {_dname(gelu_input.dtype)}")
        _chk_contig(op, "gelu_input", gelu_input)
        _chk_device(op, "gelu_input", gelu_input, "gy", gy)
    K = 0
    if need_dx:
        _chk_bwd_operand(op, "w8t", w8t, g_fp8_dtype)
        _chk(w8t.dim() == 2 and w8t.shape[1] == N,
             f"{op}: w8t must be [K, N] for gy {list(gy.shape)} (the transposed FP8 weight), found {list(w8t.shape)}")
        _chk_contig(op, "w8t", w8t)
        _chk_device(op, "w8t", w8t, "gy", gy)
        _chk_scalar_f32(op, "w_scale_inv", w_scale_inv, "gy", gy)
        K = w8t.shape[0]
    if need_dw:
        _chk_bwd_operand(op, "x8t", x8t, g_fp8_dtype)
        with_k = " with K = w8t.shape[0]" if need_dx else ""
        _chk(x8t.dim() == 2 and x8t.shape[1] == M and (not need_dx or x8t.shape[0] == K),
             f"{op}: x8t must be [K, M]{with_k} for gy {list(gy.shape)} (the transposed FP8 input), "
             f"found {list(x8t.shape)}")
        _chk_contig(op, "x8t", x8t)
        _chk_device(op, "x8t", x8t, "gy", gy)
        _chk_scalar_f32(op, "x_scale_inv", x_scale_inv, "gy", gy)
        K = x8t.shape[0]
    if need_dx or need_dw:
        _chk_gemm_dims(op, gy, M, N, K)
    dx = gy.new_empty((M, K) if need_dx else (0,), dtype=dx_dtype)
    dw = gy.new_empty((N, K) if need_dw else (0,), dtype=dw_dtype)
    db = gy.new_empty((N,) if need_db else (0,), dtype=torch.float32)
    return dx, dw, db


def _linear_bwd_sink_fake(gy, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv, x_scale_inv, gelu_input,
                          g_fp8_dtype, dx_dtype, dw_dtype, need_dx, need_dw, need_db=False):
    # linear_bwd for compiled code, whose write to g_amax is not declared (csrc/ops.c; linear.py)
    return _linear_bwd_fake(gy, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv, x_scale_inv, gelu_input,
                            g_fp8_dtype, dx_dtype, dw_dtype, need_dx, need_dw, need_db, op="fp8ops::linear_bwd_sink")


def _linear_bwd_cat_fake(gy_a, gy_b, gy_c, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv, x_scale_inv,
                         g_fp8_dtype, dx_dtype, dw_dtype, need_dx, need_dw, need_db=False):
    # linear_bwd_sink of gy = cat([gy_a, gy_b, gy_c], 1), never written (csrc/ops.c; cat_grad_pass.py)
    op = "fp8ops::linear_bwd_cat"
    for name, t in (("gy_a", gy_a), ("gy_b", gy_b), ("gy_c", gy_c)):
        _chk(t.dtype in HP_DTYPES, f"{op}: {name} must be float32, bfloat16 or float16, found {_dname(t.dtype)}")
        _chk(t.dim() == 2, f"{op}: {name} must be 2-D [M, n], found {t.dim()} dims; reshape it to (-1, n)")
        _chk(t.shape[0] == gy_a.shape[0], f"{op}: {name} must have gy_a's {gy_a.shape[0]} rows, found {list(t.shape)}")
        _chk(t.dtype == gy_a.dtype, f"{op}: {name} must have gy_a's dtype {_dname(gy_a.dtype)}, found {_dname(t.dtype)}")
        _chk(t.shape[1] <= 1 or t.stride(1) == 1,
             f"{op}: {name}'s columns must be adjacent (stride 1), found stride {t.stride(1)}; call .contiguous() on "
             f"it first")
        _chk(t.shape[0] <= 1 or t.shape[1] == 0 or t.stride(0) >= t.shape[1],
             f"{op}: {name}'s rows must not overlap (row stride {t.stride(0)} < {t.shape[1]} columns); call "
             f".contiguous() on it first")
        _chk_device(op, name, t, "gy_a", gy_a)
    gy = gy_a.new_empty((gy_a.shape[0], gy_a.shape[1] + gy_b.shape[1] + gy_c.shape[1]))
    return _linear_bwd_fake(gy, w8t, x8t, g_scale, g_amax, g_scale_inv, w_scale_inv, x_scale_inv,
                            gy.new_empty((0,)), g_fp8_dtype, dx_dtype, dw_dtype, need_dx, need_dw, need_db, op=op)


# ----------------------------------------------------------------------------
# swiglu, swiglu_backward

@_oom_as_such
def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate | up] (the last dim's two halves), rounded to
    x's dtype after the SiLU and after the product as torch's ops round, in one
    pass; differentiable (its backward is one pass too: swiglu_backward)."""
    _require()
    return torch.ops.fp8ops.swiglu.default(x)


@_oom_as_such
def swiglu_backward(dh: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The gradient of x [..., 2H] from the gradient dh [..., H] of swiglu(x)."""
    _require()
    return torch.ops.fp8ops.swiglu_backward.default(dh, x)


def _swiglu_chk(op, x):
    _chk(x.dtype in HP_DTYPES, f"{op}: x must be float32, bfloat16 or float16, found {_dname(x.dtype)}")
    _chk_ndim(op, "x", x)
    _chk_contig(op, "x", x)
    _chk(x.dim() >= 1 and x.shape[-1] % 2 == 0, f"{op}: x {list(x.shape)} must have an even last dim (the gate "
                                                "and up halves of one projection's output)")


def _swiglu_fake(x):
    _swiglu_chk("fp8ops::swiglu", x)
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _swiglu_backward_fake(dh, x):
    op = "fp8ops::swiglu_backward"
    _swiglu_chk(op, x)
    _chk(tuple(dh.shape) == (*x.shape[:-1], x.shape[-1] // 2),
         f"{op}: dh {list(dh.shape)} must have x's shape {list(x.shape)} with the last dim halved")
    _chk(dh.dtype == x.dtype, f"{op}: dh must have x's dtype {_dname(x.dtype)}, found {_dname(dh.dtype)}; "
                              "convert it with .to(x.dtype)")
    _chk_contig(op, "dh", dh)
    _chk_device(op, "dh", dh, "x", x)
    return x.new_empty(x.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, g):
    (x,) = ctx.saved_tensors
    if torch.is_grad_enabled() and (x.requires_grad or g.requires_grad):
        # backward(create_graph=True), a gradient penalty: the op's backward has no derivative of
        # its own (it read as 0); torch's formula, differentiable, gives the second one
        gate, up = x.chunk(2, dim=-1)
        (dx,) = torch.autograd.grad(torch.nn.functional.silu(gate) * up, x, g.to(x.dtype), create_graph=True)
        return dx
    return torch.ops.fp8ops.swiglu_backward.default(g.contiguous().to(x.dtype), x)


# ----------------------------------------------------------------------------
# internal fast path for Fp8Linear: the ops without the Python autograd layer
#
# Fp8Linear does its own autograd (an autograd.Function), so inside it the ops'
# registered autograd formulas are never needed; going through them costs a
# Python round trip per call (~10 us). _amax_raw calls amax below the autograd
# dispatch keys in eager mode; the fused ops have no Python autograd formula,
# so their wrappers call them directly (eager and compiled alike).

_below_autograd = torch._C._AutoDispatchBelowAutograd
_empty: dict = {}


def _amax_raw(x):
    if torch.compiler.is_compiling():
        return torch.ops.fp8ops.amax.default(x)
    with _below_autograd():
        return torch.ops.fp8ops.amax.default(x)


def _empty_for(x, dtype):
    """The "none" argument of an op's optional tensor (an empty tensor of that
    dtype on x's device), one per device and dtype in eager mode (not while
    tracing: a fake tensor kept would reach later eager calls)."""
    if torch.compiler.is_compiling() or isinstance(x, FakeTensor):
        return x.new_empty((0,), dtype=dtype)
    key = (x.device, dtype)
    t = _empty.get(key)
    if t is None:
        t = _empty[key] = x.new_empty((0,), dtype=dtype)
    return t


def _empty_bias_for(x, out_dtype):
    """The "no bias" argument (an empty tensor of the bias dtype)."""
    return _empty_for(x, _bias_dtype(out_dtype))


# Fp8Linear's two calls per layer (and the fused LayerNorm's and SwiGLU's two): the OpOverloads
# themselves once the core is loaded (_register binds them), no Python frame in between.
def _linear_fwd_raw(*args):
    _require()


def _linear_bwd_raw(*args):
    _require()


def _linear_bwd_sink_raw(*args):
    _require()


def _ln_linear_fwd_raw(*args):
    _require()


def _layernorm_bwd_raw(*args):
    _require()


def _swiglu_backward_raw(*args):
    _require()


# ----------------------------------------------------------------------------
# registration (only when the C core loaded: otherwise the ops do not exist)

_math_bits_lib = None  # (the Library must live as long as its registrations)


def _refuse_math_bit_views(name: str):
    """A kernel for the Negative and Conjugate dispatch keys: a tensor argument with the
    negative or conjugate bit set (torch._neg_view, .conj() of a complex tensor, the .imag of
    one). torch's fallback would run the op on resolved copies and then read the op's result
    where a () op returns none: for amax_update, freed tensors and a heap corrupted (a probe's
    finding); for the others, writes into copies that are thrown away. Refused, naming the
    argument."""
    schema = getattr(torch.ops.fp8ops, name).default._schema

    def flagged(v):
        return isinstance(v, torch.Tensor) and (v.is_neg() or v.is_conj())

    def kernel(*args, **kwargs):
        bad = [a.name for a, v in zip(schema.arguments, args) if flagged(v)]
        bad += [k for k, v in kwargs.items() if flagged(v)]
        raise ValueError(f"fp8ops::{name}: {', '.join(bad) or 'an argument'} "
                         f"{'are' if len(bad) > 1 else 'is'} a negative- or conjugate-bit view "
                         "(torch._neg_view, .conj() of a complex tensor or its .imag), which fp8ops' ops do "
                         "not take; pass t.resolve_neg() / t.resolve_conj() (a copy: an argument the op "
                         "writes must then be copied back)")
    return kernel


def _register() -> None:
    global _math_bits_lib
    lib = torch.library.Library("fp8ops", "IMPL")  # noqa: TOR901 -- no other way to reach a math-bit key
    for name in _loader._C.build_info()["ops"].split():  # (every op the C core registered)
        for key in ("Negative", "Conjugate"):
            lib.impl(name, _refuse_math_bit_views(name), key)
    _math_bits_lib = lib
    torch.library.register_fake("fp8ops::cast")(_cast_fake)
    torch.library.register_autograd("fp8ops::cast", _cast_backward, setup_context=_cast_setup)
    torch.library.register_fake("fp8ops::amax")(_amax_fake)
    torch.library.register_fake("fp8ops::amax_update")(_amax_update_fake)
    torch.library.register_fake("fp8ops::gemm")(_gemm_fake)
    torch.library.register_autograd("fp8ops::gemm", _gemm_backward, setup_context=_gemm_setup)
    torch.library.register_fake("fp8ops::cast_accumulate")(_cast_accumulate_fake)
    torch.library.register_fake("fp8ops::linear_fwd")(_linear_fwd_fake)
    torch.library.register_fake("fp8ops::linear_bwd")(_linear_bwd_fake)
    torch.library.register_fake("fp8ops::linear_bwd_sink")(_linear_bwd_sink_fake)
    torch.library.register_fake("fp8ops::linear_bwd_cat")(_linear_bwd_cat_fake)
    torch.library.register_fake("fp8ops::ln_linear_fwd")(_ln_linear_fwd_fake)
    torch.library.register_fake("fp8ops::ln_linear_fwd_res")(_ln_linear_fwd_res_fake)
    torch.library.register_fake("fp8ops::layernorm_bwd")(_layernorm_bwd_fake)
    torch.library.register_fake("fp8ops::layernorm_bwd_acc")(_layernorm_bwd_acc_fake)
    torch.library.register_fake("fp8ops::swiglu")(_swiglu_fake)
    torch.library.register_fake("fp8ops::swiglu_backward")(_swiglu_backward_fake)
    torch.library.register_autograd("fp8ops::swiglu", _swiglu_grad, setup_context=_swiglu_setup)
    global _linear_fwd_raw, _linear_bwd_raw, _linear_bwd_sink_raw, _ln_linear_fwd_raw, _layernorm_bwd_raw, \
        _swiglu_backward_raw
    _linear_fwd_raw = torch.ops.fp8ops.linear_fwd.default
    _linear_bwd_raw = torch.ops.fp8ops.linear_bwd.default
    _linear_bwd_sink_raw = torch.ops.fp8ops.linear_bwd_sink.default
    _ln_linear_fwd_raw = torch.ops.fp8ops.ln_linear_fwd.default
    _layernorm_bwd_raw = torch.ops.fp8ops.layernorm_bwd.default
    _swiglu_backward_raw = torch.ops.fp8ops.swiglu_backward.default


if _loader.is_available():
    try:
        _register()
    except (AttributeError, RuntimeError) as e:  # a build from other sources: an op missing
        _loader.simulate_unavailable(
            f"fp8ops' C extension does not match this fp8ops' Python code ({e}); reinstall fp8ops "
            f"(`pip install --force-reinstall --no-cache-dir .`, or `pip install -e .` for a checkout)")
