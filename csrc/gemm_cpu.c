/*
 * gemm_cpu.c -- CPU reference of fp8ops::gemm: dequantise the fp8 operands,
 * fp32 dot products (k ascending), scale, add bias, round to the out dtype.
 * Same TN convention as the cuBLASLt path: a [M, K], b [N, K], out [M, N].
 */
#include <stdlib.h>

#include "common.h"
#include "fp8_convert.h"

static inline float deq(uint8_t v, fp8ops_fp8_format f) {
  return f == FP8OPS_E4M3 ? fp8ops_e4m3_to_f32(v) : fp8ops_e5m2_to_f32(v);
}

static inline float load_bias(const void* bias, fp8ops_hp_dtype dt, int64_t i) {
  switch (dt) {
    case FP8OPS_BF16: return fp8ops_bf16_to_f32(((const uint16_t*)bias)[i]);
    case FP8OPS_F16: return fp8ops_f16_to_f32(((const uint16_t*)bias)[i]);
    default: return ((const float*)bias)[i];
  }
}

int fp8ops_gemm_cpu(const uint8_t* a, fp8ops_fp8_format a_fmt, const uint8_t* b,
                    fp8ops_fp8_format b_fmt, int64_t M, int64_t N, int64_t K,
                    const float* a_scale_inv, const float* b_scale_inv, const void* bias,
                    fp8ops_hp_dtype out_dtype, void* out) {
  FP8OPS_REQUIRE(M >= 0 && N >= 0 && K >= 0, "gemm: negative size");
  FP8OPS_REQUIRE(a_scale_inv && b_scale_inv && (M * N == 0 || out), "gemm: null pointer");
  FP8OPS_REQUIRE(!(a_fmt == FP8OPS_E5M2 && b_fmt == FP8OPS_E5M2),
                 "gemm: e5m2 x e5m2 is not supported by FP8 tensor cores; use e4m3 for one operand");
  const float s = *a_scale_inv * *b_scale_inv;
  const fp8ops_hp_dtype bias_dt = fp8ops_gemm_bias_dtype(out_dtype);
  /* dequantise b once (N*K floats) so the inner loop is a plain fp32 dot */
  float* bf = NULL;
  if (N * K > 0) {
    bf = (float*)malloc((size_t)(N * K) * sizeof(float));
    if (!bf) return fp8ops_set_error(FP8OPS_ERR_NOMEM, "gemm: out of memory: fp8ops' CPU "
                                          "reference could not allocate its fp32 copies");
    for (int64_t i = 0; i < N * K; ++i) bf[i] = deq(b[i], b_fmt);
  }
  float* arow = K > 0 ? (float*)malloc((size_t)K * sizeof(float)) : NULL;
  if (K > 0 && !arow) {
    free(bf);
    return fp8ops_set_error(FP8OPS_ERR_NOMEM, "gemm: out of memory: fp8ops' CPU "
                                          "reference could not allocate its fp32 copies");
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) arow[k] = deq(a[m * K + k], a_fmt);
    for (int64_t n = 0; n < N; ++n) {
      const float* brow = bf + n * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += arow[k] * brow[k];
      float y = acc * s;
      if (bias) y += load_bias(bias, bias_dt, n);
      const int64_t o = m * N + n;
      switch (out_dtype) {
        case FP8OPS_BF16: ((uint16_t*)out)[o] = fp8ops_f32_to_bf16(y); break;
        case FP8OPS_F16: ((uint16_t*)out)[o] = fp8ops_f32_to_f16(y); break;
        default: ((float*)out)[o] = y;
      }
    }
  }
  free(arow);
  free(bf);
  return FP8OPS_OK;
}
