/*
 * ops.h -- what module.c needs from ops.c: registering the dispatcher ops and
 * handing over torch's current-CUDA-stream getter.
 */
#ifndef FP8OPS_OPS_H
#define FP8OPS_OPS_H

#include "torch_abi.h"

/* Define fp8ops::* and register CPU kernels (and CUDA kernels if with_cuda). */
int fp8ops_register(int with_cuda);
/* aoti_torch_get_current_cuda_stream from libtorch_cuda.so, or NULL. */
void fp8ops_set_stream_getter(fp8ops_get_current_cuda_stream_fn fn);
/* amax_update of many histories on CUDA device `device`, on torch's current
 * stream there (the fast path of Fp8Linear's optimizer-step hook, called from
 * module.c without the dispatcher). */
int fp8ops_amax_update_many(int device, const fp8ops_amax_update_job* jobs, int64_t count);
/* Space-separated names of the registered ops. */
const char* fp8ops_op_names(void);

#endif /* FP8OPS_OPS_H */
