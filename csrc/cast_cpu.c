/*
 * cast_cpu.c -- CPU reference kernels of fp8ops::cast and fp8ops::amax (and
 * of the fused GELU, SwiGLU and LayerNorm around them). The casts define the semantics
 * the CUDA kernels are tested against bit for bit.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "fp8_convert.h"
#include "gelu.h"
#include "swiglu.h"

// ----------------------------------------------------------------------------
// helpers

static inline float load_hp(const void* x, fp8ops_hp_dtype dt, int64_t i) {
  switch (dt) {
    case FP8OPS_BF16: return fp8ops_bf16_to_f32(((const uint16_t*)x)[i]);
    case FP8OPS_F16: return fp8ops_f16_to_f32(((const uint16_t*)x)[i]);
    default: return ((const float*)x)[i];
  }
}

/* v rounded to dt: what a torch kernel computing v for a tensor of dtype dt writes */
static inline float round_hp(float v, fp8ops_hp_dtype dt) {
  switch (dt) {
    case FP8OPS_BF16: return fp8ops_bf16_to_f32(fp8ops_f32_to_bf16(v));
    case FP8OPS_F16: return fp8ops_f16_to_f32(fp8ops_f32_to_f16(v));
    default: return v;
  }
}

/* element i of x (dtype dt) set to v rounded to dt */
static inline void store_hp(void* x, fp8ops_hp_dtype dt, int64_t i, float v) {
  switch (dt) {
    case FP8OPS_BF16: ((uint16_t*)x)[i] = fp8ops_f32_to_bf16(v); break;
    case FP8OPS_F16: ((uint16_t*)x)[i] = fp8ops_f32_to_f16(v); break;
    default: ((float*)x)[i] = v;
  }
}

/* |v| as ordered bits: for non-negative floats the uint32 order is the value
 * order and any NaN sorts above +inf, so max over these bits propagates NaN. */
static inline uint32_t abs_bits(float v) { return fp8ops_f32_bits(v) & 0x7FFFFFFFu; }

// ----------------------------------------------------------------------------
// kernels

/* LayerNorm(x) of element (r, c), fp32 (fp8ops.h: fp8ops_ln_params; no gamma:
 * ones, no beta: zeros) */
static inline float ln_f32(float v, int64_t r, int64_t c, const fp8ops_ln_params* ln) {
  const float g = ln->gamma ? ln->gamma[c] : 1.0f, b = ln->beta ? ln->beta[c] : 0.0f;
  return g * (ln->rstd[r] * (v - ln->mean[r])) + b;
}

/* gelu: cast gelu_tanh(x); ln (not NULL): cast LayerNorm(x); either rounded to x's dtype first */
static int cast_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                    const float* scale, fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                    float* amax, int accumulate, int gelu, const fp8ops_ln_params* ln) {
  FP8OPS_REQUIRE(rows >= 0 && cols >= 0, "cast: negative shape [%lld, %lld]", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(scale && amax && (rows * cols == 0 || (x && out)), "cast: null pointer");
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "cast: unknown input dtype code %d", (int)x_dtype);
  FP8OPS_REQUIRE(fmt == FP8OPS_E4M3 || fmt == FP8OPS_E5M2, "cast: unknown fp8 format %d", (int)fmt);
  const float s = *scale;
  const float fmax = fmt == FP8OPS_E4M3 ? FP8OPS_E4M3_MAX : FP8OPS_E5M2_MAX;
  uint32_t amax_bits = 0;
  for (int64_t r = 0; cols > 0 && r < rows; ++r) { /* (cols == 0: no pass over empty rows) */
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t i = r * cols + c;
      float v = load_hp(x, x_dtype, i);
      if (gelu) v = round_hp(fp8ops_gelu_tanh(v), x_dtype);
      if (ln) v = round_hp(ln_f32(v, r, c, ln), x_dtype);
      const uint32_t a = abs_bits(v);
      if (a > amax_bits) amax_bits = a;
      float y = v * s;
      /* saturate a finite value; written so that NaN falls through both tests unchanged. An
       * infinite one stays infinite and converts to NaN (e4m3fn) or inf (e5m2), as nn.Linear's
       * output would be non-finite: a loss scaler or a divergence check must see it. */
      if (a < FP8OPS_F32_INF_BITS) {
        if (y > fmax) y = fmax;
        if (y < -fmax) y = -fmax;
      }
      const uint8_t q = fmt == FP8OPS_E4M3 ? fp8ops_f32_to_e4m3(y) : fp8ops_f32_to_e5m2(y);
      out[i] = q;
      if (out_t) out_t[c * rows + r] = q;
    }
  }
  /* accumulate: the same max over raw bits as the CUDA kernels' atomicMax, signed, so that
   * a negative value there (sign bit set) is below every amax */
  if (!accumulate || (int32_t)amax_bits > (int32_t)fp8ops_f32_bits(*amax))
    *amax = fp8ops_bits_f32(amax_bits);
  return FP8OPS_OK;
}

