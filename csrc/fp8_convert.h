/*
 * fp8_convert.h -- scalar float <-> fp8/bf16/fp16 conversions shared by the C
 * (CPU) and CUDA kernels, so both produce the same bits.
 *
 * float -> fp8 follows torch's own conversion (c10 Float8_e4m3fn / Float8_e5m2):
 * round to nearest even, subnormals kept, |x| beyond the format -> NaN (e4m3fn)
 * or inf/NaN (e5m2), and the sign bit copied, NaN included. The casts clamp a
 * finite product to +-fp8_max before converting, so only NaN and an infinite
 * input reach the "beyond" branch.
 * The subnormal branch relies on an fp32 add in round-to-nearest without
 * flush-to-zero: never build these files with -ffast-math / --use_fast_math.
 */
#ifndef FP8OPS_FP8_CONVERT_H
#define FP8OPS_FP8_CONVERT_H

#include <stdint.h>
#include <string.h>

#ifdef __CUDACC__
#define FP8OPS_HD __host__ __device__ __forceinline__
#else
#define FP8OPS_HD static inline
#endif

/* |bits| of +inf: a magnitude's bits at or above it are inf or NaN */
#define FP8OPS_F32_INF_BITS 0x7F800000u

FP8OPS_HD uint32_t fp8ops_f32_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

FP8OPS_HD float fp8ops_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

/* bf16 / fp16 bits -> float (exact) */
FP8OPS_HD float fp8ops_bf16_to_f32(uint16_t h) { return fp8ops_bits_f32((uint32_t)h << 16); }

FP8OPS_HD float fp8ops_f16_to_f32(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return fp8ops_bits_f32(sign | 0x7F800000u | (man << 13)); /* inf / NaN */
  if (exp == 0) {
    /* zero or subnormal: man * 2^-24, exact in fp32 */
    float v = (float)man * 5.9604644775390625e-08f;
    return fp8ops_bits_f32(sign | fp8ops_f32_bits(v));
  }
  return fp8ops_bits_f32(sign | ((exp + 112u) << 23) | (man << 13));
}

/* float -> fp8 bits. Normal range: add half an fp8 ulp minus one (plus one if
 * the kept mantissa is odd: ties to even) and truncate. Subnormal range: adding
 * a power of two whose fp32 ulp equals the fp8 subnormal step lets the FPU do
 * the round-to-nearest-even. */
FP8OPS_HD uint8_t fp8ops_f32_to_e4m3(float f) {
  uint32_t bits = fp8ops_f32_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  uint8_t r;
  bits ^= sign;
  if (bits >= (1087u << 20)) { /* >= 480 or NaN: e4m3fn has no inf */
    r = 0x7F;
  } else if (bits < (121u << 23)) { /* below 2^-6: subnormal, rounded by an fp32 add */
    const uint32_t magic = 141u << 23; /* 2^(141-127): aligns 2^-9 to the fp32 ulp */
    uint32_t sum = fp8ops_f32_bits(fp8ops_bits_f32(bits) + fp8ops_bits_f32(magic));
    r = (uint8_t)(sum - magic);
  } else { /* normal: rebias exponent, round half to even on bit 20 */
    uint32_t odd = (bits >> 20) & 1u;
    bits += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
    r = (uint8_t)(bits >> 20);
  }
  return (uint8_t)(r | (sign >> 24));
}

FP8OPS_HD uint8_t fp8ops_f32_to_e5m2(float f) {
  uint32_t bits = fp8ops_f32_bits(f);
  const uint32_t sign = bits & 0x80000000u;
  uint8_t r;
  bits ^= sign;
  if (bits >= (143u << 23)) { /* >= 65536: inf, or NaN */
    r = bits > 0x7F800000u ? 0x7F : 0x7C;
  } else if (bits < (113u << 23)) { /* below 2^-14: subnormal */
    const uint32_t magic = 134u << 23;
    uint32_t sum = fp8ops_f32_bits(fp8ops_bits_f32(bits) + fp8ops_bits_f32(magic));
    r = (uint8_t)(sum - magic);
  } else {
    uint32_t odd = (bits >> 21) & 1u;
    bits += ((uint32_t)(15 - 127) << 23) + 0xFFFFFu + odd;
    r = (uint8_t)(bits >> 21);
  }
  return (uint8_t)(r | (sign >> 24));
}

/* fp8 -> float (exact) */
FP8OPS_HD float fp8ops_e4m3_to_f32(uint8_t v) {
  uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xFu, man = v & 0x7u;
  if (exp == 0xFu && man == 0x7u) return fp8ops_bits_f32(sign | 0x7FC00000u);
  if (exp == 0) return fp8ops_bits_f32(sign | fp8ops_f32_bits((float)man * 0.001953125f)); /* 2^-9 */
  return fp8ops_bits_f32(sign | ((exp + 120u) << 23) | (man << 20));
}

FP8OPS_HD float fp8ops_e5m2_to_f32(uint8_t v) {
  uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  uint32_t exp = (v >> 2) & 0x1Fu, man = v & 0x3u;
  if (exp == 0x1Fu) return fp8ops_bits_f32(sign | 0x7F800000u | (man << 21));
  if (exp == 0) return fp8ops_bits_f32(sign | fp8ops_f32_bits((float)man * 1.52587890625e-05f)); /* 2^-16 */
  return fp8ops_bits_f32(sign | ((exp + 112u) << 23) | (man << 21));
}

/* float -> bf16 / fp16 bits, round to nearest even (torch's rounding) */
FP8OPS_HD uint16_t fp8ops_f32_to_bf16(float f) {
  uint32_t u = fp8ops_f32_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

FP8OPS_HD uint16_t fp8ops_f32_to_f16(float f) {
  uint32_t u = fp8ops_f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);
  if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds to >= 65520: inf */
  if (a < 0x38800000u) {                                     /* below 2^-14: subnormal half */
    float m = fp8ops_bits_f32(a) + 0.5f;                       /* 0.5 = 2^-1: ulp 2^-24 */
    return (uint16_t)(sign | (fp8ops_f32_bits(m) - 0x3F000000u));
  }
  a += 0xC8000FFFu + ((a >> 13) & 1u); /* rebias (-112 << 23) and round half to even */
  return (uint16_t)(sign | (a >> 13));
}

#endif /* FP8OPS_FP8_CONVERT_H */
