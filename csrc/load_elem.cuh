/*
 * load_elem.cuh -- one element of a bf16 / fp16 / fp32 tensor as a float, for
 * the CUDA kernels' scalar paths (cast.cu, layernorm.cu). CUDA only.
 */
#ifndef FP8OPS_LOAD_ELEM_CUH
#define FP8OPS_LOAD_ELEM_CUH

#include <stdint.h>

#include "fp8_convert.h"  // defines: fp8ops_bf16_to_f32, fp8ops_f16_to_f32
#include "fp8ops.h"       // defines: FP8OPS_F32, FP8OPS_BF16

// Element i of x (dtype DT), as float.
template <int DT>
__device__ __forceinline__ float load_elem(const void* x, int64_t i) {
  if constexpr (DT == FP8OPS_F32) {
    return ((const float*)x)[i];
  } else if constexpr (DT == FP8OPS_BF16) {
    return fp8ops_bf16_to_f32(((const uint16_t*)x)[i]);
  } else {
    return fp8ops_f16_to_f32(((const uint16_t*)x)[i]);
  }
}

#endif /* FP8OPS_LOAD_ELEM_CUH */
