/*
 * amax_writes.c -- which amax slots the ops with an undeclared amax write have
 * written since the Python package last asked: fp8ops::linear_bwd_sink and
 * linear_bwd_cat, compiled backwards' casts of dy into a layer's fp8_grad_amax.
 *
 * Why: at each optimizer step scaling.fold_grad_amax folds those slots into
 * the layers' histories. Without a record it must read every live layer's slot
 * (a few launches per step, and per layer that waits for its first update)
 * once any FP8 forward was compiled in the process, also for layers that ran
 * only eagerly or in BF16 since. With it, only the slots written are read.
 *
 * A write while its stream is being captured into a CUDA graph makes the answer
 * "every slot" for good: a replay runs no host code, so its writes would go
 * unrecorded. So does a record too long to keep (more distinct slots between two
 * questions than fit). Being told of a slot that was not written costs a read;
 * missing one would lose an amax, so every doubt answers "every slot".
 */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdint.h>

#include "fp8ops.h"

#ifdef FP8OPS_WITH_CUDA
#include <cuda_runtime.h>  // defines: cudaStreamIsCapturing
#endif

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* all below */
static uintptr_t g_slots[FP8OPS_AMAX_WRITES_MAX];
static int g_count;
static int g_every; /* sticky: a capture, a record too long, or a failed query */

/* Is `stream` (a cudaStream_t; NULL: the CPU, or the legacy default stream, which
 * cannot capture) being captured? A failed query counts as yes. */
static int capturing(void* stream) {
#ifdef FP8OPS_WITH_CUDA
  if (!stream) return 0;
  enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing((cudaStream_t)stream, &status) != cudaSuccess) return 1;
  return status != cudaStreamCaptureStatusNone;
#else
  (void)stream;
  return 0;
#endif
}

void fp8ops_note_amax_write(const void* slot, void* stream) {
  const int captured = capturing(stream);
  pthread_mutex_lock(&g_lock);
  if (captured) {
    g_every = 1;
  } else if (!g_every) {
    int i = 0;
    while (i < g_count && g_slots[i] != (uintptr_t)slot) ++i;
    if (i == g_count) {
      if (g_count < FP8OPS_AMAX_WRITES_MAX)
        g_slots[g_count++] = (uintptr_t)slot;
      else
        g_every = 1;
    }
  }
  pthread_mutex_unlock(&g_lock);
}

int fp8ops_take_amax_writes(uintptr_t out[FP8OPS_AMAX_WRITES_MAX], int* count) {
  pthread_mutex_lock(&g_lock);
  const int every = g_every;
  *count = every ? 0 : g_count;
  for (int i = 0; i < *count; ++i) out[i] = g_slots[i];
  g_count = 0;
  pthread_mutex_unlock(&g_lock);
  return every;
}
