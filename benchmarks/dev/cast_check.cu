/*
 * cast_check.cu -- standalone device test of csrc/cast.cu (fp8ops_cast_cuda,
 * fp8ops_amax_cuda) and csrc/amax_update.cu (fp8ops_amax_update_cuda), no torch.
 *
 * Checks, bit for bit against host references written like cast_cpu.c /
 * amax_update_cpu.c (same fp8_convert.h conversions, same expression order):
 *   - exhaustive: all 2^32 fp32 bit patterns, scale 1, e4m3 and e5m2, through
 *     the transposing fast path (16 chunks of 16384 x 16384): out, out_t, amax;
 *   - all 65536 bf16 and fp16 patterns x 14 scales (incl. 0, -1, inf, NaN) x
 *     both formats, with and without transpose;
 *   - shapes (1,16) (5,160) (217,256) (3,7) (1,1) (0,16) (16,0) (5,13) (100,100)
 *     (48,80) (256,4096) (4112,48) (2,3000), every dtype x format x transpose,
 *     values: random at several magnitudes plus edge values (NaN of both signs,
 *     +-inf, +-0, output-format subnormals, exact ties, just above / below 448
 *     and 57344, huge, fp32 subnormals); misaligned x / out / out_t pointers;
 *   - fp8ops_amax_cuda on the same data (aligned and misaligned);
 *   - fp8ops_amax_update_cuda: (n, H) in (1,1) (1,31) (3,1024) (10000,31)
 *     (7,5000) (100,1) (33,2) x algo max / most_recent x margin 0, 1, 0.5, -2,
 *     histories with NaN, inf, zero and tiny (scale -> FLT_MAX) columns;
 *   - a CUDA-graph capture + replay on a non-default stream; error codes.
 * Then times bf16 cast + transpose + amax (e4m3) of 16384 x 4096 and
 * 16384 x 14336 with cudaEvents against a device-to-device cudaMemcpy of the
 * same byte count (bytes read + written: 2 + 1 + 1 per element), and prints
 * GB/s and % of copy; also the no-transpose cast and the amax kernel.
 *
 * Build and run (repository root):
 *   nvcc -std=c++17 -O3 -arch=sm_90 -Icsrc benchmarks/dev/cast_check.cu csrc/cast.cu \
 *        csrc/amax_update.cu csrc/errors.c -o /tmp/cast_check && /tmp/cast_check
 * Options: --quick (skip the exhaustive 2^32 sweep), --no-bench.
 * Exit status: 0 when every check passed, 1 otherwise.
 */
#include <cuda_runtime.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "common.h"
#include "fp8_convert.h"

#define CK(expr)                                                                         \
  do {                                                                                   \
    cudaError_t e_ = (expr);                                                             \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d: CUDA error %s: %s\n", __FILE__, __LINE__, #expr,           \
              cudaGetErrorString(e_));                                                   \
      exit(2);                                                                           \
    }                                                                                    \
  } while (0)

#define FP8(expr)                                                                        \
  do {                                                                                   \
    int s_ = (expr);                                                                     \
    if (s_ != FP8OPS_OK) {                                                               \
      fprintf(stderr, "%s:%d: %s -> %d: %s\n", __FILE__, __LINE__, #expr, s_,            \
              fp8ops_last_error());                                                      \
      exit(2);                                                                           \
    }                                                                                    \
  } while (0)

static int g_failures = 0, g_checks = 0;

static void check(bool ok, const char* what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    printf("FAIL  %s\n", what);
  }
}

static const char* dt_name(int dt) { return dt == FP8OPS_F32 ? "f32" : dt == FP8OPS_BF16 ? "bf16" : "f16"; }
static const char* fmt_name(int f) { return f == FP8OPS_E4M3 ? "e4m3" : "e5m2"; }
static int dt_size(int dt) { return dt == FP8OPS_F32 ? 4 : 2; }

// ----------------------------------------------------------------------------
// host references (cast_cpu.c / amax_update_cpu.c, written out again)

static float load_hp(const void* x, int dt, int64_t i) {
  switch (dt) {
    case FP8OPS_BF16: return fp8ops_bf16_to_f32(((const uint16_t*)x)[i]);
    case FP8OPS_F16: return fp8ops_f16_to_f32(((const uint16_t*)x)[i]);
    default: return ((const float*)x)[i];
  }
}

static uint8_t ref_byte(float v, float s, int fmt) {
  const float fmax = fmt == FP8OPS_E4M3 ? FP8OPS_E4M3_MAX : FP8OPS_E5M2_MAX;
  float y = v * s;
  if (!isinf(v)) { /* an infinite input stays non-finite (cast_cpu.c) */
    if (y > fmax) y = fmax;
    if (y < -fmax) y = -fmax;
  }
  return fmt == FP8OPS_E4M3 ? fp8ops_f32_to_e4m3(y) : fp8ops_f32_to_e5m2(y);
}

