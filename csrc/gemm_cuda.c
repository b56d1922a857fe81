/*
 * gemm_cuda.c -- cuBLASLt FP8 GEMM, host-only C11: out[M, N] = a[M, K] . b[N, K]^T
 * * a_scale_inv * b_scale_inv (+ bias[N]). Serves fp8ops_gemm_cuda (and through it the
 * gemm / linear ops), fp8ops_gemm_workspace_bytes, fp8ops_cublaslt_init and
 * fp8ops_device_capability.
 *
 * cuBLASLt is the copy torch already loaded: we never link -lcublasLt and never load a
 * second copy. fp8ops_cublaslt_init() finds it with dlopen(RTLD_NOLOAD) and resolves
 * every function we call into g_lt (cublasLt.h is included for its types and enums
 * only; the _Static_asserts below check our pointer types against its prototypes and
 * reference no symbol). CPU-only torch: the library is absent and every CUDA GEMM
 * returns FP8OPS_ERR_UNSUPPORTED with a message.
 *
 * Caching and threads (one mutex, g_lock):
 *   - one cublasLtHandle_t per device, created lazily and kept for the process;
 *   - per (device, M, N, K, formats, out dtype, bias, fast_accum, workspace bytes,
 *     pointer alignments): the three matrix layouts (C and D share one, as C = D type
 *     and beta = 0) and the heuristic's algo, in a 256-slot table. Entries are
 *     immutable once built; a use count keeps an entry alive while a call uses it
 *     outside the lock, and only unused entries are replaced (least recently used of
 *     the probed slots);
 *   - the matmul descriptor is created per call, because it holds this call's
 *     pointers (scales, bias): setting them on a shared descriptor would race.
 * The call itself is graph-capturable: scales are device pointers, alpha/beta are host
 * constants, the workspace comes from the caller, and nothing here syncs or allocates
 * device memory (the first call for a device does create its handle: warm up before
 * capturing, as torch does).
 */
#define _POSIX_C_SOURCE 200809L

#include <dlfcn.h>      // defines: dlopen, dlsym, dlclose, RTLD_NOLOAD
#include <pthread.h>    // defines: pthread_mutex_t
#include <stdatomic.h>  // defines: atomic_int (lock-free fast path of init)
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cublasLt.h>          // types, enums, CUBLAS_VER_MAJOR (no symbols used)
#include <cuda_runtime_api.h>  // cudaDeviceGetAttribute, cudaGetDevice, cudaSetDevice

#include "common.h"

// ----------------------------------------------------------------------------
// cuBLASLt function table, resolved from the already-loaded library

typedef size_t (*fp8ops_lt_get_version_fn)(void);
typedef const char* (*fp8ops_lt_get_status_string_fn)(cublasStatus_t);
typedef cublasStatus_t (*fp8ops_lt_create_fn)(cublasLtHandle_t*);
typedef cublasStatus_t (*fp8ops_lt_matmul_desc_create_fn)(cublasLtMatmulDesc_t*, cublasComputeType_t,
                                                          cudaDataType_t);
typedef cublasStatus_t (*fp8ops_lt_matmul_desc_destroy_fn)(cublasLtMatmulDesc_t);
typedef cublasStatus_t (*fp8ops_lt_matmul_desc_set_attribute_fn)(cublasLtMatmulDesc_t,
                                                                 cublasLtMatmulDescAttributes_t,
                                                                 const void*, size_t);
typedef cublasStatus_t (*fp8ops_lt_matrix_layout_create_fn)(cublasLtMatrixLayout_t*, cudaDataType,
                                                            uint64_t, uint64_t, int64_t);
typedef cublasStatus_t (*fp8ops_lt_matrix_layout_destroy_fn)(cublasLtMatrixLayout_t);
typedef cublasStatus_t (*fp8ops_lt_pref_create_fn)(cublasLtMatmulPreference_t*);
typedef cublasStatus_t (*fp8ops_lt_pref_destroy_fn)(cublasLtMatmulPreference_t);
typedef cublasStatus_t (*fp8ops_lt_pref_set_attribute_fn)(cublasLtMatmulPreference_t,
                                                          cublasLtMatmulPreferenceAttributes_t,
                                                          const void*, size_t);
typedef cublasStatus_t (*fp8ops_lt_algo_get_heuristic_fn)(
    cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
    cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
    cublasLtMatmulHeuristicResult_t[], int*);
