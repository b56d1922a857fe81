/*
 * gemm_check.c -- standalone device test of fp8ops_gemm_cuda (csrc/gemm_cuda.c), no torch.
 *
 * Checks, against a host fp32/fp64 reference (dequantise + dot), by SQNR >= 25 dB:
 *   - shapes (M x N x K) 16x16x16, 64x32x48, 256x512x128: every (a, b) format pair
 *     {(e4m3,e4m3), (e5m2,e4m3), (e4m3,e5m2)} x out {bf16, fp16, fp32} x bias {off, on}
 *     x fast_accum {0, 1}, full comparison;
 *   - 8192^3 and 16384x14336x4096 (M=16384, K=4096, N=14336): sampled comparison
 *     (512 entries), then timing with cudaEvents -> TFLOP/s, fast_accum 0 and 1;
 *   - a replay of a CUDA-graph-captured call; 4 host threads calling at once;
 *   - error paths: K=1000 and e5m2 x e5m2 and a misaligned pointer -> FP8OPS_ERR_INVALID
 *     with the right message; host overhead per cached call.
 * On a GPU below sm_89 it checks for FP8OPS_ERR_UNSUPPORTED and exits 0.
 *
 * Build and run (from the repository root; -lcublasLt because no torch loaded cuBLASLt
 * here, so the program itself must; it calls cublasLtGetVersion directly so that the
 * link keeps libcublasLt NEEDED even under --as-needed):
 *   gcc -std=c11 -O2 -I/usr/local/cuda/include -Icsrc benchmarks/dev/gemm_check.c \
 *       csrc/gemm_cuda.c csrc/errors.c csrc/sanitizer_marks.c -L/usr/local/cuda/lib64 \
 *       -Wl,-rpath,/usr/local/cuda/lib64 -lcudart_static -lcublasLt -ldl -lpthread -lrt -lm \
 *       -o gemm_check && ./gemm_check
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublasLt.h>          // cublasLtGetVersion (direct reference: keeps -lcublasLt NEEDED)
#include <cuda_runtime_api.h>  // cudaMalloc, events, graphs

#include "common.h"
#include "fp8_convert.h"

#define SQNR_MIN_DB 25.0

#define CK(expr)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d: CUDA error %s: %s\n", __FILE__, __LINE__, #expr,          \
              cudaGetErrorString(e_));                                                  \
      exit(2);                                                                          \
    }                                                                                   \
  } while (0)

static int g_failures = 0, g_checks = 0;

// ----------------------------------------------------------------------------
// host helpers

static uint64_t rng_next(uint64_t* s) { /* xorshift64* */
  uint64_t x = *s;
  x ^= x >> 12;
  x ^= x << 25;
  x ^= x >> 27;
  *s = x;
  return x * 2685821657736338717ull;
}