int fp8ops_cast_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                    const float* scale, fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                    float* amax) {
  return cast_cpu(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, 0, 0, NULL);
}

int fp8ops_cast_accumulate_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                               int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                               uint8_t* out, uint8_t* out_t, float* amax) {
  return cast_cpu(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, 1, 0, NULL);
}

int fp8ops_gelu_cast_accumulate_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                    int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                    uint8_t* out, uint8_t* out_t, float* amax) {
  return cast_cpu(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, 1, 1, NULL);
}

int fp8ops_ln_cast_accumulate_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                  int64_t cols, const fp8ops_ln_params* ln, const float* scale,
                                  fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t, float* amax) {
  FP8OPS_REQUIRE(ln && ln->mean && ln->rstd, "cast: the LayerNorm cast needs mean and rstd");
  return cast_cpu(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, 1, 0, ln);
}

int fp8ops_layernorm_stats_cpu(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                               float eps, int rms, float* mean, float* rstd) {
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && (rows == 0 || (x && mean && rstd)),
                 "layernorm_stats: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "layernorm_stats: unknown dtype code %d", (int)dtype);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0.0, sq = 0.0;
    if (!rms)
      for (int64_t c = 0; c < cols; ++c) sum += load_hp(x, dtype, r * cols + c);
    const double m = sum / (double)cols; /* 0 for an RMSNorm */
    for (int64_t c = 0; c < cols; ++c) {
      const double d = load_hp(x, dtype, r * cols + c) - m;
      sq += d * d;
    }
    mean[r] = (float)m;
    rstd[r] = (float)(1.0 / sqrt(sq / (double)cols + (double)eps));
  }
  return FP8OPS_OK;
}

int fp8ops_add_layernorm_stats_cpu(const void* x, fp8ops_hp_dtype dtype, const void* res,
                                   fp8ops_hp_dtype res_dtype, int64_t rows, int64_t cols,
                                   float eps, int rms, void* sum, float* mean, float* rstd) {
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && (rows == 0 || (x && res && sum && mean && rstd)),
                 "add_layernorm_stats: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(fp8ops_add_res_dtypes_ok(dtype, res_dtype),
                 "add_layernorm_stats: res of dtype code %d cannot be added to x of dtype code %d",
                 (int)res_dtype, (int)dtype);
  for (int64_t i = 0; i < rows * cols; ++i)
    store_hp(sum, dtype, i, load_hp(x, dtype, i) + load_hp(res, res_dtype, i));
  return fp8ops_layernorm_stats_cpu(sum, dtype, rows, cols, eps, rms, mean, rstd);
}

/* Row sums in double; dx rounded once from float, as the CUDA kernel does (with dres:
 * rounded, then added to dres in float and rounded again, as a separate add would; the
 * copy: that sum rounded to copy_dtype). */
