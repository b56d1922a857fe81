/*
 * layernorm.cu -- the LayerNorm fused into an FP8 linear's input cast
 * (layernorm_fusion.py; the cast is cast.cu's ACT_LN): its per-row statistics,
 * mean[r] and rstd[r] = 1 / sqrt(var[r] + eps) over the row's cols elements,
 * var the biased variance (divided by cols), as torch's layer_norm defines
 * them (torch's native_layer_norm_backward takes them as they are), or with
 * rms an RMSNorm's, mean[r] = 0 and rstd[r] = 1 / sqrt(sum(x^2) / cols + eps)
 * (the cast and the backward then read it as a LayerNorm of mean 0), and its
 * backward (layernorm_bwd, below). The statistics take two passes over the
 * row (the second reads it from L1 / L2): sum, then the sum of squared
 * deviations from the mean, both in fp32.
 */
#include <cuda_runtime.h>  // defines: cudaStream_t, cudaMemsetAsync
#include <stdint.h>

#include "common.h"       // defines: FP8OPS_REQUIRE, FP8OPS_CHECK_CUDA, FP8OPS_CEIL_DIV
#include "load_elem.cuh"  // defines: load_elem, store_elem, vec_elem, map_vec

#define LN_THREADS 256  // 8 warps: one row each

// v summed over the warp's 32 lanes (butterfly: every lane gets the sum)
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

// Block dims: (256). Grid dims: (ceil(rows / 8)); warp w of block b takes row
// 8b + w, its lanes read 32 consecutive elements per step.
template <int DT>
__global__ void __launch_bounds__(LN_THREADS)
    layernorm_stats_kernel(const void* __restrict__ x, int64_t rows, int64_t cols, float eps,
                           bool rms, float* __restrict__ mean, float* __restrict__ rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * (LN_THREADS / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int64_t base = r * cols;
  float sum = 0.0f;
  if (!rms) {
    for (int64_t c = lane; c < cols; c += 32) sum += load_elem<DT>(x, base + c);
    sum = warp_sum(sum);
  }
  const float m = sum / (float)cols;  // 0 for an RMSNorm
  float sq = 0.0f;
  for (int64_t c = lane; c < cols; c += 32) {
    const float d = load_elem<DT>(x, base + c) - m;
    sq += d * d;
  }
  sq = warp_sum(sq);
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rsqrtf(sq / (float)cols + eps);
  }
}

// x's 16-byte vector k plus res's elements at the same place, each sum in fp32
// (no fused multiply-add) rounded to DT: torch's add with res promoted to x's
// dtype. res: RT == DT, a 16-byte vector of its own; else 16-bit values for fp32
// x, 8 bytes.
template <int DT, int RT>
__device__ __forceinline__ uint4 add_res_vec(const uint4& xv, const void* res, int64_t k) {
  uint4 rv;
  if constexpr (RT == DT) {
    rv = __ldcs((const uint4*)res + k);
  } else {
    static_assert(DT == FP8OPS_F32 && RT != FP8OPS_F32, "16-bit values added to fp32 only");
    const uint2 h = __ldcs((const uint2*)res + k);
    rv = make_uint4(h.x, h.y, 0u, 0u);
  }
  return map_vec<DT>(xv, [&](int e, float v) { return __fadd_rn(v, vec_elem<RT>(rv, e)); });
}

#define LN_NO_RES (-1)  // RT of the statistics kernel without a residual

