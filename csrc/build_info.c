/*
 * build_info.c -- what this build contains (CUDA or not, which archs), and the
 * CUDA entry points' stand-ins for a build without nvcc, so the C core links
 * and the ops raise a clear error instead of a missing symbol.
 */
#include "common.h"

#ifndef FP8OPS_CUDA_ARCHS
#define FP8OPS_CUDA_ARCHS ""
#endif

#ifndef FP8OPS_NO_CUDA_REASON
#define FP8OPS_NO_CUDA_REASON "nvcc was not found when fp8ops was installed"
#endif
#ifndef FP8OPS_SOURCE_DIGEST
#define FP8OPS_SOURCE_DIGEST ""
#endif

const char* fp8ops_cuda_archs(void) { return FP8OPS_CUDA_ARCHS; }
const char* fp8ops_source_digest(void) { return FP8OPS_SOURCE_DIGEST; }

#ifdef FP8OPS_WITH_CUDA

int fp8ops_built_with_cuda(void) { return 1; }
const char* fp8ops_no_cuda_reason(void) { return ""; }

#else /* CPU-only build */

#define NO_CUDA(op)                                                                 \
  fp8ops_set_error(FP8OPS_ERR_UNSUPPORTED, "%s: fp8ops was built without CUDA (%s)", op, \
                   FP8OPS_NO_CUDA_REASON)

