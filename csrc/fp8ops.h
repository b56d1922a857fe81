/*
 * fp8ops.h -- the C API of fp8ops: every fp8ops_* entry point, CPU and CUDA.
 *
 * Conventions (used everywhere in fp8ops, C and Python):
 *   - Row-major layout. A "matrix" view of an N-d tensor is [rows, cols] with
 *     cols = size of the last dim and rows = product of the others.
 *   - `scale` multiplies before the cast: x_fp8 = sat(round(x * scale)).
 *     `scale_inv` = 1 / scale is what the GEMM consumes to undo it.
 *   - hp / lp: high precision (fp32, bf16, fp16) / low precision (fp8).
 *   - e4m3 (float8_e4m3fn, max 448) for forward tensors, e5m2 (max 57344) for
 *     gradients in the "hybrid" format.
 *   - amax_history is [H, n]: one column per scaled tensor, H steps deep
 *     (Transformer Engine's layout). Row 0 is the slot where the current step's
 *     amaxes are collected: the accumulate casts (fp8ops_cast_accumulate_*,
 *     and the linear ops built on them) fold each cast's amax into it, across
 *     micro-batches. amax_update rolls every column up by one
 *     (torch.roll(h, -1, dims=0)): the old row 0 moves to row H-1, and row 0 is
 *     zeroed for the next step.
 *   - Every function returns FP8OPS_OK (0) or an FP8OPS_ERR_* code; the message
 *     is then in fp8ops_last_error() (thread-local). Nothing here exits or aborts.
 *   - CUDA functions take the stream to run on (the caller passes torch's
 *     current stream for the tensors' device, under a device guard). All
 *     pointers given to CUDA functions are device pointers.
 */
#ifndef FP8OPS_H
#define FP8OPS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------- */
/* status codes and errors */

enum {
  FP8OPS_OK = 0,
  FP8OPS_ERR_INVALID = 1,     /* bad argument (shape, dtype, ...) */
  FP8OPS_ERR_CUDA = 2,        /* a CUDA runtime call failed */
  FP8OPS_ERR_CUBLAS = 3,      /* a cuBLASLt call failed */
  FP8OPS_ERR_UNSUPPORTED = 4, /* this GPU / library cannot do it */
  FP8OPS_ERR_NOMEM = 5
};

/* Message of the last failure on this thread ("" if none). */
const char* fp8ops_last_error(void);
/* Record a failure message (printf-style); returns `code`. */
int fp8ops_set_error(int code, const char* fmt, ...);

/* ------------------------------------------------------------------------- */
/* dtypes (our own codes; ops.c maps torch's dtype codes onto these) */

typedef enum { FP8OPS_F32 = 0, FP8OPS_BF16 = 1, FP8OPS_F16 = 2 } fp8ops_hp_dtype;
typedef enum { FP8OPS_E4M3 = 0, FP8OPS_E5M2 = 1 } fp8ops_fp8_format;

#define FP8OPS_E4M3_MAX 448.0f
#define FP8OPS_E5M2_MAX 57344.0f

/* amax_compute_algo of delayed scaling */
typedef enum { FP8OPS_AMAX_MAX = 0, FP8OPS_AMAX_MOST_RECENT = 1 } fp8ops_amax_algo;

/* ------------------------------------------------------------------------- */
/* cast: hp -> fp8 with a scale, saturating, round-to-nearest-even, fused amax.
 * A finite x saturates to +-max; an infinite x gives NaN (e4m3) or +-inf (e5m2),
 * NaN stays NaN: a non-finite input stays non-finite, as nn.Linear's output would.
 *
 * \param[in]  x        [rows, cols] hp values, dtype `x_dtype`, contiguous
 * \param[in]  scale    one fp32 value (pointer; device pointer for CUDA)
 * \param[in]  fmt      output format
 * \param[out] out      [rows, cols] fp8 bytes
 * \param[out] out_t    [cols, rows] fp8 bytes (the transpose), or NULL to skip
 * \param[out] amax     one fp32: max |x| over the input (of x, not x*scale);
 *                      NaN if any x is NaN; 0 for an empty input.
 * Semantics, bit for bit: out = fp8(clamp(float(x) * scale, -max, max)) with
 * torch's float->fp8 conversion (RNE, subnormals kept, NaN stays NaN and keeps
 * its sign bit).
 */