// The same statistics for rows of whole 16-byte vectors (at most 2048
// columns, 16-byte aligned): each lane loads its NV vectors of the row once,
// with all loads in flight together, and both sums come from registers, where
// the kernel above reads the row twice with 4-byte loads (on an H200 it
// reached ~1.9 TB/s on the 1B model's 16384 x 2048 fp32 rows). RT != LN_NO_RES:
// the row is x + res (add_res_vec), written to sum as it is loaded, and the
// statistics are sum's: the separate add's tensor and this kernel run on it,
// bit for bit, with one read of the row instead of two (add_layernorm_stats).
template <int DT, int NV, int RT>
__global__ void __launch_bounds__(LN_THREADS)
    layernorm_stats_vec_kernel(const void* __restrict__ x, const void* __restrict__ res,
                               int64_t rows, int cols, float eps, bool rms,
                               void* __restrict__ sum_out, float* __restrict__ mean,
                               float* __restrict__ rstd) {
  constexpr int EPV = DT == FP8OPS_F32 ? 4 : 8;  // elements per 16-byte vector
  const int lane = threadIdx.x & 31;
  const int64_t r = (int64_t)blockIdx.x * (LN_THREADS / 32) + (threadIdx.x >> 5);
  if (r >= rows) return;
  const int nvec = cols / EPV;
  const uint4* xr = (const uint4*)x + r * nvec;
  uint4 v[NV];
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    const int k = j * 32 + lane;
    v[j] = k < nvec ? xr[k] : make_uint4(0, 0, 0, 0);
  }
  if constexpr (RT != LN_NO_RES) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int k = j * 32 + lane;
      if (k < nvec) {
        v[j] = add_res_vec<DT, RT>(v[j], res, r * nvec + k);
        ((uint4*)sum_out)[r * nvec + k] = v[j];
      }
    }
  }
  float sum = 0.0f;
  if (!rms) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int e = 0; e < EPV; ++e) sum += vec_elem<DT>(v[j], e);  // (padding is +0)
    sum = warp_sum(sum);
  }
  const float m = sum / (float)cols;  // 0 for an RMSNorm
  float sq = 0.0f;
#pragma unroll
  for (int j = 0; j < NV; ++j) {
    if (j * 32 + lane < nvec) {
#pragma unroll
      for (int e = 0; e < EPV; ++e) {
        const float d = vec_elem<DT>(v[j], e) - m;
        sq += d * d;
      }
    }
  }
  sq = warp_sum(sq);
  if (lane == 0) {
    mean[r] = m;
    rstd[r] = rsqrtf(sq / (float)cols + eps);
  }
}

// NV rounded up to a power of two: fewer instances, the extra vectors masked.
template <int DT, int RT = LN_NO_RES>
static int launch_layernorm_stats_vec(const void* x, const void* res, int64_t rows, int64_t cols,
                                      float eps, bool rms, void* sum, float* mean, float* rstd,
                                      unsigned blocks, cudaStream_t s) {
  constexpr int EPV = DT == FP8OPS_F32 ? 4 : 8;
  const int64_t nv = FP8OPS_CEIL_DIV(cols / EPV, (int64_t)32);
#define LNS_LAUNCH(n)                                                                           \
  layernorm_stats_vec_kernel<DT, n, RT><<<blocks, LN_THREADS, 0, s>>>(x, res, rows, (int)cols, \
                                                                      eps, rms, sum, mean, rstd)
  if (nv <= 1)
    LNS_LAUNCH(1);
  else if (nv <= 2)
    LNS_LAUNCH(2);
  else if (nv <= 4)
    LNS_LAUNCH(4);
  else if (nv <= 8)
    LNS_LAUNCH(8);
  else if constexpr (EPV == 4)  // (2048 bf16 / fp16 columns are 8 vectors per lane)
    if (nv <= 16) LNS_LAUNCH(16);
#undef LNS_LAUNCH
  if (nv > (EPV == 4 ? 16 : 8))
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "layernorm_stats: %lld columns is too wide for the "
                            "vector kernel", (long long)cols);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// whether the vector kernel takes rows of cols elements of dtype at these addresses
static bool layernorm_stats_vec_ok(fp8ops_hp_dtype dtype, int64_t cols, uintptr_t addresses) {
  const int64_t epv = dtype == FP8OPS_F32 ? 4 : 8;
  return cols <= 2048 && cols % epv == 0 && (addresses & 15u) == 0;
}