int fp8ops_layernorm_bwd_cpu(const void* dy, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                             int64_t cols, const float* mean, const float* rstd,
                             const float* gamma, int rms, const void* dres,
                             fp8ops_hp_dtype copy_dtype, void* dx, void* dcopy, float* dgb) {
  FP8OPS_REQUIRE(rows >= 0 && cols > 0 && dgb &&
                     (rows == 0 || (dy && x && mean && rstd && dx)),
                 "layernorm_bwd: bad arguments (rows %lld, cols %lld)", (long long)rows,
                 (long long)cols);
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "layernorm_bwd: unknown dtype code %d", (int)dtype);
  const int copy = copy_dtype != FP8OPS_F32;
  FP8OPS_REQUIRE(!copy || (dtype == FP8OPS_F32 && (rows == 0 || (dres && dcopy)) &&
                           (copy_dtype == FP8OPS_BF16 || copy_dtype == FP8OPS_F16)),
                 "layernorm_bwd: a copy (dtype code %d) only of dx + dres over fp32 rows",
                 (int)copy_dtype);
  double* col = (double*)calloc(2 * (size_t)cols, sizeof(double));
  FP8OPS_REQUIRE(col != NULL, "layernorm_bwd: out of memory: fp8ops' CPU reference could not "
                 "allocate %lld columns", (long long)cols);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mean[r], rs = rstd[r];
    double s1 = 0.0, s2 = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const double g = (double)load_hp(dy, dtype, r * cols + c) * (gamma ? gamma[c] : 1.0f);
      s1 += g;
      s2 += g * ((load_hp(x, dtype, r * cols + c) - m) * rs);
    }
    const float c1 = rms ? 0.0f : (float)(s1 / (double)cols), c2 = (float)(s2 / (double)cols);
    for (int64_t c = 0; c < cols; ++c) {
      const float d = load_hp(dy, dtype, r * cols + c);
      const float xh = (load_hp(x, dtype, r * cols + c) - m) * rs;
      col[c] += (double)d * xh;
      col[cols + c] += d;
      const float v = rs * (d * (gamma ? gamma[c] : 1.0f) - c1 - xh * c2);
      const float o =
          dres ? round_hp(round_hp(v, dtype) + load_hp(dres, dtype, r * cols + c), dtype) : v;
      store_hp(dx, dtype, r * cols + c, o);
      if (copy) store_hp(dcopy, copy_dtype, r * cols + c, o);
    }
  }
  for (int64_t c = 0; c < 2 * cols; ++c) dgb[c] = (float)col[c];
  free(col);
  return FP8OPS_OK;
}

int fp8ops_gelu_grad_cpu(const void* x, const void* aux, fp8ops_hp_dtype dtype, int64_t n,
                         void* out) {
  FP8OPS_REQUIRE(n >= 0 && (n == 0 || (x && aux && out)), "gelu_grad: bad arguments");
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "gelu_grad: unknown dtype code %d", (int)dtype);
  for (int64_t i = 0; i < n; ++i) {
    store_hp(out, dtype, i, load_hp(x, dtype, i) * fp8ops_gelu_tanh_grad(load_hp(aux, dtype, i)));
  }
  return FP8OPS_OK;
}

static int swiglu_args(const char* op, const void* a, const void* b, fp8ops_hp_dtype dtype,
                       int64_t rows, int64_t cols, const void* out) {
  FP8OPS_REQUIRE(rows >= 0 && cols >= 0 && (rows * cols == 0 || (a && b && out)),
                 "%s: bad arguments", op);
  FP8OPS_REQUIRE(dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 || dtype == FP8OPS_F16,
                 "%s: unknown dtype code %d", op, (int)dtype);
  return FP8OPS_OK;
}

int fp8ops_swiglu_cpu(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                      void* out) {
  FP8OPS_TRY(swiglu_args("swiglu", x, x, dtype, rows, cols, out));
  for (int64_t r = 0; cols > 0 && r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float s = round_hp(fp8ops_silu(load_hp(x, dtype, 2 * r * cols + c)), dtype);
      store_hp(out, dtype, r * cols + c, s * load_hp(x, dtype, (2 * r + 1) * cols + c));
    }
  return FP8OPS_OK;
}