int fp8ops_built_with_cuda(void) { return 0; }
const char* fp8ops_no_cuda_reason(void) { return FP8OPS_NO_CUDA_REASON; }
int fp8ops_cublaslt_init(void) { return NO_CUDA("cuBLASLt"); }
size_t fp8ops_gemm_workspace_bytes(void) { return 0; }
int fp8ops_device_capability(int device, int* cc) {
  (void)device;
  *cc = 0;
  return NO_CUDA("device_capability");
}
int fp8ops_cast_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows, int64_t cols,
                     const float* scale, fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                     float* amax, void* stream) {
  (void)x; (void)x_dtype; (void)rows; (void)cols; (void)scale; (void)fmt; (void)out;
  (void)out_t; (void)amax; (void)stream;
  return NO_CUDA("cast");
}
int fp8ops_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                uint8_t* out, uint8_t* out_t, float* amax, void* stream) {
  return fp8ops_cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, stream);
}
int64_t fp8ops_dbias_workspace_floats(int64_t rows, int64_t cols) {
  return (rows + 127) / 128 * cols;
}
int fp8ops_cast_accumulate_dbias_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                      int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                      uint8_t* out, uint8_t* out_t, float* amax, float* dbias,
                                      float* partial, int64_t partial_floats, void* stream) {
  (void)dbias; (void)partial; (void)partial_floats;
  return fp8ops_cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, stream);
}
int fp8ops_gelu_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                     int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                     uint8_t* out, uint8_t* out_t, float* amax, void* stream) {
  return fp8ops_cast_cuda(x, x_dtype, rows, cols, scale, fmt, out, out_t, amax, stream);
}
int fp8ops_gelu_grad_cuda(const void* x, const void* aux, fp8ops_hp_dtype dtype, int64_t n,
                          void* out, void* stream) {
  (void)x; (void)aux; (void)dtype; (void)n; (void)out; (void)stream;
  return NO_CUDA("gelu_grad");
}
int fp8ops_blocks_cast_fusable(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype, int64_t rows) {
  (void)b; (void)dtype; (void)rows;
  return 0;
}
int fp8ops_blocks_cast_accumulate_cuda(const fp8ops_col_blocks* b, fp8ops_hp_dtype x_dtype,
                                       int64_t rows, const float* scale, fp8ops_fp8_format fmt,
                                       uint8_t* out, uint8_t* out_t, float* amax, float* dbias,
                                       float* partial, int64_t partial_floats, void* stream) {
  (void)b; (void)x_dtype; (void)rows; (void)scale; (void)fmt; (void)out; (void)out_t; (void)amax;
  (void)dbias; (void)partial; (void)partial_floats; (void)stream;
  return NO_CUDA("blocks_cast");
}
int fp8ops_blocks_copy_cuda(const fp8ops_col_blocks* b, fp8ops_hp_dtype dtype, int64_t rows,
                            void* out, void* stream) {
  (void)b; (void)dtype; (void)rows; (void)out; (void)stream;
  return NO_CUDA("blocks_copy");
}
int fp8ops_dgelu_cast_fusable(const void* x, const void* aux, int64_t rows, int64_t cols,
                              const uint8_t* out, const uint8_t* out_t) {
  (void)x; (void)aux; (void)rows; (void)cols; (void)out; (void)out_t;
  return 0;
}
int fp8ops_dgelu_cast_accumulate_cuda(const void* x, const void* aux, fp8ops_hp_dtype x_dtype,
                                      int64_t rows, int64_t cols, const float* scale,
                                      fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t,
                                      float* amax, float* dbias, float* partial,
                                      int64_t partial_floats, void* stream) {
  (void)x; (void)aux; (void)x_dtype; (void)rows; (void)cols; (void)scale; (void)fmt; (void)out;
  (void)out_t; (void)amax; (void)dbias; (void)partial; (void)partial_floats; (void)stream;
  return NO_CUDA("dgelu_cast");
}
int fp8ops_swiglu_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                       void* out, void* stream) {
  (void)x; (void)dtype; (void)rows; (void)cols; (void)out; (void)stream;
  return NO_CUDA("swiglu");
}
int fp8ops_swiglu_grad_cuda(const void* dh, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                            int64_t cols, void* dx, void* stream) {
  (void)dh; (void)x; (void)dtype; (void)rows; (void)cols; (void)dx; (void)stream;
  return NO_CUDA("swiglu_grad");
}
int fp8ops_swiglu_cast_fusable(const void* x, int64_t rows, int64_t cols, const uint8_t* out,
                               const uint8_t* out_t) {
  (void)x; (void)rows; (void)cols; (void)out; (void)out_t;
  return 0;
}
int fp8ops_swiglu_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                       int64_t cols, const float* scale, fp8ops_fp8_format fmt,
                                       uint8_t* out, uint8_t* out_t, float* amax, void* stream) {
  (void)x; (void)x_dtype; (void)rows; (void)cols; (void)scale; (void)fmt; (void)out; (void)out_t;
  (void)amax; (void)stream;
  return NO_CUDA("swiglu_cast");
}
int fp8ops_add_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype, const void* res,
                                    fp8ops_hp_dtype res_dtype, int64_t rows, int64_t cols,
                                    float eps, int rms, void* sum, float* mean, float* rstd,
                                    void* stream) {
  (void)x; (void)dtype; (void)res; (void)res_dtype; (void)rows; (void)cols; (void)eps; (void)rms;
  (void)sum; (void)mean; (void)rstd; (void)stream;
  return NO_CUDA("add_layernorm_stats");
}
int fp8ops_layernorm_stats_cuda(const void* x, fp8ops_hp_dtype dtype, int64_t rows, int64_t cols,
                                float eps, int rms, float* mean, float* rstd, void* stream) {
  (void)x; (void)dtype; (void)rows; (void)cols; (void)eps; (void)rms; (void)mean; (void)rstd;
  (void)stream;
  return NO_CUDA("layernorm_stats");
}
int fp8ops_ln_cast_accumulate_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t rows,
                                   int64_t cols, const fp8ops_ln_params* ln, const float* scale,
                                   fp8ops_fp8_format fmt, uint8_t* out, uint8_t* out_t, float* amax,
                                   void* stream) {
  (void)x; (void)x_dtype; (void)rows; (void)cols; (void)ln; (void)scale; (void)fmt; (void)out;
  (void)out_t; (void)amax; (void)stream;
  return NO_CUDA("ln_cast");
}
int fp8ops_layernorm_bwd_cuda(const void* dy, const void* x, fp8ops_hp_dtype dtype, int64_t rows,
                              int64_t cols, const float* mean, const float* rstd,
                              const float* gamma, int rms, const void* dres,
                              fp8ops_hp_dtype copy_dtype, void* dx, void* dcopy, float* dgb,
                              float* partial, int64_t partial_floats, void* stream) {
  (void)dy; (void)x; (void)dtype; (void)rows; (void)cols; (void)mean; (void)rstd; (void)gamma;
  (void)rms; (void)dres; (void)copy_dtype; (void)dcopy;
  (void)dx; (void)dgb; (void)partial; (void)partial_floats; (void)stream;
  return NO_CUDA("layernorm_bwd");
}
int fp8ops_amax_cuda(const void* x, fp8ops_hp_dtype x_dtype, int64_t n, float* amax, void* stream) {
  (void)x; (void)x_dtype; (void)n; (void)amax; (void)stream;
  return NO_CUDA("amax");
}
int fp8ops_amax_update_cuda(float* amax_history, float* scale, float* scale_inv,
                            const float* fp8_max, int64_t n, int64_t H, float margin,
                            fp8ops_amax_algo algo, int64_t* overflow_count,
                            int64_t scale_inv_stride, void* stream) {
  (void)amax_history; (void)scale; (void)scale_inv; (void)fp8_max; (void)n; (void)H;
  (void)margin; (void)algo; (void)overflow_count; (void)scale_inv_stride; (void)stream;
  return NO_CUDA("amax_update");
}
int fp8ops_amax_update_many_cuda(const fp8ops_amax_update_job* jobs, int64_t count, void* stream) {
  (void)jobs; (void)count; (void)stream;
  return NO_CUDA("amax_update_many");
}
int fp8ops_gemm_cuda(const uint8_t* a, fp8ops_fp8_format a_fmt, const uint8_t* b,
                     fp8ops_fp8_format b_fmt, int64_t M, int64_t N, int64_t K,
                     const float* a_scale_inv, const float* b_scale_inv, const void* bias,
                     fp8ops_hp_dtype out_dtype, void* out, int fast_accum, void* workspace,
                     size_t workspace_bytes, int device, void* stream) {
  (void)a; (void)a_fmt; (void)b; (void)b_fmt; (void)M; (void)N; (void)K; (void)a_scale_inv;
  (void)b_scale_inv; (void)bias; (void)out_dtype; (void)out; (void)fast_accum; (void)workspace;
  (void)workspace_bytes; (void)device; (void)stream;
  return NO_CUDA("gemm");
}

#endif