extern "C" int fp8ops_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                                           int64_t cols, float eps, int rms, float* mean,
                                           float* rstd, void* stream) {
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && (rows == 0 || (x && mean && rstd)),
                 "layernorm_stats: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "layernorm_stats: unknown dtype code %d", (int)dtype);
  if (rows == 0) return FP8OPS_OK;
  const int64_t blocks = FP8OPS_CEIL_DIV(rows, (int64_t)(LN_THREADS / 32));
  FP8OPS_REQUIRE(blocks <= INT32_MAX, "layernorm_stats: too many rows (%lld)", (long long)rows);
  cudaStream_t s = (cudaStream_t)stream;
  if (layernorm_stats_vec_ok(dtype, cols, (uintptr_t)x)) {
    switch (dtype) {
      case FP8OPS_F32:
        return launch_layernorm_stats_vec<FP8OPS_F32>(x, NULL, rows, cols, eps, rms != 0, NULL,
                                                       mean, rstd, (unsigned)blocks, s);
      case FP8OPS_BF16:
        return launch_layernorm_stats_vec<FP8OPS_BF16>(x, NULL, rows, cols, eps, rms != 0, NULL,
                                                        mean, rstd, (unsigned)blocks, s);
      default:
        return launch_layernorm_stats_vec<FP8OPS_F16>(x, NULL, rows, cols, eps, rms != 0, NULL,
                                                       mean, rstd, (unsigned)blocks, s);
    }
  }
  switch (dtype) {
    case FP8OPS_F32:
      layernorm_stats_kernel<FP8OPS_F32><<<(unsigned)blocks, LN_THREADS, 0, s>>>(x, rows, cols, eps,
                                                                                rms != 0, mean, rstd);
      break;
    case FP8OPS_BF16:
      layernorm_stats_kernel<FP8OPS_BF16><<<(unsigned)blocks, LN_THREADS, 0, s>>>(x, rows, cols, eps,
                                                                                 rms != 0, mean, rstd);
      break;
    default:
      layernorm_stats_kernel<FP8OPS_F16><<<(unsigned)blocks, LN_THREADS, 0, s>>>(x, rows, cols, eps,
                                                                                rms != 0, mean, rstd);
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// sum[i] = x[i] + res[i] rounded to DT, one element per thread per step: the
// add of add_layernorm_stats where the vector kernel cannot take the rows
template <int DT, int RT>
__global__ void __launch_bounds__(LN_THREADS)
    add_res_kernel(const void* __restrict__ x, const void* __restrict__ res, int64_t n,
                   void* __restrict__ sum) {
  for (int64_t i = (int64_t)blockIdx.x * LN_THREADS + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * LN_THREADS)
    store_elem<DT>(sum, i, __fadd_rn(load_elem<DT>(x, i), load_elem<RT>(res, i)));
}

template <int DT, int RT>
static int add_layernorm_stats_as(const void* x, const void* res, int64_t rows, int64_t cols,
                                  float eps, bool rms, void* sum, float* mean, float* rstd,
                                  cudaStream_t s) {
  const int64_t blocks = FP8OPS_CEIL_DIV(rows, (int64_t)(LN_THREADS / 32));
  FP8OPS_REQUIRE(blocks <= INT32_MAX, "layernorm_stats: too many rows (%lld)", (long long)rows);
  if (layernorm_stats_vec_ok((fp8ops_hp_dtype)DT, cols, (uintptr_t)x | (uintptr_t)sum) &&
      ((uintptr_t)res & (RT == DT ? 15u : 7u)) == 0)
    return launch_layernorm_stats_vec<DT, RT>(x, res, rows, cols, eps, rms, sum, mean, rstd,
                                              (unsigned)blocks, s);
  const int64_t n = rows * cols;
  const unsigned grid = (unsigned)(FP8OPS_CEIL_DIV(n, (int64_t)LN_THREADS) < 65536
                                       ? FP8OPS_CEIL_DIV(n, (int64_t)LN_THREADS)
                                       : 65536);
  add_res_kernel<DT, RT><<<grid, LN_THREADS, 0, s>>>(x, res, n, sum);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return fp8ops_layernorm_stats_cuda(sum, (fp8ops_hp_dtype)DT, rows, cols, eps, rms, mean, rstd,
                                     s);
}

extern "C" int fp8ops_add_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype,
                                               const void* res, fp8ops_hp_dtype res_dtype,
                                               int64_t rows, int64_t cols, float eps, int rms,
                                               void* sum, float* mean, float* rstd, void* stream) {
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && (rows == 0 || (x && res && sum && mean && rstd)),
                 "add_layernorm_stats: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(fp8ops_add_res_dtypes_ok(dtype, res_dtype),
                 "add_layernorm_stats: res of dtype code %d cannot be added to x of dtype code %d",
                 (int)res_dtype, (int)dtype);
  if (rows == 0) return FP8OPS_OK;
  cudaStream_t s = (cudaStream_t)stream;
#define ALS_ARGS x, res, rows, cols, eps, rms != 0, sum, mean, rstd, s
  if (dtype == FP8OPS_BF16) return add_layernorm_stats_as<FP8OPS_BF16, FP8OPS_BF16>(ALS_ARGS);
  if (dtype == FP8OPS_F16) return add_layernorm_stats_as<FP8OPS_F16, FP8OPS_F16>(ALS_ARGS);
  if (res_dtype == FP8OPS_BF16) return add_layernorm_stats_as<FP8OPS_F32, FP8OPS_BF16>(ALS_ARGS);
  if (res_dtype == FP8OPS_F16) return add_layernorm_stats_as<FP8OPS_F32, FP8OPS_F16>(ALS_ARGS);
  return add_layernorm_stats_as<FP8OPS_F32, FP8OPS_F32>(ALS_ARGS);
#undef ALS_ARGS
}

