/* Does cuBLASLt's first heuristic pick leave FP8 GEMM speed on the table? For each
 * GEMM of a linear layer's fwd + bwd (the descriptors fp8ops builds: TN, fp32 compute,
 * scale pointers, fast accumulation in the forward only), ask the heuristic for up to
 * 16 algorithms, time each back to back, and print each one's time against the first
 * pick (what fp8ops, torch._scaled_mm and Transformer Engine run).
 *
 * Build and run (repository root; standalone, no torch):
 *   gcc -std=c11 -O2 -I/usr/local/cuda/include benchmarks/dev/gemm_algos.c \
 *       -L/usr/local/cuda/lib64 -Wl,-rpath,/usr/local/cuda/lib64 -lcudart -lcublasLt \
 *       -o /tmp/gemm_algos && /tmp/gemm_algos [MxKxN ...]
 */
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e_ = (x);                                                       \
    if (e_ != cudaSuccess) {                                                    \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,                 \
              cudaGetErrorString(e_));                                          \
      return 1;                                                                 \
    }                                                                           \
  } while (0)
#define CB(x)                                                                   \
  do {                                                                          \
    cublasStatus_t s_ = (x);                                                    \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                          \
      fprintf(stderr, "%s:%d %s: status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      return 1;                                                                 \
    }                                                                           \
  } while (0)

enum { MAX_ALGOS = 16, WARM = 3, REPS = 20, ROUNDS = 3 };
static const size_t WS_BYTES = (size_t)32 << 20; /* fp8ops_gemm_workspace_bytes() */

static cudaError_t fill_random(void* dev, size_t n) {
  unsigned char* host = (unsigned char*)malloc(n);
  if (host == NULL) return cudaErrorMemoryAllocation;
  uint64_t x = 0x9E3779B97F4A7C15ull ^ n;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17; /* xorshift64 */
    host[i] = (unsigned char)(x >> 24) & 0xBF;
  }
  cudaError_t e = cudaMemcpy(dev, host, n, cudaMemcpyHostToDevice);
  free(host);
  return e;
}

/* out[m, n] = sum_k a[m, k] b[n, k] (row-major, both K-contiguous), as fp8ops' gemm */
static int time_gemm(cublasLtHandle_t h, const char* role, long M, long K, long N,
                     cudaDataType_t ta, cudaDataType_t tb, cudaDataType_t tout, int fast) {
  void *a, *b, *out, *ws;
  float* scales; /* a's and b's scale 16-byte apart: cuBLASLt answers "not supported" for FP8
                  * scale pointers that are not 16-byte aligned (csrc/gemm_cuda.c) */
  CK(cudaMalloc(&a, (size_t)M * K));
  CK(cudaMalloc(&b, (size_t)N * K));
  CK(cudaMalloc(&out, (size_t)M * N * (tout == CUDA_R_32F ? 4 : 2)));
  CK(cudaMalloc(&ws, WS_BYTES));
  CK(cudaMalloc((void**)&scales, 8 * sizeof(float)));
  /* random finite values (bit 6 clear: no NaN/inf in either format); constant data
   * draws less power and runs at higher clocks than real operands */
  CK(fill_random(a, (size_t)M * K));
  CK(fill_random(b, (size_t)N * K));
  const float one[8] = {1.0f, 0, 0, 0, 1.0f, 0, 0, 0};
  CK(cudaMemcpy(scales, one, sizeof one, cudaMemcpyHostToDevice));

  cublasLtMatmulDesc_t desc;
  CB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const int32_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
  const void *sa = scales, *sb = scales + 4;
  const int8_t fa = (int8_t)fast;
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof transa));
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof transb));
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
  CB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof fa));
  /* column-major: cuBLAS A = b [K, N] op T, B = a [K, M], D = [N, M] */
  cublasLtMatrixLayout_t la, lb, lo;
  CB(cublasLtMatrixLayoutCreate(&la, tb, (uint64_t)K, (uint64_t)N, K));
  CB(cublasLtMatrixLayoutCreate(&lb, ta, (uint64_t)K, (uint64_t)M, K));
  CB(cublasLtMatrixLayoutCreate(&lo, tout, (uint64_t)N, (uint64_t)M, N));
  cublasLtMatmulPreference_t pref;
  CB(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t wsb = WS_BYTES;
  CB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb,
                                          sizeof wsb));
  cublasLtMatmulHeuristicResult_t res[MAX_ALGOS];
  int n = 0;
  CB(cublasLtMatmulAlgoGetHeuristic(h, desc, la, lb, lo, lo, pref, MAX_ALGOS, res, &n));

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  const float alpha = 1.0f, beta = 0.0f;
  float first = 0.0f, best = 1e30f;
  int best_i = -1;
  printf("%-6s %ldx%ld->%ld fast=%d: %d algorithms\n", role, M, K, N, fast, n);
  for (int i = 0; i < n; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    float med[ROUNDS];
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    for (int r = 0; r < ROUNDS && st == CUBLAS_STATUS_SUCCESS; ++r) {
      for (int w = 0; w < WARM && st == CUBLAS_STATUS_SUCCESS; ++w)
        st = cublasLtMatmul(h, desc, &alpha, b, la, a, lb, &beta, out, lo, out, lo, &res[i].algo,
                            ws, WS_BYTES, 0);
      CK(cudaEventRecord(e0, 0));
      for (int it = 0; it < REPS && st == CUBLAS_STATUS_SUCCESS; ++it)
        st = cublasLtMatmul(h, desc, &alpha, b, la, a, lb, &beta, out, lo, out, lo, &res[i].algo,
                            ws, WS_BYTES, 0);
      CK(cudaEventRecord(e1, 0));
      CK(cudaEventSynchronize(e1));
      CK(cudaEventElapsedTime(&med[r], e0, e1));
      med[r] /= REPS;
    }
    if (st != CUBLAS_STATUS_SUCCESS) {
      printf("  algo %2d: cublasLtMatmul failed: %s\n", i, cublasLtGetStatusString(st));
      continue;
    }
    /* median of the rounds */
    for (int x = 0; x < ROUNDS; ++x)
      for (int y = x + 1; y < ROUNDS; ++y)
        if (med[y] < med[x]) { float t = med[x]; med[x] = med[y]; med[y] = t; }
    const float t = med[ROUNDS / 2];
    if (i == 0) first = t;
    if (t < best) { best = t; best_i = i; }
    printf("  algo %2d: %.4f ms (%.3fx of the first pick's time), %.0f TFLOP/s\n", i, t,
           first > 0 ? t / first : 1.0, 2.0 * M * N * K / (t * 1e-3) / 1e12);
  }
  if (best_i >= 0 && first > 0)
    printf("  best: algo %d, %.1f %% faster than the first pick\n", best_i,
           100.0 * (first / best - 1.0));
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(lo);
  cublasLtMatmulDescDestroy(desc);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a); cudaFree(b); cudaFree(out); cudaFree(ws); cudaFree(scales);
  return 0;
}