// out (and out_t) and amax bits, rows split over host threads
static uint32_t ref_cast(const void* x, int dt, int64_t rows, int64_t cols, float s, int fmt,
                         uint8_t* out, uint8_t* out_t) {
  const int nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<uint32_t> part(nt, 0);
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t) {
    th.emplace_back([&, t] {
      uint32_t m = 0;
      for (int64_t r = t; r < rows; r += nt) {
        for (int64_t c = 0; c < cols; ++c) {
          const int64_t i = r * cols + c;
          const float v = load_hp(x, dt, i);
          const uint32_t a = fp8ops_f32_bits(v) & 0x7FFFFFFFu;
          if (a > m) m = a;
          const uint8_t q = ref_byte(v, s, fmt);
          if (out) out[i] = q;
          if (out_t) out_t[c * rows + r] = q;
        }
      }
      part[t] = m;
    });
  }
  for (auto& t : th) t.join();
  uint32_t m = 0;
  for (uint32_t p : part) m = std::max(m, p);
  return m;
}

static void ref_amax_update(std::vector<float>& hist, std::vector<float>& scale,
                            std::vector<float>& scale_inv, const std::vector<float>& fp8_max,
                            int64_t n, int64_t H, float margin, int algo) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t m = 0;
    if (algo == FP8OPS_AMAX_MOST_RECENT) {
      m = fp8ops_f32_bits(hist[i]) & 0x7FFFFFFFu;
    } else {
      for (int64_t h = 0; h < H; ++h) m = std::max(m, fp8ops_f32_bits(hist[h * n + i]) & 0x7FFFFFFFu);
    }
    const float a = fp8ops_bits_f32(m);
    const float first = hist[i];
    for (int64_t h = 0; h + 1 < H; ++h) hist[h * n + i] = hist[(h + 1) * n + i];
    hist[(H - 1) * n + i] = first;
    hist[i] = 0.0f;
    float s = scale[i];
    if (std::isfinite(a) && a > 0.0f) {
      s = (fp8_max[i] / a) / exp2f(margin);
      if (std::isinf(s)) s = FLT_MAX;
    }
    scale[i] = s;
    scale_inv[i] = 1.0f / s;
  }
}

// Mismatches between got_t [C, R] and the transpose of ref [R, C], in 64 x 64
// tiles over host threads (a plain strided loop over 2^28 bytes is slow).
static int64_t count_transpose_mismatch(const uint8_t* ref, const uint8_t* got_t, int64_t R, int64_t C) {
  const int nt = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<int64_t> part(nt, 0);
  std::vector<std::thread> th;
  const int64_t tiles_r = (R + 63) / 64;
  for (int t = 0; t < nt; ++t) {
    th.emplace_back([&, t] {
      int64_t bad = 0;
      for (int64_t tr = t; tr < tiles_r; tr += nt)
        for (int64_t c0 = 0; c0 < C; c0 += 64)
          for (int64_t c = c0; c < std::min(C, c0 + 64); ++c)
            for (int64_t r = tr * 64; r < std::min(R, tr * 64 + 64); ++r) bad += got_t[c * R + r] != ref[r * C + c];
      part[t] = bad;
    });
  }
  for (auto& t : th) t.join();
  int64_t bad = 0;
  for (int64_t b : part) bad += b;
  return bad;
}

// got == want, except that when x and the scale are both NaN the sign of the
// CPU's NaN product depends on the operand order the compiler chose for
// `v * s` (x86 returns the first NaN operand): any NaN byte passes there.
static bool same_byte(uint8_t got, uint8_t want, float x, float s) {
  if (got == want) return true;
  return std::isnan(x) && std::isnan(s) && (got & 0x7F) == 0x7F && (want & 0x7F) == 0x7F;
}

// ----------------------------------------------------------------------------
// device runs