static float rng_uniform(uint64_t* s) { /* [-1, 1) */
  return (float)((double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0) * 2.0 - 1.0);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static const char* fmt_name(int f) { return f == FP8OPS_E5M2 ? "e5m2" : "e4m3"; }
static const char* hp_name(int d) {
  return d == FP8OPS_F32 ? "fp32" : d == FP8OPS_BF16 ? "bf16" : "fp16";
}
static size_t hp_size(int d) { return d == FP8OPS_F32 ? 4 : 2; }

static float fp8_to_f32(uint8_t v, int fmt) {
  return fmt == FP8OPS_E5M2 ? fp8ops_e5m2_to_f32(v) : fp8ops_e4m3_to_f32(v);
}

/* n fp8 values of a tensor whose real values are uniform in [-mag, mag): quantised with
 * scale = 0.9 * fmax / mag (clamped, as the casts do). Returns scale_inv; `deq` (if not
 * NULL) gets the unscaled fp8 values as floats. */
static float fill_fp8(uint8_t* dst, float* deq, size_t n, int fmt, float mag, uint64_t* rng) {
  const float fmax = fmt == FP8OPS_E5M2 ? FP8OPS_E5M2_MAX : FP8OPS_E4M3_MAX;
  const float scale = 0.9f * fmax / mag;
  for (size_t i = 0; i < n; ++i) {
    float x = rng_uniform(rng) * mag * scale;
    x = x > fmax ? fmax : x < -fmax ? -fmax : x;
    dst[i] = fmt == FP8OPS_E5M2 ? fp8ops_f32_to_e5m2(x) : fp8ops_f32_to_e4m3(x);
    if (deq) deq[i] = fp8_to_f32(dst[i], fmt);
  }
  return 1.0f / scale;
}

/* bias[n] in `dtype` bits; `val` gets the exact float of each. */
static void fill_bias(void* dst, float* val, int64_t n, int dtype, uint64_t* rng) {
  for (int64_t i = 0; i < n; ++i) {
    float x = 2.0f * rng_uniform(rng);
    if (dtype == FP8OPS_BF16) {
      uint16_t h = fp8ops_f32_to_bf16(x);
      ((uint16_t*)dst)[i] = h;
      val[i] = fp8ops_bf16_to_f32(h);
    } else if (dtype == FP8OPS_F16) {
      uint16_t h = fp8ops_f32_to_f16(x);
      ((uint16_t*)dst)[i] = h;
      val[i] = fp8ops_f16_to_f32(h);
    } else {
      ((float*)dst)[i] = x;
      val[i] = x;
    }
  }
}

static float out_to_f32(const void* out, size_t i, int dtype) {
  if (dtype == FP8OPS_F32) return ((const float*)out)[i];
  uint16_t h = ((const uint16_t*)out)[i];
  return dtype == FP8OPS_BF16 ? fp8ops_bf16_to_f32(h) : fp8ops_f16_to_f32(h);
}

typedef struct {
  double sig, noise, max_diff, sum_diff;
  int64_t n, nonfinite;
} err_acc;

static void err_add(err_acc* e, double ref, double got) {
  if (!isfinite(got)) {
    e->nonfinite++;
    return;
  }
  double d = got - ref;
  e->sig += ref * ref;
  e->noise += d * d;
  if (fabs(d) > e->max_diff) e->max_diff = fabs(d);
  e->sum_diff += fabs(d);
  e->n++;
}

static double err_sqnr(const err_acc* e) {
  if (e->nonfinite) return -INFINITY;
  if (e->noise == 0.0) return INFINITY;
  return 10.0 * log10(e->sig / e->noise);
}

static void check(int ok, const char* what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    printf("  FAIL: %s\n", what);
  }
}

// ----------------------------------------------------------------------------
// device state shared by the tests

typedef struct {
  uint8_t *a, *b;
  void *out, *bias;
  float* scales; /* [0] = a_scale_inv, [1] = b_scale_inv */
  void* ws;
  size_t ws_bytes;
  cudaStream_t stream;
  int device;
} dev_bufs;

static void dev_alloc(dev_bufs* d, int device, size_t a_bytes, size_t b_bytes, size_t out_bytes,
                      size_t bias_bytes) {
  d->device = device;
  CK(cudaMalloc((void**)&d->a, a_bytes));
  CK(cudaMalloc((void**)&d->b, b_bytes));
  CK(cudaMalloc(&d->out, out_bytes));
  CK(cudaMalloc(&d->bias, bias_bytes));
  CK(cudaMalloc((void**)&d->scales, 2 * sizeof(float)));
  d->ws_bytes = fp8ops_gemm_workspace_bytes();
  CK(cudaMalloc(&d->ws, d->ws_bytes));
  CK(cudaStreamCreateWithFlags(&d->stream, cudaStreamNonBlocking));
}

static void dev_free(dev_bufs* d) {
  CK(cudaFree(d->a));
  CK(cudaFree(d->b));
  CK(cudaFree(d->out));
  CK(cudaFree(d->bias));
  CK(cudaFree(d->scales));
  CK(cudaFree(d->ws));
  CK(cudaStreamDestroy(d->stream));
}

static int gemm(const dev_bufs* d, int a_fmt, int b_fmt, int64_t M, int64_t N, int64_t K,
                int has_bias, int out_dtype, int fast) {
  return fp8ops_gemm_cuda(d->a, (fp8ops_fp8_format)a_fmt, d->b, (fp8ops_fp8_format)b_fmt, M, N, K,
                          d->scales, d->scales + 1, has_bias ? d->bias : NULL,
                          (fp8ops_hp_dtype)out_dtype, d->out, fast, d->ws, d->ws_bytes, d->device,
                          (void*)d->stream);
}

/* One GEMM, its output copied to hout (M*N elements of out_dtype). On failure
 * the error is printed, the check counted as failed, and 0 returned. */