int fp8ops_cast_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                    const float* scale, fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                    float* amax);
int fp8ops_cast_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                     const float* scale, fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                     float* amax, void* stream);
/* The same cast, folding this input's amax into the running value at *amax
 * instead of overwriting it: *amax = max(*amax, max |x|), the max taken over
 * the fp32 bit patterns (so a NaN on either side wins, as in amax_update).
 * A negative value there counts as below every amax (e.g. row 0 of an amax history);
 * used by Fp8Linear so no separate max op follows each cast. */
int fp8ops_cast_accumulate_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                               const float* scale, fp8ops_fp8_format fmt, uint8_t* out,
                               uint8_t* out_t, float* amax);
int fp8ops_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                uint8_t* out, uint8_t* out_t, float* amax, void* stream);

/* The fused GELU of an FP8 linear whose input is gelu_tanh(x): cast_accumulate
 * of g = gelu_tanh(x) rounded to x's dtype (the tensor torch's GELU writes;
 * gelu.h has the formula), amax of g. x is the GELU's input, the linear's
 * pre-activation. CPU and CUDA agree to tanhf's rounding (gelu.h). */
int fp8ops_gelu_cast_accumulate_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                    int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                    uint8_t* out, uint8_t* out_t, float* amax);
int fp8ops_gelu_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                     int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                     uint8_t* out, uint8_t* out_t, float* amax, void* stream);
/* The fused GELU's backward, in the layer that produced the GELU's input h:
 * out[i] = x[i] * gelu_tanh'(aux[i]) rounded to `dtype` (x the gradient of
 * gelu(h), aux = h; n elements each). */
int fp8ops_gelu_grad_cpu(const void* x, const void* aux, fp8ops_hp_dtype dtype, int64_t n,
                         void* out);
int fp8ops_gelu_grad_cuda(const void* x, const void* aux, fp8ops_hp_dtype dtype, int64_t n,
                          void* out, void* stream);
/* The same product fused into cast_accumulate (with the product's column sums
 * into dbias unless dbias is NULL; partial as for
 * fp8ops_cast_accumulate_dbias_cuda): one pass over x and aux instead of
 * three. Needs out_t, rows and cols multiples of 16 and x, aux, out, out_t
 * 16-byte aligned: fp8ops_dgelu_cast_fusable says whether they are; else
 * fp8ops_gelu_grad_cuda into a buffer, then the plain cast. */
int fp8ops_dgelu_cast_fusable(const void* x, const void* aux, int64_t rows, int64_t cols,
                              const uint8_t* out, const uint8_t* out_t);
int fp8ops_dgelu_cast_accumulate_cuda(const void* x, const void* aux, fp8ops_hp_dtype x_dtype,
                                      int64_t rows, int64_t cols, const float* scale,
                                      fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                                      float* amax, float* dbias, float* partial,
                                      int64_t partial_floats, void* stream);

/* The SwiGLU activation (swiglu_fusion.py): x [rows, 2 * cols] holds gate =
 * x[:, :cols] and up = x[:, cols:] (one projection's output, chunked).
 * swiglu: out [rows, cols] = silu(gate) * up, rounded to `dtype` after the
 * SiLU and after the product (the tensors torch's silu and mul write).
 * swiglu_grad: its backward, dx [rows, 2 * cols] from the output's gradient
 * dh [rows, cols]: dgate = round(round(dh * up) * silu'(gate)), dup =
 * round(dh * round(silu(gate))) (torch's mul and silu_backward, and the chunk's
 * cat, in one pass). swiglu.h has the formulas; CPU and CUDA agree to expf's
 * rounding. */
