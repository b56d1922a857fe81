/*
 * gelu.h -- GELU (tanh approximation) and its derivative, shared by the C
 * (CPU) and CUDA kernels of Fp8Linear's fused GELU: the linear whose input is
 * gelu_tanh(h) casts h's GELU inside its input cast, and the linear that
 * produced h multiplies its output gradient by gelu_tanh'(h) inside its
 * gradient cast, so neither of the model's GELU kernels runs.
 *
 * gelu_tanh(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)
 *              = x / (1 + exp(-2u))          (0.5 (1 + tanh(u)) = sigmoid(2u))
 * The second form is the one evaluated: one exp and one division, no
 * cancellation in 1 + tanh(u) for negative u, and on the GPU two MUFU
 * instructions instead of tanhf's ~20, which kept the cast kernel from its
 * memory bandwidth. Its result is within a few fp32 ulps of torch's tanh
 * form; rounded to bf16 / fp16 (what the cast kernels do first, as torch's
 * GELU kernel writes its output in the input's dtype) it nearly always gives
 * the same bits. For u < -44 exp(-2u) overflows to inf and the result is -0
 * (the true value is below 1e-37 in magnitude).
 *
 * gelu_tanh'(x) = s + 2 x s (1 - s) u',  s = sigmoid(2u), u' = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
 * (torch's 0.5 (1 + t) + 0.5 x (1 - t^2) u' with t = tanh(u) = 2s - 1).
 */
#ifndef FP8OPS_GELU_H
#define FP8OPS_GELU_H

#include <math.h>

#include "fp8_convert.h"  // defines: FP8OPS_HD

#define FP8OPS_GELU_BETA 0.7978845608028654f /* sqrt(2 / pi) */
#define FP8OPS_GELU_KAPPA 0.044715f

FP8OPS_HD float fp8ops_gelu_tanh(float x) {
  const float u = FP8OPS_GELU_BETA * (x + FP8OPS_GELU_KAPPA * (x * x * x));
#ifdef __CUDA_ARCH__
  return __fdividef(x, 1.0f + __expf(-2.0f * u));
#else
  return x / (1.0f + expf(-2.0f * u));
#endif
}

FP8OPS_HD float fp8ops_gelu_tanh_grad(float x) {
  const float u = FP8OPS_GELU_BETA * (x + FP8OPS_GELU_KAPPA * (x * x * x));
  const float du = FP8OPS_GELU_BETA * (1.0f + 3.0f * FP8OPS_GELU_KAPPA * (x * x));
#ifdef __CUDA_ARCH__
  const float s = __fdividef(1.0f, 1.0f + __expf(-2.0f * u));
#else
  const float s = 1.0f / (1.0f + expf(-2.0f * u));
#endif
  return s + 2.0f * x * s * (1.0f - s) * du;
}

#endif /* FP8OPS_GELU_H */