static int gemm_to_host(const dev_bufs* d, int a_fmt, int b_fmt, int64_t M, int64_t N, int64_t K,
                        int has_bias, int out_dtype, int fast, void* hout, const char* label) {
  int rc = gemm(d, a_fmt, b_fmt, M, N, K, has_bias, out_dtype, fast);
  if (rc != FP8OPS_OK) {
    printf("  %s -> rc %d: %s\n", label, rc, fp8ops_last_error());
    check(0, label);
    return 0;
  }
  CK(cudaStreamSynchronize(d->stream));
  CK(cudaMemcpy(hout, d->out, (size_t)(M * N) * hp_size(out_dtype), cudaMemcpyDeviceToHost));
  return 1;
}

// ----------------------------------------------------------------------------
// small shapes: full comparison over every combination

static const int k_pairs[3][2] = {{FP8OPS_E4M3, FP8OPS_E4M3},
                                  {FP8OPS_E5M2, FP8OPS_E4M3},
                                  {FP8OPS_E4M3, FP8OPS_E5M2}};
static const int k_outs[3] = {FP8OPS_BF16, FP8OPS_F16, FP8OPS_F32};

static void test_small(int device) {
  static const int64_t shapes[3][3] = {{16, 16, 16}, {64, 32, 48}, {256, 512, 128}}; /* M N K */
  const int64_t maxM = 256, maxN = 512, maxK = 128;
  dev_bufs d;
  dev_alloc(&d, device, (size_t)(maxM * maxK), (size_t)(maxN * maxK), (size_t)(maxM * maxN * 4),
            (size_t)maxN * 4);
  uint8_t* ha = malloc((size_t)(maxM * maxK));
  uint8_t* hb = malloc((size_t)(maxN * maxK));
  float* fa = malloc(sizeof(float) * (size_t)(maxM * maxK));
  float* fb = malloc(sizeof(float) * (size_t)(maxN * maxK));
  double* prod = malloc(sizeof(double) * (size_t)(maxM * maxN));
  void* hout = malloc((size_t)(maxM * maxN * 4));
  void* hbias = malloc((size_t)maxN * 4);
  float* bias_val = malloc(sizeof(float) * (size_t)maxN);
  uint64_t rng = 0x9E3779B97F4A7C15ull;

  printf("\n== correctness, full comparison (SQNR >= %.0f dB) ==\n", SQNR_MIN_DB);
  printf("%-13s %-10s %-5s %-4s %-4s %9s %11s %11s\n", "MxNxK", "a x b", "out", "bias", "fast",
         "SQNR dB", "max|diff|", "mean|diff|");
  for (int s = 0; s < 3; ++s) {
    const int64_t M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
    for (int p = 0; p < 3; ++p) {
      const int af = k_pairs[p][0], bf = k_pairs[p][1];
      float sc[2];
      sc[0] = fill_fp8(ha, fa, (size_t)(M * K), af, 3.0f, &rng);
      sc[1] = fill_fp8(hb, fb, (size_t)(N * K), bf, 0.05f, &rng);
      CK(cudaMemcpy(d.a, ha, (size_t)(M * K), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d.b, hb, (size_t)(N * K), cudaMemcpyHostToDevice));
      CK(cudaMemcpy(d.scales, sc, sizeof sc, cudaMemcpyHostToDevice));
      for (int64_t i = 0; i < M; ++i)
        for (int64_t j = 0; j < N; ++j) {
          double acc = 0.0;
          for (int64_t k = 0; k < K; ++k) acc += (double)fa[i * K + k] * (double)fb[j * K + k];
          prod[i * N + j] = acc * (double)sc[0] * (double)sc[1];
        }
      for (int o = 0; o < 3; ++o) {
        const int od = k_outs[o];
        for (int has_bias = 0; has_bias < 2; ++has_bias) {
          if (has_bias) {
            fill_bias(hbias, bias_val, N, fp8ops_gemm_bias_dtype((fp8ops_hp_dtype)od), &rng);
            CK(cudaMemcpy(d.bias, hbias, (size_t)N * 4, cudaMemcpyHostToDevice));
          }
          for (int fast = 0; fast < 2; ++fast) {
            char label[160];
            snprintf(label, sizeof label, "%lldx%lldx%lld %s x %s out=%s bias=%d fast=%d",
                     (long long)M, (long long)N, (long long)K, fmt_name(af), fmt_name(bf),
                     hp_name(od), has_bias, fast);
            CK(cudaMemsetAsync(d.out, 0xFF, (size_t)(M * N) * hp_size(od), d.stream)); /* NaN */
            if (!gemm_to_host(&d, af, bf, M, N, K, has_bias, od, fast, hout, label)) continue;
            err_acc e;
            memset(&e, 0, sizeof e);
            for (int64_t i = 0; i < M; ++i)
              for (int64_t j = 0; j < N; ++j)
                err_add(&e, prod[i * N + j] + (has_bias ? (double)bias_val[j] : 0.0),
                        (double)out_to_f32(hout, (size_t)(i * N + j), od));
            const double q = err_sqnr(&e);
            char sh[32], pr[16];
            snprintf(sh, sizeof sh, "%lldx%lldx%lld", (long long)M, (long long)N, (long long)K);
            snprintf(pr, sizeof pr, "%sx%s", fmt_name(af), fmt_name(bf));
            printf("%-13s %-10s %-5s %-4d %-4d %9.2f %11.3g %11.3g%s\n", sh, pr, hp_name(od),
                   has_bias, fast, q, e.max_diff, e.n ? e.sum_diff / (double)e.n : 0.0,
                   e.nonfinite ? "  (non-finite outputs!)" : "");
            check(q >= SQNR_MIN_DB, label);
          }
        }
      }
    }
  }
  free(ha), free(hb), free(fa), free(fb), free(prod), free(hout), free(hbias), free(bias_val);
  dev_free(&d);
}

