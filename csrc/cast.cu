/*
 * cast.cu -- CUDA kernels of fp8ops::cast (hp -> fp8 with a scale, saturating,
 * optional transposed copy, fused amax) and fp8ops::amax (max |x|, current
 * scaling). Bit for bit the same as cast_cpu.c, i.e. as
 * out = fp8(clamp(float(x) * scale, -max, max)) (no clamp for an infinite x,
 * which stays non-finite: NaN in e4m3, inf in e5m2) with fp8_convert.h's
 * conversions: the per-element conversion below is a branch-free equivalent of
 * fp8ops_f32_to_e4m3 / e5m2 after the clamp (no hardware cvt), checked against
 * them over all 2^32 fp32 inputs by benchmarks/dev/cast_check.cu. amax is a
 * max over |x| bits (for non-negative floats the uint32 order is the value
 * order and every NaN sorts above +inf, so the max propagates NaN).
 * Never build with --use_fast_math / -ftz=true: the rounding relies on fp32
 * adds and multiplies that keep subnormals.
 *
 * Paths of fp8ops_cast_cuda:
 *   cast_transpose_kernel   out and out_t, rows % 16 == 0, cols % 16 == 0 and
 *                           16-byte aligned pointers (every FP8 GEMM operand):
 *                           16-byte loads, an 8 x VEC block per thread
 *                           transposed in registers (byte permutes), a
 *                           swizzled shared tile, 16-byte stores of out_t
 *                           (8- / 4-byte row stores of out, 128 / 64
 *                           contiguous bytes per half-warp).
 *   cast_transpose_general_kernel   out and out_t, any shape or alignment:
 *                           scalar loads, 32 x 32 tile through shared memory.
 *   cast_kernel             out only: flat elementwise over rows * cols,
 *                           16-byte loads in the aligned middle, scalar head
 *                           and tail (x may be a view with a storage offset).
 * All of them reduce amax per block and finish with one atomicMax on the
 * uint32 bits of *amax, which the launcher zeroes first on the same stream.
 * GELU instances (fp8ops_gelu_cast_accumulate_cuda) cast gelu_tanh(x) instead
 * of x: each element is replaced right after its load by its GELU rounded to
 * x's dtype, the tensor torch's GELU kernel would have written, so the rest of
 * each kernel is unchanged and the model's GELU pass disappears. DGELU
 * instances of the transposing kernel (fp8ops_dgelu_cast_accumulate_cuda)
 * likewise replace each element x of the output gradient by
 * x * gelu_tanh'(h) (h read from a second input of the same shape), rounded
 * to x's dtype: what torch's GELU backward would have written. SWIGLU
 * instances (fp8ops_swiglu_cast_accumulate_cuda) read x [rows, 2 * cols] and
 * replace each element by silu(gate) * up of its two halves (swiglu.h).
 * Nothing here allocates, synchronises or reads device memory from the host,
 * so every launcher can be captured in a CUDA graph.
 */
#include <cuda_fp16.h>     // defines: __half2float, __ushort_as_half
#include <cuda_runtime.h>  // defines: cudaStream_t, cudaMemsetAsync, uint4 / uint2
#include <stdint.h>

#include "common.h"       // defines: FP8OPS_REQUIRE, FP8OPS_CHECK_CUDA, FP8OPS_CEIL_DIV
#include "fp8_convert.h"  // defines: fp8ops_f32_bits / bits_f32, fp8ops_bf16/f16_to_f32
#include "gelu.h"         // defines: fp8ops_gelu_tanh
#include "swiglu.h"       // defines: fp8ops_silu
#include "load_elem.cuh"  // defines: load_elem, vec_elem, map_vec

// ----------------------------------------------------------------------------
// CUDA helpers (element conversion)
//
// Why not call fp8ops_f32_to_e4m3 per element: its if / else-if chain compiles
// to a real branch per element (BSSY / BSYNC, no interleaving across
// elements), about 29 instructions per element in the transposing kernel,
// which then cannot reach the memory bandwidth (at ~4.1 elements per clock
// per SM on an H200 the kernel is issue-bound, not memory-bound). The
// conversion below is branch-free, ~7 instructions per element, and gives the
// same bits as `y = v * s; clamp to +-max (NaN passes); fp8ops_f32_to_e4m3/
// e5m2(y)` of cast_cpu.c for every fp32 y: benchmarks/dev/cast_check.cu
// compares it exhaustively (all 2^32 inputs) against fp8_convert.h.
//
// Rounding: for a = |y| clamped to max, with k = max(exponent of a, emin)
// (emin = -6 for e4m3, -14 for e5m2) the fp8 grid step there is
// q = 2^(k - mbits). Adding M = 2^(k + 23 - mbits) + delta * q puts a into a
// binade whose fp32 ulp is exactly q, so the fp32 add rounds a to the fp8 grid
// with ties to even (delta is even), subnormals included. The sum's bits are
// bits(2^K) + delta + n (n = round(a / q)), and the fp8 code is
// n + (bits(M) >> (23 - mbits)) - const; delta is chosen so that const
// vanishes mod 256 (152 for e4m3, 232 for e5m2): the code is the low byte of
// `sum_bits + (M_bits >> (23 - mbits))` (one LEA.HI). M itself is one
// VIADDMNMX: max(exponent_bits(a) + offset, floor) on sm_90+.
// NaN and an infinite input never reach this (cast_byte patches them); a
// finite input whose product overflows to +inf clamps to max.