int main(int argc, char** argv) {
  static const char* defaults[] = {"16384x4096x14336", "16384x14336x4096", "16384x4096x4096",
                                   "4096x4096x4096", "16384x768x3072", "16384x3072x768",
                                   "16384x2048x2048"};
  const int nshapes = argc > 1 ? argc - 1 : (int)(sizeof defaults / sizeof *defaults);
  cublasLtHandle_t h;
  CB(cublasLtCreate(&h));
  for (int s = 0; s < nshapes; ++s) {
    long M, K, N;
    if (sscanf(argc > 1 ? argv[s + 1] : defaults[s], "%ldx%ldx%ld", &M, &K, &N) != 3) {
      fprintf(stderr, "shape %s: expected MxKxN\n", argv[s + 1]);
      return 2;
    }
    /* the three GEMMs of fp8ops' linear: y = x W^T; dx = dy W; dW = dy^T x */
    if (time_gemm(h, "fwd", M, K, N, CUDA_R_8F_E4M3, CUDA_R_8F_E4M3, CUDA_R_16BF, 1)) return 1;
    if (time_gemm(h, "dgrad", M, N, K, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_16BF, 0)) return 1;
    if (time_gemm(h, "wgrad", N, M, K, CUDA_R_8F_E5M2, CUDA_R_8F_E4M3, CUDA_R_32F, 0)) return 1;
  }
  cublasLtDestroy(h);
  return 0;
}