// ----------------------------------------------------------------------------
// LayerNorm backward (fp8ops_layernorm_bwd_cuda): one read of x and dy, one
// write of dx; torch's native_layer_norm_backward reads both twice (a dx
// kernel, then a column-sum kernel for dgamma / dbeta that ran at about a
// third of the memory bandwidth in GPT-2's profile, benchmarks/RESULTS.md §5).
//
// layernorm_bwd_kernel: WPR warps per row (1 up to 1024 columns, 2 up to
// 2048, 4 up to 4096) hold the row's x and dy in registers, each warp a slice
// of cols / WPR columns (NV 16-byte vectors per lane), reduce sum(g) and
// sum(g * xhat) with shuffles (and, for WPR > 1, through shared memory in
// warp order), write dx,
// and add dy * xhat and dy into their lanes' column sums, kept in registers
// over the rows. Each CTA then adds its warps' sums in warp order (shared
// memory) and writes them to partial[blockIdx.x][0 : 2 cols] (dgamma, then
// dbeta); layernorm_bwd_reduce_kernel adds the CTAs' partials in a fixed
// order. The result does not depend on timing: the same inputs give the same
// bits.

#define LNB_WARPS FP8OPS_LN_BWD_WARPS  // warps per CTA
#define LNB_REDUCE_GROUPS 32           // row groups per column in the reduce kernel

// gamma[k * EPV .. k * EPV + EPV) from shared memory as 16-byte reads
template <int EPV>
__device__ __forceinline__ void load_gamma(const float4* gs4, int k, float (&g)[EPV]) {
#pragma unroll
  for (int q = 0; q < EPV / 4; ++q) {
    const float4 v = gs4[k * (EPV / 4) + q];
    g[4 * q] = v.x;
    g[4 * q + 1] = v.y;
    g[4 * q + 2] = v.z;
    g[4 * q + 3] = v.w;
  }
}