// fp32 arithmetic that must round exactly like the CPU's: the _rn intrinsics
// are never contracted into an FMA. Host versions for tests.
__host__ __device__ __forceinline__ float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
__host__ __device__ __forceinline__ float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
__host__ __device__ __forceinline__ uint32_t umin32(uint32_t a, uint32_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ uint32_t umax32(uint32_t a, uint32_t b) { return a > b ? a : b; }

template <int FMT>
struct Fp8Consts {
  static constexpr uint32_t max_bits = FMT == FP8OPS_E4M3 ? 0x43E00000u : 0x47600000u;  // 448 / 57344
  static constexpr uint32_t shift = FMT == FP8OPS_E4M3 ? 20 : 21;  // 23 - mantissa bits
  static constexpr uint32_t min_exp = FMT == FP8OPS_E4M3 ? 121 : 113;  // fp32 biased exponent of emin
  static constexpr uint32_t delta = FMT == FP8OPS_E4M3 ? 152 : 232;
  static constexpr uint32_t magic_add = (shift << 23) + delta;
  static constexpr uint32_t magic_min = ((min_exp + shift) << 23) + delta;
};

// |y| as bits (not NaN; +inf allowed) -> fp8 code of the saturated value in
// the low 8 bits (upper bits are garbage; callers take the low byte).
template <int FMT>
__host__ __device__ __forceinline__ uint32_t fp8_code(uint32_t a) {
  using K = Fp8Consts<FMT>;
  const uint32_t c = umin32(a, K::max_bits);
  const uint32_t m = umax32((c & 0x7F800000u) + K::magic_add, K::magic_min);
  const uint32_t s = fp8ops_f32_bits(add_rn(fp8ops_bits_f32(c), fp8ops_bits_f32(m)));
  return s + (m >> K::shift);
}

// The complete fp8 byte of x * scale for any x and scale, as cast_cpu.c
// computes it on x86. NaN: 0x7F with a sign bit. An infinite x (whose product
// is not NaN) gives the format's non-finite code, NaN (e4m3fn) or inf (e5m2),
// with the product's sign; a finite x whose product overflows saturates.
// The GPU's fmul returns a canonical (positive) NaN, x86's mulss does not, so the sign is the one
// x86 gives `x * scale`: a NaN operand's own sign (x first), or negative for
// an invalid product (0 * inf: x86's default NaN is negative).
template <int FMT>
__host__ __device__ __forceinline__ uint32_t cast_byte(float x, float scale) {
  const uint32_t yb = fp8ops_f32_bits(mul_rn(x, scale));
  const uint32_t a = yb & 0x7FFFFFFFu;
  const uint32_t xb = fp8ops_f32_bits(x), sb = fp8ops_f32_bits(scale);
  const uint32_t nan_sign = (xb & 0x7FFFFFFFu) > 0x7F800000u   ? xb
                            : (sb & 0x7FFFFFFFu) > 0x7F800000u ? sb
                                                               : 0x80000000u;
  const bool nan = a > 0x7F800000u;
  const bool inf_x = (xb & 0x7FFFFFFFu) == 0x7F800000u;
  const uint32_t code = nan ? 0x7Fu : inf_x ? (FMT == FP8OPS_E4M3 ? 0x7Fu : 0x7Cu) : fp8_code<FMT>(a) & 0xFFu;
  return code | (((nan ? nan_sign : yb) >> 24) & 0x80u);
}

// The operands of a cast kernel's prologue (ACT): the GELU's input for
// ACT_DGELU; per-row mean / rstd and per-column gamma / beta for ACT_LN
// (gamma, beta NULL: ones, zeros; an RMSNorm's mean is 0, layernorm.cu);
// for ACT_BLOCKS the blocks' data, row strides (elements) and the columns
// where blocks 0 and 1 end (x itself is unused).
struct Prologue {
  const void* aux;
  const float* mean;
  const float* rstd;
  const float* gamma;
  const float* beta;
  const void* blk[FP8OPS_MAX_BLOCKS];
  int64_t blk_ld[FP8OPS_MAX_BLOCKS];
  int64_t blk_end[FP8OPS_MAX_BLOCKS - 1];
};

// The elementwise prologue of a cast kernel instance (ACT template argument)
#define ACT_NONE 0
#define ACT_GELU 1   // cast gelu_tanh(x)
#define ACT_DGELU 2  // cast x * gelu_tanh'(aux)
#define ACT_LN 3     // cast LayerNorm(x): gamma * (rstd * (x - mean)) + beta, per row / column
#define ACT_SWIGLU 4 // cast silu(x[:, :cols]) * x[:, cols:], x [rows, 2 * cols] (swiglu.h)
#define ACT_BLOCKS 5 // cast x given as column blocks (fp8ops_col_blocks), never concatenated

// ----------------------------------------------------------------------------
// CUDA helpers (amax, packing)

// Running max of |x| over one thread's elements, as ordered bits.
// fp32: max of |bits|. bf16 / fp16: the 16-bit sign-magnitude patterns order
// like the values too (NaN above inf), so 32-bit words (two elements) are
// reduced raw and turned into fp32 bits only at the end. On sm_90+ with the
// 16x2 integer max (VIMNMX3): the unsigned max of the raw halves is
// 0x8000 + the largest negative magnitude (when there is one), the signed
// max (from 0) the largest positive one; no masking per word. Older parts
// keep two 32-bit maxima of masked halves. Scalar paths fold fp32 bits into
// `f32`.
template <int DT>
struct AbsMax {
  uint32_t f32 = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t mu = 0, ms = 0;
  __device__ __forceinline__ void add_word(uint32_t w) {
    if constexpr (DT == FP8OPS_F32) {
      f32 = max(f32, w & 0x7FFFFFFFu);
    } else {
      mu = __vmaxu2(mu, w);
      ms = __vmaxs2(ms, w);
    }
  }
  __device__ __forceinline__ void merge(const AbsMax& o) {
    f32 = max(f32, o.f32);
    mu = __vmaxu2(mu, o.mu);
    ms = __vmaxs2(ms, o.ms);
  }
  // largest |x| of the words as 16-bit bits (ms halves are in [0, 0x7FFF]; a
  // mu half below 0x8000 is a positive value, already in ms)
  __device__ __forceinline__ uint32_t m16() const {
    const uint32_t t = __vmaxu2(ms, mu & 0x7FFF7FFFu);  // per 16-bit half
    return max(t & 0xFFFFu, t >> 16);
  }
#else
  uint32_t lo = 0, hi = 0;
  __device__ __forceinline__ void add_word(uint32_t w) {
    if constexpr (DT == FP8OPS_F32) {
      f32 = max(f32, w & 0x7FFFFFFFu);
    } else {
      lo = max(lo, w & 0x7FFFu);
      hi = max(hi, w & 0x7FFF0000u);
    }
  }
  __device__ __forceinline__ void merge(const AbsMax& o) {
    f32 = max(f32, o.f32);
    lo = max(lo, o.lo);
    hi = max(hi, o.hi);
  }
  __device__ __forceinline__ uint32_t m16() const { return max(lo, hi >> 16); }
#endif
  __device__ __forceinline__ void add_vec(const uint4& v) {
    add_word(v.x);
    add_word(v.y);
    add_word(v.z);
    add_word(v.w);
  }
  __device__ __forceinline__ void add_f32(float v) {
    f32 = max(f32, fp8ops_f32_bits(v) & 0x7FFFFFFFu);
  }
  // every element added with add_word is finite
  __device__ __forceinline__ bool words_finite() const {
    if constexpr (DT == FP8OPS_F32) {
      return f32 < 0x7F800000u;
    } else {
      return m16() < (DT == FP8OPS_BF16 ? 0x7F80u : 0x7C00u);
    }
  }
  // the result: |amax| as fp32 bits
  __device__ __forceinline__ uint32_t bits() const {
    if constexpr (DT == FP8OPS_F32) {
      return f32;
    } else if constexpr (DT == FP8OPS_BF16) {
      return max(f32, m16() << 16);
    } else {
      return max(f32, fp8ops_f32_bits(fp8ops_f16_to_f32((uint16_t)m16())));
    }
  }
};

// Block-wide max of `v` (uint32 bits of |amax|), then one atomicMax into
// *amax by thread 0. Every thread of the block must call it (warp reduce and
// a barrier inside). `red` holds one word per warp; 1-D blocks.
__device__ __forceinline__ void block_amax_atomic(uint32_t v, uint32_t* red, float* amax) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = __reduce_max_sync(0xFFFFFFFFu, v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t m = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = max(m, red[w]);
    // signed: |x|'s bits are >= 0 and ordered as the floats (NaN above inf), and a
    // negative value in *amax (sign bit set) is below every amax, 0 included
    atomicMax((int*)amax, (int)m);
  }
}

// 4x4 byte transpose: in a..d are rows 0..3 (byte k = column k), out c0..c3
// are columns 0..3 (byte k = row k). Eight PRMTs.
__device__ __forceinline__ void transpose4x4(uint32_t a, uint32_t b, uint32_t c, uint32_t d,
                                             uint32_t& c0, uint32_t& c1, uint32_t& c2,
                                             uint32_t& c3) {
  const uint32_t s0 = __byte_perm(a, b, 0x5140);  // a0 b0 a1 b1
  const uint32_t s1 = __byte_perm(a, b, 0x7362);  // a2 b2 a3 b3
  const uint32_t s2 = __byte_perm(c, d, 0x5140);  // c0 d0 c1 d1
  const uint32_t s3 = __byte_perm(c, d, 0x7362);  // c2 d2 c3 d3
  c0 = __byte_perm(s0, s2, 0x5410);               // a0 b0 c0 d0
  c1 = __byte_perm(s0, s2, 0x7632);               // a1 b1 c1 d1
  c2 = __byte_perm(s1, s3, 0x5410);
  c3 = __byte_perm(s1, s3, 0x7632);
}

// The low bytes of four words packed into one, b0 first. Three PRMTs.
__device__ __forceinline__ uint32_t pack4(uint32_t b0, uint32_t b1, uint32_t b2, uint32_t b3) {
  return __byte_perm(__byte_perm(b0, b1, 0x0040), __byte_perm(b2, b3, 0x0040), 0x5410);
}

// Elements per 16-byte vector and packed fp8 words per vector.
template <int DT>
struct VecInfo {
  static constexpr int esz = DT == FP8OPS_F32 ? 4 : 2;
  static constexpr int vec = 16 / esz;   // 4 or 8 elements
  static constexpr int words = vec / 4;  // 1 or 2 words of fp8 bytes
};

// Fast conversion of one 16-byte vector whose elements are all finite, with a
// finite scale >= +0 (so no NaN anywhere, and sign(x * scale) = sign(x)):
// codes from |x| * scale, the sign bits straight from the input words.
// p gets VecInfo::words packed words.
template <int DT, int FMT>
__device__ __forceinline__ void cast_vec_fast(const uint4& v, float scale, uint32_t* p) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (DT == FP8OPS_F32) {
    uint32_t c[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      c[k] = fp8_code<FMT>(fp8ops_f32_bits(mul_rn(fabsf(fp8ops_bits_f32(w[k])), scale)));
    const uint32_t signs = __byte_perm(__byte_perm(w[0], w[1], 0x0073),
                                       __byte_perm(w[2], w[3], 0x0073), 0x5410);
    p[0] = (pack4(c[0], c[1], c[2], c[3]) | (signs & 0x80808080u));
  } else {
    uint32_t c[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      float lo, hi;
      if constexpr (DT == FP8OPS_BF16) {
        lo = fabsf(fp8ops_bits_f32(w[k] << 16));  // exact: bf16 is the top half of fp32
        hi = fabsf(fp8ops_bits_f32(w[k] & 0xFFFF0000u));
      } else {
        // fp16 magnitude bits shifted into fp32 position read as a float that
        // is exactly 2^-112 times the value (fp16 subnormals land on fp32
        // subnormals); the power-of-two product is exact. Finite inputs only.
        lo = mul_rn(fp8ops_bits_f32((w[k] & 0x7FFFu) << 13), 0x1p112f);
        hi = mul_rn(fp8ops_bits_f32((w[k] >> 3) & 0x0FFFE000u), 0x1p112f);
      }
      c[2 * k] = fp8_code<FMT>(fp8ops_f32_bits(mul_rn(lo, scale)));
      c[2 * k + 1] = fp8_code<FMT>(fp8ops_f32_bits(mul_rn(hi, scale)));
    }
    // sign bits of elements 0..3 are the top bits of bytes 1, 3 of w0, w1
    const uint32_t s01 = __byte_perm(w[0], w[1], 0x7531);
    const uint32_t s23 = __byte_perm(w[2], w[3], 0x7531);
    p[0] = (pack4(c[0], c[1], c[2], c[3]) | (s01 & 0x80808080u));
    p[1] = (pack4(c[4], c[5], c[6], c[7]) | (s23 & 0x80808080u));
  }
}

// Exact conversion of one 16-byte vector for any values (NaN, inf): each
// element through cast_byte. Its packed words come back by value (a uint2; the
// second word 0 for fp32). Not inlined: the kernels' fast path then keeps the
// registers it would have alone. Inlined eight times into the transposing
// kernel, this rare path (a NaN / inf among a thread's inputs, or a negative
// scale) made ptxas spill 380-668 bytes per thread of the bf16 instances at
// their 64-register bound, slowing the common path's cast + transpose by ~5 %
// on an H200 (RESULTS.md, section 2).
template <int DT, int FMT>
__device__ __noinline__ uint2 cast_vec_full(uint4 v, float scale) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
  if constexpr (DT == FP8OPS_F32) {
    return make_uint2(pack4(cast_byte<FMT>(fp8ops_bits_f32(w[0]), scale),
                            cast_byte<FMT>(fp8ops_bits_f32(w[1]), scale),
                            cast_byte<FMT>(fp8ops_bits_f32(w[2]), scale),
                            cast_byte<FMT>(fp8ops_bits_f32(w[3]), scale)),
                      0u);
  } else {
    uint32_t b[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint16_t h = (uint16_t)(w[k >> 1] >> (16 * (k & 1)));
      b[k] = cast_byte<FMT>(DT == FP8OPS_BF16 ? fp8ops_bf16_to_f32(h) : fp8ops_f16_to_f32(h), scale);
    }
    return make_uint2(pack4(b[0], b[1], b[2], b[3]), pack4(b[4], b[5], b[6], b[7]));
  }
}

