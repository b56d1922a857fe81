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

/* The slots noted since the last take: in order in g_slots (g_pos: where each sits in g_table),
 * and in g_table, open addressing with linear probing (0: empty), so that a note costs O(1) with
 * thousands of layers (a scan of the list cost 6 ms per backward at 4000 layers). Half full at
 * most: FP8OPS_AMAX_WRITES_MAX entries in twice as many cells. */
#define TABLE_BITS 13
#define TABLE_CELLS (1 << TABLE_BITS)
_Static_assert(TABLE_CELLS >= 2 * FP8OPS_AMAX_WRITES_MAX, "the table must stay half empty");

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* all below */
static uintptr_t g_table[TABLE_CELLS];
static uintptr_t g_slots[FP8OPS_AMAX_WRITES_MAX];
static uint32_t g_pos[FP8OPS_AMAX_WRITES_MAX];
static int g_count;
static int g_every; /* sticky: a capture, a record too long, or a failed query */

/* Is `stream` (a cudaStream_t; NULL: the CPU, or the legacy default stream, which
 * cannot capture) being captured? A failed query counts as yes. */
static int capturing(void* stream) {
#ifdef FP8OPS_WITH_CUDA
  if (!stream) return 0;
  enum cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing((cudaStream_t)stream, &status) != cudaSuccess) {
    (void)cudaGetLastError(); /* (not left for the op's next launch check to report) */
    return 1;
  }
  return status != cudaStreamCaptureStatusNone;
#else
  (void)stream;
  return 0;
#endif
}

void fp8ops_note_amax_write(const void* slot, void* stream) {
  const int captured = capturing(stream);
  const uintptr_t key = (uintptr_t)slot;
  pthread_mutex_lock(&g_lock);
  if (captured || !key) {
    g_every = 1;
  } else if (!g_every) {
    /* Fibonacci hashing of the address (its low bits are alignment) */
    uint32_t i = (uint32_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> (64 - TABLE_BITS));
    while (g_table[i] && g_table[i] != key) i = (i + 1) & (TABLE_CELLS - 1);
    if (!g_table[i]) {
      if (g_count < FP8OPS_AMAX_WRITES_MAX) {
        g_table[i] = key;
        g_pos[g_count] = i;
        g_slots[g_count++] = key;
      } else {
        g_every = 1;
      }
    }
  }
  pthread_mutex_unlock(&g_lock);
}

int fp8ops_take_amax_writes(uintptr_t out[FP8OPS_AMAX_WRITES_MAX], int* count) {
  pthread_mutex_lock(&g_lock);
  const int every = g_every;
  *count = every ? 0 : g_count;
  for (int i = 0; i < g_count; ++i) {
    if (!every) out[i] = g_slots[i];
    g_table[g_pos[i]] = 0; /* (every entry goes: no probe chain is left broken) */
  }
  g_count = 0;
  pthread_mutex_unlock(&g_lock);
  return every;
}