// ----------------------------------------------------------------------------
// large shapes: sampled comparison + timing

static void test_large(int device, int64_t M, int64_t N, int64_t K) {
  const int af = FP8OPS_E4M3, bf = FP8OPS_E4M3, od = FP8OPS_BF16;
  const int n_samples = 512, warmup = 5, iters = 20;
  dev_bufs d;
  dev_alloc(&d, device, (size_t)(M * K), (size_t)(N * K), (size_t)(M * N) * hp_size(od),
            (size_t)N * 2);
  uint8_t* ha = malloc((size_t)(M * K));
  uint8_t* hb = malloc((size_t)(N * K));
  void* hout = malloc((size_t)(M * N) * hp_size(od));
  void* hbias = malloc((size_t)N * 2);
  float* bias_val = malloc(sizeof(float) * (size_t)N);
  uint64_t rng = 0xD1B54A32D192ED03ull ^ (uint64_t)(M * 31 + N * 7 + K);
  float sc[2];
  sc[0] = fill_fp8(ha, NULL, (size_t)(M * K), af, 3.0f, &rng);
  sc[1] = fill_fp8(hb, NULL, (size_t)(N * K), bf, 0.05f, &rng);
  fill_bias(hbias, bias_val, N, fp8ops_gemm_bias_dtype((fp8ops_hp_dtype)od), &rng);
  CK(cudaMemcpy(d.a, ha, (size_t)(M * K), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.b, hb, (size_t)(N * K), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.bias, hbias, (size_t)N * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d.scales, sc, sizeof sc, cudaMemcpyHostToDevice));

  printf("\n== M=%lld N=%lld K=%lld, e4m3 x e4m3 -> bf16 ==\n", (long long)M, (long long)N,
         (long long)K);
  for (int has_bias = 0; has_bias < 2; ++has_bias)
    for (int fast = 0; fast < 2; ++fast) {
      char label[128];
      snprintf(label, sizeof label, "M=%lld N=%lld K=%lld bias=%d fast=%d (sampled)",
               (long long)M, (long long)N, (long long)K, has_bias, fast);
      if (!gemm_to_host(&d, af, bf, M, N, K, has_bias, od, fast, hout, label)) continue;
      err_acc e;
      memset(&e, 0, sizeof e);
      uint64_t r2 = 12345;
      for (int s = 0; s < n_samples; ++s) {
        const int64_t i = (int64_t)(rng_next(&r2) % (uint64_t)M);
        const int64_t j = (int64_t)(rng_next(&r2) % (uint64_t)N);
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k)
          acc += (double)fp8_to_f32(ha[i * K + k], af) * (double)fp8_to_f32(hb[j * K + k], bf);
        const double ref = acc * (double)sc[0] * (double)sc[1] + (has_bias ? bias_val[j] : 0.0);
        err_add(&e, ref, (double)out_to_f32(hout, (size_t)(i * N + j), od));
      }
      const double q = err_sqnr(&e);
      printf("  bias=%d fast=%d: sampled SQNR %.2f dB over %d entries (max|diff| %.3g, "
             "mean|diff| %.3g)\n",
             has_bias, fast, q, n_samples, e.max_diff, e.n ? e.sum_diff / (double)e.n : 0.0);
      check(q >= SQNR_MIN_DB, label);
    }

  cudaEvent_t t0, t1;
  CK(cudaEventCreate(&t0));
  CK(cudaEventCreate(&t1));
  const double flop = 2.0 * (double)M * (double)N * (double)K;
  for (int fast = 0; fast < 2; ++fast) {
    int rc = FP8OPS_OK;
    for (int i = 0; i < warmup && rc == FP8OPS_OK; ++i) rc = gemm(&d, af, bf, M, N, K, 0, od, fast);
    CK(cudaEventRecord(t0, d.stream));
    for (int i = 0; i < iters && rc == FP8OPS_OK; ++i) rc = gemm(&d, af, bf, M, N, K, 0, od, fast);
    CK(cudaEventRecord(t1, d.stream));
    CK(cudaEventSynchronize(t1));
    if (rc != FP8OPS_OK) {
      printf("  timing fast=%d -> rc %d: %s\n", fast, rc, fp8ops_last_error());
      check(0, "timing run");
      continue;
    }
    float ms = 0.0f;
    CK(cudaEventElapsedTime(&ms, t0, t1));
    ms /= (float)iters;
    printf("  timing fast_accum=%d: %.3f ms/GEMM, %.1f TFLOP/s (%d iters after %d warmup)\n",
           fast, ms, flop / ((double)ms * 1e-3) / 1e12, iters, warmup);
  }
  CK(cudaEventDestroy(t0));
  CK(cudaEventDestroy(t1));
  free(ha), free(hb), free(hout), free(hbias), free(bias_val);
  dev_free(&d);
}