// Converts N vectors, updates `am`. The fast conversion runs when the scale
// is finite and not negative and all N * vec inputs are finite (then no
// product is NaN); else the exact one (a branch per thread per batch, not per
// element; scales are positive in practice, NaN / inf inputs rare).
template <int DT, int FMT, int N>
__device__ __forceinline__ void cast_batch(const uint4 (&v)[N], float scale, AbsMax<DT>& am,
                                           uint32_t (&p)[N][VecInfo<DT>::words]) {
  AbsMax<DT> local;
#pragma unroll
  for (int i = 0; i < N; ++i) local.add_vec(v[i]);
  am.merge(local);
  // a positive finite scale (+0 included: bits below +inf), finite inputs
  if (local.words_finite() && fp8ops_f32_bits(scale) < 0x7F800000u) {
#pragma unroll
    for (int i = 0; i < N; ++i) cast_vec_fast<DT, FMT>(v[i], scale, p[i]);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const uint2 q = cast_vec_full<DT, FMT>(v[i], scale);
      p[i][0] = q.x;
      if constexpr (VecInfo<DT>::words == 2) p[i][1] = q.y;
    }
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels

// Fast path geometry, shared by kernel and launcher.
#define CT_THREADS 256  // 8 warps = 16 half-warps
#define CT_RB 8         // rows per thread block-of-work (one u64 column chunk)
#define CT_TM 128       // tile rows = 16 half-warps * CT_RB
// tile cols = 16 lanes * VEC: 128 for bf16/fp16 (VEC 8), 64 for fp32 (VEC 4)
#define CT_VEC(DT) ((DT) == FP8OPS_F32 ? 4 : 8)
#define CT_TN(DT) (16 * CT_VEC(DT))
// Blocks per SM the register allocation must allow: 4 (<= 64 registers,
// 1024 threads, 128 KB of loads in flight per SM) for bf16 / fp16 on sm_90+;
// 3 (<= 80 registers) for fp32, where 64 would spill. sm_89 lacks the 16x2
// integer max and VIADDMNMX and needs more registers: 3 for fp32, 2 for
// bf16 / fp16 (80 would spill).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define CT_MIN_BLOCKS(DT) ((DT) == FP8OPS_F32 ? 3 : 2)
#else
#define CT_MIN_BLOCKS(DT) ((DT) == FP8OPS_F32 ? 3 : 4)
#endif
// With the column sums (DB) a thread needs more registers: 3 blocks per SM (80
// registers). fp16 and fp32 fit; bf16 spills 80 bytes a thread on sm_90
// (ptxas -v) and still runs faster than at 2 blocks (127 registers, no
// spill): on an H200 the bf16 dy cast with the bias gradient, GELU gradient
// fused, took 0.210 ms instead of 0.237 at 32768 x 3072 and 0.304 instead of
// 0.329 at 16384 x 8192; without the GELU, 1-7 % less (RESULTS.md §5). At 4
// blocks it spills 244 bytes.
#define CT_MIN_BLOCKS_DB(DT) (CT_MIN_BLOCKS(DT) > 3 ? 3 : CT_MIN_BLOCKS(DT))
// The GELU instances (never with DB) fit the same budget as the plain ones
// with gelu.h's exp form (no spills; at 2 blocks per SM, the first version,
// the GELU cast of GPT-2's 32768 x 3072 took 0.173 ms on an H200 against the
// plain cast's 0.109 ms); so do the DGELU ones, but for fp16 without DB,
// which spills at 4 blocks and gets DB's budget.

// cast + transpose + amax, fast path (rows % 16 == 0, cols % 16 == 0, x / out
// / out_t 16-byte aligned).
// Block dims: (256). Grid dims: (tiles_n, tiles_m), one 128 x TN tile each
// (TN = 128 columns for bf16 / fp16, 64 for fp32); blockIdx.x runs along a
// row band, so the blocks in flight read neighbouring columns.
// Thread (h = tid / 16, l = tid % 16) loads the 8 x VEC block at tile rows
// 8h..8h+7, cols VEC*l.. (VEC = 8 bf16/fp16, 4 fp32): eight independent
// 16-byte loads in flight (a half-warp reads 256 contiguous bytes of one
// row). It converts them, stores each row's VEC fp8 bytes to `out` (8 or 4
// bytes; a half-warp writes 128 or 64 contiguous bytes), transposes the
// 8 x VEC byte block in registers (PRMT) and writes each column's 8 bytes
// (8 rows) as one u64 into the shared tile tile_t[TN][128] (one 128-byte row
// per input column). After the barrier each thread copies 16-byte chunks
// (16 consecutive input rows of one column) from tile_t to out_t with
// 16-byte stores; 8 lanes cover one column's 128 contiguous bytes of out_t.
// Bank conflicts: the 16-byte chunk index inside a tile_t row is XOR-swizzled
// with (row / VEC) & 7, i.e. with the writing lane l: the u64 writes of a
// half-warp then hit 8 distinct 16-byte bank groups (2-way, the minimum for
// 16 lanes writing the same 8-byte half of a chunk), and the 16-byte reads of
// a quarter-warp (8 chunks of one row) are conflict-free.
// rows % 16 == 0 and cols % 16 == 0 make every 8-row block, every VEC-column
// vector and every 16-row chunk of a partial edge tile either fully inside or
// fully outside, so the edges need whole-vector predicates only.
// DB (the bias gradient of Fp8Linear's backward, fused into the pass that
// reads dy anyway): each thread also sums its 8 rows per column in row order,
// the 16 half-warps' sums meet in shared memory and are added in h order, and
// the tile's column sums go to partial[blockIdx.y][col]; dbias_reduce_kernel
// then adds the tiles in row order (the order fp8ops_dbias_cpu defines). A
// row past the end of the last tile counts as +0 (the loads there are 0).
template <int DT, int FMT, bool DB, int ACT>
__global__ void __launch_bounds__(CT_THREADS, DB || ((ACT == ACT_DGELU || ACT == ACT_SWIGLU) &&
                                                     DT == FP8OPS_F16)
                                                  ? CT_MIN_BLOCKS_DB(DT)
                                                  : CT_MIN_BLOCKS(DT))
    cast_transpose_kernel(const void* __restrict__ x, const float* __restrict__ scale_p,
                          uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                          float* __restrict__ amax, int64_t rows, int64_t cols,
                          float* __restrict__ partial, Prologue pro) {
  constexpr int ESZ = VecInfo<DT>::esz;
  constexpr int VEC = CT_VEC(DT);
  constexpr int TN = CT_TN(DT);
  constexpr int WORDS = VecInfo<DT>::words;
  __shared__ __align__(16) uint8_t tile_t[TN * CT_TM];
  __shared__ uint32_t red[CT_THREADS / 32];
  __shared__ float colsum[DB ? (CT_TM / CT_RB) * TN : 1];  // [h][tile column]

  const int tid = threadIdx.x;
  const int h = tid >> 4, l = tid & 15;
  const int64_t row0 = (int64_t)blockIdx.y * CT_TM, col0 = (int64_t)blockIdx.x * TN;
  // rows / cols left in this tile (edge tiles are partial), as ints
  const int tile_rows = (int)min(rows - row0, (int64_t)CT_TM);
  const int tile_cols = (int)min(cols - col0, (int64_t)TN);
  const bool valid = h * CT_RB < tile_rows && l * VEC < tile_cols;
  const float scale = __ldg(scale_p);

  // all loads first: eight 16-byte loads in flight per thread. x is read
  // once, so the loads are marked evict-first (ld.global.cs).
  uint4 v[CT_RB];
  const int64_t off = (row0 + h * CT_RB) * cols + col0 + l * VEC;  // element offset of row 0
  // x's rows are 2 * cols long for the SwiGLU (gate, then up), cols otherwise
  constexpr int XW = ACT == ACT_SWIGLU ? 2 : 1;
  if (valid) {
    const uint4* src;
    int64_t stride;  // one row of x in uint4
    if constexpr (ACT == ACT_BLOCKS) {
      // the tile's columns lie in one block (fp8ops_blocks_cast_fusable); selects, not an
      // indexed parameter array (which would go through local memory)
      const int b = col0 < pro.blk_end[0] ? 0 : col0 < pro.blk_end[1] ? 1 : 2;
      const char* base = (const char*)(b == 0 ? pro.blk[0] : b == 1 ? pro.blk[1] : pro.blk[2]);
      const int64_t ld = b == 0 ? pro.blk_ld[0] : b == 1 ? pro.blk_ld[1] : pro.blk_ld[2];
      const int64_t c = col0 - (b == 0 ? 0 : b == 1 ? pro.blk_end[0] : pro.blk_end[1]) + l * VEC;
      src = (const uint4*)(base + ((row0 + h * CT_RB) * ld + c) * ESZ);
      stride = ld * ESZ / 16;
    } else {
      const int64_t xoff = XW == 1 ? off : (row0 + h * CT_RB) * XW * cols + col0 + l * VEC;
      src = (const uint4*)((const char*)x + xoff * ESZ);
      stride = XW * cols * ESZ / 16;
    }
#pragma unroll
    for (int i = 0; i < CT_RB; ++i) v[i] = __ldcs(src + i * stride);
    if constexpr (ACT == ACT_SWIGLU) {
      // up: cols elements after gate in the same row; silu(gate) rounded to DT
      // first, as torch's silu writes it (map_vec rounds the product)
      const uint4* src_u = src + cols * ESZ / 16;
      uint4 uv[CT_RB];
#pragma unroll
      for (int i = 0; i < CT_RB; ++i) uv[i] = __ldcs(src_u + i * stride);
#pragma unroll
      for (int i = 0; i < CT_RB; ++i) {
        const uint4 u = uv[i];
        v[i] = map_vec<DT>(v[i], [&](int j, float g) {
          return round_to<DT>(fp8ops_silu(g)) * vec_elem<DT>(u, j);
        });
      }
    } else if constexpr (ACT == ACT_GELU) {
#pragma unroll
      for (int i = 0; i < CT_RB; ++i)
        v[i] = map_vec<DT>(v[i], [](int, float x) { return fp8ops_gelu_tanh(x); });
    } else if constexpr (ACT == ACT_DGELU) {
      // aux (the GELU's input) has x's shape and dtype: the same offsets
      const uint4* src_h = (const uint4*)((const char*)pro.aux + off * ESZ);
      uint4 hv[CT_RB];
#pragma unroll
      for (int i = 0; i < CT_RB; ++i) hv[i] = __ldcs(src_h + i * stride);
#pragma unroll
      for (int i = 0; i < CT_RB; ++i) {
        const uint4 h = hv[i];
        v[i] = map_vec<DT>(v[i], [&](int j, float g) {
          return g * fp8ops_gelu_tanh_grad(vec_elem<DT>(h, j));
        });
      }
    } else if constexpr (ACT == ACT_LN) {
      const int64_t r0 = row0 + h * CT_RB, c0 = col0 + l * VEC;
      float gam[VEC], bet[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        gam[j] = pro.gamma ? __ldg(pro.gamma + c0 + j) : 1.0f;
        bet[j] = pro.beta ? __ldg(pro.beta + c0 + j) : 0.0f;
      }
#pragma unroll
      for (int i = 0; i < CT_RB; ++i) {
        const float m = __ldg(pro.mean + r0 + i), r = __ldg(pro.rstd + r0 + i);
        v[i] = map_vec<DT>(v[i], [&](int j, float x) { return gam[j] * (r * (x - m)) + bet[j]; });
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < CT_RB; ++i) v[i] = make_uint4(0, 0, 0, 0);  // |0| leaves amax alone
  }

  if constexpr (DB) {  // one column at a time: two live floats, not VEC
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float sum = vec_elem<DT>(v[0], j);
#pragma unroll
      for (int i = 1; i < CT_RB; ++i) sum = add_rn(sum, vec_elem<DT>(v[i], j));
      colsum[h * TN + l * VEC + j] = sum;
    }
  }

  AbsMax<DT> am;
  uint32_t p[CT_RB][WORDS];  // p[i][w]: row i, cols 4w..4w+3 (byte k = col 4w+k)
  cast_batch<DT, FMT, CT_RB>(v, scale, am, p);

  if (valid) {
    uint8_t* dst = out + off;
#pragma unroll
    for (int i = 0; i < CT_RB; ++i) {
      if constexpr (WORDS == 2) {
        *(uint2*)(dst + i * cols) = make_uint2(p[i][0], p[i][1]);
      } else {
        *(uint32_t*)(dst + i * cols) = p[i][0];
      }
    }
  }

  // transpose the 8 x VEC byte block: column j = 4w + q gets lo (rows 0..3)
  // and hi (rows 4..7), written as one u64 at tile_t row VEC*l + j, bytes
  // 8h..8h+7 of the row before the swizzle.
  const int swz = l & 7;  // == (tile_t row / VEC) & 7 for every j of this thread
  uint8_t* trow = tile_t + VEC * l * CT_TM + ((((h >> 1) ^ swz) << 4) | ((h & 1) << 3));
#pragma unroll
  for (int w = 0; w < WORDS; ++w) {
    uint32_t lo[4], hi[4];
    transpose4x4(p[0][w], p[1][w], p[2][w], p[3][w], lo[0], lo[1], lo[2], lo[3]);
    transpose4x4(p[4][w], p[5][w], p[6][w], p[7][w], hi[0], hi[1], hi[2], hi[3]);
#pragma unroll
    for (int q = 0; q < 4; ++q) *(uint2*)(trow + (4 * w + q) * CT_TM) = make_uint2(lo[q], hi[q]);
  }

  // amax: warp max now, the barrier below doubles as the reduction's
  const int lane = tid & 31, warp = tid >> 5;
  const uint32_t wmax = __reduce_max_sync(0xFFFFFFFFu, am.bits());
  if (lane == 0) red[warp] = wmax;
  __syncthreads();

  // out_t: TN columns x 8 chunks of 16 rows; thread tid takes chunk k = tid % 8
  // of columns tid / 8 + 32 * it, so a warp stores 4 columns x 128 contiguous
  // bytes per iteration.
  constexpr int ITEMS = TN * (CT_TM / 16) / CT_THREADS;  // 4 (bf16/fp16) or 2 (fp32)
  constexpr int COLS_PER_IT = CT_THREADS / 8;            // 32, a multiple of VEC
  const unsigned c0 = tid >> 3, k = tid & 7;
  uint8_t* dst_t = out_t + (col0 + c0) * rows + row0 + 16 * k;
  const uint8_t* src_t = tile_t + c0 * CT_TM;
#pragma unroll
  for (int it = 0; it < ITEMS; ++it) {
    if ((int)(c0 + it * COLS_PER_IT) < tile_cols && (int)(16 * k) < tile_rows) {
      const unsigned swz_t = (c0 / VEC + it * (COLS_PER_IT / VEC)) & 7;  // (column / VEC) & 7
      const uint4 d = *(const uint4*)(src_t + it * COLS_PER_IT * CT_TM + ((k ^ swz_t) << 4));
      *(uint4*)(dst_t + it * COLS_PER_IT * rows) = d;
    }
  }

  if constexpr (DB) {  // colsum was written before the barrier above
    if (tid < tile_cols) {
      float t = colsum[tid];
#pragma unroll
      for (int hh = 1; hh < CT_TM / CT_RB; ++hh) t = add_rn(t, colsum[hh * TN + tid]);
      partial[(int64_t)blockIdx.y * cols + col0 + tid] = t;
    }
  }

  if (tid == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < CT_THREADS / 32; ++w) m = max(m, red[w]);
    atomicMax((int*)amax, (int)m);  // (signed: see block_amax_atomic)
  }
}

