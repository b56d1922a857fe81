/*
 * sanitizer_marks.c -- tells compute-sanitizer's initcheck which bytes cuBLASLt
 * wrote, through the NVTX memory API (header-only NVTX v3; with no tool attached
 * each call is one predictable branch on a null function pointer).
 *
 * Why: initcheck does not see how some of cuBLASLt's FP8 kernels store their output
 * (on H100 the fp32-with-bias and the Fp8Linear configurations; torch's own
 * _scaled_mm picks other algorithms for the same shapes and is not flagged; torch's
 * BF16 nn.Linear is flagged the same way: benchmarks/dev/initcheck_bf16_control.py), so
 * a torch kernel that later reads the GEMM's output is reported as reading
 * uninitialized memory. tests/test_gemm.py::test_gemm_writes_every_output_element
 * fills the output block with NaN before each flagged configuration and finds every
 * element written; that test, not this mark, is what shows the output complete.
 * The mark is issued only after cublasLtMatmul returned success, and covers exactly
 * the M x N output. Run compute-sanitizer with --nvtx yes for it to take effect.
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stddef.h>

#include <cuda_runtime_api.h>
#include <nvtx3/nvToolsExtMemCudaRt.h>

#include "fp8ops.h"

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static nvtxDomainHandle_t g_domain;

static void create_domain(void) { g_domain = nvtxDomainCreateA("fp8ops"); }

void fp8ops_mark_initialized(const void* ptr, size_t bytes, void* stream) {
  if (ptr == NULL || bytes == 0) return;
  pthread_once(&g_once, create_domain);
  nvtxMemVirtualRangeDesc_t range;
  range.size = bytes;
  range.ptr = ptr;
  nvtxMemMarkInitializedBatch_t batch;
  batch.extCompatID = NVTX_EXT_COMPATID_MEM;
  batch.structSize = sizeof batch;
  batch.regionType = NVTX_MEM_TYPE_VIRTUAL_ADDRESS;
  batch.regionDescCount = 1;
  batch.regionDescElementSize = sizeof range;
  batch.regionDescElements = &range;
  nvtxMemCudaMarkInitialized(g_domain, (cudaStream_t)stream, 0, &batch);
}