// ----------------------------------------------------------------------------
// graph capture, threads, host overhead, error paths

/* One 256x512x128 problem with its reference, shared by the graph and thread tests. */
typedef struct {
  int64_t M, N, K;
  uint8_t *ha, *hb;
  float sc[2];
  double* ref; /* with bias */
  void* hbias;
} problem;

static void problem_init(problem* p, int64_t M, int64_t N, int64_t K, uint64_t seed) {
  uint64_t rng = seed;
  p->M = M, p->N = N, p->K = K;
  p->ha = malloc((size_t)(M * K));
  p->hb = malloc((size_t)(N * K));
  p->hbias = malloc((size_t)N * 2);
  p->ref = malloc(sizeof(double) * (size_t)(M * N));
  float* fa = malloc(sizeof(float) * (size_t)(M * K));
  float* fb = malloc(sizeof(float) * (size_t)(N * K));
  float* bv = malloc(sizeof(float) * (size_t)N);
  p->sc[0] = fill_fp8(p->ha, fa, (size_t)(M * K), FP8OPS_E4M3, 3.0f, &rng);
  p->sc[1] = fill_fp8(p->hb, fb, (size_t)(N * K), FP8OPS_E4M3, 0.05f, &rng);
  fill_bias(p->hbias, bv, N, FP8OPS_BF16, &rng);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < N; ++j) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k) acc += (double)fa[i * K + k] * (double)fb[j * K + k];
      p->ref[i * N + j] = acc * (double)p->sc[0] * (double)p->sc[1] + (double)bv[j];
    }
  free(fa), free(fb), free(bv);
}

static void problem_free(problem* p) { free(p->ha), free(p->hb), free(p->hbias), free(p->ref); }

static void problem_upload(const problem* p, dev_bufs* d) {
  CK(cudaMemcpy(d->a, p->ha, (size_t)(p->M * p->K), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d->b, p->hb, (size_t)(p->N * p->K), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d->bias, p->hbias, (size_t)p->N * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d->scales, p->sc, sizeof p->sc, cudaMemcpyHostToDevice));
}

static double problem_sqnr(const problem* p, const dev_bufs* d) { /* out is bf16 */
  uint16_t* h = malloc((size_t)(p->M * p->N) * 2);
  CK(cudaMemcpy(h, d->out, (size_t)(p->M * p->N) * 2, cudaMemcpyDeviceToHost));
  err_acc e;
  memset(&e, 0, sizeof e);
  for (int64_t i = 0; i < p->M * p->N; ++i) err_add(&e, p->ref[i], (double)fp8ops_bf16_to_f32(h[i]));
  free(h);
  return err_sqnr(&e);
}