// dbias[c] = the tiles' column sums added in row order (partial [tiles][cols]).
// Few threads (one per column) each add up to a few hundred values in a fixed
// order, so the kernel is bound by load latency, not bandwidth: each thread
// issues DBIAS_BATCH independent loads before folding them in, in the same
// order (bit-identical to the one-at-a-time loop). The one-at-a-time loop took
// ~25 us per call at 256 tiles on an H200 (1.2 ms of a GPT-2 small step); this
// one ~9 us (benchmarks/RESULTS.md, section 5).
// Block dims: (DBIAS_THREADS). Grid dims: (ceil(cols / DBIAS_THREADS));
// coalesced reads of one partial row per load.
#define DBIAS_THREADS 128
#define DBIAS_BATCH 32
__global__ void __launch_bounds__(DBIAS_THREADS)
    dbias_reduce_kernel(const float* __restrict__ partial, float* __restrict__ dbias,
                        int64_t tiles, int64_t cols) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const float* p = partial + c;
  float t = p[0];
  int64_t k = 1;
  for (; k + DBIAS_BATCH <= tiles; k += DBIAS_BATCH) {
    float v[DBIAS_BATCH];
#pragma unroll
    for (int j = 0; j < DBIAS_BATCH; ++j) v[j] = __ldg(p + (k + j) * cols);
#pragma unroll
    for (int j = 0; j < DBIAS_BATCH; ++j) t = add_rn(t, v[j]);
  }
  for (; k < tiles; ++k) t = add_rn(t, p[k * cols]);
  dbias[c] = t;
}

// The same column sums without a cast, for inputs the fast path does not
// take (any shape or alignment): one thread per column walks the rows in the
// reference order (fp8ops_dbias_cpu). A second read of x, so slower; the
// aligned shapes of Fp8Linear take the fused path.
// Block dims: (256). Grid dims: (ceil(cols / 256)).
template <int DT>
__global__ void __launch_bounds__(256)
    colsum_kernel(const void* __restrict__ x, float* __restrict__ dbias, int64_t rows,
                  int64_t cols) {
  const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float total = 0.0f;
  for (int64_t r0 = 0; r0 < rows; r0 += CT_TM) {
    float tile = 0.0f;
    for (int hh = 0; hh < CT_TM / CT_RB; ++hh) {
      const int64_t rb = r0 + hh * CT_RB;
      float g = rb < rows ? load_elem<DT>(x, rb * cols + c) : 0.0f;
      for (int i = 1; i < CT_RB; ++i)
        g = add_rn(g, rb + i < rows ? load_elem<DT>(x, (rb + i) * cols + c) : 0.0f);
      tile = hh == 0 ? g : add_rn(tile, g);
    }
    total = r0 == 0 ? tile : add_rn(total, tile);
  }
  dbias[c] = total;
}