int fp8ops_swiglu_grad_cpu(const void* dh, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                           int64_t cols, void* dx) {
  FP8OPS_TRY(swiglu_args("swiglu_grad", dh, x, dtype, rows, cols, dx));
  for (int64_t r = 0; cols > 0 && r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t gi = 2 * r * cols + c, ui = gi + cols;
      const float d = load_hp(dh, dtype, r * cols + c), g = load_hp(x, dtype, gi);
      const float dup = d * round_hp(fp8ops_silu(g), dtype);
      const float dgate = round_hp(d * load_hp(x, dtype, ui), dtype) * fp8ops_silu_grad(g);
      store_hp(dx, dtype, gi, dgate);
      store_hp(dx, dtype, ui, dup);
    }
  return FP8OPS_OK;
}

/* Row by row, keeping the running 8-row block sums, 128-row tile sums and
 * totals per column (the order fp8ops.h defines; cache-friendly on the CPU). */
int fp8ops_dbias_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                     float* dbias) {
  FP8OPS_REQUIRE(rows >= 0 && cols >= 0 && dbias && (rows * cols == 0 || x),
                 "dbias: bad arguments");
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "dbias: unknown input dtype code %d", (int)x_dtype);
  for (int64_t c = 0; c < cols; ++c) dbias[c] = 0.0f;
  if (rows == 0 || cols == 0) return FP8OPS_OK;
  float* block = (float*)malloc(2 * (size_t)cols * sizeof(float));
  FP8OPS_REQUIRE(block != NULL, "dbias: out of memory: fp8ops' CPU reference could not "
                 "allocate %lld columns", (long long)cols);
  float* tile = block + cols;
  const int64_t padded = (rows + 127) / 128 * 128;
  for (int64_t r = 0; r < padded; ++r) {
    const int i = (int)(r % 8), h = (int)(r % 128 / 8);
    for (int64_t c = 0; c < cols; ++c) {
      const float v = r < rows ? load_hp(x, x_dtype, r * cols + c) : 0.0f;
      block[c] = i == 0 ? v : block[c] + v;
      if (i == 7) tile[c] = h == 0 ? block[c] : tile[c] + block[c];
      if (i == 7 && h == 15) dbias[c] = r == 127 ? tile[c] : dbias[c] + tile[c];
    }
  }
  free(block);
  return FP8OPS_OK;
}

int fp8ops_amax_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t n, float* amax) {
  FP8OPS_REQUIRE(n >= 0 && amax && (n == 0 || x), "amax: bad arguments");
  FP8OPS_REQUIRE(x_dtype == FP8OPS_F32 || x_dtype == FP8OPS_BF16 || x_dtype == FP8OPS_F16,
                 "amax: unknown input dtype code %d", (int)x_dtype);
  uint32_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = abs_bits(load_hp(x, x_dtype, i));
    if (a > m) m = a;
  }
  *amax = fp8ops_bits_f32(m);
  return FP8OPS_OK;
}

int fp8ops_blocks_copy_cpu(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype, int64_t rows,
                           void* out) {
  FP8OPS_REQUIRE(b != NULL && rows >= 0 && (dtype == FP8OPS_F32 || dtype == FP8OPS_BF16 ||
                                            dtype == FP8OPS_F16), "blocks_copy: bad arguments");
  const size_t esz = dtype == FP8OPS_F32 ? 4 : 2;
  int64_t cols = 0;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    FP8OPS_REQUIRE(b->cols[i] >= 0, "blocks_copy: block %d has %lld columns", i,
                   (long long)b->cols[i]);
    cols += b->cols[i];
  }
  int64_t c0 = 0;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    for (int64_t r = 0; r < rows && b->cols[i] > 0; ++r)
      memcpy((char*)out + (r * cols + c0) * esz, (const char*)b->data[i] + r * b->ld[i] * esz,
             (size_t)b->cols[i] * esz);
    c0 += b->cols[i];
  }
  return FP8OPS_OK;
}
