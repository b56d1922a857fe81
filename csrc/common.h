/*
 * common.h -- error-check macros and small helpers shared by the C and CUDA
 * sources. Errors never exit: they record a message (fp8ops_set_error) and
 * return an FP8OPS_ERR_* code up to the boxed op, which raises RuntimeError.
 */
#ifndef FP8OPS_COMMON_H
#define FP8OPS_COMMON_H

#include "fp8ops.h"

#define FP8OPS_CEIL_DIV(a, b) (((a) + (b) - 1) / (b))

/* Return FP8OPS_ERR_INVALID with a message unless `cond` holds. */
#define FP8OPS_REQUIRE(cond, ...)                                   \
  do {                                                              \
    if (!(cond)) return fp8ops_set_error(FP8OPS_ERR_INVALID, __VA_ARGS__); \
  } while (0)

/* Check a CUDA runtime call; TE-shaped message. */
#define FP8OPS_CHECK_CUDA(expr)                                                         \
  do {                                                                                  \
    cudaError_t fp8ops_e_ = (expr);                                                     \
    if (fp8ops_e_ != cudaSuccess)                                                       \
      return fp8ops_set_error(FP8OPS_ERR_CUDA, "%s:%d in function %s: CUDA Error: %s (%s)", \
                              __FILE__, __LINE__, __func__, cudaGetErrorString(fp8ops_e_), #expr); \
  } while (0)

/* Check a status-returning fp8ops call and pass failures up. */
#define FP8OPS_TRY(expr)            \
  do {                              \
    int fp8ops_s_ = (expr);         \
    if (fp8ops_s_ != FP8OPS_OK) return fp8ops_s_; \
  } while (0)

/* Argument checks shared by amax_update's CPU and CUDA implementations. */
static inline int fp8ops_amax_update_check(const float* amax_history, const float* scale,
                                           const float* scale_inv, const float* fp8_max, int64_t n,
                                           int64_t H, fp8ops_amax_algo algo,
                                           int64_t scale_inv_stride) {
  FP8OPS_REQUIRE(n >= 0 && H >= 1, "amax_update: bad sizes n=%lld H=%lld", (long long)n,
                 (long long)H);
  FP8OPS_REQUIRE(algo == FP8OPS_AMAX_MAX || algo == FP8OPS_AMAX_MOST_RECENT,
                 "amax_update: unknown amax_compute_algo code %d", (int)algo);
  FP8OPS_REQUIRE(n == 0 || (amax_history && scale && scale_inv && fp8_max),
                 "amax_update: null pointer");
  FP8OPS_REQUIRE(scale_inv_stride >= 1, "amax_update: scale_inv stride must be >= 1, found %lld",
                 (long long)scale_inv_stride);
  return FP8OPS_OK;
}

#endif /* FP8OPS_COMMON_H */