// cast + transpose + amax, general path: any rows / cols, any alignment.
// Block dims: (32, 8). Grid dims: (tiles_m * tiles_n), one 32 x 32 tile each.
// Thread (tx, ty) converts the elements (row0 + ty + 8i, col0 + tx), i < 4,
// with scalar loads (a warp reads 32 consecutive elements of one row), stores
// the byte to `out` and to the shared tile; after the barrier it writes
// out_t[col0 + ty + 8i][row0 + tx] (a warp writes 32 consecutive bytes).
template <int DT, int FMT, int ACT>
__global__ void __launch_bounds__(256)
    cast_transpose_general_kernel(const void* __restrict__ x, const float* __restrict__ scale_p,
                                  uint8_t* __restrict__ out, uint8_t* __restrict__ out_t,
                                  float* __restrict__ amax, int64_t rows, int64_t cols,
                                  int tiles_n, Prologue pro) {
  __shared__ uint8_t tile[32][33];  // +1: column reads spread over banks
  __shared__ uint32_t red[8];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int tile_m = blockIdx.x / tiles_n, tile_n = blockIdx.x - tile_m * tiles_n;
  const int64_t row0 = (int64_t)tile_m * 32, col0 = (int64_t)tile_n * 32;
  const float scale = __ldg(scale_p);
  AbsMax<DT> am;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t rr = row0 + ty + 8 * i, cc = col0 + tx;
    if (rr < rows && cc < cols) {
      float v = load_elem<DT>(x, rr * cols + cc);
      if constexpr (ACT == ACT_GELU) v = round_to<DT>(fp8ops_gelu_tanh(v));
      if constexpr (ACT == ACT_LN)
        v = round_to<DT>((pro.gamma ? pro.gamma[cc] : 1.0f) * (pro.rstd[rr] * (v - pro.mean[rr])) +
                         (pro.beta ? pro.beta[cc] : 0.0f));
      am.add_f32(v);
      const uint8_t q = (uint8_t)cast_byte<FMT>(v, scale);
      out[rr * cols + cc] = q;
      tile[ty + 8 * i][tx] = q;
    }
  }
  const uint32_t wmax = __reduce_max_sync(0xFFFFFFFFu, am.bits());
  if (tx == 0) red[ty] = wmax;
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t cc = col0 + ty + 8 * i, rr = row0 + tx;
    if (cc < cols && rr < rows) out_t[cc * rows + rr] = tile[tx][ty + 8 * i];
  }
  if (tx == 0 && ty == 0) {
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) m = max(m, red[w]);
    atomicMax((int*)amax, (int)m);  // (signed: see block_amax_atomic)
  }
}

#define EW_THREADS 256
#define EW_UNROLL 4      // 16-byte loads in flight per thread per iteration
#define EW_MIN_BLOCKS 4  // resident blocks per SM the registers must allow; the grid is
                         // capped at SMs * 4 so that every block is resident (grid-stride)