// Runs fp8ops_cast_cuda on host data hx (rows x cols of dtype dt), with the
// device pointers of x / out / out_t shifted by x_off elements / out_off /
// out_t_off bytes (to test misalignment), and compares out, out_t and amax
// with the host reference. Returns the number of mismatching bytes.
static int64_t run_cast_case(const void* hx, int dt, int64_t rows, int64_t cols, float s, int fmt,
                             bool transpose, int x_off, int out_off, int out_t_off,
                             const char* label, bool with_amax_kernel = true) {
  const int64_t n = rows * cols;
  const size_t esz = dt_size(dt);
  std::vector<uint8_t> ref(n), ref_t(transpose ? n : 0), got(n), got_t(transpose ? n : 0);
  const uint32_t ref_amax = ref_cast(hx, dt, rows, cols, s, fmt, ref.data(), transpose ? ref_t.data() : nullptr);

  char *dx, *dout, *dout_t = nullptr;
  float *dscale, *damax;
  CK(cudaMalloc(&dx, n * esz + 64));
  CK(cudaMalloc(&dout, n + 64));
  if (transpose) CK(cudaMalloc(&dout_t, n + 64));
  CK(cudaMalloc(&dscale, sizeof(float)));
  CK(cudaMalloc(&damax, sizeof(float)));
  CK(cudaMemcpy(dx + x_off * esz, hx, n * esz, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dscale, &s, sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemset(dout, 0xA5, n + 64));
  if (transpose) CK(cudaMemset(dout_t, 0xA5, n + 64));
  const float poison = 12345.0f;
  CK(cudaMemcpy(damax, &poison, sizeof(float), cudaMemcpyHostToDevice));
  FP8(fp8ops_cast_cuda(dx + x_off * esz, (fp8ops_hp_dtype)dt, rows, cols, dscale, (fp8ops_fp8_format)fmt,
                       (uint8_t*)dout + out_off, transpose ? (uint8_t*)dout_t + out_t_off : nullptr,
                       damax, nullptr));
  CK(cudaDeviceSynchronize());
  float amax = 0;
  if (n) CK(cudaMemcpy(got.data(), dout + out_off, n, cudaMemcpyDeviceToHost));
  if (transpose && n) CK(cudaMemcpy(got_t.data(), dout_t + out_t_off, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(&amax, damax, sizeof(float), cudaMemcpyDeviceToHost));
  // guard bytes after the output must be untouched
  uint8_t guard[16];
  CK(cudaMemcpy(guard, dout + out_off + n, 16, cudaMemcpyDeviceToHost));
  bool guard_ok = true;
  for (int i = 0; i < 16; ++i) guard_ok &= guard[i] == 0xA5;

  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!same_byte(got[i], ref[i], load_hp(hx, dt, i), s)) {
      if (bad < 4) {
        const float v = load_hp(hx, dt, i);
        printf("   out[%lld] (r %lld c %lld) x=%a (bits %08x) s=%a: got %02x want %02x\n", (long long)i,
               (long long)(i / cols), (long long)(i % cols), v, fp8ops_f32_bits(v), s, got[i], ref[i]);
      }
      ++bad;
    }
  }
  int64_t bad_t = 0;
  for (int64_t i = 0; transpose && i < n; ++i) {
    if (!same_byte(got_t[i], ref_t[i], load_hp(hx, dt, (i % rows) * cols + i / rows), s)) {
      if (bad_t < 4) printf("   out_t[%lld]: got %02x want %02x\n", (long long)i, got_t[i], ref_t[i]);
      ++bad_t;
    }
  }
  const uint32_t ab = fp8ops_f32_bits(amax);
  const bool amax_ok = ab == ref_amax || (ab > 0x7F800000u && ref_amax > 0x7F800000u);
  char what[256];
  snprintf(what, sizeof what, "cast %s %s->%s [%lld,%lld] scale %a%s offs(x %d, out %d, out_t %d): "
           "%lld + %lld bad bytes, amax %a vs %a%s", label, dt_name(dt), fmt_name(fmt), (long long)rows,
           (long long)cols, s, transpose ? " +T" : "", x_off, out_off, out_t_off, (long long)bad,
           (long long)bad_t, amax, fp8ops_bits_f32(ref_amax), guard_ok ? "" : ", GUARD BYTES CHANGED");
  check(bad == 0 && bad_t == 0 && amax_ok && guard_ok, what);

  if (with_amax_kernel) {  // fp8ops_amax_cuda on the same input
    CK(cudaMemcpy(damax, &poison, sizeof(float), cudaMemcpyHostToDevice));
    FP8(fp8ops_amax_cuda(dx + x_off * esz, (fp8ops_hp_dtype)dt, n, damax, nullptr));
    CK(cudaMemcpy(&amax, damax, sizeof(float), cudaMemcpyDeviceToHost));
    const uint32_t ab2 = fp8ops_f32_bits(amax);
    snprintf(what, sizeof what, "amax %s %s n=%lld x_off %d: %a vs %a", label, dt_name(dt), (long long)n,
             x_off, amax, fp8ops_bits_f32(ref_amax));
    check(ab2 == ref_amax || (ab2 > 0x7F800000u && ref_amax > 0x7F800000u), what);
  }
  CK(cudaFree(dx));
  CK(cudaFree(dout));
  if (dout_t) CK(cudaFree(dout_t));
  CK(cudaFree(dscale));
  CK(cudaFree(damax));
  return bad + bad_t;
}

// ----------------------------------------------------------------------------
// test data

// Edge values in fp32, as seen after multiplying by the scale s (so they are
// divided by s here): NaN of both signs and payloads, +-inf, +-0, the output
// format's subnormals and their midpoints (ties), values around the format max,
// huge values, fp32 subnormals.
static std::vector<float> edge_values(int fmt, float s) {
  std::vector<float> e = {NAN, -NAN, fp8ops_bits_f32(0x7F800001u), fp8ops_bits_f32(0xFFFFFFFFu),
                          fp8ops_bits_f32(0x7FC00000u), fp8ops_bits_f32(0xFFC00000u), INFINITY, -INFINITY,
                          0.0f, -0.0f, FLT_MAX, -FLT_MAX, 1e38f, -3e38f, 1.4e-45f, -1.4e-45f, 1e-40f,
                          FLT_MIN, -FLT_MIN};
  const float fmax = fmt == FP8OPS_E4M3 ? 448.0f : 57344.0f;
  const float sub = fmt == FP8OPS_E4M3 ? 0x1p-9f : 0x1p-16f;  // subnormal step
  std::vector<float> y;
  for (int k = 0; k <= 20; ++k) y.push_back(sub * k), y.push_back(sub * (k + 0.5f)), y.push_back(-sub * (k + 0.5f));
  for (float d : {0.0f, 1.0f, 8.0f, 15.9f, 16.0f, 16.1f, 31.9f, 32.0f, 32.1f, 100.0f, 1000.0f, 1e6f})
    y.push_back(fmax + d), y.push_back(-(fmax + d)), y.push_back(fmax - d), y.push_back(-(fmax - d));
  // ties between neighbouring normal values: 1 + 2^-(m+1) * odd
  const int mb = fmt == FP8OPS_E4M3 ? 3 : 2;
  for (int k = 1; k < 16; k += 2) y.push_back(1.0f + k * ldexpf(1.0f, -(mb + 1))), y.push_back(-(1.0f + k * ldexpf(1.0f, -(mb + 1))));
  for (int k = 1; k < 16; k += 2) y.push_back(ldexpf(1.0f + k * ldexpf(1.0f, -(mb + 1)), -5));
  for (float v : y) e.push_back(v / s);
  return e;
}