int fp8ops_swiglu_cpu(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                      void* out);
int fp8ops_swiglu_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                       void* out, void* stream);
int fp8ops_swiglu_grad_cpu(const void* dh, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                           int64_t cols, void* dx);
int fp8ops_swiglu_grad_cuda(const void* dh, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                            int64_t cols, void* dx, void* stream);
/* cast_accumulate of swiglu(x) (x [rows, 2 * cols]; out [rows, cols], out_t
 * [cols, rows], amax of swiglu(x)) in the cast's own pass over x: the input
 * cast of the linear a SwiGLU feeds. Fast path only (out_t, rows and cols
 * multiples of 16, 16-byte aligned pointers): fp8ops_swiglu_cast_fusable says
 * when; else fp8ops_swiglu_cuda into a buffer, then the plain cast. */
int fp8ops_swiglu_cast_fusable(const void* x, int64_t rows, int64_t cols, const uint8_t* out,
                               const uint8_t* out_t);
int fp8ops_swiglu_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                       int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                       uint8_t* out, uint8_t* out_t, float* amax, void* stream);

/* The LayerNorm or RMSNorm fused into an FP8 linear's input cast
 * (layernorm_fusion.py). layernorm_stats: per row of x [rows, cols], mean[r]
 * and rstd[r] = 1 / sqrt(var[r] + eps) (biased variance), fp32: what torch's
 * native_layer_norm returns beside its output, and its backward takes; with
 * rms, RMSNorm's: mean[r] = 0 and rstd[r] = 1 / sqrt(sum_c(x^2) / cols + eps),
 * so that everything downstream reads an RMSNorm as a LayerNorm whose mean is
 * 0. ln_cast_accumulate: cast_accumulate of LayerNorm(x) = gamma[c] * (rstd[r]
 * * (x - mean[r])) + beta[c] rounded to x's dtype (the tensor torch's
 * LayerNorm writes), amax of it; gamma, beta fp32 [cols], or NULL for ones /
 * zeros (no weight / no bias); out_t is required. CPU and CUDA agree to fp32
 * rounding, not bit for bit. */
typedef struct {
  const float* mean;
  const float* rstd;
  const float* gamma;
  const float* beta;
} fp8ops_ln_params;
int fp8ops_layernorm_stats_cpu(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                               float eps, int rms, float* mean, float* rstd);
int fp8ops_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                                float eps, int rms, float* mean, float* rstd, void* stream);
/* add_layernorm_stats: sum = x + res [rows, cols] in x's dtype, each element
 * the fp32 sum (res promoted to x's dtype: res of x's dtype, or bfloat16 or
 * float16 for fp32 x, fp8ops_add_res_dtypes_ok) rounded to x's dtype, what
 * torch's add writes, then layernorm_stats of sum: the separate add and
 * layernorm_stats, bit for bit, in one pass over the rows on CUDA where they are
 * whole 16-byte vectors (an add kernel first where not). ln_linear_fwd_res's
 * norm: a residual stream's add fused into the next norm's statistics. */
static inline int fp8ops_add_res_dtypes_ok(fp8ops_hp_dtype dtype, fp8ops_hp_dtype res_dtype) {
  return res_dtype == dtype || dtype == FP8OPS_F32;
}
int fp8ops_add_layernorm_stats_cpu(const void* x, fp8ops_hp_dtype dtype, const void* res,
                                   fp8ops_hp_dtype res_dtype, int64_t rows, int64_t cols,
                                   float eps, int rms, void* sum, float* mean, float* rstd);
int fp8ops_add_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype, const void* res,
                                    fp8ops_hp_dtype res_dtype, int64_t rows, int64_t cols,
                                    float eps, int rms, void* sum, float* mean, float* rstd,
                                    void* stream);
int fp8ops_ln_cast_accumulate_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                  int64_t cols, const fp8ops_ln_params* ln, const float* scale,
                                  fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t, float* amax);
int fp8ops_ln_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                   int64_t cols, const fp8ops_ln_params* ln, const float* scale,
                                   fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t, float* amax,
                                   void* stream);

