/*
 * swiglu.cu -- CUDA kernels of the SwiGLU activation on its own (fp8ops.h:
 * fp8ops_swiglu_cuda, fp8ops_swiglu_grad_cuda): the forward where it is not
 * fused into an FP8 cast (a layer left in BF16, current scaling's first step,
 * an unaligned input), and its backward always. One pass each: torch runs
 * silu and mul forward, and mul's two products, silu_backward and the chunk's
 * cat backward, each a pass over the hidden activation.
 * Nothing here allocates or synchronises (CUDA-graph capturable).
 */
#include <cuda_runtime.h>  // defines: cudaStream_t, uint4
#include <stdint.h>

#include "common.h"       // defines: FP8OPS_REQUIRE, FP8OPS_CHECK_CUDA, FP8OPS_CEIL_DIV
#include "load_elem.cuh"  // defines: load_elem, store_elem, vec_elem, map_vec, round_to
#include "swiglu.h"       // defines: fp8ops_silu, fp8ops_silu_grad

#define SW_THREADS 256
#define SW_MAX_BLOCKS 8192  // grid-stride beyond: enough blocks to fill any current GPU

// One 16-byte vector (VEC elements of one row) per step: x [rows, 2 * cols]
// (gate, up), dh / out [rows, cols], dx [rows, 2 * cols]. Needs cols % VEC ==
// 0 and 16-byte aligned pointers (launch_swiglu checks). GRAD: dx from dh and
// x; else out = silu(gate) * up.
// Block dims: (256). Grid dims: (min(ceil(rows * cols / VEC / 256), 8192)), grid-stride.
template <int DT, bool GRAD>
__global__ void __launch_bounds__(SW_THREADS)
    swiglu_vec_kernel(const void* __restrict__ x, const void* __restrict__ dh,
                      void* __restrict__ out, int64_t rows, int64_t cols) {
  constexpr int ESZ = DT == FP8OPS_F32 ? 4 : 2;
  constexpr int VEC = 16 / ESZ;
  const int64_t per_row = cols / VEC, n = rows * per_row, up = cols * ESZ / 16;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / per_row, v = i - r * per_row;  // row, vector within the row's half
    const uint4* xg = (const uint4*)x + 2 * r * per_row + v;
    const uint4 g = __ldcs(xg), u = __ldcs(xg + up);
    if constexpr (GRAD) {
      const uint4 d = __ldcs((const uint4*)dh + i);
      uint4* dx = (uint4*)out + 2 * r * per_row + v;
      __stcs(dx, map_vec<DT>(g, [&](int j, float gv) {
               return round_to<DT>(vec_elem<DT>(d, j) * vec_elem<DT>(u, j)) * fp8ops_silu_grad(gv);
             }));
      __stcs(dx + up, map_vec<DT>(g, [&](int j, float gv) {
               return vec_elem<DT>(d, j) * round_to<DT>(fp8ops_silu(gv));
             }));
    } else {
      __stcs((uint4*)out + i, map_vec<DT>(g, [&](int j, float gv) {
               return round_to<DT>(fp8ops_silu(gv)) * vec_elem<DT>(u, j);
             }));
    }
  }
}

// The same, one element per step, for any cols and alignment.
template <int DT, bool GRAD>
__global__ void __launch_bounds__(SW_THREADS)
    swiglu_scalar_kernel(const void* __restrict__ x, const void* __restrict__ dh,
                         void* __restrict__ out, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t r = i / cols, gi = i + r * cols, ui = gi + cols;  // gi = 2 r cols + c
    const float g = load_elem<DT>(x, gi), u = load_elem<DT>(x, ui);
    if constexpr (GRAD) {
      const float d = load_elem<DT>(dh, i);
      store_elem<DT>(out, gi, round_to<DT>(d * u) * fp8ops_silu_grad(g));
      store_elem<DT>(out, ui, d * round_to<DT>(fp8ops_silu(g)));
    } else {
      store_elem<DT>(out, i, round_to<DT>(fp8ops_silu(g)) * u);
    }
  }
}

static inline bool aligned16(const void* p) { return ((uintptr_t)p & 15u) == 0; }

template <int DT, bool GRAD>
static int launch_swiglu(const void* x, const void* dh, void* out, int64_t rows, int64_t cols,
                         cudaStream_t s) {
  constexpr int VEC = DT == FP8OPS_F32 ? 4 : 8;
  const bool vec = cols % VEC == 0 && aligned16(x) && aligned16(out) && (!GRAD || aligned16(dh));
  const int64_t steps = vec ? rows * (cols / VEC) : rows * cols;
  const int64_t blocks = FP8OPS_CEIL_DIV(steps, (int64_t)SW_THREADS);
  const unsigned grid = (unsigned)(blocks < SW_MAX_BLOCKS ? blocks : SW_MAX_BLOCKS);
  if (vec)
    swiglu_vec_kernel<DT, GRAD><<<grid, SW_THREADS, 0, s>>>(x, dh, out, rows, cols);
  else
    swiglu_scalar_kernel<DT, GRAD><<<grid, SW_THREADS, 0, s>>>(x, dh, out, rows, cols);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

template <bool GRAD>
static int swiglu_cuda(const char* op, const void* x, const void* dh, fp8ops_hp_dtype dtype,
                       int64_t rows, int64_t cols, void* out, void* stream) {
  FP8OPS_REQUIRE(rows >= 0 && cols >= 0 && (cols == 0 || rows <= INT64_MAX / 2 / cols),
                 "%s: bad shape [%lld, 2 * %lld]", op, (long long)rows, (long long)cols);
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "%s: unknown dtype code %d", op, (int)dtype);
  if (rows * cols == 0) return FP8OPS_OK;
  FP8OPS_REQUIRE(x && out && (!GRAD || dh), "%s: null pointer", op);
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case FP8OPS_F32: return launch_swiglu<FP8OPS_F32, GRAD>(x, dh, out, rows, cols, s);
    case FP8OPS_BF16: return launch_swiglu<FP8OPS_BF16, GRAD>(x, dh, out, rows, cols, s);
    default: return launch_swiglu<FP8OPS_F16, GRAD>(x, dh, out, rows, cols, s);
  }
}

extern "C" int fp8ops_swiglu_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                                  void* out, void* stream) {
  return swiglu_cuda<false>("swiglu", x, NULL, dtype, rows, cols, out, stream);
}

extern "C" int fp8ops_swiglu_grad_cuda(const void* dh, const void* x, fp8ops_hp_dtype dtype,
                                       int64_t rows, int64_t cols, void* dx, void* stream) {
  return swiglu_cuda<true>("swiglu_grad", x, dh, dtype, rows, cols, dx, stream);
}
