/*
 * amax_update.cu -- CUDA kernel of fp8ops::amax_update (delayed scaling): for
 * n scaled tensors at once, in one launch, reduce each column of the amax
 * history, compute the new scale and scale_inv, and roll the history.
 * The rules are written once here and once in amax_update_cpu.c (fp8ops.h):
 *   a = max_h |history[h, i]| (algo max) or |history[0, i]| (most_recent),
 *       NaN-propagating in row 0 (max over |bits|: NaN sorts above +inf); a NaN/inf
 *       in an older row is skipped;
 *   if a is finite and > 0: scale = (fp8_max / a) / 2^margin, inf -> FLT_MAX;
 *   else the scale keeps its value; scale_inv = 1 / scale;
 *   history[:, i] = roll(history[:, i], -1) (row h takes row h + 1, the old
 *   row 0 goes to row H - 1), then row 0 = 0.
 * 2^margin is exp2f(margin) evaluated on the host by the launcher, i.e. by the
 * same libm call as the CPU reference, so scale is bit-identical to it (the
 * divisions are IEEE round-to-nearest on both sides).
 * No allocation, no synchronisation, no host read of device memory: the
 * launcher can be captured in a CUDA graph.
 */
#include <cuda_runtime.h>  // defines: cudaStream_t, dim3
#include <float.h>         // defines: FLT_MAX
#include <math.h>          // defines: exp2f (host)
#include <stdint.h>
#include <string.h>  // defines: memset

#include "common.h"       // defines: FP8OPS_REQUIRE, FP8OPS_CHECK_CUDA, FP8OPS_CEIL_DIV
#include "fp8_convert.h"  // defines: fp8ops_f32_bits, fp8ops_bits_f32

// ----------------------------------------------------------------------------
// CUDA kernels

#define AU_THREADS 256  // threads per block, blockDim.x * blockDim.y
#define AU_RPT 8        // history rows per thread per iteration (loads in flight)

// Block dims: (cx, cy) with cx = min(32, next power of two >= n) columns and
// cy = 256 / cx rows. Grid dims: (ceil(n / cx)).
// Thread (tx, ty) owns column i = blockIdx.x * cx + tx. A warp reads whole
// 4 * cx-byte row segments of the [H, n] history (coalesced; for small n one
// warp covers several rows). Each iteration handles a chunk of cy * AU_RPT
// rows: thread ty loads rows r + 1 for r = r0 + ty + cy * k (k < AU_RPT, all
// loads in flight), folds them into its running max, and after a barrier
// writes them one row up (row r := row r + 1, row H - 1 := the old row 0,
// row 0 := 0). In-place safety: a chunk reads rows r0 + 1 .. r0 + chunk and
// writes rows r0 .. r0 + chunk - 1, so the only row both read and written
// across chunks (r0 + chunk) is read before this chunk's barrier and written
// after the next one; row 0 is read by every thread before the first
// barrier. Finally the per-thread maxima are tree-reduced over ty in shared
// memory and thread ty == 0 computes scale and scale_inv of its column.
// One block's work: columns block_col0 .. block_col0 + cx - 1 of one history.
__device__ __forceinline__ void amax_update_block(float* __restrict__ hist, float* __restrict__ scale,
                                                  float* __restrict__ scale_inv,
                                                  const float* __restrict__ fp8_max,
                                                  int64_t* __restrict__ overflow_count,
                                                  int64_t scale_inv_stride, int64_t n, int64_t H,
                                                  float pow2_margin, int most_recent,
                                                  int64_t block_col0, uint32_t* red) {
  const int cx = blockDim.x, cy = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int64_t col = block_col0 + tx;
  const bool active = col < n;
  float* hc = hist + (active ? col : 0);  // element (r, col) is hc[r * n]

  const float h0 = active ? hc[0] : 0.0f;  // this step's amax; becomes row H - 1
  uint32_t m = fp8ops_f32_bits(h0) & 0x7FFFFFFFu;  // max over |bits|, NaN-propagating

  const int64_t chunk = (int64_t)cy * AU_RPT;
  for (int64_t r0 = 0; r0 < H; r0 += chunk) {
    float v[AU_RPT];
#pragma unroll
    for (int k = 0; k < AU_RPT; ++k) {
      const int64_t r = r0 + ty + (int64_t)cy * k;  // the row this value goes to
      v[k] = h0;                                     // row H - 1 gets the old row 0
      if (active && r + 1 < H) {
        v[k] = hc[(r + 1) * n];
        const uint32_t b = fp8ops_f32_bits(v[k]) & 0x7FFFFFFFu;
        if (b < FP8OPS_F32_INF_BITS) m = max(m, b);  // an older step's NaN/inf: skipped
      }
    }
    __syncthreads();  // every read of this chunk (and of row 0) before any write
#pragma unroll
    for (int k = 0; k < AU_RPT; ++k) {
      const int64_t r = r0 + ty + (int64_t)cy * k;
      if (active && r < H) hc[r * n] = r == 0 ? 0.0f : v[k];
    }
  }

  // max over the cy threads of each column (cy is a power of two)
  red[ty * cx + tx] = m;
  __syncthreads();
  for (int s = cy >> 1; s > 0; s >>= 1) {
    if (ty < s) red[ty * cx + tx] = max(red[ty * cx + tx], red[(ty + s) * cx + tx]);
    __syncthreads();
  }

  if (ty == 0 && active) {
    const uint32_t abits = most_recent ? fp8ops_f32_bits(h0) & 0x7FFFFFFFu : red[tx];
    const float a = fp8ops_bits_f32(abits);
    float s = scale[col];
    if (isfinite(a) && a > 0.0f) {
      const float t = (fp8_max[col] / a) / pow2_margin;  // same expression order as the CPU
      // an overflow clamps to FLT_MAX; an underflow to 0 (huge amax, large margin) keeps s
      if (isinf(t)) s = FLT_MAX;
      else if (t > 0.0f && isfinite(1.0f / t)) s = t;  // scale_inv must stay finite too
    }
    // a scale that came in 0, negative, inf or NaN is not kept either (as on the CPU)
    if (!(isfinite(s) && s > 0.0f && isfinite(1.0f / s))) s = 1.0f;
    scale[col] = s;
    scale_inv[col * scale_inv_stride] = 1.0f / s;
    if (overflow_count && !isfinite(h0)) overflow_count[col] += 1;  // one thread per column
  }
}

