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
#include "load_elem.cuh"  // defines: load_elem, vec_elem, map_vec

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

// The same statistics for rows of whole 16-byte vectors (at most 2048
// columns, 16-byte aligned): each lane loads its NV vectors of the row once,
// with all loads in flight together, and both sums come from registers, where
// the kernel above reads the row twice with 4-byte loads (on an H200 it
// reached ~1.9 TB/s on the 1B model's 16384 x 2048 fp32 rows).
template <int DT, int NV>
__global__ void __launch_bounds__(LN_THREADS)
    layernorm_stats_vec_kernel(const void* __restrict__ x, int64_t rows, int cols, float eps,
                               bool rms, float* __restrict__ mean, float* __restrict__ rstd) {
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
template <int DT>
static int launch_layernorm_stats_vec(const void* x, int64_t rows, int64_t cols, float eps,
                                      bool rms, float* mean, float* rstd, unsigned blocks,
                                      cudaStream_t s) {
  constexpr int EPV = DT == FP8OPS_F32 ? 4 : 8;
  const int64_t nv = FP8OPS_CEIL_DIV(cols / EPV, (int64_t)32);
  if (nv <= 1)
    layernorm_stats_vec_kernel<DT, 1><<<blocks, LN_THREADS, 0, s>>>(x, rows, (int)cols, eps, rms, mean, rstd);
  else if (nv <= 2)
    layernorm_stats_vec_kernel<DT, 2><<<blocks, LN_THREADS, 0, s>>>(x, rows, (int)cols, eps, rms, mean, rstd);
  else if (nv <= 4)
    layernorm_stats_vec_kernel<DT, 4><<<blocks, LN_THREADS, 0, s>>>(x, rows, (int)cols, eps, rms, mean, rstd);
  else if (nv <= 8)
    layernorm_stats_vec_kernel<DT, 8><<<blocks, LN_THREADS, 0, s>>>(x, rows, (int)cols, eps, rms, mean, rstd);
  else if constexpr (EPV == 4)  // (2048 bf16 / fp16 columns are 8 vectors per lane)
    if (nv <= 16)
      layernorm_stats_vec_kernel<DT, 16><<<blocks, LN_THREADS, 0, s>>>(x, rows, (int)cols, eps, rms,
                                                                      mean, rstd);
  if (nv > (EPV == 4 ? 16 : 8))
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "layernorm_stats: %lld columns is too wide for the "
                            "vector kernel", (long long)cols);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
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
  const int64_t epv = dtype == FP8OPS_F32 ? 4 : 8;
  if (cols <= 2048 && cols % epv == 0 && ((uintptr_t)x & 15u) == 0) {
    switch (dtype) {
      case FP8OPS_F32:
        return launch_layernorm_stats_vec<FP8OPS_F32>(x, rows, cols, eps, rms != 0, mean, rstd,
                                                       (unsigned)blocks, s);
      case FP8OPS_BF16:
        return launch_layernorm_stats_vec<FP8OPS_BF16>(x, rows, cols, eps, rms != 0, mean, rstd,
                                                       (unsigned)blocks, s);
      default:
        return launch_layernorm_stats_vec<FP8OPS_F16>(x, rows, cols, eps, rms != 0, mean, rstd,
                                                       (unsigned)blocks, s);
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
template <int DT, int NV, int WPR>
__global__ void __launch_bounds__(LNB_WARPS * 32)
    layernorm_bwd_kernel(const void* __restrict__ dy, const void* __restrict__ x,
                         const float* __restrict__ mean, const float* __restrict__ rstd,
                         const float* __restrict__ gamma, bool rms, int64_t rows, int cols,
                         int rows_per_warp, void* __restrict__ dx, float* __restrict__ partial) {
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
        float gam[EPV];
        load_gamma<EPV>(lnb_smem, v0 + k, gam);
        dxr[k] = map_vec<DT>(dv[j], [&](int e, float d) {
          const float xh = (vec_elem<DT>(xj, e) - m) * rs;
          dg[j * EPV + e] += d * xh;
          db[j * EPV + e] += d;
          return rs * (d * gam[e] - c1 - xh * c2);
        });
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

template <int DT, int NV, int WPR>
static int launch_layernorm_bwd(const void* dy, const void* x, const float* mean,
                                const float* rstd, const float* gamma, bool rms, int64_t rows,
                                int cols, int rows_per_warp, int64_t tiles, void* dx,
                                float* partial, cudaStream_t s) {
  const size_t smem = 3 * (size_t)cols * sizeof(float);
  if (smem > 40 * 1024)  // 4096 columns: 48 KB, over the default limit with the static red[]
    FP8OPS_CHECK_CUDA(cudaFuncSetAttribute(layernorm_bwd_kernel<DT, NV, WPR>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  layernorm_bwd_kernel<DT, NV, WPR><<<(unsigned)tiles, LNB_WARPS * 32, smem, s>>>(
      dy, x, mean, rstd, gamma, rms, rows, cols, rows_per_warp, dx, partial);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// NV = the 16-byte vectors per lane that cover a warp's slice of at most 1024
// columns: 1 .. 8 (fp32), 1 .. 4 (bf16, fp16). Two warps per row only for rows
// over 1024 columns, i.e. slices over 512 (NV over 4 / 2); four only for rows
// over 2048, slices over 512 again.
template <int DT>
static int layernorm_bwd_dispatch(int nv, int wpr, const void* dy, const void* x,
                                  const float* mean, const float* rstd, const float* gamma,
                                  bool rms, int64_t rows, int cols, int rows_per_warp,
                                  int64_t tiles, void* dx, float* partial, cudaStream_t s) {
  constexpr int MAX_NV = 1024 / 32 / (DT == FP8OPS_F32 ? 4 : 8);
  static_assert(MAX_NV == 8 || MAX_NV == 4, "the cases below cover 8 vectors per lane");
#define LNB_CASE(n)                                                                            \
  case n:                                                                                      \
    if constexpr (n <= MAX_NV) {                                                               \
      if (wpr == 1)                                                                            \
        return launch_layernorm_bwd<DT, n, 1>(dy, x, mean, rstd, gamma, rms, rows, cols,       \
                                              rows_per_warp, tiles, dx, partial, s);           \
      if constexpr (2 * n > MAX_NV) {                                                          \
        if (wpr == 2)                                                                          \
          return launch_layernorm_bwd<DT, n, 2>(dy, x, mean, rstd, gamma, rms, rows, cols,     \
                                                rows_per_warp, tiles, dx, partial, s);         \
        if (wpr == 4)                                                                          \
          return launch_layernorm_bwd<DT, n, 4>(dy, x, mean, rstd, gamma, rms, rows, cols,     \
                                                rows_per_warp, tiles, dx, partial, s);         \
      }                                                                                        \
    }                                                                                          \
    break;
  switch (nv) {
    LNB_CASE(1) LNB_CASE(2) LNB_CASE(3) LNB_CASE(4)
    LNB_CASE(5) LNB_CASE(6) LNB_CASE(7) LNB_CASE(8)
    default: break;
  }
#undef LNB_CASE
  return fp8ops_set_error(FP8OPS_ERR_INVALID, "layernorm_bwd: no kernel for %d warps per row of "
                          "%d vectors per lane", wpr, nv);
}

extern "C" int fp8ops_layernorm_bwd_cuda(const void* dy, const void* x, fp8ops_hp_dtype dtype,
                                         int64_t rows, int64_t cols, const float* mean,
                                         const float* rstd, const float* gamma, int rms,
                                         void* dx, float* dgb, float* partial,
                                         int64_t partial_floats, void* stream) {
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "layernorm_bwd: unknown dtype code %d", (int)dtype);
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && dgb &&
                     (rows == 0 || (dy && x && mean && rstd && dx && partial)),
                 "layernorm_bwd: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(fp8ops_layernorm_bwd_fusable(dy, x, dx, dtype, cols),
                 "layernorm_bwd: on CUDA the rows must be 16-byte aligned vectors (per warp), at "
                 "most %d columns (found %lld)", FP8OPS_LN_BWD_MAX_COLS, (long long)cols);
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
                                              (int)cols, rpw, tiles, dx, partial, s);
      break;
    case FP8OPS_BF16:
      rc = layernorm_bwd_dispatch<FP8OPS_BF16>(nv, wpr, dy, x, mean, rstd, gamma, rms != 0, rows,
                                               (int)cols, rpw, tiles, dx, partial, s);
      break;
    default:
      rc = layernorm_bwd_dispatch<FP8OPS_F16>(nv, wpr, dy, x, mean, rstd, gamma, rms != 0, rows,
                                              (int)cols, rpw, tiles, dx, partial, s);
  }
  FP8OPS_TRY(rc);
  const dim3 block(32, LNB_REDUCE_GROUPS);
  layernorm_bwd_reduce_kernel<<<(unsigned)FP8OPS_CEIL_DIV(2 * cols, (int64_t)32), block, 0, s>>>(
      partial, tiles, 2 * cols, dgb);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}
