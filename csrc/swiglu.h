/*
 * swiglu.h -- SiLU and its derivative, shared by the C (CPU) and CUDA kernels
 * of the SwiGLU activation fp8ops fuses into an FP8 linear (swiglu_fusion.py):
 * the linear whose input is silu(gate) * up, gate and up the two halves of
 * one projection's output, casts that product inside its input cast, so the
 * model's SiLU and multiply never write their outputs.
 *
 * silu(g)  = g * sigmoid(g) = g / (1 + exp(-g))
 * silu'(g) = sigmoid(g) * (1 + g * (1 - sigmoid(g)))   (torch's silu_backward)
 * On the GPU, exp and the division are the MUFU approximations, as in gelu.h:
 * within a few fp32 ulps of the CPU's expf form; rounded to bf16 / fp16 (what
 * the kernels do first, as torch's kernels write their outputs in the input's
 * dtype) they nearly always give the same bits. For g below about -87.3 the
 * GPU's division gives -0 where the CPU's gives the true value, below 1e-35 in
 * magnitude (and both give -0 once exp(-g) overflows, below about -88.7).
 */
#ifndef FP8OPS_SWIGLU_H
#define FP8OPS_SWIGLU_H

#include <math.h>

#include "fp8_convert.h"  // defines: FP8OPS_HD

FP8OPS_HD float fp8ops_sigmoid(float g) {
#ifdef __CUDA_ARCH__
  return __fdividef(1.0f, 1.0f + __expf(-g));
#else
  return 1.0f / (1.0f + expf(-g));
#endif
}

FP8OPS_HD float fp8ops_silu(float g) {
#ifdef __CUDA_ARCH__
  return __fdividef(g, 1.0f + __expf(-g));
#else
  return g / (1.0f + expf(-g));
#endif
}

FP8OPS_HD float fp8ops_silu_grad(float g) {
  const float s = fp8ops_sigmoid(g);
  return s * (1.0f + g * (1.0f - s));
}

#endif /* FP8OPS_SWIGLU_H */
