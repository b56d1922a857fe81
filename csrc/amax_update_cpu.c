/*
 * amax_update_cpu.c -- CPU reference of fp8ops::amax_update (delayed scaling:
 * history roll, amax reduction, scale and scale_inv), for n tensors at once.
 * The rules (fp8ops.h) are written once here and once in amax_update.cu.
 */
#include <float.h>
#include <math.h>

#include "common.h"
#include "fp8_convert.h"

int fp8ops_amax_update_cpu(float* amax_history, float* scale, float* scale_inv,
                           const float* fp8_max, int64_t n, int64_t H, float margin,
                           fp8ops_amax_algo algo, int64_t* overflow_count,
                           int64_t scale_inv_stride) {
  FP8OPS_TRY(fp8ops_amax_update_check(amax_history, scale, scale_inv, fp8_max, n, H, algo,
                                      scale_inv_stride));
  for (int64_t i = 0; i < n; ++i) {
    /* reduce: NaN-propagating max through the ordered |bits| (see cast_cpu.c) */
    uint32_t m = 0;
    if (algo == FP8OPS_AMAX_MOST_RECENT) {
      m = fp8ops_f32_bits(amax_history[i]) & 0x7FFFFFFFu;
    } else {
      for (int64_t h = 0; h < H; ++h) {
        const uint32_t b = fp8ops_f32_bits(amax_history[h * n + i]) & 0x7FFFFFFFu;
        /* an older step's NaN/inf (kept in the history as the record of that step) is
         * skipped: it held the scale for its own step, not for the H steps after it */
        if (h > 0 && b >= FP8OPS_F32_INF_BITS) continue;
        if (b > m) m = b;
      }
    }
    const float a = fp8ops_bits_f32(m);
    /* roll up by one: row h takes row h+1, the old row 0 goes to row H-1 */
    const float first = amax_history[i];
    if (overflow_count && !isfinite(first)) overflow_count[i] += 1;
    for (int64_t h = 0; h + 1 < H; ++h) amax_history[h * n + i] = amax_history[(h + 1) * n + i];
    amax_history[(H - 1) * n + i] = first;
    amax_history[i] = 0.0f;
    /* scale: a zero or non-finite amax keeps the previous scale */
    float s = scale[i];
    if (isfinite(a) && a > 0.0f) {
      const float t = (fp8_max[i] / a) / exp2f(margin);
      /* an overflow clamps to FLT_MAX; an underflow to 0 (huge amax, large
       * margin) keeps the previous scale: a scale is never 0, inf or NaN */
      if (isinf(t)) s = FLT_MAX;
      else if (t > 0.0f && isfinite(1.0f / t)) s = t; /* scale_inv must stay finite too */
    }
    /* a scale that came in 0, negative, inf or NaN (written by hand, a corrupt checkpoint)
     * is not kept either: 1 until an amax sets one */
    if (!(isfinite(s) && s > 0.0f && isfinite(1.0f / s))) s = 1.0f;
    scale[i] = s;
    scale_inv[i * scale_inv_stride] = 1.0f / s;
  }
  return FP8OPS_OK;
}