// Block dims: (LNB_WARPS * 32). Grid dims: fp8ops_layernorm_bwd_tiles(rows, cols).
// The CTA's LNB_WARPS / WPR warp groups take one row each at a time: group p
// of CTA b takes rows (b * rows_per_warp + i) * groups + p, warp h of the group
// the columns [h, h + 1) * cols / WPR. Dynamic shared memory: gamma [cols],
// then the CTA's sums [2 cols].
// ACC: dx = round(LayerNorm's dx) + dres, the sum in fp32 without a fused multiply-add
// (__fadd_rn), rounded again: a separate add's result bit for bit (layernorm_bwd_acc).
// CP (with ACC, fp32 rows only): also dcopy = that dx rounded to CP (bf16 or fp16; F32: no
// copy), the conversion a separate add's kernel would write beside the sum.
template <int DT, int NV, int WPR, bool ACC, int CP>
__global__ void __launch_bounds__(LNB_WARPS * 32)
    layernorm_bwd_kernel(const void* __restrict__ dy, const void* __restrict__ x,
                         const float* __restrict__ mean, const float* __restrict__ rstd,
                         const float* __restrict__ gamma, bool rms, int64_t rows, int cols,
                         int rows_per_warp, const void* __restrict__ dres, void* __restrict__ dx,
                         void* __restrict__ dcopy, float* __restrict__ partial) {
  static_assert(CP == FP8OPS_F32 || (ACC && DT == FP8OPS_F32), "a copy of an fp32 sum only");
  constexpr int EPV = DT == FP8OPS_F32 ? 4 : 8;  // elements per 16-byte vector
  constexpr int GROUPS = LNB_WARPS / WPR;        // rows in flight per CTA
  extern __shared__ float4 lnb_smem[];           // 16-byte aligned; cols % 4 == 0
  __shared__ float2 red[LNB_WARPS];              // per-warp row sums (WPR > 1)
  float* gs = (float*)lnb_smem;
  float* sums = gs + cols;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) gs[c] = gamma ? gamma[c] : 1.0f;
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp / WPR, half = warp % WPR;
  const int row_vecs = cols / EPV;
  const int nvec = row_vecs / WPR;  // this warp's vectors per row
  const int v0 = half * nvec;       // the first of them
  const float inv_cols = 1.0f / (float)cols;
  float dg[NV * EPV], db[NV * EPV];
#pragma unroll
  for (int e = 0; e < NV * EPV; ++e) dg[e] = db[e] = 0.0f;
  const int64_t first = (int64_t)blockIdx.x * rows_per_warp * GROUPS + group;
  for (int i = 0; i < rows_per_warp; ++i) {
    const int64_t r = first + (int64_t)i * GROUPS;
    const bool live = r < rows;
    if (WPR == 1 && !live) break;  // (WPR > 1: every warp reaches the barriers below)
    const uint4* xr = (const uint4*)x + r * row_vecs + v0;
    const uint4* dr = (const uint4*)dy + r * row_vecs + v0;
    uint4 xv[NV], dv[NV];
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int k = j * 32 + lane;
      const bool in = live && k < nvec;
      xv[j] = in ? __ldcs(xr + k) : make_uint4(0, 0, 0, 0);
      dv[j] = in ? __ldcs(dr + k) : make_uint4(0, 0, 0, 0);
    }
    const float m = live ? mean[r] : 0.0f, rs = live ? rstd[r] : 0.0f;
    float s1 = 0.0f, s2 = 0.0f;  // sum(g), sum(g * xhat) of this lane's elements
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int k = j * 32 + lane;
      if (k < nvec) {
        float gam[EPV];
        load_gamma<EPV>(lnb_smem, v0 + k, gam);
#pragma unroll
        for (int e = 0; e < EPV; ++e) {
          const float g = vec_elem<DT>(dv[j], e) * gam[e];
          s1 += g;
          s2 += g * ((vec_elem<DT>(xv[j], e) - m) * rs);
        }
      }
    }
    s1 = warp_sum(s1);
    s2 = warp_sum(s2);
    if constexpr (WPR > 1) {
      if (lane == 0) red[warp] = make_float2(s1, s2);
      __syncthreads();
      s1 = red[group * WPR].x;
      s2 = red[group * WPR].y;
#pragma unroll
      for (int h = 1; h < WPR; ++h) {
        s1 += red[group * WPR + h].x;
        s2 += red[group * WPR + h].y;
      }
      __syncthreads();  // red is rewritten for the next row
      if (!live) continue;
    }
    const float c1 = rms ? 0.0f : s1 * inv_cols, c2 = s2 * inv_cols;
    uint4* dxr = (uint4*)dx + r * row_vecs + v0;