static void fill_random(std::vector<float>& f, std::mt19937& rng, int fmt, float s) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-12, 12);
  const std::vector<float> edges = edge_values(fmt, s);
  std::uniform_int_distribution<size_t> pick(0, edges.size() - 1);
  for (size_t i = 0; i < f.size(); ++i) {
    const int r = (int)(rng() % 16);
    if (r == 0) f[i] = edges[pick(rng)];
    else f[i] = nd(rng) * ldexpf(1.0f, mag(rng)) / s * 64.0f;
  }
}

// Converts fp32 data to the dtype's storage (RNE, as torch would round).
static std::vector<uint8_t> to_dtype(const std::vector<float>& f, int dt) {
  std::vector<uint8_t> b(f.size() * dt_size(dt));
  for (size_t i = 0; i < f.size(); ++i) {
    if (dt == FP8OPS_F32) memcpy(&b[4 * i], &f[i], 4);
    else {
      const uint16_t h = dt == FP8OPS_BF16 ? fp8ops_f32_to_bf16(f[i]) : fp8ops_f32_to_f16(f[i]);
      memcpy(&b[2 * i], &h, 2);
    }
  }
  return b;
}

// ----------------------------------------------------------------------------
// test groups

static void test_exhaustive_f32() {
  const int64_t R = 16384, C = 16384;  // 2^28 values per chunk, 16 chunks
  std::vector<uint32_t> hx(R * C);
  std::vector<uint8_t> ref(R * C), got(R * C), got_t(R * C);
  uint32_t *dx;
  uint8_t *dout, *dout_t;
  float *dscale, *damax;
  CK(cudaMalloc(&dx, R * C * 4));
  CK(cudaMalloc(&dout, R * C));
  CK(cudaMalloc(&dout_t, R * C));
  CK(cudaMalloc(&dscale, 4));
  CK(cudaMalloc(&damax, 4));
  const float one = 1.0f;
  CK(cudaMemcpy(dscale, &one, 4, cudaMemcpyHostToDevice));
  for (int fmt = 0; fmt < 2; ++fmt) {
    int64_t bad = 0, bad_t = 0, bad_amax = 0;
    for (uint64_t chunk = 0; chunk < 16; ++chunk) {
      for (int64_t i = 0; i < R * C; ++i) hx[i] = (uint32_t)((chunk << 28) + (uint64_t)i);
      CK(cudaMemcpy(dx, hx.data(), R * C * 4, cudaMemcpyHostToDevice));
      FP8(fp8ops_cast_cuda(dx, FP8OPS_F32, R, C, dscale, (fp8ops_fp8_format)fmt, dout, dout_t, damax, nullptr));
      const uint32_t ref_amax = ref_cast(hx.data(), FP8OPS_F32, R, C, 1.0f, fmt, ref.data(), nullptr);
      float amax;
      CK(cudaMemcpy(got.data(), dout, R * C, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(got_t.data(), dout_t, R * C, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(&amax, damax, 4, cudaMemcpyDeviceToHost));
      for (int64_t i = 0; i < R * C; ++i) {
        if (got[i] != ref[i]) {
          if (bad < 4) printf("   %s x=%08x: got %02x want %02x\n", fmt_name(fmt), hx[i], got[i], ref[i]);
          ++bad;
        }
      }
      bad_t += count_transpose_mismatch(ref.data(), got_t.data(), R, C);
      const uint32_t ab = fp8ops_f32_bits(amax);
      bad_amax += !(ab == ref_amax || (ab > 0x7F800000u && ref_amax > 0x7F800000u));
    }
    char what[160];
    snprintf(what, sizeof what, "exhaustive fp32 -> %s, all 2^32 inputs, scale 1, transposing path: %lld + %lld bad bytes, %lld bad amax",
             fmt_name(fmt), (long long)bad, (long long)bad_t, (long long)bad_amax);
    check(bad == 0 && bad_t == 0 && bad_amax == 0, what);
    printf("%s  %s\n", bad == 0 && bad_t == 0 && bad_amax == 0 ? "ok  " : "FAIL", what);
  }
  CK(cudaFree(dx));
  CK(cudaFree(dout));
  CK(cudaFree(dout_t));
  CK(cudaFree(dscale));
  CK(cudaFree(damax));
}

static void test_all_16bit() {
  const float scales[] = {1.0f, 0.5f, 3.7f, 1e-3f, 448.0f / 3.0f, 0x1p-20f, 1e4f, 2.5e8f, FLT_MAX,
                          -1.0f, 0.0f, -0.0f, INFINITY, NAN};
  std::vector<uint16_t> h(65536);
  for (int i = 0; i < 65536; ++i) h[i] = (uint16_t)i;
  int64_t total_bad = 0, cases = 0;
  for (int dt : {FP8OPS_BF16, FP8OPS_F16})
    for (int fmt = 0; fmt < 2; ++fmt)
      for (float s : scales) {
        // 256 x 256: the transposing fast path; then the flat no-transpose path
        total_bad += run_cast_case(h.data(), dt, 256, 256, s, fmt, true, 0, 0, 0, "all-16bit", false);
        total_bad += run_cast_case(h.data(), dt, 256, 256, s, fmt, false, 0, 0, 0, "all-16bit", s == 1.0f);
        cases += 2;
      }
  printf("%s  all 65536 bf16 / fp16 patterns x %d scales x 2 formats x (transpose, flat): %lld cases, %lld bad bytes\n",
         total_bad ? "FAIL" : "ok  ", (int)(sizeof scales / sizeof scales[0]), (long long)cases, (long long)total_bad);
}

static void test_shapes() {
  const int64_t shapes[][2] = {{1, 16},   {5, 160},  {217, 256}, {3, 7},   {1, 1},   {0, 16},   {16, 0},
                               {0, 0},    {5, 13},   {100, 100}, {48, 80}, {256, 4096}, {4112, 48}, {2, 3000},
                               {16, 16},  {144, 272}};
  std::mt19937 rng(1234);
  int64_t total_bad = 0, cases = 0;
  const float scales[] = {1.0f, 37.5f, 1.0f / 1024.0f};
  for (auto& sh : shapes) {
    const int64_t R = sh[0], C = sh[1];
    for (int dt : {FP8OPS_F32, FP8OPS_BF16, FP8OPS_F16})
      for (int fmt = 0; fmt < 2; ++fmt)
        for (float s : scales) {
          std::vector<float> f(R * C);
          fill_random(f, rng, fmt, s);
          const std::vector<uint8_t> hx = to_dtype(f, dt);
          for (int tr = 0; tr < 2; ++tr) {
            total_bad += run_cast_case(hx.data(), dt, R, C, s, fmt, tr, 0, 0, 0, "shape");
            ++cases;
          }
          // misaligned: x by one element, out by 1 / 8 bytes, out_t by 3 bytes
          total_bad += run_cast_case(hx.data(), dt, R, C, s, fmt, true, 1, 0, 0, "misaligned-x");
          total_bad += run_cast_case(hx.data(), dt, R, C, s, fmt, true, 0, 1, 3, "misaligned-out");
          total_bad += run_cast_case(hx.data(), dt, R, C, s, fmt, false, 1, 1, 0, "misaligned-x+out");
          total_bad += run_cast_case(hx.data(), dt, R, C, s, fmt, false, 3, 8, 0, "misaligned-x3");
          total_bad += run_cast_case(hx.data(), dt, R, C, s, fmt, false, 1, 0, 0, "misaligned-x-only");
          cases += 5;
        }
  }
  printf("%s  shapes x dtypes x formats x scales x (transpose, flat, misaligned): %lld cases, %lld bad bytes\n",
         total_bad ? "FAIL" : "ok  ", (long long)cases, (long long)total_bad);
}

static void test_amax_update() {
  const int64_t sizes[][2] = {{1, 1}, {1, 31}, {3, 1024}, {10000, 31}, {7, 5000}, {100, 1}, {33, 2}, {64, 17}};
  const float margins[] = {0.0f, 1.0f, 0.5f, -2.0f};
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  int bad_cases = 0, cases = 0;
  for (auto& sz : sizes) {
    const int64_t n = sz[0], H = sz[1];
    for (int algo = 0; algo < 2; ++algo)
      for (float margin : margins) {
        std::vector<float> hist(n * H), scale(n), scale_inv(n, -1.0f), fmax(n);
        for (int64_t i = 0; i < n; ++i) {
          fmax[i] = i % 3 == 2 ? 57344.0f : 448.0f;
          scale[i] = 0.5f + u(rng);
          const int kind = (int)(i % 9);
          for (int64_t h = 0; h < H; ++h) {
            float v = ldexpf(u(rng), (int)(rng() % 40) - 20);
            if (kind == 1) v = 0.0f;                                      // all zero: keep scale
            if (kind == 2 && h == H / 2) v = NAN;                         // NaN somewhere
            if (kind == 3 && h == 0) v = INFINITY;                        // inf current amax
            if (kind == 4) v = 1e-44f;                                    // tiny: scale -> FLT_MAX
            if (kind == 5 && h == H - 1) v = -3.0f;                       // negative entry (|.| counts)
            if (kind == 6 && h == 0) v = -NAN;
            hist[h * n + i] = v;
          }
        }
        std::vector<float> rh = hist, rs = scale, rsi = scale_inv;
        ref_amax_update(rh, rs, rsi, fmax, n, H, margin, algo);
        float *dh, *ds, *dsi, *dm;
        CK(cudaMalloc(&dh, n * H * 4));
        CK(cudaMalloc(&ds, n * 4));
        CK(cudaMalloc(&dsi, n * 4));
        CK(cudaMalloc(&dm, n * 4));
        CK(cudaMemcpy(dh, hist.data(), n * H * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(ds, scale.data(), n * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dsi, scale_inv.data(), n * 4, cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dm, fmax.data(), n * 4, cudaMemcpyHostToDevice));
        FP8(fp8ops_amax_update_cuda(dh, ds, dsi, dm, n, H, margin, (fp8ops_amax_algo)algo, nullptr, 1, nullptr));
        std::vector<float> gh(n * H), gs(n), gsi(n);
        CK(cudaMemcpy(gh.data(), dh, n * H * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gs.data(), ds, n * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(gsi.data(), dsi, n * 4, cudaMemcpyDeviceToHost));
        int64_t bh = 0, bs = 0;
        for (int64_t i = 0; i < n * H; ++i) bh += memcmp(&gh[i], &rh[i], 4) != 0;
        for (int64_t i = 0; i < n; ++i) {
          const bool ok = memcmp(&gs[i], &rs[i], 4) == 0 && memcmp(&gsi[i], &rsi[i], 4) == 0;
          if (!ok && bs < 3)
            printf("   col %lld: scale %a / %a, scale_inv %a / %a\n", (long long)i, gs[i], rs[i], gsi[i], rsi[i]);
          bs += !ok;
        }
        char what[200];
        snprintf(what, sizeof what, "amax_update n=%lld H=%lld algo=%s margin=%g: %lld bad history, %lld bad scales",
                 (long long)n, (long long)H, algo ? "most_recent" : "max", margin, (long long)bh, (long long)bs);
        check(bh == 0 && bs == 0, what);
        bad_cases += !(bh == 0 && bs == 0);
        ++cases;
        CK(cudaFree(dh));
        CK(cudaFree(ds));
        CK(cudaFree(dsi));
        CK(cudaFree(dm));
      }
  }
  printf("%s  amax_update: %d cases, %d failed\n", bad_cases ? "FAIL" : "ok  ", cases, bad_cases);
}

static void test_graph_and_errors() {
  // capture cast (+T) and amax_update on a non-default stream, replay twice
  const int64_t R = 512, C = 768, n = R * C;
  std::vector<float> f(n);
  std::mt19937 rng(7);
  fill_random(f, rng, FP8OPS_E4M3, 2.0f);
  const std::vector<uint8_t> hx = to_dtype(f, FP8OPS_BF16);
  std::vector<uint8_t> ref(n), ref_t(n), got(n), got_t(n);
  const uint32_t ref_amax = ref_cast(hx.data(), FP8OPS_BF16, R, C, 2.0f, FP8OPS_E4M3, ref.data(), ref_t.data());
  void* dx;
  uint8_t *dout, *dout_t;
  float *dscale, *damax, *damax2, *damax3, *dh, *ds, *dsi, *dm;
  uint8_t* dflat;
  CK(cudaMalloc(&dflat, n));
  CK(cudaMalloc(&damax2, 4));
  CK(cudaMalloc(&damax3, 4));
  CK(cudaMalloc(&dx, n * 2));
  CK(cudaMalloc(&dout, n));
  CK(cudaMalloc(&dout_t, n));
  CK(cudaMalloc(&dscale, 4));
  CK(cudaMalloc(&damax, 4));
  CK(cudaMalloc(&dh, 16 * 4 * 4));
  CK(cudaMalloc(&ds, 4 * 4));
  CK(cudaMalloc(&dsi, 4 * 4));
  CK(cudaMalloc(&dm, 4 * 4));
  CK(cudaMemcpy(dx, hx.data(), n * 2, cudaMemcpyHostToDevice));
  const float two = 2.0f, ones[4] = {1, 1, 1, 1}, m448[4] = {448, 448, 448, 448};
  CK(cudaMemcpy(dscale, &two, 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(dh, 0, 16 * 4 * 4));
  CK(cudaMemcpy(ds, ones, 16, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dm, m448, 16, cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  // the flat (no transpose) cast and the amax kernel first, into scratch
  // outputs, then the transposing cast whose results are checked
  const int s0 = fp8ops_cast_cuda(dx, FP8OPS_BF16, R, C, dscale, FP8OPS_E5M2, dflat, nullptr, damax2, st);
  const int s3 = fp8ops_amax_cuda(dx, FP8OPS_BF16, n, damax3, st);
  const int s1 = fp8ops_cast_cuda(dx, FP8OPS_BF16, R, C, dscale, FP8OPS_E4M3, dout, dout_t, damax, st);
  const int s2 = fp8ops_amax_update_cuda(dh, ds, dsi, dm, 4, 16, 0.0f, FP8OPS_AMAX_MAX, nullptr, 1, st);
  CK(cudaStreamEndCapture(st, &g));
  check(s0 == FP8OPS_OK && s1 == FP8OPS_OK && s2 == FP8OPS_OK && s3 == FP8OPS_OK,
        "graph capture: cast (flat and +T), amax and amax_update return OK while capturing");
  if (s0 || s1 || s2 || s3) printf("   %s\n", fp8ops_last_error());
  CK(cudaGraphInstantiate(&ge, g, 0));
  for (int rep = 0; rep < 2; ++rep) {
    CK(cudaMemset(dout, 0, n));
    CK(cudaMemset(dout_t, 0, n));
    CK(cudaGraphLaunch(ge, st));
    CK(cudaStreamSynchronize(st));
    float amax;
    CK(cudaMemcpy(got.data(), dout, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(got_t.data(), dout_t, n, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&amax, damax, 4, cudaMemcpyDeviceToHost));
    float amax3;
    CK(cudaMemcpy(&amax3, damax3, 4, cudaMemcpyDeviceToHost));
    const bool ok = got == ref && got_t == ref_t &&
                    (fp8ops_f32_bits(amax) == ref_amax || (std::isnan(amax) && ref_amax > 0x7F800000u)) &&
                    (fp8ops_f32_bits(amax3) == ref_amax || (std::isnan(amax3) && ref_amax > 0x7F800000u));
    check(ok, rep ? "graph replay 2 on a non-default stream: out, out_t, amax bit-exact"
                  : "graph replay 1 on a non-default stream: out, out_t, amax bit-exact");
  }
  CK(cudaGraphExecDestroy(ge));
  CK(cudaGraphDestroy(g));
  CK(cudaStreamDestroy(st));

  // error paths: FP8OPS_ERR_INVALID with a message, nothing launched
  struct {
    int got;
    const char* what;
  } errs[] = {
      {fp8ops_cast_cuda(dx, FP8OPS_BF16, -1, 16, dscale, FP8OPS_E4M3, dout, nullptr, damax, nullptr), "negative rows"},
      {fp8ops_cast_cuda(dx, (fp8ops_hp_dtype)7, 4, 16, dscale, FP8OPS_E4M3, dout, nullptr, damax, nullptr), "bad dtype"},
      {fp8ops_cast_cuda(dx, FP8OPS_BF16, 4, 16, dscale, (fp8ops_fp8_format)3, dout, nullptr, damax, nullptr), "bad format"},
      {fp8ops_cast_cuda(dx, FP8OPS_BF16, 4, 16, nullptr, FP8OPS_E4M3, dout, nullptr, damax, nullptr), "null scale"},
      {fp8ops_cast_cuda(dx, FP8OPS_BF16, 4, 16, dscale, FP8OPS_E4M3, nullptr, nullptr, damax, nullptr), "null out"},
      {fp8ops_cast_cuda(dx, FP8OPS_BF16, 4, 16, dscale, FP8OPS_E4M3, dout, nullptr, nullptr, nullptr), "null amax"},
      {fp8ops_cast_cuda((char*)dx + 1, FP8OPS_BF16, 4, 16, dscale, FP8OPS_E4M3, dout, nullptr, damax, nullptr), "odd bf16 pointer"},
      {fp8ops_amax_cuda(dx, FP8OPS_F32, -5, damax, nullptr), "amax negative n"},
      {fp8ops_amax_cuda(nullptr, FP8OPS_F32, 5, damax, nullptr), "amax null x"},
      {fp8ops_amax_update_cuda(dh, ds, dsi, dm, 4, 0, 0.0f, FP8OPS_AMAX_MAX, nullptr, 1, nullptr), "amax_update H=0"},
      {fp8ops_amax_update_cuda(dh, ds, dsi, dm, -1, 4, 0.0f, FP8OPS_AMAX_MAX, nullptr, 1, nullptr), "amax_update n<0"},
      {fp8ops_amax_update_cuda(dh, ds, dsi, dm, 4, 4, 0.0f, (fp8ops_amax_algo)5, nullptr, 1, nullptr), "amax_update bad algo"},
      {fp8ops_amax_update_cuda(nullptr, ds, dsi, dm, 4, 4, 0.0f, FP8OPS_AMAX_MAX, nullptr, 1, nullptr), "amax_update null history"},
  };
  for (auto& e : errs) {
    char what[200];
    snprintf(what, sizeof what, "error path %s -> FP8OPS_ERR_INVALID (%d: %s)", e.what, e.got, fp8ops_last_error());
    check(e.got == FP8OPS_ERR_INVALID, what);
  }
  // empty input: amax = 0, nothing else
  const float poison = 5.0f;
  CK(cudaMemcpy(damax, &poison, 4, cudaMemcpyHostToDevice));
  FP8(fp8ops_cast_cuda(nullptr, FP8OPS_BF16, 0, 4096, dscale, FP8OPS_E4M3, nullptr, nullptr, damax, nullptr));
  float amax;
  CK(cudaMemcpy(&amax, damax, 4, cudaMemcpyDeviceToHost));
  check(fp8ops_f32_bits(amax) == 0, "empty cast (x = out = NULL): amax = +0");
  CK(cudaMemcpy(damax, &poison, 4, cudaMemcpyHostToDevice));
  FP8(fp8ops_amax_cuda(nullptr, FP8OPS_F16, 0, damax, nullptr));
  CK(cudaMemcpy(&amax, damax, 4, cudaMemcpyDeviceToHost));
  check(fp8ops_f32_bits(amax) == 0, "empty amax: +0");
  CK(cudaDeviceSynchronize());
  CK(cudaGetLastError());
  for (void* p : {(void*)dx, (void*)dout, (void*)dout_t, (void*)dscale, (void*)damax, (void*)dh, (void*)ds,
                  (void*)dsi, (void*)dm, (void*)dflat, (void*)damax2, (void*)damax3})
    CK(cudaFree(p));
}

// ----------------------------------------------------------------------------
// benchmark

static void bench() {
  cudaDeviceProp prop;
  int dev;
  CK(cudaGetDevice(&dev));
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("\nbenchmark on %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  printf("%-34s %10s %10s %9s %9s\n", "op (bf16 -> e4m3)", "ms", "GB/s", "copy GB/s", "% copy");
  const int64_t shapes[][2] = {{16384, 4096}, {16384, 14336}};
  for (auto& sh : shapes) {
    const int64_t R = sh[0], C = sh[1], n = R * C;
    void *dx, *dcopy;
    uint8_t *dout, *dout_t;
    float *dscale, *damax;
    CK(cudaMalloc(&dx, n * 2));
    CK(cudaMalloc(&dout, n));
    CK(cudaMalloc(&dout_t, n));
    CK(cudaMalloc(&dcopy, n * 2));
    CK(cudaMalloc(&dscale, 4));
    CK(cudaMalloc(&damax, 4));
    {  // realistic data: N(0, 1) bf16, scale 448 / 4
      std::vector<float> f(1 << 20);
      std::mt19937 rng(3);
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (auto& v : f) v = nd(rng);
      const std::vector<uint8_t> h = to_dtype(f, FP8OPS_BF16);
      for (int64_t off = 0; off < n; off += (int64_t)f.size())
        CK(cudaMemcpy((char*)dx + off * 2, h.data(), std::min((int64_t)f.size(), n - off) * 2, cudaMemcpyHostToDevice));
      const float s = 112.0f;
      CK(cudaMemcpy(dscale, &s, 4, cudaMemcpyHostToDevice));
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    auto time_ms = [&](auto&& fn) {
      for (int i = 0; i < 5; ++i) fn();
      CK(cudaDeviceSynchronize());
      const int iters = 50;
      CK(cudaEventRecord(e0));
      for (int i = 0; i < iters; ++i) fn();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      return ms / iters;
    };
    // copy of the same byte count: cast+T moves 2n (read) + 2n (written) bytes;
    // a memcpy of 2n bytes moves 4n
    const double copy_ms = time_ms([&] { CK(cudaMemcpyAsync(dcopy, dx, n * 2, cudaMemcpyDeviceToDevice)); });
    const double copy_gbs = 4.0 * n / copy_ms / 1e6;
    const double ct_ms = time_ms([&] {
      FP8(fp8ops_cast_cuda(dx, FP8OPS_BF16, R, C, dscale, FP8OPS_E4M3, dout, dout_t, damax, nullptr));
    });
    const double c_ms = time_ms([&] {
      FP8(fp8ops_cast_cuda(dx, FP8OPS_BF16, R, C, dscale, FP8OPS_E4M3, dout, nullptr, damax, nullptr));
    });
    const double a_ms = time_ms([&] { FP8(fp8ops_amax_cuda(dx, FP8OPS_BF16, n, damax, nullptr)); });
    char name[64];
    snprintf(name, sizeof name, "cast+T+amax %lldx%lld", (long long)R, (long long)C);
    const double ct_gbs = 4.0 * n / ct_ms / 1e6, c_gbs = 3.0 * n / c_ms / 1e6, a_gbs = 2.0 * n / a_ms / 1e6;
    printf("%-34s %10.4f %10.1f %9.1f %8.1f%%\n", name, ct_ms, ct_gbs, copy_gbs, 100.0 * ct_gbs / copy_gbs);
    snprintf(name, sizeof name, "cast+amax (no T) %lldx%lld", (long long)R, (long long)C);
    printf("%-34s %10.4f %10.1f %9.1f %8.1f%%\n", name, c_ms, c_gbs, copy_gbs, 100.0 * c_gbs / copy_gbs);
    snprintf(name, sizeof name, "amax %lldx%lld", (long long)R, (long long)C);
    printf("%-34s %10.4f %10.1f %9.1f %8.1f%%\n", name, a_ms, a_gbs, copy_gbs, 100.0 * a_gbs / copy_gbs);
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    for (void* p : {(void*)dx, dcopy, (void*)dout, (void*)dout_t, (void*)dscale, (void*)damax}) CK(cudaFree(p));
  }
  {  // amax_update, the largest documented case
    const int64_t n = 10000, H = 1024;
    float *dh, *ds, *dsi, *dm;
    CK(cudaMalloc(&dh, n * H * 4));
    CK(cudaMalloc(&ds, n * 4));
    CK(cudaMalloc(&dsi, n * 4));
    CK(cudaMalloc(&dm, n * 4));
    CK(cudaMemset(dh, 0, n * H * 4));
    CK(cudaMemset(ds, 0, n * 4));
    CK(cudaMemset(dm, 0, n * 4));
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; ++i) FP8(fp8ops_amax_update_cuda(dh, ds, dsi, dm, n, H, 0.0f, FP8OPS_AMAX_MAX, nullptr, 1, nullptr));
    CK(cudaEventRecord(e0));
    for (int i = 0; i < 20; ++i) FP8(fp8ops_amax_update_cuda(dh, ds, dsi, dm, n, H, 0.0f, FP8OPS_AMAX_MAX, nullptr, 1, nullptr));
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ms /= 20;
    printf("%-34s %10.4f %10.1f\n", "amax_update n=10000 H=1024", ms, 2.0 * n * H * 4 / ms / 1e6);
    for (void* p : {(void*)dh, (void*)ds, (void*)dsi, (void*)dm}) CK(cudaFree(p));
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
  }
}

int main(int argc, char** argv) {
  bool quick = false, do_bench = true;
  for (int i = 1; i < argc; ++i) {
    if (!strcmp(argv[i], "--quick")) quick = true;
    else if (!strcmp(argv[i], "--no-bench")) do_bench = false;
  }
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
    printf("no CUDA device: nothing to check\n");
    return 0;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, sm_%d%d\n", prop.name, prop.major, prop.minor);

  test_graph_and_errors();
  test_shapes();
  test_all_16bit();
  test_amax_update();
  if (!quick) test_exhaustive_f32();
  if (do_bench) bench();
  printf("\n%d passed, %d failed\n", g_checks - g_failures, g_failures);
  return g_failures ? 1 : 0;
}