// cast + amax without transpose (and, with out == NULL, amax alone), flat
// over n contiguous elements.
// Block dims: (256). Grid dims: (min(blocks needed, SMs * 4)), grid-stride.
// Elements [head, head + 16/ESZ * nvec) are 16-byte aligned in x (and
// 16/ESZ-byte aligned in out): each thread loads 4 independent 16-byte
// vectors per iteration (vector j of the iteration at base + j * 256, so a
// warp reads 512 contiguous bytes per load) and stores their packed fp8
// bytes. The head before and the tail after the vectors (fewer than 16/ESZ
// elements each, or everything when x and out cannot both be aligned) go
// element by element, grid-stride.
// (GELU: 2 blocks per SM, at 4 the GELU spills on sm_90; blocks past the
// resident ones just wait their turn. Only casts without a transpose, i.e.
// forwards without a weight gradient, take this kernel.)
template <int DT, int FMT, bool WRITE, bool GELU>
__global__ void __launch_bounds__(EW_THREADS, GELU ? 2 : EW_MIN_BLOCKS)
    cast_kernel(const void* __restrict__ x, const float* __restrict__ scale_p,
                uint8_t* __restrict__ out, float* __restrict__ amax, int64_t n, int64_t head,
                int64_t nvec) {
  constexpr int ESZ = DT == FP8OPS_F32 ? 4 : 2;
  constexpr int VEC = 16 / ESZ;
  constexpr int WORDS = VEC / 4;
  __shared__ uint32_t red[EW_THREADS / 32];
  const float scale = WRITE ? __ldg(scale_p) : 1.0f;
  AbsMax<DT> am;
  const int64_t nthreads = (int64_t)gridDim.x * EW_THREADS;
  const int64_t gtid = (int64_t)blockIdx.x * EW_THREADS + threadIdx.x;

  // scalar head and tail
  const int64_t tail0 = head + nvec * VEC;
  const int64_t nscalar = head + (n - tail0);
  for (int64_t s = gtid; s < nscalar; s += nthreads) {
    const int64_t i = s < head ? s : tail0 + (s - head);
    float v = load_elem<DT>(x, i);
    if constexpr (GELU) v = round_to<DT>(fp8ops_gelu_tanh(v));
    am.add_f32(v);
    if constexpr (WRITE) out[i] = (uint8_t)cast_byte<FMT>(v, scale);
  }

  // vector body
  const uint4* src = (const uint4*)((const char*)x + head * ESZ);
  for (int64_t base = (int64_t)blockIdx.x * EW_THREADS * EW_UNROLL + threadIdx.x; base < nvec;
       base += nthreads * EW_UNROLL) {
    uint4 v[EW_UNROLL];
#pragma unroll
    for (int j = 0; j < EW_UNROLL; ++j) {
      const int64_t idx = base + j * EW_THREADS;
      v[j] = idx < nvec ? __ldcs(src + idx) : make_uint4(0, 0, 0, 0);
      if constexpr (GELU)  // gelu(0) = 0 past the end
        v[j] = map_vec<DT>(v[j], [](int, float x) { return fp8ops_gelu_tanh(x); });
    }
    if constexpr (WRITE) {
      uint32_t p[EW_UNROLL][WORDS];
      cast_batch<DT, FMT, EW_UNROLL>(v, scale, am, p);
#pragma unroll
      for (int j = 0; j < EW_UNROLL; ++j) {
        const int64_t idx = base + j * EW_THREADS;
        uint8_t* dst = out + head + idx * VEC;
        if (idx < nvec) {
          if constexpr (WORDS == 2) {
            *(uint2*)dst = make_uint2(p[j][0], p[j][1]);
          } else {
            *(uint32_t*)dst = p[j][0];
          }
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < EW_UNROLL; ++j) am.add_vec(v[j]);
    }
  }
  block_amax_atomic(am.bits(), red, amax);
}

// ----------------------------------------------------------------------------
// kernel launchers

// SM count of the current device, cached per device (host overhead per call
// matters for small tensors). Racing writers store the same value.
#define MAX_DEVICES 64
static int g_sms[MAX_DEVICES];

static int num_sms(int* sms) {
  int dev = 0;
  FP8OPS_CHECK_CUDA(cudaGetDevice(&dev));
  if (dev >= 0 && dev < MAX_DEVICES && __atomic_load_n(&g_sms[dev], __ATOMIC_RELAXED) > 0) {
    *sms = __atomic_load_n(&g_sms[dev], __ATOMIC_RELAXED);
    return FP8OPS_OK;
  }
  FP8OPS_CHECK_CUDA(cudaDeviceGetAttribute(sms, cudaDevAttrMultiProcessorCount, dev));
  if (dev >= 0 && dev < MAX_DEVICES) __atomic_store_n(&g_sms[dev], *sms, __ATOMIC_RELAXED);
  return FP8OPS_OK;
}

static inline bool aligned(const void* p, uintptr_t a) { return ((uintptr_t)p & (a - 1)) == 0; }

static inline int dtype_size(fp8ops_hp_dtype dt) { return dt == FP8OPS_F32 ? 4 : 2; }

// Flat elementwise launch (cast without transpose, or amax alone when
// out == NULL). Splits [0, n) into a scalar head, 16-byte vectors and a
// scalar tail; when x and out cannot be aligned at the same element,
// everything is scalar.
template <int DT, int FMT, bool GELU = false>
static int launch_elementwise(const void* x, const float* scale, uint8_t* out, float* amax,
                              int64_t n, cudaStream_t stream) {
  constexpr int ESZ = DT == FP8OPS_F32 ? 4 : 2;
  constexpr int VEC = 16 / ESZ;
  int64_t head = n, nvec = 0;
  const uintptr_t xa = (uintptr_t)x;
  if (xa % ESZ == 0) {
    // elements until x is 16-byte aligned
    const int64_t h = (int64_t)(((16 - xa % 16) % 16) / ESZ);
    const bool out_ok = out == NULL || aligned(out + h, VEC);
    if (out_ok && h < n) {
      head = h;
      nvec = (n - h) / VEC;
    }
  }
  int sms = 0;
  FP8OPS_TRY(num_sms(&sms));
  const int64_t work = nvec > 0 ? FP8OPS_CEIL_DIV(nvec, (int64_t)EW_THREADS * EW_UNROLL)
                                : FP8OPS_CEIL_DIV(n, (int64_t)EW_THREADS);
  const int64_t cap = (int64_t)sms * EW_MIN_BLOCKS;
  const unsigned grid = (unsigned)(work < cap ? (work > 0 ? work : 1) : cap);
  if (out != NULL) {
    cast_kernel<DT, FMT, true, GELU><<<grid, EW_THREADS, 0, stream>>>(x, scale, out, amax, n, head,
                                                                      nvec);
  } else {
    // amax alone: the format is unused, one instance per dtype
    cast_kernel<DT, FP8OPS_E4M3, false, false><<<grid, EW_THREADS, 0, stream>>>(
        x, scale, out, amax, n, head, nvec);
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// Column sums of x into dbias without a cast (colsum_kernel).
template <int DT>
static int launch_colsum(const void* x, int64_t rows, int64_t cols, float* dbias,
                         cudaStream_t stream) {
  const int64_t blocks = FP8OPS_CEIL_DIV(cols, (int64_t)256);
  FP8OPS_REQUIRE(blocks <= INT32_MAX, "cast: too many columns (%lld)", (long long)cols);
  colsum_kernel<DT><<<(unsigned)blocks, 256, 0, stream>>>(x, dbias, rows, cols);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// The transposing fast path's conditions (cast_transpose_kernel).
static bool ct_fast(const void* x, int64_t rows, int64_t cols, const void* out, const void* out_t) {
  return out_t != NULL && rows % 16 == 0 && cols % 16 == 0 && aligned(x, 16) && aligned(out, 16) &&
         aligned(out_t, 16) && FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM) <= 65535 &&
         FP8OPS_CEIL_DIV(cols, (int64_t)64) <= INT32_MAX;
}

// dbias != NULL: also the column sums of x (fused into the fast transposing
// path, whose per-tile sums go to partial; else a separate colsum pass).
// ACT: the prologue, ACT_NONE, ACT_GELU or ACT_LN (never with dbias; ACT_LN
// only with out_t: cast_cuda checks both). (The DGELU instances have their
// own launcher, launch_dgelu_cast.)
template <int DT, int FMT, int ACT>
static int launch_cast(const void* x, int64_t rows, int64_t cols, const float* scale,
                       uint8_t* out, uint8_t* out_t, float* amax, float* dbias, float* partial,
                       const Prologue& pro, cudaStream_t stream) {
  const int64_t ct_tiles_m = FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM);
  const int64_t ct_tiles_n = FP8OPS_CEIL_DIV(cols, (int64_t)CT_TN(DT));
  if (ct_fast(x, rows, cols, out, out_t)) {
    const dim3 grid((unsigned)ct_tiles_n, (unsigned)ct_tiles_m);
    if (ACT == ACT_NONE && dbias != NULL) {
      cast_transpose_kernel<DT, FMT, true, ACT_NONE><<<grid, CT_THREADS, 0, stream>>>(
          x, scale, out, out_t, amax, rows, cols, partial, pro);
      FP8OPS_CHECK_CUDA(cudaGetLastError());
      dbias_reduce_kernel<<<(unsigned)FP8OPS_CEIL_DIV(cols, (int64_t)DBIAS_THREADS), DBIAS_THREADS,
                            0, stream>>>(partial, dbias, ct_tiles_m, cols);
    } else {
      cast_transpose_kernel<DT, FMT, false, ACT><<<grid, CT_THREADS, 0, stream>>>(
          x, scale, out, out_t, amax, rows, cols, NULL, pro);
    }
    FP8OPS_CHECK_CUDA(cudaGetLastError());
    return FP8OPS_OK;
  }
  if (ACT == ACT_NONE && dbias != NULL) FP8OPS_TRY(launch_colsum<DT>(x, rows, cols, dbias, stream));
  if (ACT != ACT_LN && out_t == NULL)
    return launch_elementwise<DT, FMT, ACT == ACT_GELU>(x, scale, out, amax, rows * cols, stream);
  {
    const int64_t tiles_m = FP8OPS_CEIL_DIV(rows, (int64_t)32);
    const int64_t tiles_n = FP8OPS_CEIL_DIV(cols, (int64_t)32);
    FP8OPS_REQUIRE(tiles_m * tiles_n <= INT32_MAX, "cast: tensor too large ([%lld, %lld])",
                   (long long)rows, (long long)cols);
    cast_transpose_general_kernel<DT, FMT, ACT><<<(unsigned)(tiles_m * tiles_n), dim3(32, 8), 0,
                                                  stream>>>(x, scale, out, out_t, amax, rows, cols,
                                                            (int)tiles_n, pro);
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

template <int DT, int FMT>
static int launch_cast_act(const void* x, int64_t rows, int64_t cols, const float* scale,
                           uint8_t* out, uint8_t* out_t, float* amax, float* dbias, float* partial,
                           int act, const Prologue& pro, cudaStream_t stream) {
  switch (act) {
    case ACT_GELU:
      return launch_cast<DT, FMT, ACT_GELU>(x, rows, cols, scale, out, out_t, amax, NULL, NULL, pro,
                                            stream);
    case ACT_LN:
      return launch_cast<DT, FMT, ACT_LN>(x, rows, cols, scale, out, out_t, amax, NULL, NULL, pro,
                                          stream);
    default:
      return launch_cast<DT, FMT, ACT_NONE>(x, rows, cols, scale, out, out_t, amax, dbias, partial,
                                            pro, stream);
  }
}

template <int DT>
static int launch_cast_fmt(const void* x, int64_t rows, int64_t cols, const float* scale,
                           fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t, float* amax,
                           float* dbias, float* partial, int act, const Prologue& pro,
                           cudaStream_t stream) {
  return fmt == FP8OPS_E4M3
             ? launch_cast_act<DT, FP8OPS_E4M3>(x, rows, cols, scale, out, out_t, amax, dbias,
                                                partial, act, pro, stream)
             : launch_cast_act<DT, FP8OPS_E5M2>(x, rows, cols, scale, out, out_t, amax, dbias,
                                                partial, act, pro, stream);
}

static const Prologue kNoPrologue = {NULL, NULL, NULL, NULL, NULL};

// An empty cast_accumulate's fold: the amax of no element is +0, folded as the blocks fold
// theirs (a signed max over the bits: a negative value in the slot becomes +0, as on the CPU)
__global__ void fold_zero_amax(float* amax) { atomicMax((int*)amax, 0); }

static int cast_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                     const float* scale, fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                     float* amax, bool accumulate, float* dbias, float* partial, int act,
                     const Prologue& pro, void* stream) {
  FP8OPS_REQUIRE(rows >= 0 && cols >= 0, "cast: negative shape [%lld, %lld]", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(cols == 0 || rows <= INT64_MAX / cols, "cast: rows * cols overflows ([%lld, %lld])",
                 (long long)rows, (long long)cols);
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "cast: unknown input dtype code %d", (int)x_dtype);
  FP8OPS_REQUIRE(fmt == FP8OPS_E4M3 || fmt == FP8OPS_E5M2, "cast: unknown fp8 format %d", (int)fmt);
  FP8OPS_REQUIRE(scale && amax && (rows * cols == 0 || (x && out)), "cast: null pointer");
  FP8OPS_REQUIRE(act == ACT_NONE || dbias == NULL, "cast: a prologue cast has no fused column sums");
  FP8OPS_REQUIRE(act != ACT_LN || out_t != NULL || rows * cols == 0,
                 "cast: the LayerNorm cast needs the transposed output");
  FP8OPS_REQUIRE(aligned(x, dtype_size(x_dtype)),
                 "cast: input pointer %p is not aligned to its dtype (%d bytes)", x,
                 dtype_size(x_dtype));
  cudaStream_t s = (cudaStream_t)stream;
  // blocks fold their amax into *amax with atomicMax on its bits: start from
  // +0, or (accumulate) from the value there, e.g. an amax history slot
  if (!accumulate) FP8OPS_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(float), s));
  if (rows * cols == 0) {
    if (dbias != NULL && cols > 0) FP8OPS_CHECK_CUDA(cudaMemsetAsync(dbias, 0, cols * sizeof(float), s));
    if (accumulate) {
      fold_zero_amax<<<1, 1, 0, s>>>(amax);
      FP8OPS_CHECK_CUDA(cudaGetLastError());
    }
    return FP8OPS_OK;
  }
  switch (x_dtype) {
    case FP8OPS_F32:
      return launch_cast_fmt<FP8OPS_F32>(x, rows, cols, scale, fmt, out, out_t, amax, dbias, partial,
                                         act, pro, s);
    case FP8OPS_BF16:
      return launch_cast_fmt<FP8OPS_BF16>(x, rows, cols, scale, fmt, out, out_t, amax, dbias,
                                          partial, act, pro, s);
    default:
      return launch_cast_fmt<FP8OPS_F16>(x, rows, cols, scale, fmt, out, out_t, amax, dbias, partial,
                                         act, pro, s);
  }
}

extern "C" int fp8ops_cast_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                uint8_t* out, uint8_t* out_t, float* amax, void* stream) {
  return cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, false, NULL, NULL, ACT_NONE,
                   kNoPrologue, stream);
}

extern "C" int fp8ops_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                           int64_t cols, const float* scale,
                                           fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                                           float* amax, void* stream) {
  FP8OPS_REQUIRE(aligned(amax, sizeof(float)), "cast: amax pointer %p is not 4-byte aligned",
                 (const void*)amax);
  return cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, true, NULL, NULL, ACT_NONE,
                   kNoPrologue, stream);
}

extern "C" int fp8ops_gelu_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype,
                                                int64_t rows, int64_t cols, const float* scale,
                                                fp8ops_fp8_format fmt, uint8_t* out,
                                                uint8_t* out_t, float* amax, void* stream) {
  FP8OPS_REQUIRE(aligned(amax, sizeof(float)), "cast: amax pointer %p is not 4-byte aligned",
                 (const void*)amax);
  return cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, true, NULL, NULL, ACT_GELU,
                   kNoPrologue, stream);
}