/* layernorm_bwd: the LayerNorm's backward from layernorm_stats' mean and rstd,
 * for x and dy [rows, cols] of one dtype, gamma fp32 [cols] (NULL: ones); per
 * row, with xhat = (x - mean[r]) * rstd[r] and g = dy * gamma[c],
 *   dx = rstd[r] * (g - sum_c(g) / cols - xhat * sum_c(g * xhat) / cols)
 * rounded to the dtype (plus dres[r, c] when dres, x's dtype and shape, is not
 * NULL: dx rounded first, then the sum in fp32 rounded again, which is a separate
 * add's result bit for bit; then, with copy_dtype FP8OPS_BF16 or FP8OPS_F16 and
 * fp32 rows, also dcopy = that sum rounded to copy_dtype, the conversion the
 * add's kernel would write; FP8OPS_F32: no copy), and over the rows
 * dgb[c] = sum_r dy * xhat (dgamma),
 * dgb[cols + c] = sum_r dy (dbeta), fp32: what torch's
 * native_layer_norm_backward computes, with one read of x and dy instead of
 * two. With rms (RMSNorm's statistics, mean 0) the sum_c(g) / cols term is
 * not there: the mean was not subtracted, so its gradient is not either; dbeta
 * is then the column sum of dy, which an RMSNorm has no use for. CUDA: rows of
 * at most FP8OPS_LN_BWD_MAX_COLS columns, split into
 * fp8ops_layernorm_bwd_warps_per_row slices of whole 16-byte vectors (4 fp32 /
 * 8 bf16 or fp16 elements: fp8ops_layernorm_bwd_cols_ok), pointers 16-byte
 * aligned (fp8ops_layernorm_bwd_fusable; the op copies a misaligned x or dy
 * first); partial: device scratch of
 * fp8ops_layernorm_bwd_partial_floats(rows, cols) floats. CPU and CUDA agree to
 * fp32 rounding; each is deterministic. */
#define FP8OPS_LN_BWD_MAX_COLS 4096
#define FP8OPS_LN_BWD_WARPS 4 /* warps per CTA */
/* warps that share a row: its registers hold at most 1024 columns per warp */
static inline int fp8ops_layernorm_bwd_warps_per_row(int64_t cols) {
  return cols > 2048 ? 4 : cols > 1024 ? 2 : 1;
}
/* rows per warp (group): 4, doubled until the grid is at most 1024 CTAs */
static inline int fp8ops_layernorm_bwd_rows_per_warp(int64_t rows, int64_t cols) {
  const int64_t in_flight = FP8OPS_LN_BWD_WARPS / fp8ops_layernorm_bwd_warps_per_row(cols);
  int rpw = 4;
  while (rpw < (1 << 24) && (int64_t)rpw * in_flight * 1024 < rows) rpw *= 2;
  return rpw;
}
static inline int64_t fp8ops_layernorm_bwd_tiles(int64_t rows, int64_t cols) {
  const int64_t per_cta = (int64_t)FP8OPS_LN_BWD_WARPS / fp8ops_layernorm_bwd_warps_per_row(cols) *
                          fp8ops_layernorm_bwd_rows_per_warp(rows, cols);
  return (rows + per_cta - 1) / per_cta;
}
static inline int64_t fp8ops_layernorm_bwd_partial_floats(int64_t rows, int64_t cols) {
  return fp8ops_layernorm_bwd_tiles(rows, cols) * 2 * cols;
}
static inline int fp8ops_layernorm_bwd_cols_ok(fp8ops_hp_dtype dtype, int64_t cols) {
  const int64_t per_vec = dtype == FP8OPS_F32 ? 4 : 8;
  return cols > 0 && cols <= FP8OPS_LN_BWD_MAX_COLS &&
         cols % (per_vec * fp8ops_layernorm_bwd_warps_per_row(cols)) == 0;
}
static inline int fp8ops_layernorm_bwd_fusable(const void* dy, const void* x, const void* dx,
                                               fp8ops_hp_dtype dtype, int64_t cols) {
  return fp8ops_layernorm_bwd_cols_ok(dtype, cols) &&
         (((uintptr_t)dy | (uintptr_t)x | (uintptr_t)dx) & 15u) == 0;
}
int fp8ops_layernorm_bwd_cpu(const void* dy, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                             int64_t cols, const float* mean, const float* rstd,
                             const float* gamma, int rms, const void* dres,
                             fp8ops_hp_dtype copy_dtype, void* dx, void* dcopy, float* dgb);
