/*
 * load_elem.cuh -- elements of bf16 / fp16 / fp32 tensors as floats (and
 * back), and 16-byte vectors of them, for the CUDA kernels (cast.cu, layernorm.cu,
 * swiglu.cu).
 * CUDA only.
 */
#ifndef FP8OPS_LOAD_ELEM_CUH
#define FP8OPS_LOAD_ELEM_CUH

#include <cuda_fp16.h>  // defines: __half2float, __ushort_as_half
#include <stdint.h>

#include "fp8_convert.h"  // defines: fp8ops_bf16_to_f32, fp8ops_f32_to_bf16
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

// Element i of p (dtype DT) set to v rounded to DT.
template <int DT>
__device__ __forceinline__ void store_elem(void* p, int64_t i, float v) {
  if constexpr (DT == FP8OPS_F32) {
    ((float*)p)[i] = v;
  } else if constexpr (DT == FP8OPS_BF16) {
    ((uint16_t*)p)[i] = fp8ops_f32_to_bf16(v);
  } else {
    ((uint16_t*)p)[i] = fp8ops_f32_to_f16(v);
  }
}

// Element j (in memory order) of one 16-byte vector of dtype DT as a float;
// j is a constant after unrolling. fp16: the exact hardware conversion.
template <int DT>
__device__ __forceinline__ float vec_elem(const uint4& v, int j) {
  constexpr int PER_WORD = DT == FP8OPS_F32 ? 1 : 2;
  const int k = j / PER_WORD;
  const uint32_t w = k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
  if constexpr (DT == FP8OPS_F32) {
    return fp8ops_bits_f32(w);
  } else if constexpr (DT == FP8OPS_BF16) {
    return fp8ops_bits_f32((j & 1) ? (w & 0xFFFF0000u) : (w << 16));
  } else {
    return __half2float(__ushort_as_half((unsigned short)((j & 1) ? (w >> 16) : (w & 0xFFFFu))));
  }
}

// f(x) rounded to dtype DT: what a torch kernel computing f on a tensor of
// dtype DT writes (what the cast kernels' fused prologues replace).
template <int DT>
__device__ __forceinline__ float round_to(float f) {
  if constexpr (DT == FP8OPS_BF16) {
    return fp8ops_bf16_to_f32(fp8ops_f32_to_bf16(f));
  } else if constexpr (DT == FP8OPS_F16) {
    return fp8ops_f16_to_f32(fp8ops_f32_to_f16(f));
  } else {
    return f;
  }
}

// One 16-byte vector of dtype DT with element j (memory order) replaced by
// f(j, element) rounded to DT.
template <int DT, class F>
__device__ __forceinline__ uint4 map_vec(const uint4& v, F f) {
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (DT == FP8OPS_F32) {
      w[k] = fp8ops_f32_bits(f(k, fp8ops_bits_f32(w[k])));
    } else {
      const float lo = f(2 * k, vec_elem<DT>(v, 2 * k)), hi = f(2 * k + 1, vec_elem<DT>(v, 2 * k + 1));
      w[k] = DT == FP8OPS_BF16 ? fp8ops_f32_to_bf16(lo) | ((uint32_t)fp8ops_f32_to_bf16(hi) << 16)
                               : fp8ops_f32_to_f16(lo) | ((uint32_t)fp8ops_f32_to_f16(hi) << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

#endif /* FP8OPS_LOAD_ELEM_CUH */