typedef cublasStatus_t (*fp8ops_lt_matmul_fn)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*,
                                              const void*, cublasLtMatrixLayout_t, const void*,
                                              cublasLtMatrixLayout_t, const void*, const void*,
                                              cublasLtMatrixLayout_t, void*, cublasLtMatrixLayout_t,
                                              const cublasLtMatmulAlgo_t*, void*, size_t,
                                              cudaStream_t);

/* Each typedef must match the header's prototype exactly. _Generic does not evaluate
 * its controlling expression, so no reference to the symbol is emitted. */
#define FP8OPS_LT_PROTO_CHECK(fn_type, sym) \
  _Static_assert(_Generic(&sym, fn_type: 1, default: 0), #sym " prototype changed in cublasLt.h")
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_get_version_fn, cublasLtGetVersion);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_get_status_string_fn, cublasLtGetStatusString);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_create_fn, cublasLtCreate);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_matmul_desc_create_fn, cublasLtMatmulDescCreate);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_matmul_desc_destroy_fn, cublasLtMatmulDescDestroy);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_matmul_desc_set_attribute_fn, cublasLtMatmulDescSetAttribute);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_matrix_layout_create_fn, cublasLtMatrixLayoutCreate);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_matrix_layout_destroy_fn, cublasLtMatrixLayoutDestroy);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_pref_create_fn, cublasLtMatmulPreferenceCreate);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_pref_destroy_fn, cublasLtMatmulPreferenceDestroy);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_pref_set_attribute_fn, cublasLtMatmulPreferenceSetAttribute);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_algo_get_heuristic_fn, cublasLtMatmulAlgoGetHeuristic);
FP8OPS_LT_PROTO_CHECK(fp8ops_lt_matmul_fn, cublasLtMatmul);

static struct {
  fp8ops_lt_get_version_fn GetVersion;
  fp8ops_lt_get_status_string_fn GetStatusString;
  fp8ops_lt_create_fn Create;
  fp8ops_lt_matmul_desc_create_fn MatmulDescCreate;
  fp8ops_lt_matmul_desc_destroy_fn MatmulDescDestroy;
  fp8ops_lt_matmul_desc_set_attribute_fn MatmulDescSetAttribute;
  fp8ops_lt_matrix_layout_create_fn MatrixLayoutCreate;
  fp8ops_lt_matrix_layout_destroy_fn MatrixLayoutDestroy;
  fp8ops_lt_pref_create_fn MatmulPreferenceCreate;
  fp8ops_lt_pref_destroy_fn MatmulPreferenceDestroy;
  fp8ops_lt_pref_set_attribute_fn MatmulPreferenceSetAttribute;
  fp8ops_lt_algo_get_heuristic_fn MatmulAlgoGetHeuristic;
  fp8ops_lt_matmul_fn Matmul;
} g_lt;

#define FP8OPS_STR_(x) #x
#define FP8OPS_STR(x) FP8OPS_STR_(x)
#define FP8OPS_LT_SONAME "libcublasLt.so." FP8OPS_STR(CUBLAS_VER_MAJOR)

static pthread_mutex_t g_init_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_int g_lt_ready; /* 1 once g_lt is complete (release/acquire) */

/* Check a cuBLASLt call; TE-shaped message. Sets `rc` and jumps to the function's
 * `done:` label, where whatever was created is released. Only used after g_lt is
 * loaded (the message comes from cublasLtGetStatusString). */