extern "C" int fp8ops_ln_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                              int64_t cols, const fp8ops_ln_params* ln,
                                              const float* scale, fp8ops_fp8_format fmt,
                                              uint8_t* out, uint8_t* out_t, float* amax,
                                              void* stream) {
  FP8OPS_REQUIRE(aligned(amax, sizeof(float)), "cast: amax pointer %p is not 4-byte aligned",
                 (const void*)amax);
  FP8OPS_REQUIRE(ln && ln->mean && ln->rstd, "cast: the LayerNorm cast needs mean and rstd");
  const Prologue pro = {NULL, ln->mean, ln->rstd, ln->gamma, ln->beta};
  return cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, true, NULL, NULL, ACT_LN,
                   pro, stream);
}

extern "C" int64_t fp8ops_dbias_workspace_floats(int64_t rows, int64_t cols) {
  return FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM) * cols;
}

extern "C" int fp8ops_cast_accumulate_dbias_cuda(const void* x, fp8ops_hp_dtype x_dtype,
                                                 int64_t rows, int64_t cols, const float* scale,
                                                 fp8ops_fp8_format fmt, uint8_t* out,
                                                 uint8_t* out_t, float* amax, float* dbias,
                                                 float* partial, int64_t partial_floats,
                                                 void* stream) {
  FP8OPS_REQUIRE(aligned(amax, sizeof(float)), "cast: amax pointer %p is not 4-byte aligned",
                 (const void*)amax);
  FP8OPS_REQUIRE(dbias != NULL && aligned(dbias, sizeof(float)),
                 "cast: dbias must be a 4-byte aligned fp32 buffer of cols floats");
  FP8OPS_REQUIRE(rows >= 0 && cols >= 0, "cast: negative shape [%lld, %lld]", (long long)rows,
                 (long long)cols);
  const int64_t need = fp8ops_dbias_workspace_floats(rows, cols);
  FP8OPS_REQUIRE(partial_floats >= need && (partial != NULL || rows * cols == 0),
                 "cast: the dbias workspace holds %lld floats, fp8ops_dbias_workspace_floats "
                 "asks %lld", (long long)partial_floats, (long long)need);
  return cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, true, dbias, partial,
                   ACT_NONE, kNoPrologue, stream);
}

// The DGELU cast (fast path only; fp8ops_dgelu_cast_fusable says when):
// x * gelu_tanh'(aux) cast and transposed, amax folded in, column sums of the
// product into dbias when given.
template <int DT, int FMT>
static int launch_dgelu_cast(const void* x, const void* aux, int64_t rows, int64_t cols,
                             const float* scale, uint8_t* out, uint8_t* out_t, float* amax,
                             float* dbias, float* partial, cudaStream_t stream) {
  const int64_t tiles_m = FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM);
  const dim3 grid((unsigned)FP8OPS_CEIL_DIV(cols, (int64_t)CT_TN(DT)), (unsigned)tiles_m);
  if (dbias != NULL) {
    cast_transpose_kernel<DT, FMT, true, ACT_DGELU><<<grid, CT_THREADS, 0, stream>>>(
        x, scale, out, out_t, amax, rows, cols, partial, Prologue{aux, NULL, NULL, NULL, NULL});
    FP8OPS_CHECK_CUDA(cudaGetLastError());
    dbias_reduce_kernel<<<(unsigned)FP8OPS_CEIL_DIV(cols, (int64_t)DBIAS_THREADS), DBIAS_THREADS, 0,
                          stream>>>(partial, dbias, tiles_m, cols);
  } else {
    cast_transpose_kernel<DT, FMT, false, ACT_DGELU><<<grid, CT_THREADS, 0, stream>>>(
        x, scale, out, out_t, amax, rows, cols, NULL, Prologue{aux, NULL, NULL, NULL, NULL});
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

extern "C" int fp8ops_dgelu_cast_fusable(const void* x, const void* aux, int64_t rows,
                                         int64_t cols, const uint8_t* out, const uint8_t* out_t) {
  return rows > 0 && cols > 0 && aligned(aux, 16) && ct_fast(x, rows, cols, out, out_t);
}

// The checks the fused transposing casts (DGELU, column blocks, SwiGLU) share, past their
// own fusable test. dbias NULL: no column sums (partial and partial_floats unused).
static int fused_cast_check(fp8ops_fp8_format fmt, const float* scale, const float* amax,
                            const float* dbias, const float* partial, int64_t partial_floats,
                            int64_t rows, int64_t cols) {
  FP8OPS_REQUIRE(fmt == FP8OPS_E4M3 || fmt == FP8OPS_E5M2, "cast: unknown fp8 format %d", (int)fmt);
  FP8OPS_REQUIRE(scale && amax && aligned(amax, sizeof(float)), "cast: bad scale / amax pointer");
  FP8OPS_REQUIRE(dbias == NULL || (partial != NULL &&
                                   partial_floats >= fp8ops_dbias_workspace_floats(rows, cols)),
                 "cast: the dbias workspace holds %lld floats, fp8ops_dbias_workspace_floats "
                 "asks %lld", (long long)partial_floats,
                 (long long)fp8ops_dbias_workspace_floats(rows, cols));
  return FP8OPS_OK;
}

extern "C" int fp8ops_dgelu_cast_accumulate_cuda(const void* x, const void* aux,
                                                 fp8ops_hp_dtype x_dtype, int64_t rows,
                                                 int64_t cols, const float* scale,
                                                 fp8ops_fp8_format fmt, uint8_t* out,
                                                 uint8_t* out_t, float* amax, float* dbias,
                                                 float* partial, int64_t partial_floats,
                                                 void* stream) {
  FP8OPS_REQUIRE(fp8ops_dgelu_cast_fusable(x, aux, rows, cols, out, out_t),
                 "cast: the fused GELU-gradient cast needs out_t, rows and cols multiples of 16 "
                 "and 16-byte aligned pointers (fp8ops_dgelu_cast_fusable)");
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "cast: unknown input dtype code %d", (int)x_dtype);
  FP8OPS_TRY(fused_cast_check(fmt, scale, amax, dbias, partial, partial_floats, rows, cols));
  cudaStream_t s = (cudaStream_t)stream;
#define FP8OPS_DGELU_LAUNCH(DT)                                                               \
  return fmt == FP8OPS_E4M3                                                                    \
             ? launch_dgelu_cast<DT, FP8OPS_E4M3>(x, aux, rows, cols, scale, out, out_t, amax, \
                                                  dbias, partial, s)                          \
             : launch_dgelu_cast<DT, FP8OPS_E5M2>(x, aux, rows, cols, scale, out, out_t, amax, \
                                                  dbias, partial, s)
  switch (x_dtype) {
    case FP8OPS_F32: FP8OPS_DGELU_LAUNCH(FP8OPS_F32);
    case FP8OPS_BF16: FP8OPS_DGELU_LAUNCH(FP8OPS_BF16);
    default: FP8OPS_DGELU_LAUNCH(FP8OPS_F16);
  }
#undef FP8OPS_DGELU_LAUNCH
}

// The column blocks' cast (fast path only; fp8ops_blocks_cast_fusable says
// when): x = the blocks side by side, cast and transposed with the amax folded
// in and its column sums into dbias when given, reading each block where it
// lies, so the concatenation is never written (fp8ops::linear_bwd_cat).
template <int DT, int FMT>
static int launch_blocks_cast(const Prologue& pro, int64_t rows, int64_t cols, const float* scale,
                              uint8_t* out, uint8_t* out_t, float* amax, float* dbias,
                              float* partial, cudaStream_t stream) {
  const int64_t tiles_m = FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM);
  const dim3 grid((unsigned)FP8OPS_CEIL_DIV(cols, (int64_t)CT_TN(DT)), (unsigned)tiles_m);
  if (dbias != NULL) {
    cast_transpose_kernel<DT, FMT, true, ACT_BLOCKS><<<grid, CT_THREADS, 0, stream>>>(
        NULL, scale, out, out_t, amax, rows, cols, partial, pro);
    FP8OPS_CHECK_CUDA(cudaGetLastError());
    dbias_reduce_kernel<<<(unsigned)FP8OPS_CEIL_DIV(cols, (int64_t)DBIAS_THREADS), DBIAS_THREADS, 0,
                          stream>>>(partial, dbias, tiles_m, cols);
  } else {
    cast_transpose_kernel<DT, FMT, false, ACT_BLOCKS><<<grid, CT_THREADS, 0, stream>>>(
        NULL, scale, out, out_t, amax, rows, cols, NULL, pro);
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

// Total columns of the blocks, or -1 if a block has a negative width.
static int64_t blocks_cols(const fp8ops_col_blocks* b) {
  int64_t n = 0;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    if (b->cols[i] < 0) return -1;
    n += b->cols[i];
  }
  return n;
}

extern "C" int fp8ops_blocks_cast_fusable(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype,
                                          int64_t rows) {
  // bf16 / fp16 (a 128-column tile); every block but the last non-empty one a whole number
  // of tiles wide, so no tile straddles two; rows and the last block's width multiples of
  // 16; 16-byte aligned rows
  if (b == NULL || (dtype != FP8OPS_BF16 && dtype != FP8OPS_F16) || rows <= 0 || rows % 16 != 0)
    return 0;
  const int64_t cols = blocks_cols(b);
  if (cols <= 0 || FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM) > 65535) return 0;
  int last = -1;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i)
    if (b->cols[i] > 0) last = i;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    if (b->cols[i] == 0) continue;
    if (b->cols[i] % (i == last ? 16 : CT_TN(FP8OPS_BF16)) != 0) return 0;
    if (b->ld[i] < b->cols[i] || b->ld[i] % 8 != 0 || !aligned(b->data[i], 16)) return 0;
  }
  return 1;
}