static void test_graph(int device, const problem* p) {
  printf("\n== CUDA graph capture ==\n");
  dev_bufs d;
  dev_alloc(&d, device, (size_t)(p->M * p->K), (size_t)(p->N * p->K), (size_t)(p->M * p->N) * 2,
            (size_t)p->N * 2);
  problem_upload(p, &d);
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  CK(cudaStreamBeginCapture(d.stream, cudaStreamCaptureModeThreadLocal));
  int rc = gemm(&d, FP8OPS_E4M3, FP8OPS_E4M3, p->M, p->N, p->K, 1, FP8OPS_BF16, 0);
  cudaError_t ce = cudaStreamEndCapture(d.stream, &graph);
  if (rc != FP8OPS_OK || ce != cudaSuccess) {
    printf("  capture failed: rc %d (%s), end capture: %s\n", rc, fp8ops_last_error(),
           cudaGetErrorString(ce));
    check(0, "graph capture");
    (void)cudaGetLastError();
  } else {
    CK(cudaGraphInstantiate(&exec, graph, 0));
    CK(cudaMemsetAsync(d.out, 0xFF, (size_t)(p->M * p->N) * 2, d.stream));
    CK(cudaGraphLaunch(exec, d.stream));
    CK(cudaStreamSynchronize(d.stream));
    const double q = problem_sqnr(p, &d);
    printf("  replayed graph: SQNR %.2f dB\n", q);
    check(q >= SQNR_MIN_DB, "graph replay");
    CK(cudaGraphExecDestroy(exec));
    CK(cudaGraphDestroy(graph));
  }
  dev_free(&d);
}

typedef struct {
  const problem* p;
  int device, iters, fails;
  double worst;
} thread_arg;

static void* thread_main(void* argp) {
  thread_arg* t = argp;
  CK(cudaSetDevice(t->device));
  dev_bufs d;
  dev_alloc(&d, t->device, (size_t)(t->p->M * t->p->K), (size_t)(t->p->N * t->p->K),
            (size_t)(t->p->M * t->p->N) * 2, (size_t)t->p->N * 2);
  problem_upload(t->p, &d);
  t->worst = INFINITY;
  for (int it = 0; it < t->iters; ++it) {
    const int fast = it & 1;
    CK(cudaMemsetAsync(d.out, 0xFF, (size_t)(t->p->M * t->p->N) * 2, d.stream));
    int rc = gemm(&d, FP8OPS_E4M3, FP8OPS_E4M3, t->p->M, t->p->N, t->p->K, 1, FP8OPS_BF16, fast);
    if (rc != FP8OPS_OK) {
      printf("  thread: rc %d: %s\n", rc, fp8ops_last_error());
      t->fails++;
      continue;
    }
    CK(cudaStreamSynchronize(d.stream));
    const double q = problem_sqnr(t->p, &d);
    if (q < t->worst) t->worst = q;
    if (q < SQNR_MIN_DB) t->fails++;
  }
  dev_free(&d);
  return NULL;
}

static void test_threads(int device, const problem* p) {
  enum { NT = 4 };
  printf("\n== %d host threads, own streams, shared cache ==\n", NT);
  pthread_t th[NT];
  thread_arg args[NT];
  for (int i = 0; i < NT; ++i) {
    memset(&args[i], 0, sizeof args[i]);
    args[i].p = p, args[i].device = device, args[i].iters = 25;
    pthread_create(&th[i], NULL, thread_main, &args[i]);
  }
  for (int i = 0; i < NT; ++i) {
    pthread_join(th[i], NULL);
    printf("  thread %d: %d calls, worst SQNR %.2f dB, %d failures\n", i, args[i].iters,
           args[i].worst, args[i].fails);
    check(args[i].fails == 0, "threaded calls");
  }
}