__global__ void __launch_bounds__(AU_THREADS)
    amax_update_kernel(float* __restrict__ hist, float* __restrict__ scale,
                       float* __restrict__ scale_inv, const float* __restrict__ fp8_max,
                       int64_t* __restrict__ overflow_count, int64_t scale_inv_stride,
                       int64_t n, int64_t H, float pow2_margin, int most_recent) {
  __shared__ uint32_t red[AU_THREADS];
  amax_update_block(hist, scale, scale_inv, fp8_max, overflow_count, scale_inv_stride, n, H,
                    pow2_margin, most_recent, (int64_t)blockIdx.x * blockDim.x, red);
}

// Many histories in one launch (e.g. every layer of a model after an optimizer
// step): the jobs travel by value in the kernel's parameters (no host-to-device
// copy, graph-capturable). Block (x, y) does column chunk x of job y, the block
// shaped for the launch's widest job as above; blocks past a job's last column
// exit at once (whole blocks: no barrier is split).
#define AU_MANY 32  // jobs per launch: 32 * sizeof(job) stays far below the 4 KiB parameter limit
struct au_job {
  float* hist;
  float* scale;
  float* scale_inv;
  const float* fp8_max;
  int64_t* overflow_count;
  int64_t scale_inv_stride, n, H;
  float pow2_margin;
  int most_recent;
};
struct au_jobs {
  au_job job[AU_MANY];
};

__global__ void __launch_bounds__(AU_THREADS) amax_update_many_kernel(const au_jobs jobs) {
  __shared__ uint32_t red[AU_THREADS];
  const au_job& j = jobs.job[blockIdx.y];
  const int64_t col0 = (int64_t)blockIdx.x * blockDim.x;
  if (col0 >= j.n) return;
  amax_update_block(j.hist, j.scale, j.scale_inv, j.fp8_max, j.overflow_count, j.scale_inv_stride,
                    j.n, j.H, j.pow2_margin, j.most_recent, col0, red);
}

// ----------------------------------------------------------------------------
// kernel launchers

