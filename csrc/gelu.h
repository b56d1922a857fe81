/*
 * gelu.h -- GELU (tanh approximation), shared by the C (CPU) and CUDA kernels
 * of Fp8Linear's fused GELU: a linear whose input is gelu_tanh(h) casts h's
 * GELU inside its input cast, so the model's GELU kernel never runs.
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

#endif /* FP8OPS_GELU_H */