static void test_host_overhead(int device) {
  printf("\n== host overhead of a cached call (16x16x16, bf16 out) ==\n");
  dev_bufs d;
  dev_alloc(&d, device, 256, 256, 1024, 64);
  CK(cudaMemset(d.a, 0, 256));
  CK(cudaMemset(d.b, 0, 256));
  const float one[2] = {1.0f, 1.0f};
  CK(cudaMemcpy(d.scales, one, sizeof one, cudaMemcpyHostToDevice));
  int rc = gemm(&d, FP8OPS_E4M3, FP8OPS_E4M3, 16, 16, 16, 0, FP8OPS_BF16, 0); /* warm */
  CK(cudaStreamSynchronize(d.stream));
  const int n = 2000;
  double t = now_s();
  for (int i = 0; i < n && rc == FP8OPS_OK; ++i)
    rc = gemm(&d, FP8OPS_E4M3, FP8OPS_E4M3, 16, 16, 16, 0, FP8OPS_BF16, 0);
  t = now_s() - t;
  CK(cudaStreamSynchronize(d.stream));
  if (rc != FP8OPS_OK) printf("  rc %d: %s\n", rc, fp8ops_last_error());
  check(rc == FP8OPS_OK, "host overhead loop");
  printf("  %.2f us per fp8ops_gemm_cuda call (enqueue only, %d calls)\n", t / n * 1e6, n);
  dev_free(&d);
}

static void expect_invalid(int rc, const char* must_contain, const char* what) {
  const char* msg = fp8ops_last_error();
  printf("  %s -> rc %d: %s\n", what, rc, msg);
  check(rc == FP8OPS_ERR_INVALID && strstr(msg, must_contain) != NULL, what);
}

static void test_errors(int device) {
  printf("\n== error paths ==\n");
  dev_bufs d;
  dev_alloc(&d, device, 16 * 1024, 16 * 1024, 16 * 1024 * 4, 1024 * 4);
  expect_invalid(gemm(&d, FP8OPS_E4M3, FP8OPS_E4M3, 16, 16, 1000, 0, FP8OPS_BF16, 0),
                 "K must be a multiple of 16 for FP8 GEMM (got 1000)", "K=1000");
  expect_invalid(gemm(&d, FP8OPS_E5M2, FP8OPS_E5M2, 16, 16, 16, 0, FP8OPS_BF16, 0), "e5m2 x e5m2",
                 "e5m2 x e5m2");
  const int rc = fp8ops_gemm_cuda(d.a + 8, FP8OPS_E4M3, d.b, FP8OPS_E4M3, 16, 16, 16, d.scales,
                                  d.scales + 1, NULL, FP8OPS_BF16, d.out, 0, d.ws, d.ws_bytes,
                                  device, (void*)d.stream);
  expect_invalid(rc, "16-byte aligned", "a at offset 8");
  dev_free(&d);
}

// ----------------------------------------------------------------------------

int main(void) {
  const size_t lt_ver = cublasLtGetVersion();
  printf("cuBLASLt (linked) %zu, built against cuBLAS %d.%d.%d\n", lt_ver, CUBLAS_VER_MAJOR,
         CUBLAS_VER_MINOR, CUBLAS_VER_PATCH);
  int rc = fp8ops_cublaslt_init();
  printf("fp8ops_cublaslt_init -> %d %s\n", rc, fp8ops_last_error());
  if (rc != FP8OPS_OK) return 1;

  const int device = 0;
  CK(cudaSetDevice(device));
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  int cc = 0;
  rc = fp8ops_device_capability(device, &cc);
  printf("device %d: %s, sm_%d (rc %d), %d SMs\n", device, prop.name, cc, rc,
         prop.multiProcessorCount);
  if (rc != FP8OPS_OK) return 1;

  if (cc < 89) { /* only the refusal can be checked here */
    dev_bufs d;
    dev_alloc(&d, device, 256, 256, 1024, 64);
    rc = gemm(&d, FP8OPS_E4M3, FP8OPS_E4M3, 16, 16, 16, 0, FP8OPS_BF16, 0);
    printf("sm_%d < sm_89: fp8ops_gemm_cuda -> %d: %s\n", cc, rc, fp8ops_last_error());
    dev_free(&d);
    return rc == FP8OPS_ERR_UNSUPPORTED ? 0 : 1;
  }

  test_errors(device);
  test_small(device);
  problem p;
  problem_init(&p, 256, 512, 128, 777);
  test_graph(device, &p);
  test_threads(device, &p);
  problem_free(&p);
  test_host_overhead(device);
  test_large(device, 8192, 8192, 8192);
  test_large(device, 16384, 14336, 4096);

  printf("\n%s: %d of %d checks passed\n", g_failures ? "FAILED" : "All results match",
         g_checks - g_failures, g_checks);
  return g_failures ? 1 : 0;
}