extern "C" int fp8ops_amax_update_cuda(float* amax_history, float* scale, float* scale_inv,
                                       const float* fp8_max, int64_t n, int64_t H, float margin,
                                       fp8ops_amax_algo algo, int64_t* overflow_count,
                                       int64_t scale_inv_stride, void* stream) {
  FP8OPS_TRY(fp8ops_amax_update_check(amax_history, scale, scale_inv, fp8_max, n, H, algo,
                                      scale_inv_stride));
  FP8OPS_REQUIRE(n == 0 || H <= INT64_MAX / n, "amax_update: history [%lld, %lld] too large",
                 (long long)H, (long long)n);
  if (n == 0) return FP8OPS_OK;
  int cx = 1;
  while (cx < 32 && cx < n) cx *= 2;
  const dim3 block(cx, AU_THREADS / cx);
  const int64_t blocks = FP8OPS_CEIL_DIV(n, (int64_t)cx);
  FP8OPS_REQUIRE(blocks <= INT32_MAX, "amax_update: too many tensors (n=%lld)", (long long)n);
  // evaluated here, by the same libm call as amax_update_cpu.c
  const float pow2_margin = exp2f(margin);
  amax_update_kernel<<<(unsigned)blocks, block, 0, (cudaStream_t)stream>>>(
      amax_history, scale, scale_inv, fp8_max, overflow_count, scale_inv_stride, n, H, pow2_margin,
      algo == FP8OPS_AMAX_MOST_RECENT ? 1 : 0);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

extern "C" int fp8ops_amax_update_many_cuda(const fp8ops_amax_update_job* jobs, int64_t count,
                                            void* stream) {
  FP8OPS_REQUIRE(count >= 0 && (count == 0 || jobs), "amax_update_many: bad job list");
  // every job is checked before the first launch: a bad job changes no history
  for (int64_t i = 0; i < count; ++i) {
    const fp8ops_amax_update_job* in = &jobs[i];
    FP8OPS_TRY(fp8ops_amax_update_check(in->amax_history, in->scale, in->scale_inv, in->fp8_max,
                                        in->n, in->H, (fp8ops_amax_algo)in->algo,
                                        in->scale_inv_stride));
    FP8OPS_REQUIRE(in->n == 0 || in->H <= INT64_MAX / in->n,
                   "amax_update_many: history [%lld, %lld] too large", (long long)in->H,
                   (long long)in->n);
    FP8OPS_REQUIRE(in->n <= (int64_t)INT32_MAX * 32, "amax_update_many: too many tensors in one "
                   "job (n=%lld)", (long long)in->n);
    FP8OPS_REQUIRE(in->margin == in->margin && in->margin > -64.f && in->margin < 64.f,
                   "amax_update_many: margin must be a number in (-64, 64), found %g",
                   (double)in->margin);
  }
  for (int64_t first = 0; first < count; first += AU_MANY) {
    au_jobs batch;
    memset(&batch, 0, sizeof batch);
    const int64_t k = count - first < AU_MANY ? count - first : AU_MANY;
    int64_t max_n = 0;
    for (int64_t i = 0; i < k; ++i) {
      const fp8ops_amax_update_job* in = &jobs[first + i];
      au_job* o = &batch.job[i];
      o->hist = in->amax_history;
      o->scale = in->scale;
      o->scale_inv = in->scale_inv;
      o->fp8_max = in->fp8_max;
      o->overflow_count = in->overflow_count;
      o->scale_inv_stride = in->scale_inv_stride;
      o->n = in->n;
      o->H = in->H;
      o->pow2_margin = exp2f(in->margin);  // the same libm call as the single-job launcher
      o->most_recent = in->algo == FP8OPS_AMAX_MOST_RECENT ? 1 : 0;
      if (in->n > max_n) max_n = in->n;
    }
    if (max_n == 0) continue;
    // the block as narrow as the widest history (Fp8Linear's have 3 columns: 4 x 64 threads,
    // 512 rows per pass); 32 x 8 for every width took 16 passes over a 1024-row history, each
    // a round trip to memory: 58 us per launch on an H200, measured, for 12 KB of data
    int cx = 1;
    while (cx < 32 && cx < max_n) cx *= 2;
    const dim3 grid((unsigned)FP8OPS_CEIL_DIV(max_n, (int64_t)cx), (unsigned)k),
        block(cx, AU_THREADS / cx);
    amax_update_many_kernel<<<grid, block, 0, (cudaStream_t)stream>>>(batch);
    FP8OPS_CHECK_CUDA(cudaGetLastError());
  }
  return FP8OPS_OK;
}