int fp8ops_layernorm_bwd_cuda(const void* dy, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                              int64_t cols, const float* mean, const float* rstd,
                              const float* gamma, int rms, const void* dres,
                              fp8ops_hp_dtype copy_dtype, void* dx, void* dcopy, float* dgb,
                              float* partial, int64_t partial_floats, void* stream);

/* dbias: the column sums of x [rows, cols] (Fp8Linear's bias gradient: the
 * sum of dy over the tokens) into dbias[cols], fp32, in one fixed order that
 * CPU and CUDA share bit for bit: x padded with +0 rows to a multiple of 128;
 * each 8-row block summed in row order (starting from its first row), a
 * 128-row tile's 16 block sums added in order, the tiles' sums added in row
 * order. rows == 0 gives +0. */
int fp8ops_dbias_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                     float* dbias);
/* cast_accumulate with the column sums of x into dbias (fp32 [cols]): fused
 * into the cast's pass over x on the transposing fast path (out_t given, rows
 * and cols % 16 == 0, 16-byte aligned), a separate pass otherwise. partial:
 * device scratch of at least fp8ops_dbias_workspace_floats(rows, cols) floats. */
int64_t fp8ops_dbias_workspace_floats(int64_t rows, int64_t cols);
int fp8ops_cast_accumulate_dbias_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                      int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                      uint8_t* out, uint8_t* out_t, float* amax, float* dbias,
                                      float* partial, int64_t partial_floats, void* stream);

/* A [rows, cols] tensor given as FP8OPS_MAX_BLOCKS column blocks side by side
 * (a concatenation along the columns, never written): block i is [rows,
 * cols[i]] (cols[i] >= 0) at data[i], ld[i] elements from one row to the next,
 * one element to the next column. Fp8Linear's dy under torch.compile when a
 * layer's output was split (q, k, v of an attention projection):
 * fp8ops::linear_bwd_cat, which inductor's pass (cat_grad_pass.py) calls.
 * fp8ops_blocks_cast_accumulate_cuda: cast_accumulate (with the column sums
 * into dbias unless NULL, as fp8ops_cast_accumulate_dbias_cuda) of the blocks'
 * concatenation, reading each block in place; bf16 / fp16 only, for the shapes
 * fp8ops_blocks_cast_fusable accepts, with both out and out_t.
 * fp8ops_blocks_copy_*: the concatenation into out [rows, cols] (contiguous),
 * for the others. */
#define FP8OPS_MAX_BLOCKS 3
typedef struct {
  const void* data[FP8OPS_MAX_BLOCKS];
  int64_t cols[FP8OPS_MAX_BLOCKS];
  int64_t ld[FP8OPS_MAX_BLOCKS];
} fp8ops_col_blocks;
int fp8ops_blocks_cast_fusable(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype, int64_t rows);
int fp8ops_blocks_cast_accumulate_cuda(const fp8ops_col_blocks* b, fp8ops_hp_dtype x_dtype,
                                       int64_t rows, const float* scale, fp8ops_fp8_format fmt,
                                       uint8_t* out, uint8_t* out_t, float* amax, float* dbias,
                                       float* partial, int64_t partial_floats, void* stream);
int fp8ops_blocks_copy_cpu(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype, int64_t rows,
                           void* out);
int fp8ops_blocks_copy_cuda(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype, int64_t rows,
                            void* out, void* stream);

/* ------------------------------------------------------------------------- */
/* amax: max |x| of a contiguous hp tensor of n elements into one fp32
 * (NaN-propagating; 0 for n == 0). Used by current (dynamic) scaling. */