#define FP8OPS_CHECK_CUBLAS(expr)                                                              \
  do {                                                                                         \
    cublasStatus_t fp8ops_st_ = (expr);                                                        \
    if (fp8ops_st_ != CUBLAS_STATUS_SUCCESS) {                                                 \
      rc = fp8ops_set_error(FP8OPS_ERR_CUBLAS, "%s:%d in function %s: cuBLAS Error: %s (%s)", \
                            __FILE__, __LINE__, __func__, g_lt.GetStatusString(fp8ops_st_),    \
                            #expr);                                                            \
      goto done;                                                                               \
    }                                                                                          \
  } while (0)

/* Resolve one symbol into g_lt; on failure record why and jump to `fail`. */
#define FP8OPS_LT_LOAD(field, name)                                                          \
  do {                                                                                       \
    void* fp8ops_p_ = dlsym(lib, name);                                                      \
    if (fp8ops_p_ == NULL) {                                                                 \
      rc = fp8ops_set_error(FP8OPS_ERR_UNSUPPORTED,                                          \
                            "fp8ops: %s is loaded but has no symbol %s (%s); fp8ops needs "  \
                            "cuBLASLt %d.x",                                                 \
                            soname, name, dlerror(), CUBLAS_VER_MAJOR);                      \
      goto fail;                                                                             \
    }                                                                                        \
    memcpy(&g_lt.field, &fp8ops_p_, sizeof fp8ops_p_);                                      \
  } while (0)

int fp8ops_cublaslt_init(void) {
  if (atomic_load_explicit(&g_lt_ready, memory_order_acquire)) return FP8OPS_OK;
  int rc = FP8OPS_OK;
  pthread_mutex_lock(&g_init_lock);
  if (atomic_load_explicit(&g_lt_ready, memory_order_relaxed)) goto out;

  /* Failures are not cached: torch may load cuBLASLt after a first failed try. */
  const char* soname = FP8OPS_LT_SONAME;
  void* lib = dlopen(soname, RTLD_NOLOAD | RTLD_LAZY);
  if (lib == NULL) {
    soname = "libcublasLt.so";
    lib = dlopen(soname, RTLD_NOLOAD | RTLD_LAZY);
  }
  if (lib == NULL) {
    rc = fp8ops_set_error(FP8OPS_ERR_UNSUPPORTED,
                          "fp8ops: cuBLASLt (%s) is not loaded in this process, so the CUDA FP8 "
                          "GEMM is unavailable. fp8ops uses the copy that a CUDA build of torch "
                          "loads; import torch (a CUDA %d build) before fp8ops. A CPU-only torch "
                          "has no cuBLASLt.",
                          FP8OPS_LT_SONAME, CUBLAS_VER_MAJOR);
    goto out;
  }

  FP8OPS_LT_LOAD(GetVersion, "cublasLtGetVersion");
  {
    size_t ver = g_lt.GetVersion(); /* major * 10000 + minor * 100 + patch */
    if ((int)(ver / 10000) != CUBLAS_VER_MAJOR) {
      rc = fp8ops_set_error(FP8OPS_ERR_UNSUPPORTED,
                            "fp8ops: the loaded cuBLASLt (%s) is version %zu.%zu.%zu, but fp8ops "
                            "was built against cuBLAS %d.%d; rebuild fp8ops for this torch",
                            soname, ver / 10000, (ver / 100) % 100, ver % 100, CUBLAS_VER_MAJOR,
                            CUBLAS_VER_MINOR);
      goto fail;
    }
  }
  FP8OPS_LT_LOAD(GetStatusString, "cublasLtGetStatusString");
  FP8OPS_LT_LOAD(Create, "cublasLtCreate");
  FP8OPS_LT_LOAD(MatmulDescCreate, "cublasLtMatmulDescCreate");
  FP8OPS_LT_LOAD(MatmulDescDestroy, "cublasLtMatmulDescDestroy");
  FP8OPS_LT_LOAD(MatmulDescSetAttribute, "cublasLtMatmulDescSetAttribute");
  FP8OPS_LT_LOAD(MatrixLayoutCreate, "cublasLtMatrixLayoutCreate");
  FP8OPS_LT_LOAD(MatrixLayoutDestroy, "cublasLtMatrixLayoutDestroy");
  FP8OPS_LT_LOAD(MatmulPreferenceCreate, "cublasLtMatmulPreferenceCreate");
  FP8OPS_LT_LOAD(MatmulPreferenceDestroy, "cublasLtMatmulPreferenceDestroy");
  FP8OPS_LT_LOAD(MatmulPreferenceSetAttribute, "cublasLtMatmulPreferenceSetAttribute");
  FP8OPS_LT_LOAD(MatmulAlgoGetHeuristic, "cublasLtMatmulAlgoGetHeuristic");
  FP8OPS_LT_LOAD(Matmul, "cublasLtMatmul");
  /* The NOLOAD handle holds a reference: keep it for the life of the process. */
  atomic_store_explicit(&g_lt_ready, 1, memory_order_release);
  goto out;

fail:
  dlclose(lib);
  memset(&g_lt, 0, sizeof g_lt);
out:
  pthread_mutex_unlock(&g_init_lock);
  return rc;
}

// ----------------------------------------------------------------------------
// devices: capability, handle

#define FP8OPS_MAX_DEVICES 64

/* Cached per device: ops.c asks on every GEMM call. Racing writers store the same value. */
static int g_cc[FP8OPS_MAX_DEVICES];

int fp8ops_device_capability(int device, int* cc) {
  FP8OPS_REQUIRE(cc != NULL, "fp8ops_device_capability: cc must not be NULL");
  FP8OPS_REQUIRE(device >= 0, "fp8ops_device_capability: device must be >= 0 (got %d)", device);
  if (device < FP8OPS_MAX_DEVICES && (*cc = __atomic_load_n(&g_cc[device], __ATOMIC_RELAXED)) > 0)
    return FP8OPS_OK;
  int major = 0, minor = 0;
  FP8OPS_CHECK_CUDA(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FP8OPS_CHECK_CUDA(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  *cc = major * 10 + minor;
  if (device < FP8OPS_MAX_DEVICES) __atomic_store_n(&g_cc[device], *cc, __ATOMIC_RELAXED);
  return FP8OPS_OK;
}

/* Hopper's best FP8 kernels want 32 MiB (torch and TE use the same on sm_90); the
 * caller allocates it from torch's caching allocator, so one size for all is fine. */
size_t fp8ops_gemm_workspace_bytes(void) { return (size_t)32 << 20; }

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* g_dev, g_cache, g_tick */

static struct {
  cublasLtHandle_t handle; /* NULL = not created yet */
} g_dev[FP8OPS_MAX_DEVICES];

/* Under g_lock: capability check (cached) and the device's handle (created once). */
static int device_handle_locked(int device, cublasLtHandle_t* handle) {
  int rc = FP8OPS_OK;
  int cc = 0;
  FP8OPS_TRY(fp8ops_device_capability(device, &cc)); /* cached */
  if (cc < 89)
    return fp8ops_set_error(FP8OPS_ERR_UNSUPPORTED,
                            "FP8 GEMM needs a GPU of compute capability 8.9 or newer (sm_89 Ada, "
                            "sm_90 Hopper, ...); device %d is sm_%d%d",
                            device, cc / 10, cc % 10);
  int prev = -1;
  if (g_dev[device].handle == NULL) {
    /* A cuBLASLt context belongs to the device current at creation. */
    FP8OPS_CHECK_CUDA(cudaGetDevice(&prev));
    if (prev == device) prev = -1;
    else FP8OPS_CHECK_CUDA(cudaSetDevice(device));
    FP8OPS_CHECK_CUBLAS(g_lt.Create(&g_dev[device].handle));
  }
  *handle = g_dev[device].handle;
done:
  if (prev >= 0) { /* put the caller's device back */
    cudaError_t e = cudaSetDevice(prev);
    if (e != cudaSuccess && rc == FP8OPS_OK)
      rc = fp8ops_set_error(FP8OPS_ERR_CUDA, "%s:%d in function %s: CUDA Error: %s (%s)",
                            __FILE__, __LINE__, __func__, cudaGetErrorString(e),
                            "cudaSetDevice(prev)");
  }
  return rc;
}

// ----------------------------------------------------------------------------
// layout + algo cache

#define FP8OPS_GEMM_CACHE_SLOTS 256 /* power of two */
#define FP8OPS_GEMM_CACHE_PROBE 8

typedef struct {
  int32_t device;
  int32_t a_fmt, b_fmt, out_dtype;
  int64_t M, N, K;
  uint64_t workspace_bytes;
  int32_t has_bias, fast_accum;
  /* pointer alignments (bytes, 16..256) the algo was chosen for */
  int32_t align_a, align_b, align_out, align_bias;
} gemm_key;

typedef struct {
  int valid;
  int in_use;        /* calls using the layouts outside the lock */
  uint64_t last_use; /* g_tick at the last hit */
  uint64_t hash;
  gemm_key key;
  cublasLtMatrixLayout_t lay_a, lay_b, lay_out; /* cuBLAS A (= b), B (= a), C = D (= out) */
  cublasLtMatmulAlgo_t algo;
} gemm_entry;

static gemm_entry g_cache[FP8OPS_GEMM_CACHE_SLOTS];
static uint64_t g_tick;

static uint64_t key_hash(const gemm_key* k) { /* FNV-1a over the (zero-padded) key */
  const unsigned char* p = (const unsigned char*)k;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < sizeof *k; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

/* Largest power of two dividing the address, capped at 256 (cuBLASLt's default
 * assumption; a smaller value makes the heuristic pick kernels that tolerate it). */
static int32_t ptr_alignment(const void* p) {
  uintptr_t a = (uintptr_t)p;
  int32_t al = 256;
  while (al > 1 && (a & (uintptr_t)(al - 1)) != 0) al >>= 1;
  return al;
}

/* rc, or (rc being FP8OPS_OK) the error of a failed cuBLASLt destroy: the first error wins */
static int lt_destroyed(int rc, cublasStatus_t st, const char* what) {
  if (st == CUBLAS_STATUS_SUCCESS || rc != FP8OPS_OK) return rc;
  return fp8ops_set_error(FP8OPS_ERR_CUBLAS, "fp8ops gemm: %s failed: %s", what,
                          g_lt.GetStatusString(st));
}

/* Destroys e's layouts (all of them, whatever fails); the first failure's status. */
static cublasStatus_t entry_release_layouts(gemm_entry* e) {
  cublasLtMatrixLayout_t lay[3] = {e->lay_a, e->lay_b, e->lay_out};
  cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
  for (int i = 0; i < 3; ++i) {
    const cublasStatus_t s = lay[i] ? g_lt.MatrixLayoutDestroy(lay[i]) : CUBLAS_STATUS_SUCCESS;
    if (st == CUBLAS_STATUS_SUCCESS) st = s;
  }
  e->lay_a = e->lay_b = e->lay_out = NULL;
  e->valid = 0;
  return st;
}

static cudaDataType_t fp8_type(int fmt) {
  return fmt == FP8OPS_E5M2 ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
}

static cudaDataType_t hp_type(int dtype) {
  return dtype == FP8OPS_F32 ? CUDA_R_32F : dtype == FP8OPS_BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

static const char* fmt_name(int fmt) { return fmt == FP8OPS_E5M2 ? "e5m2" : "e4m3"; }

static const char* hp_name(int dtype) {
  return dtype == FP8OPS_F32 ? "fp32" : dtype == FP8OPS_BF16 ? "bf16" : "fp16";
}

/* Build the layouts and run the heuristic for `e->key` with this call's descriptor
 * (whose non-pointer attributes are what the key describes). On failure the entry is
 * left invalid with nothing allocated. */
static int entry_build(gemm_entry* e, cublasLtHandle_t handle, cublasLtMatmulDesc_t desc) {
  int rc = FP8OPS_OK;
  const gemm_key* k = &e->key;
  cublasLtMatmulPreference_t pref = NULL;
  e->lay_a = e->lay_b = e->lay_out = NULL;

  /* Column-major view: cuBLAS A = b stored [K rows, N cols] ld K, op T -> [N, K];
   * cuBLAS B = a stored [K, M] ld K, op N; D = [N, M] ld N = row-major out [M, N]. */
  FP8OPS_CHECK_CUBLAS(g_lt.MatrixLayoutCreate(&e->lay_a, fp8_type(k->b_fmt), (uint64_t)k->K,
                                              (uint64_t)k->N, k->K));
  FP8OPS_CHECK_CUBLAS(g_lt.MatrixLayoutCreate(&e->lay_b, fp8_type(k->a_fmt), (uint64_t)k->K,
                                              (uint64_t)k->M, k->K));
  /* C type = D type for bf16/fp16/fp32 outputs (cuBLASLt's FP8 table asks C to be
   * bf16/fp16 only when D is fp8, which fp8ops never produces). */
  FP8OPS_CHECK_CUBLAS(g_lt.MatrixLayoutCreate(&e->lay_out, hp_type(k->out_dtype), (uint64_t)k->N,
                                              (uint64_t)k->M, k->N));

  FP8OPS_CHECK_CUBLAS(g_lt.MatmulPreferenceCreate(&pref));
  {
    const uint64_t ws = k->workspace_bytes;
    const uint32_t al_a = (uint32_t)k->align_b, al_b = (uint32_t)k->align_a;
    const uint32_t al_cd = (uint32_t)k->align_out;
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_cd, sizeof al_cd));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulPreferenceSetAttribute(
        pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_cd, sizeof al_cd));
  }

  {
    cublasLtMatmulHeuristicResult_t res;
    int n = 0;
    memset(&res, 0, sizeof res);
    cublasStatus_t st = g_lt.MatmulAlgoGetHeuristic(handle, desc, e->lay_a, e->lay_b, e->lay_out,
                                                    e->lay_out, pref, 1, &res, &n);
    if (st == CUBLAS_STATUS_SUCCESS && n > 0 && res.state == CUBLAS_STATUS_SUCCESS) {
      e->algo = res.algo;
    } else {
      const cublasStatus_t why = st != CUBLAS_STATUS_SUCCESS ? st
                                 : n > 0                     ? res.state
                                                             : CUBLAS_STATUS_NOT_SUPPORTED;
      rc = fp8ops_set_error(
          why == CUBLAS_STATUS_NOT_SUPPORTED ? FP8OPS_ERR_UNSUPPORTED : FP8OPS_ERR_CUBLAS,
          "%s:%d in function %s: cuBLASLt found no FP8 GEMM algorithm for M=%lld N=%lld "
          "K=%lld a=%s b=%s out=%s bias=%s fast_accum=%d workspace=%llu bytes "
          "(alignment a=%d b=%d out=%d bias=%d) on device %d: %s",
          __FILE__, __LINE__, __func__, (long long)k->M, (long long)k->N, (long long)k->K,
          fmt_name(k->a_fmt), fmt_name(k->b_fmt), hp_name(k->out_dtype),
          k->has_bias ? hp_name(fp8ops_gemm_bias_dtype((fp8ops_hp_dtype)k->out_dtype)) : "none",
          k->fast_accum, (unsigned long long)k->workspace_bytes, k->align_a, k->align_b,
          k->align_out, k->align_bias, k->device,
          n > 0 || st != CUBLAS_STATUS_SUCCESS ? g_lt.GetStatusString(why) : "0 results");
      goto done;
    }
  }
  e->valid = 1;
done:
  if (pref) rc = lt_destroyed(rc, g_lt.MatmulPreferenceDestroy(pref), "cublasLtMatmulPreferenceDestroy");
  if (rc != FP8OPS_OK) rc = lt_destroyed(rc, entry_release_layouts(e), "cublasLtMatrixLayoutDestroy");
  return rc;
}

/* Under g_lock: the entry for `key` (built if missing), with in_use taken. When every
 * probed slot is busy, `*tmp` is built and returned instead (the caller frees it). */
static int cache_acquire_locked(const gemm_key* key, cublasLtHandle_t handle,
                                cublasLtMatmulDesc_t desc, gemm_entry* tmp, gemm_entry** out) {
  const uint64_t h = key_hash(key);
  gemm_entry* victim = NULL;
  ++g_tick;
  for (int i = 0; i < FP8OPS_GEMM_CACHE_PROBE; ++i) {
    gemm_entry* e = &g_cache[(h + (uint64_t)i) & (FP8OPS_GEMM_CACHE_SLOTS - 1)];
    if (e->valid && e->hash == h && memcmp(&e->key, key, sizeof *key) == 0) {
      e->in_use++;
      e->last_use = g_tick;
      *out = e;
      return FP8OPS_OK;
    }
    if (e->in_use == 0 && (victim == NULL || (victim->valid && (!e->valid ||
                                                                e->last_use < victim->last_use))))
      victim = e;
  }
  gemm_entry* e = victim ? victim : tmp;
  if (e->valid)
    FP8OPS_TRY(lt_destroyed(FP8OPS_OK, entry_release_layouts(e), "cublasLtMatrixLayoutDestroy"));
  memset(e, 0, sizeof *e);
  e->key = *key;
  e->hash = h;
  FP8OPS_TRY(entry_build(e, handle, desc));
  e->in_use = 1;
  e->last_use = g_tick;
  *out = e;
  return FP8OPS_OK;
}

// ----------------------------------------------------------------------------
// the GEMM

#define FP8OPS_GEMM_REQUIRE_DIM(name, v)                                                      \
  FP8OPS_REQUIRE((v) > 0 && (v) % 16 == 0,                                                    \
                 name " must be a multiple of 16 for FP8 GEMM (got %lld); pad or exclude this " \
                      "layer via module_filter_fn",                                           \
                 (long long)(v))

#define FP8OPS_GEMM_REQUIRE_ALIGNED(name, p)                                                   \
  FP8OPS_REQUIRE(((uintptr_t)(p) & 15u) == 0,                                                  \
                 "FP8 GEMM: " name " must be 16-byte aligned (address %p); pass a contiguous " \
                 "tensor that does not start at an offset (e.g. .contiguous().clone())",        \
                 (const void*)(p))

int fp8ops_gemm_cuda(const uint8_t* a, fp8ops_fp8_format a_fmt, const uint8_t* b,
                     fp8ops_fp8_format b_fmt, int64_t M, int64_t N, int64_t K,
                     const float* a_scale_inv, const float* b_scale_inv, const void* bias,
                     fp8ops_hp_dtype out_dtype, void* out, int fast_accum, void* workspace,
                     size_t workspace_bytes, int device, void* stream) {
  /* -- validate (no library or device needed) -- */
  FP8OPS_REQUIRE(a_fmt == FP8OPS_E4M3 || a_fmt == FP8OPS_E5M2,
                 "FP8 GEMM: a_fmt must be e4m3 (0) or e5m2 (1) (got %d)", (int)a_fmt);
  FP8OPS_REQUIRE(b_fmt == FP8OPS_E4M3 || b_fmt == FP8OPS_E5M2,
                 "FP8 GEMM: b_fmt must be e4m3 (0) or e5m2 (1) (got %d)", (int)b_fmt);
  FP8OPS_REQUIRE(!(a_fmt == FP8OPS_E5M2 && b_fmt == FP8OPS_E5M2),
                 "FP8 GEMM: e5m2 x e5m2 is not supported by cuBLASLt; one operand must be e4m3 "
                 "(supported (a, b): (e4m3, e4m3), (e5m2, e4m3), (e4m3, e5m2))");
  FP8OPS_REQUIRE(out_dtype == FP8OPS_F32 || out_dtype == FP8OPS_BF16 || out_dtype == FP8OPS_F16,
                 "FP8 GEMM: out_dtype must be fp32 (0), bf16 (1) or fp16 (2) (got %d)",
                 (int)out_dtype);
  FP8OPS_GEMM_REQUIRE_DIM("M", M);
  FP8OPS_GEMM_REQUIRE_DIM("N", N);
  FP8OPS_GEMM_REQUIRE_DIM("K", K);
  FP8OPS_REQUIRE(M <= INT32_MAX && N <= INT32_MAX && K <= INT32_MAX,
                 "FP8 GEMM: M, N, K must each be below 2^31 (got M=%lld N=%lld K=%lld)",
                 (long long)M, (long long)N, (long long)K);
  FP8OPS_REQUIRE(a != NULL && b != NULL && out != NULL,
                 "FP8 GEMM: a, b and out must not be NULL");
  FP8OPS_REQUIRE(a_scale_inv != NULL && b_scale_inv != NULL,
                 "FP8 GEMM: a_scale_inv and b_scale_inv must not be NULL (one fp32 each, on "
                 "the device)");
  FP8OPS_GEMM_REQUIRE_ALIGNED("a", a);
  FP8OPS_GEMM_REQUIRE_ALIGNED("b", b);
  FP8OPS_GEMM_REQUIRE_ALIGNED("out", out);
  if (bias) FP8OPS_GEMM_REQUIRE_ALIGNED("bias", bias);
  FP8OPS_REQUIRE(((uintptr_t)a_scale_inv & 3u) == 0 && ((uintptr_t)b_scale_inv & 3u) == 0,
                 "FP8 GEMM: a_scale_inv and b_scale_inv must be 4-byte aligned fp32");
  FP8OPS_REQUIRE(workspace != NULL || workspace_bytes == 0,
                 "FP8 GEMM: workspace is NULL but workspace_bytes is %zu", workspace_bytes);
  FP8OPS_REQUIRE(device >= 0 && device < FP8OPS_MAX_DEVICES,
                 "FP8 GEMM: device must be in [0, %d) (got %d)", FP8OPS_MAX_DEVICES, device);

  /* cuBLASLt wants a 256-byte aligned workspace: round the start up, shrink the size. */
  if (workspace != NULL) {
    const uintptr_t w = (uintptr_t)workspace, w_al = (w + 255u) & ~(uintptr_t)255u;
    if (w_al - w >= workspace_bytes) {
      workspace_bytes = 0;
    } else {
      workspace_bytes -= (size_t)(w_al - w);
      workspace_bytes &= ~(size_t)255u;
    }
    workspace = workspace_bytes ? (void*)w_al : NULL;
  }

  /* cuBLASLt answers NOT_SUPPORTED at cublasLtMatmul (after a heuristic that
   * succeeded) when a scale pointer is not 16-byte aligned -- seen on H100 with
   * cuBLASLt 13.1 for a scale_inv view at a 4-byte offset. Callers pass views
   * of per-layer [3] buffers, so the first 256 bytes of the workspace are kept
   * for aligned copies of the scales (stream-ordered, graph-capturable). */
  FP8OPS_REQUIRE(workspace != NULL && workspace_bytes >= 512,
                 "FP8 GEMM: workspace must hold at least 512 bytes (got %zu); use "
                 "fp8ops_gemm_workspace_bytes()", workspace_bytes);
  {
    float* slots = (float*)workspace; /* [0] = a_scale_inv, [4] = b_scale_inv */
    if (((uintptr_t)a_scale_inv & 15u) != 0) {
      FP8OPS_CHECK_CUDA(cudaMemcpyAsync(slots, a_scale_inv, sizeof(float), cudaMemcpyDeviceToDevice,
                                        (cudaStream_t)stream));
      a_scale_inv = slots;
    }
    if (((uintptr_t)b_scale_inv & 15u) != 0) {
      FP8OPS_CHECK_CUDA(cudaMemcpyAsync(slots + 4, b_scale_inv, sizeof(float),
                                        cudaMemcpyDeviceToDevice, (cudaStream_t)stream));
      b_scale_inv = slots + 4;
    }
    workspace = (char*)workspace + 256;
    workspace_bytes -= 256;
  }

  FP8OPS_TRY(fp8ops_cublaslt_init());

  int rc = FP8OPS_OK;
  cublasLtHandle_t handle = NULL;
  cublasLtMatmulDesc_t desc = NULL;
  gemm_entry tmp;
  gemm_entry* e = NULL;
  memset(&tmp, 0, sizeof tmp);

  pthread_mutex_lock(&g_lock);
  rc = device_handle_locked(device, &handle);
  pthread_mutex_unlock(&g_lock);
  if (rc != FP8OPS_OK) return rc;

  /* -- this call's descriptor (holds this call's pointers, so never shared) -- */
  FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  {
    const int32_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    const void* scale_a = b_scale_inv; /* cuBLAS A is our b */
    const void* scale_b = a_scale_inv; /* cuBLAS B is our a */
    const int8_t fast = fast_accum ? 1 : 0;
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa,
                                                    sizeof transa));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb,
                                                    sizeof transb));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                    &scale_a, sizeof scale_a));
    FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                    &scale_b, sizeof scale_b));
    FP8OPS_CHECK_CUBLAS(
        g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast));
    if (bias) {
      /* FP8 bias epilogue: bf16 bias for an fp32 output, else the output's type. */
      const uint32_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      const int32_t bias_type = (int32_t)hp_type(fp8ops_gemm_bias_dtype(out_dtype));
      FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE,
                                                      &epilogue, sizeof epilogue));
      FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                      &bias, sizeof bias));
      FP8OPS_CHECK_CUBLAS(g_lt.MatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                      &bias_type, sizeof bias_type));
    }
  }

  /* -- layouts + algo: cached -- */
  {
    gemm_key key;
    memset(&key, 0, sizeof key); /* padding takes part in hash and memcmp */
    key.device = device;
    key.a_fmt = (int32_t)a_fmt;
    key.b_fmt = (int32_t)b_fmt;
    key.out_dtype = (int32_t)out_dtype;
    key.M = M;
    key.N = N;
    key.K = K;
    key.workspace_bytes = (uint64_t)workspace_bytes;
    key.has_bias = bias != NULL;
    key.fast_accum = fast_accum ? 1 : 0;
    key.align_a = ptr_alignment(a);
    key.align_b = ptr_alignment(b);
    key.align_out = ptr_alignment(out);
    key.align_bias = bias ? ptr_alignment(bias) : 0;
    pthread_mutex_lock(&g_lock);
    rc = cache_acquire_locked(&key, handle, desc, &tmp, &e);
    pthread_mutex_unlock(&g_lock);
    if (rc != FP8OPS_OK) {
      e = NULL;
      goto done;
    }
  }

  /* -- the call: D = 1 * op(A) op(B) (+ bias), scaled by the A/B scale pointers -- */
  {
    const float alpha = 1.0f, beta = 0.0f;
    FP8OPS_CHECK_CUBLAS(g_lt.Matmul(handle, desc, &alpha, b, e->lay_a, a, e->lay_b, &beta, out,
                                    e->lay_out, out, e->lay_out, &e->algo, workspace,
                                    workspace_bytes, (cudaStream_t)stream));
    const size_t out_elem = out_dtype == FP8OPS_F32 ? 4 : 2;
    fp8ops_mark_initialized(out, (size_t)M * (size_t)N * out_elem, stream);
  }

done:
  if (e != NULL) {
    if (e == &tmp) {
      rc = lt_destroyed(rc, entry_release_layouts(&tmp), "cublasLtMatrixLayoutDestroy");
    } else {
      pthread_mutex_lock(&g_lock);
      e->in_use--;
      pthread_mutex_unlock(&g_lock);
    }
  }
  if (desc) rc = lt_destroyed(rc, g_lt.MatmulDescDestroy(desc), "cublasLtMatmulDescDestroy");
  return rc;
}
