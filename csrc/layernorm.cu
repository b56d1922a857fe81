/*
 * layernorm.cu -- per-row LayerNorm statistics for the LayerNorm fused into an
 * FP8 linear's input cast (layernorm_fusion.py; the cast is cast.cu's ACT_LN):
 * mean[r] and rstd[r] = 1 / sqrt(var[r] + eps) over the row's cols elements,
 * var the biased variance (divided by cols), as torch's layer_norm defines
 * them; torch's native_layer_norm_backward then takes them as they are.
 * Two passes over the row (the second reads it from L1 / L2): sum, then the
 * sum of squared deviations from the mean, both in fp32.
 */
#include <cuda_runtime.h>  // defines: cudaStream_t
#include <stdint.h>

#include "common.h"       // defines: FP8OPS_REQUIRE, FP8OPS_CHECK_CUDA, FP8OPS_CEIL_DIV
#include "load_elem.cuh"  // defines: load_elem

#define LN_THREADS 256  // 8 warps: one row each

// Block dims: (256). Grid dims: (ceil(rows / 8)); warp w of block b takes row
// 8b + w, its lanes read 32 consecutive elements per step.
template <int DT>
__global__ void __launch_bounds__(LN_THREADS)
    layernorm_stats_kernel(const void* __restrict__ x, int64_t rows, int64_t cols, float eps,
                           float* __restrict__ mean, float* __restrict__ rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * (LN_THREADS / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int64_t base = r * cols;
  float sum = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) sum += load_elem<DT>(x, base + c);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xFFFFFFFFu, sum, o);
  const float m = sum / (float)cols;
  float sq = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) {
    const float d = load_elem<DT>(x, base + c) - m;
    sq += d * d;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sq += __shfl_xor_sync(0xFFFFFFFFu, sq, o);
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rsqrtf(sq / (float)cols + eps);
  }
}

extern "C" int fp8ops_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                                           int64_t cols, float eps, float* mean, float* rstd,
                                           void* stream) {
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && (rows == 0 || (x && mean && rstd)),
                 "layernorm_stats: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "layernorm_stats: unknown dtype code %d", (int)dtype);
  if (rows == 0) return FP8OPS_OK;
  const int64_t blocks = FP8OPS_CEIL_DIV(rows, (int64_t)(LN_THREADS / 32));
  FP8OPS_REQUIRE(blocks <= INT32_MAX, "layernorm_stats: too many rows (%lld)", (long long)rows);
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case FP8OPS_F32:
      layernorm_stats_kernel<FP8OPS_F32><<<(unsigned)blocks, LN_THREADS, 0, s>>>(x, rows, cols, eps,
                                                                                mean, rstd);
      break;
    case FP8OPS_BF16:
      layernorm_stats_kernel<FP8OPS_BF16><<<(unsigned)blocks, LN_THREADS, 0, s>>>(x, rows, cols, eps,
                                                                                 mean, rstd);
      break;
    default:
      layernorm_stats_kernel<FP8OPS_F16><<<(unsigned)blocks, LN_THREADS, 0, s>>>(x, rows, cols, eps,
                                                                                mean, rstd);
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}