int fp8ops_amax_cpu(const void* x, fp8ops_hp_dtype x_dtype, int64_t n, float* amax);
int fp8ops_amax_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t n, float* amax, void* stream);

/* ------------------------------------------------------------------------- */
/* amax_update: delayed scaling for n tensors at once (one launch on CUDA).
 *
 * \param[in,out] amax_history [H, n] fp32, contiguous; row 0 holds this step's amax
 * \param[in,out] scale        [n] fp32
 * \param[out]    scale_inv    [n] fp32, 1 / new scale, element i at scale_inv[i * scale_inv_stride]
 *                             (a stride of 4 keeps every entry 16-byte aligned, as cuBLASLt
 *                             wants its scale pointers; Fp8Linear's buffers are laid out so)
 * \param[in]     fp8_max      [n] fp32, the format max of each tensor (448 or 57344)
 * \param[in,out] overflow_count [n] int64 or NULL: overflow_count[i] += 1 when
 *                             history[0, i] (this step's amax) is NaN or +-inf
 * For each tensor (column) i:
 *   a = max |history[:, i]| (algo max) or |history[0, i]| (most_recent); a NaN/inf in
 *   row 0 makes a NaN/inf (this step keeps its scale), one in an older row is skipped
 *   (it stays in the history as the record of its step, but holds no later scale)
 *   if a is finite and a > 0: scale[i] = (fp8_max[i] / a) / 2^margin, an infinite
 *   result clamped to FLT_MAX, one so small that 1/scale overflows ignored; otherwise
 *   scale[i] keeps its value. So a finite positive scale stays finite and positive.
 *   scale_inv[i * scale_inv_stride] = 1 / scale[i]
 *   history[:, i] = roll(history[:, i], -1); history[0, i] = 0
 */
int fp8ops_amax_update_cpu(float* amax_history, float* scale, float* scale_inv,
                           const float* fp8_max, int64_t n, int64_t H, float margin,
                           fp8ops_amax_algo algo, int64_t* overflow_count,
                           int64_t scale_inv_stride);
int fp8ops_amax_update_cuda(float* amax_history, float* scale, float* scale_inv,
                            const float* fp8_max, int64_t n, int64_t H, float margin,
                            fp8ops_amax_algo algo, int64_t* overflow_count,
                            int64_t scale_inv_stride, void* stream);

/* amax_update of many independent histories (e.g. every FP8 layer of a model
 * after an optimizer step) in as few launches as possible (32 per launch): the
 * same rules per job as above. CUDA only; every pointer on the current device. */
typedef struct {
  float* amax_history; /* [H, n] */
  float* scale;        /* [n] */
  float* scale_inv;    /* [n], element i at scale_inv[i * scale_inv_stride] */
  const float* fp8_max;
  int64_t* overflow_count; /* [n] or NULL */
  int64_t n, H, scale_inv_stride;
  float margin;
  int32_t algo; /* fp8ops_amax_algo */
} fp8ops_amax_update_job;
int fp8ops_amax_update_many_cuda(const fp8ops_amax_update_job* jobs, int64_t count, void* stream);

/* ------------------------------------------------------------------------- */
/* the record of amax slots written by ops that do not declare that write
 * (amax_writes.c; compiled backwards' dy casts into fp8_grad_amax) */

#define FP8OPS_AMAX_WRITES_MAX 4096 /* distinct slots between two takes (a layer's is one) */

/* Note that an op wrote the amax `slot` on `stream` (NULL: the CPU). */
void fp8ops_note_amax_write(const void* slot, void* stream);
/* The slots noted since the last take, into out[0 .. *count - 1], and forgets them.
 * Returns 1 instead (and *count = 0) if any slot may have been written unnoted: one
 * written during a CUDA graph capture, or more distinct slots than fit; from then on
 * it always returns 1. */
int fp8ops_take_amax_writes(uintptr_t out[FP8OPS_AMAX_WRITES_MAX], int* count);