#pragma unroll
    for (int j = 0; j < NV; ++j) {
      const int k = j * 32 + lane;
      if (k < nvec) {
        const uint4 xj = xv[j];
        uint4 rj = make_uint4(0, 0, 0, 0);
        if constexpr (ACC) rj = __ldcs((const uint4*)dres + r * row_vecs + v0 + k);
        float gam[EPV];
        load_gamma<EPV>(lnb_smem, v0 + k, gam);
        const uint4 o = map_vec<DT>(dv[j], [&](int e, float d) {
          const float xh = (vec_elem<DT>(xj, e) - m) * rs;
          dg[j * EPV + e] += d * xh;
          db[j * EPV + e] += d;
          const float v = rs * (d * gam[e] - c1 - xh * c2);
          if constexpr (ACC) return __fadd_rn(round_to<DT>(v), vec_elem<DT>(rj, e));
          return v;
        });
        dxr[k] = o;
        if constexpr (CP != FP8OPS_F32) {  // 4 fp32 -> 4 16-bit: 8 bytes
          uint32_t h[4];
#pragma unroll
          for (int e = 0; e < 4; ++e)
            h[e] = CP == FP8OPS_BF16 ? fp8ops_f32_to_bf16(vec_elem<DT>(o, e))
                                     : fp8ops_f32_to_f16(vec_elem<DT>(o, e));
          __stcs((uint2*)dcopy + r * row_vecs + v0 + k,
                 make_uint2(h[0] | h[1] << 16, h[2] | h[3] << 16));
        }
      }
    }
  }
  // the CTA's column sums: group 0's warps first, then group 1's, ...
  for (int w = 0; w < LNB_WARPS; ++w) {
    if (warp == w) {
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        const int k = j * 32 + lane;
        if (k < nvec) {
#pragma unroll
          for (int e = 0; e < EPV; ++e) {
            const int c = (v0 + k) * EPV + e;
            sums[c] = group == 0 ? dg[j * EPV + e] : sums[c] + dg[j * EPV + e];
            sums[cols + c] = group == 0 ? db[j * EPV + e] : sums[cols + c] + db[j * EPV + e];
          }
        }
      }
    }
    __syncthreads();
  }
  float* out = partial + (int64_t)blockIdx.x * 2 * cols;
  for (int c = threadIdx.x; c < 2 * cols; c += blockDim.x) out[c] = sums[c];
}

// out[c] = the sum of partial[t][c] over t < tiles: group g of column c adds
// tiles g, g + 32, g + 64, ... in order, then group 0 adds the 32 group sums
// in order. Block dims: (32, LNB_REDUCE_GROUPS). Grid dims: (ceil(cols / 32)).
__global__ void __launch_bounds__(32 * LNB_REDUCE_GROUPS)
    layernorm_bwd_reduce_kernel(const float* __restrict__ partial, int64_t tiles, int64_t cols,
                                float* __restrict__ out) {
  __shared__ float part[LNB_REDUCE_GROUPS][33];
  const int64_t c = (int64_t)blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < cols)
    for (int64_t t = threadIdx.y; t < tiles; t += LNB_REDUCE_GROUPS) s += partial[t * cols + c];
  part[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float t = part[0][threadIdx.x];
    for (int g = 1; g < LNB_REDUCE_GROUPS; ++g) t += part[g][threadIdx.x];
    out[c] = t;
  }
}