extern "C" int fp8ops_blocks_cast_accumulate_cuda(const fp8ops_col_blocks* b,
                                                  fp8ops_hp_dtype x_dtype, int64_t rows,
                                                  const float* scale, fp8ops_fp8_format fmt,
                                                  uint8_t* out, uint8_t* out_t, float* amax,
                                                  float* dbias, float* partial,
                                                  int64_t partial_floats, void* stream) {
  FP8OPS_REQUIRE(fp8ops_blocks_cast_fusable(b, x_dtype, rows),
                 "cast: the column blocks' cast needs bf16 / fp16 blocks, all but the last a "
                 "multiple of 128 columns wide, rows and the last block's width multiples of 16 "
                 "and 16-byte aligned rows (fp8ops_blocks_cast_fusable)");
  const int64_t cols = blocks_cols(b);
  FP8OPS_REQUIRE(out != NULL && out_t != NULL && aligned(out, 16) && aligned(out_t, 16),
                 "cast: the column blocks' cast needs out and out_t, 16-byte aligned");
  FP8OPS_TRY(fused_cast_check(fmt, scale, amax, dbias, partial, partial_floats, rows, cols));
  Prologue pro = kNoPrologue;
  int64_t end = 0;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    pro.blk[i] = b->data[i];
    pro.blk_ld[i] = b->ld[i];
    end += b->cols[i];
    if (i < FP8OPS_MAX_BLOCKS - 1) pro.blk_end[i] = end;
  }
  cudaStream_t s = (cudaStream_t)stream;
#define FP8OPS_BLOCKS_LAUNCH(DT)                                                                   \
  return fmt == FP8OPS_E4M3                                                                        \
             ? launch_blocks_cast<DT, FP8OPS_E4M3>(pro, rows, cols, scale, out, out_t, amax, dbias, \
                                                   partial, s)                                     \
             : launch_blocks_cast<DT, FP8OPS_E5M2>(pro, rows, cols, scale, out, out_t, amax, dbias, \
                                                   partial, s)
  if (x_dtype == FP8OPS_BF16) FP8OPS_BLOCKS_LAUNCH(FP8OPS_BF16);
  FP8OPS_BLOCKS_LAUNCH(FP8OPS_F16);
#undef FP8OPS_BLOCKS_LAUNCH
}

// The blocks side by side into out [rows, cols] (contiguous): one strided copy
// per block, for the shapes the fused cast does not take.
extern "C" int fp8ops_blocks_copy_cuda(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype,
                                       int64_t rows, void* out, void* stream) {
  const int64_t cols = blocks_cols(b);
  FP8OPS_REQUIRE(cols >= 0 && rows >= 0, "blocks_copy: negative shape");
  const size_t esz = (size_t)dtype_size(dtype);
  int64_t c0 = 0;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    if (b->cols[i] > 0 && rows > 0) {
      FP8OPS_REQUIRE(b->ld[i] >= b->cols[i] || rows == 1, "blocks_copy: block %d's row stride %lld "
                     "is below its width %lld", i, (long long)b->ld[i], (long long)b->cols[i]);
      FP8OPS_CHECK_CUDA(cudaMemcpy2DAsync((char*)out + c0 * esz, cols * esz, b->data[i],
                                          (rows == 1 ? b->cols[i] : b->ld[i]) * esz,
                                          b->cols[i] * esz, rows, cudaMemcpyDeviceToDevice,
                                          (cudaStream_t)stream));
    }
    c0 += b->cols[i];
  }
  return FP8OPS_OK;
}

// The SwiGLU cast (fast path only; fp8ops_swiglu_cast_fusable says when):
// silu(gate) * up of x [rows, 2 * cols] cast and transposed, amax folded in.
template <int DT, int FMT>
static int launch_swiglu_cast(const void* x, int64_t rows, int64_t cols, const float* scale,
                              uint8_t* out, uint8_t* out_t, float* amax, cudaStream_t stream) {
  const dim3 grid((unsigned)FP8OPS_CEIL_DIV(cols, (int64_t)CT_TN(DT)),
                  (unsigned)FP8OPS_CEIL_DIV(rows, (int64_t)CT_TM));
  cast_transpose_kernel<DT, FMT, false, ACT_SWIGLU><<<grid, CT_THREADS, 0, stream>>>(
      x, scale, out, out_t, amax, rows, cols, NULL, kNoPrologue);
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

extern "C" int fp8ops_swiglu_cast_fusable(const void* x, int64_t rows, int64_t cols,
                                          const uint8_t* out, const uint8_t* out_t) {
  // (x's rows are 2 * cols long: with cols % 16 == 0 every row and the up half
  // start 16-byte aligned when x does, as ct_fast asks of a [rows, cols] input)
  return rows > 0 && cols > 0 && cols <= INT64_MAX / 2 && ct_fast(x, rows, cols, out, out_t);
}

extern "C" int fp8ops_swiglu_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype,
                                                  int64_t rows, int64_t cols, const float* scale,
                                                  fp8ops_fp8_format fmt, uint8_t* out,
                                                  uint8_t* out_t, float* amax, void* stream) {
  FP8OPS_REQUIRE(fp8ops_swiglu_cast_fusable(x, rows, cols, out, out_t),
                 "cast: the fused SwiGLU cast needs out_t, rows and cols multiples of 16 and "
                 "16-byte aligned pointers (fp8ops_swiglu_cast_fusable)");
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "cast: unknown input dtype code %d", (int)x_dtype);
  FP8OPS_TRY(fused_cast_check(fmt, scale, amax, NULL, NULL, 0, rows, cols));
  cudaStream_t s = (cudaStream_t)stream;
#define FP8OPS_SWIGLU_LAUNCH(DT)                                                                 \
  return fmt == FP8OPS_E4M3                                                                       \
             ? launch_swiglu_cast<DT, FP8OPS_E4M3>(x, rows, cols, scale, out, out_t, amax, s)     \
             : launch_swiglu_cast<DT, FP8OPS_E5M2>(x, rows, cols, scale, out, out_t, amax, s)
  switch (x_dtype) {
    case FP8OPS_F32: FP8OPS_SWIGLU_LAUNCH(FP8OPS_F32);
    case FP8OPS_BF16: FP8OPS_SWIGLU_LAUNCH(FP8OPS_BF16);
    default: FP8OPS_SWIGLU_LAUNCH(FP8OPS_F16);
  }
#undef FP8OPS_SWIGLU_LAUNCH
}

// out[i] = x[i] * gelu_tanh'(aux[i]) rounded to DT: the GELU's gradient as a
// pass of its own, for the casts fp8ops_dgelu_cast_accumulate_cuda cannot take.
// Block dims: (256). Grid dims: (min(ceil(n / 256), SMs * 8)), grid-stride.
template <int DT>
__global__ void __launch_bounds__(256)
    gelu_grad_kernel(const void* __restrict__ x, const void* __restrict__ aux,
                     void* __restrict__ out, int64_t n) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    store_elem<DT>(out, i, load_elem<DT>(x, i) * fp8ops_gelu_tanh_grad(load_elem<DT>(aux, i)));
  }
}

extern "C" int fp8ops_gelu_grad_cuda(const void* x, const void* aux, fp8ops_hp_dtype dtype,
                                     int64_t n, void* out, void* stream) {
  FP8OPS_REQUIRE(n >= 0 && (n == 0 || (x && aux && out)), "gelu_grad: bad arguments");
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "gelu_grad: unknown dtype code %d", (int)dtype);
  if (n == 0) return FP8OPS_OK;
  int sms = 0;
  FP8OPS_TRY(num_sms(&sms));
  const int64_t blocks = FP8OPS_CEIL_DIV(n, (int64_t)256), cap = (int64_t)sms * 8;
  const unsigned grid = (unsigned)(blocks < cap ? blocks : cap);
  cudaStream_t s = (cudaStream_t)stream;
  switch (dtype) {
    case FP8OPS_F32: gelu_grad_kernel<FP8OPS_F32><<<grid, 256, 0, s>>>(x, aux, out, n); break;
    case FP8OPS_BF16: gelu_grad_kernel<FP8OPS_BF16><<<grid, 256, 0, s>>>(x, aux, out, n); break;
    default: gelu_grad_kernel<FP8OPS_F16><<<grid, 256, 0, s>>>(x, aux, out, n);
  }
  FP8OPS_CHECK_CUDA(cudaGetLastError());
  return FP8OPS_OK;
}

extern "C" int fp8ops_amax_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t n, float* amax,
                                void* stream) {
  FP8OPS_REQUIRE(n >= 0, "amax: negative size %lld", (long long)n);
  FP8OPS_REQUIRE(amax && (n == 0 || x), "amax: null pointer");
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "amax: unknown input dtype code %d", (int)x_dtype);
  FP8OPS_REQUIRE(aligned(x, dtype_size(x_dtype)),
                 "amax: input pointer %p is not aligned to its dtype (%d bytes)", x,
                 dtype_size(x_dtype));
  cudaStream_t s = (cudaStream_t)stream;
  FP8OPS_CHECK_CUDA(cudaMemsetAsync(amax, 0, sizeof(float), s));
  if (n == 0) return FP8OPS_OK;
  // the format and scale are unused without an output; E4M3 picks one instance
  switch (x_dtype) {
    case FP8OPS_F32: return launch_elementwise<FP8OPS_F32, FP8OPS_E4M3>(x, NULL, NULL, amax, n, s);
    case FP8OPS_BF16: return launch_elementwise<FP8OPS_BF16, FP8OPS_E4M3>(x, NULL, NULL, amax, n, s);
    default: return launch_elementwise<FP8OPS_F16, FP8OPS_E4M3>(x, NULL, NULL, amax, n, s);
  }
}