/* ------------------------------------------------------------------------- */
/* gemm: out[M, N] = (a[M, K] . b[N, K]^T) * a_scale_inv * b_scale_inv (+ bias[N])
 * a, b fp8 bytes, row-major ("TN": both K-major, as cuBLASLt FP8 requires);
 * formats (a, b) in {(e4m3, e4m3), (e5m2, e4m3), (e4m3, e5m2)}; fp32 accumulation.
 * CUDA only: M, N, K positive multiples of 16, a/b/out/bias 16-byte aligned, an
 * sm_89+ GPU (else FP8OPS_ERR_INVALID / FP8OPS_ERR_UNSUPPORTED with the reason).
 * bias: [N] in fp8ops_gemm_bias_dtype(out_dtype), or NULL. out: [M, N] in out_dtype.
 * CPU: the reference (dequantise, fp32 dot products, k ascending).
 */
int fp8ops_gemm_cpu(const uint8_t* a, fp8ops_fp8_format a_fmt, const uint8_t* b,
                    fp8ops_fp8_format b_fmt, int64_t M, int64_t N, int64_t K,
                    const float* a_scale_inv, const float* b_scale_inv, const void* bias,
                    fp8ops_hp_dtype out_dtype, void* out);

/* cuBLASLt's rule for FP8 bias epilogues: the bias is bf16 for an fp32 output,
 * else the output's dtype. */
static inline fp8ops_hp_dtype fp8ops_gemm_bias_dtype(fp8ops_hp_dtype out_dtype) {
  return out_dtype == FP8OPS_F32 ? FP8OPS_BF16 : out_dtype;
}

/* CUDA (cuBLASLt, resolved from the copy torch loaded). workspace: device
 * buffer of workspace_bytes (>= fp8ops_gemm_workspace_bytes()), allocated by
 * the caller from torch's caching allocator on the same stream.
 * fast_accum: 1 = Hopper fast accumulation (CUBLASLT_MATMUL_DESC_FAST_ACCUM). */
size_t fp8ops_gemm_workspace_bytes(void);
int fp8ops_gemm_cuda(const uint8_t* a, fp8ops_fp8_format a_fmt, const uint8_t* b,
                     fp8ops_fp8_format b_fmt, int64_t M, int64_t N, int64_t K,
                     const float* a_scale_inv, const float* b_scale_inv, const void* bias,
                     fp8ops_hp_dtype out_dtype, void* out, int fast_accum, void* workspace,
                     size_t workspace_bytes, int device, void* stream);

/* compute-sanitizer initcheck: [ptr, ptr + bytes) was written by work queued on
 * `stream` that the tool cannot observe (sanitizer_marks.c says which and why). */
void fp8ops_mark_initialized(const void* ptr, size_t bytes, void* stream);

/* ------------------------------------------------------------------------- */
/* CUDA runtime facts (a build without CUDA answers 0 / "" / FP8OPS_ERR_UNSUPPORTED) */

/* 1 when the module was built with nvcc, else 0. */
int fp8ops_built_with_cuda(void);
/* Space-separated list of the SM archs compiled in, e.g. "89 90a 100 120 ptx". */
const char* fp8ops_cuda_archs(void);
/* Why a build has no CUDA kernels (no nvcc found, or FP8OPS_NO_CUDA set); "" with CUDA. */
const char* fp8ops_no_cuda_reason(void);
/* A digest of the csrc/ sources this build was compiled from (setup.py), so that the Python
 * package can tell a stale build of a source checkout from a current one. */
const char* fp8ops_source_digest(void);
/* Load cuBLASLt symbols from the copy already in the process (dlopen NOLOAD).
 * Returns FP8OPS_OK, or FP8OPS_ERR_UNSUPPORTED with a message. */
int fp8ops_cublaslt_init(void);
/* Compute capability of a device as major*10+minor (e.g. 90). */
int fp8ops_device_capability(int device, int* cc);

#ifdef __cplusplus
}
#endif
#endif /* FP8OPS_H */