template <int DT, int NV, int WPR, bool ACC, int CP>
static int launch_layernorm_bwd_as(const void* dy, const void* x, const float* mean,
                                   const float* rstd, const float* gamma, bool rms, int64_t rows,
                                   int cols, int rows_per_warp, int64_t tiles, const void* dres,
                                   void* dx, void* dcopy, float* partial, cudaStream_t s) {
  const size_t smem = 3 * (size_t)cols * sizeof(float);
  if (smem > 40 * 1024)  // 4096 columns: 48 KB, over the default limit with the static red[]
    FP8OPS_CHECK_CUDA(cudaFuncSetAttribute(layernorm_bwd_kernel<DT, NV, WPR, ACC, CP>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  layernorm_bwd_kernel<DT, NV, WPR, ACC, CP><<<(unsigned)tiles, LNB_WARPS * 32, smem, s>>>(
      dy, x, mean, rstd, gamma, rms, rows, cols, rows_per_warp, dres, dx, dcopy, partial);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// (dres NULL: the kernel without the add, as it was before layernorm_bwd_acc; copy_dtype
// F32: no copy; a copy only of fp32 rows, checked by the caller)
template <int DT, int NV, int WPR>
static int launch_layernorm_bwd(const void* dy, const void* x, const float* mean,
                                const float* rstd, const float* gamma, bool rms, int64_t rows,
                                int cols, int rows_per_warp, int64_t tiles, const void* dres,
                                fp8ops_hp_dtype copy_dtype, void* dx, void* dcopy, float* partial,
                                cudaStream_t s) {
#define LNB_ARGS \
  dy, x, mean, rstd, gamma, rms, rows, cols, rows_per_warp, tiles, dres, dx, dcopy, partial, s
  if (!dres) return launch_layernorm_bwd_as<DT, NV, WPR, false, FP8OPS_F32>(LNB_ARGS);
  if constexpr (DT == FP8OPS_F32) {
    if (copy_dtype == FP8OPS_BF16)
      return launch_layernorm_bwd_as<DT, NV, WPR, true, FP8OPS_BF16>(LNB_ARGS);
    if (copy_dtype == FP8OPS_F16)
      return launch_layernorm_bwd_as<DT, NV, WPR, true, FP8OPS_F16>(LNB_ARGS);
  }
  return launch_layernorm_bwd_as<DT, NV, WPR, true, FP8OPS_F32>(LNB_ARGS);
#undef LNB_ARGS
}

// NV = the 16-byte vectors per lane that cover a warp's slice of at most 1024
// columns: 1 .. 8 (fp32), 1 .. 4 (bf16, fp16). Two warps per row only for rows
// over 1024 columns, i.e. slices over 512 (NV over 4 / 2); four only for rows
// over 2048, slices over 512 again.
template <int DT>
static int layernorm_bwd_dispatch(int nv, int wpr, const void* dy, const void* x,
                                  const float* mean, const float* rstd, const float* gamma,
                                  bool rms, int64_t rows, int cols, int rows_per_warp,
                                  int64_t tiles, const void* dres, fp8ops_hp_dtype copy_dtype,
                                  void* dx, void* dcopy, float* partial, cudaStream_t s) {
  constexpr int MAX_NV = 1024 / 32 / (DT == FP8OPS_F32 ? 4 : 8);
  static_assert(MAX_NV == 8 || MAX_NV == 4, "the cases below cover 8 vectors per lane");
#define LNB_LAUNCH(n, w)                                                                       \
  return launch_layernorm_bwd<DT, n, w>(dy, x, mean, rstd, gamma, rms, rows, cols, rows_per_warp, \
                                        tiles, dres, copy_dtype, dx, dcopy, partial, s)
#define LNB_CASE(n)                                                                            \
  case n:                                                                                      \
    if constexpr (n <= MAX_NV) {                                                               \
      if (wpr == 1) LNB_LAUNCH(n, 1);                                                          \
      if constexpr (2 * n > MAX_NV) {                                                          \
        if (wpr == 2) LNB_LAUNCH(n, 2);                                                        \
        if (wpr == 4) LNB_LAUNCH(n, 4);                                                        \
      }                                                                                        \
    }                                                                                          \
    break;
  switch (nv) {
    LNB_CASE(1) LNB_CASE(2) LNB_CASE(3) LNB_CASE(4)
    LNB_CASE(5) LNB_CASE(6) LNB_CASE(7) LNB_CASE(8)
    default: break;
  }
#undef LNB_CASE
#undef LNB_LAUNCH
  return fp8ops_set_error(FP8OPS_ERR_INVALID, "layernorm_bwd: no kernel for %d warps per row of "
                          "%d vectors per lane", wpr, nv);
}

extern "C" int fp8ops_layernorm_bwd_cuda(const void* dy, const void* x, fp8ops_hp_dtype dtype,
                                         int64_t rows, int64_t cols, const float* mean,
                                         const float* rstd, const float* gamma, int rms,
                                         const void* dres, fp8ops_hp_dtype copy_dtype, void* dx,
                                         void* dcopy, float* dgb, float* partial,
                                         int64_t partial_floats, void* stream) {
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "layernorm_bwd: unknown dtype code %d", (int)dtype);
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && dgb &&
                     (rows == 0 || (dy && x && mean && rstd && dx && partial)),
                 "layernorm_bwd: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(fp8ops_layernorm_bwd_fusable(dy, x, dx, dtype, cols) &&
                     ((uintptr_t)dres & 15u) == 0,
                 "layernorm_bwd: on CUDA the rows must be 16-byte aligned vectors (per warp), at "
                 "most %d columns (found %lld)", FP8OPS_LN_BWD_MAX_COLS, (long long)cols);
  FP8OPS_REQUIRE(copy_dtype == FP8OPS_F32 ||
                     (dtype == FP8OPS_F32 &&
                      (copy_dtype == FP8OPS_BF16 || copy_dtype == FP8OPS_F16) &&
                      (rows == 0 || (dres && dcopy)) && ((uintptr_t)dcopy & 7u) == 0),
                 "layernorm_bwd: a copy (dtype code %d) only of dx + dres over fp32 rows, into an "
                 "8-byte aligned buffer", (int)copy_dtype);
  cudaStream_t s = (cudaStream_t)stream;
  if (rows == 0) {
    FP8OPS_CHECK_CUDA(cudaMemsetAsync(dgb, 0, 2 * (size_t)cols * sizeof(float), s));
    return FP8OPS_OK;
  }
  const int64_t tiles = fp8ops_layernorm_bwd_tiles(rows, cols);
  FP8OPS_REQUIRE(tiles <= INT32_MAX && partial_floats >= fp8ops_layernorm_bwd_partial_floats(rows, cols),
                 "layernorm_bwd: scratch of %lld floats, need %lld", (long long)partial_floats,
                 (long long)fp8ops_layernorm_bwd_partial_floats(rows, cols));
  const int epv = dtype == FP8OPS_F32 ? 4 : 8;
  const int wpr = fp8ops_layernorm_bwd_warps_per_row(cols);
  const int nv = (int)FP8OPS_CEIL_DIV(cols / epv / wpr, (int64_t)32);
  const int rpw = fp8ops_layernorm_bwd_rows_per_warp(rows, cols);
  int rc;
  switch (dtype) {
    case FP8OPS_F32:
      rc = layernorm_bwd_dispatch<FP8OPS_F32>(nv, wpr, dy, x, mean, rstd, gamma, rms != 0, rows,
                                              (int)cols, rpw, tiles, dres, copy_dtype, dx, dcopy,
                                              partial, s);
      break;
    case FP8OPS_BF16:
      rc = layernorm_bwd_dispatch<FP8OPS_BF16>(nv, wpr, dy, x, mean, rstd, gamma, rms != 0, rows,
                                               (int)cols, rpw, tiles, dres, copy_dtype, dx, dcopy,
                                               partial, s);
      break;
    default:
      rc = layernorm_bwd_dispatch<FP8OPS_F16>(nv, wpr, dy, x, mean, rstd, gamma, rms != 0, rows,
                                              (int)cols, rpw, tiles, dres, copy_dtype, dx, dcopy,
                                              partial, s);
  }
  FP8OPS_TRY(rc);
  const dim3 block(32, LNB_REDUCE_GROUPS);
  layernorm_bwd_reduce_kernel<<<(unsigned)FP8OPS_CEIL_DIV(2 * cols, (int64_t)32), block, 0, s>>>(
      partial, tiles, 2 * cols, dgb);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}
