"""All-E5M2 layers (fp8_format="e5m2"): FP8 numerics without an FP8 GEMM.

FP8 tensor cores (and so cuBLASLt and torch._scaled_mm) cannot multiply E5M2 by
E5M2, and in an all-E5M2 layer all three GEMMs would have to. Here the casts are
the fp8ops ops, with the same scales, amax history, overflow counting and FP8
tensors saved for backward as the tensor-core path; only the GEMMs run on the FP8
operands widened to BF16. That widening is exact (every E5M2 value is a BF16
value), so are the products (3 x 3 significant bits), and the sums accumulate in
fp32 with the scales applied to the fp32 result: the numbers an E5M2 x E5M2 tensor
core would give, at BF16 GEMM speed. The layer is therefore slower than BF16 (its
casts cost extra): this format is for studying E5M2 numerics, not for speed, and
policy "auto" does not move it to BF16 (report() says so).
"""
from __future__ import annotations

import torch

from . import ops
from .linear import (V_H, V_S, V_SI, W, X, _check_scales_unchanged, _current_scale, _keep_context,
                     _keep_scales, _once_differentiable, _scaled_grad_output, _take_scales)


def mm_dequant(a8: torch.Tensor, b8: torch.Tensor, a_scale_inv: torch.Tensor,
               b_scale_inv: torch.Tensor) -> torch.Tensor:
    """(a8 @ b8) * a_scale_inv * b_scale_inv in fp32, for FP8 a8 [M, K] and b8
    [K, N] (any strides). CUDA: BF16 operands, fp32 accumulation and output
    (aten::mm.dtype); CPU: fp32 (no mm.dtype kernel there), the same values."""
    if a8.is_cuda:
        acc = torch.mm(a8.to(torch.bfloat16), b8.to(torch.bfloat16), out_dtype=torch.float32)
    else:
        acc = torch.mm(a8.float(), b8.float())
    return acc * (a_scale_inv * b_scale_inv)


class Fp8LinearEmulatedFn(torch.autograd.Function):
    """linear._Fp8LinearFn's contract (same arguments, same scaling state), for
    formats whose GEMMs no tensor core runs. w_in is the cached FP8 weight or,
    on a miss, the weight itself, cast here (store keeps the cast for the step).
    No transposes are made: the GEMMs here take any layout."""

    @staticmethod
    def forward(ctx, x2, weight, bias, w_in, w8t, b_lp, views, static, store):
        x_dtype, w_dtype, g_dtype, out_dtype, _fast, current, margin, need_wgrad, _need_dgrad, delayed, *_gelu = static
        if current:
            _current_scale(x2, views, X, margin, keep_history=delayed)
        if w_in.dtype == w_dtype:
            w8 = w_in
        else:
            w8, _ = ops._cast_accumulate(w_in, views[V_S + W], views[V_H + W], w_dtype, False)
            if store is not None:
                store(w8, w8)
        x8, _ = ops._cast_accumulate(x2, views[V_S + X], views[V_H + X], x_dtype, False)
        y = mm_dequant(x8, w8.t(), views[V_SI + X], views[V_SI + W])
        if bias is not None:
            # the bias as it is (no bf16 rounding: that is a cuBLASLt FP8 rule, not needed here)
            y = y + bias.float()
        sx_inv, *scales = _keep_scales(ctx, views, static)
        ctx.save_for_backward(x8 if need_wgrad else None, w8, sx_inv, *scales)
        _keep_context(ctx, views, static, weight, bias, x2)
        # A view, not the product tensor itself: returned directly, torch.compile (2.11)
        # traced this backward with a zero gradient (test_e5m2_compiled_matches_eager_cpu).
        return y.to(out_dtype).view(y.shape)

    @staticmethod
    @_once_differentiable  # as linear._Fp8LinearFn's
    def backward(ctx, gy):
        _check_scales_unchanged(ctx)
        x8, w8, sx_inv = _take_scales(ctx, ctx.saved_tensors)
        x_dtype, w_dtype, g_dtype, out_dtype, _fast, current, margin, need_wgrad, need_dgrad, delayed, *_gelu = \
            ctx.static
        # (compiled: cast_accumulate declares its write to the amax slot, so here a second
        # compiled forward before this backward still fails torch's version check)
        g2, sg, sg_inv, g_amax = _scaled_grad_output(ctx, gy)
        g8, _ = ops._cast_accumulate(g2, sg, g_amax, g_dtype, False)
        dx = dw = db = None
        if need_dgrad and ctx.needs_input_grad[0]:
            dx = mm_dequant(g8, w8, sg_inv, ctx.sw_inv).to(ctx.x2_dtype)
        if need_wgrad and ctx.needs_input_grad[1]:
            w_out = ctx.w_dtype if ctx.w_dtype in ops.HP_DTYPES else torch.float32
            dw = mm_dequant(g8.t(), x8, sg_inv, sx_inv).to(w_out)
        if ctx.b_dtype is not None and ctx.needs_input_grad[2]:
            db = g2.sum(0, dtype=torch.float32).to(ctx.b_dtype)
        return dx, dw, db, None, None, None, None, None, None
