/*
 * torch_abi.h -- C declarations of the libtorch stable C shim functions fp8ops
 * calls. The shim headers are C++ (using-aliases, c10 types), but every function
 * here has extern "C" linkage and takes opaque handles, so plain C can declare
 * and call them.
 *
 * Copied by hand from torch 2.11.0's torch/csrc/inductor/aoti_torch/c/shim.h and
 * torch/csrc/stable/c/shim.h. The symbol set is the real compatibility contract
 * (the module is dlopen'ed with RTLD_NOW): everything below exists in libtorch
 * 2.10 and later (torch_library_impl, torch_get_{mutable,const}_data_ptr are the
 * 2.10 additions; the rest predates 2.10). Raise FP8OPS_TORCH_MIN_VERSION if
 * you add a newer symbol.
 *
 * Ownership: a boxed kernel owns its input handles and must delete them; the
 * handles it writes to the stack as outputs are new references libtorch takes.
 */
#ifndef FP8OPS_TORCH_ABI_H
#define FP8OPS_TORCH_ABI_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FP8OPS_TORCH_MIN_VERSION "2.10"
/* libtorch's version encoding: (major << 56) | (minor << 48) | (patch << 40) */
#define FP8OPS_TORCH_VERSION_2_10_0 0x020A000000000000ULL
/* The version whose StableIValue conventions our boxed kernels follow. */
#define FP8OPS_TORCH_BUILD_VERSION FP8OPS_TORCH_VERSION_2_10_0

typedef int32_t AOTITorchError;
#define AOTI_TORCH_SUCCESS 0

typedef struct AtenTensorOpaque* AtenTensorHandle;
typedef struct TorchLibraryOpaque* TorchLibraryHandle;
typedef struct DeviceGuardOpaque* DeviceGuardHandle;
typedef uint64_t StableIValue;
typedef void (*fp8ops_boxed_fn)(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);

/* versions, dtypes, devices */
uint64_t aoti_torch_abi_version(void);
int32_t aoti_torch_dtype_float8_e5m2(void);
int32_t aoti_torch_dtype_float8_e4m3fn(void);
int32_t aoti_torch_dtype_bfloat16(void);
int32_t aoti_torch_dtype_float16(void);
int32_t aoti_torch_dtype_float32(void);
int32_t aoti_torch_dtype_float64(void);
int32_t aoti_torch_dtype_uint8(void);
int32_t aoti_torch_dtype_int32(void);
int32_t aoti_torch_dtype_int64(void);
int32_t aoti_torch_dtype_bool(void);
/* (only to name them in error messages) */
int32_t aoti_torch_dtype_float8_e5m2fnuz(void);
int32_t aoti_torch_dtype_float8_e4m3fnuz(void);
int32_t aoti_torch_dtype_int8(void);
int32_t aoti_torch_dtype_int16(void);
int32_t aoti_torch_dtype_complex64(void);
int32_t aoti_torch_dtype_complex128(void);
int32_t aoti_torch_device_type_cpu(void);
int32_t aoti_torch_device_type_cuda(void);

/* tensor metadata (sizes/strides pointers are borrowed) */
AOTITorchError aoti_torch_get_dim(AtenTensorHandle t, int64_t* ret);
AOTITorchError aoti_torch_get_numel(AtenTensorHandle t, int64_t* ret);
AOTITorchError aoti_torch_get_sizes(AtenTensorHandle t, int64_t** ret);
AOTITorchError aoti_torch_get_strides(AtenTensorHandle t, int64_t** ret);
AOTITorchError aoti_torch_get_dtype(AtenTensorHandle t, int32_t* ret);
AOTITorchError aoti_torch_get_device_type(AtenTensorHandle t, int32_t* ret);
AOTITorchError aoti_torch_get_device_index(AtenTensorHandle t, int32_t* ret);
AOTITorchError aoti_torch_is_contiguous(AtenTensorHandle t, bool* ret);
AOTITorchError aoti_torch_is_defined(AtenTensorHandle t, bool* ret);                 /* 2.9 */
AOTITorchError aoti_torch_get_storage_size(AtenTensorHandle t, int64_t* ret_nbytes);
AOTITorchError aoti_torch_get_storage_offset(AtenTensorHandle t, int64_t* ret);
AOTITorchError torch_get_mutable_data_ptr(AtenTensorHandle t, void** ret);           /* 2.10 */
AOTITorchError torch_get_const_data_ptr(AtenTensorHandle t, const void** ret);       /* 2.10 */

/* tensor lifetime */
AOTITorchError aoti_torch_empty_strided(int64_t ndim, const int64_t* sizes, const int64_t* strides,
                                        int32_t dtype, int32_t device_type, int32_t device_index,
                                        AtenTensorHandle* ret_new);
AOTITorchError aoti_torch_delete_tensor_object(AtenTensorHandle t);
AOTITorchError aoti_torch_clone(AtenTensorHandle self, AtenTensorHandle* ret_new);

/* device guard (device-generic, libtorch_cpu) */
AOTITorchError aoti_torch_create_device_guard(int32_t device_index, DeviceGuardHandle* ret);
AOTITorchError aoti_torch_delete_device_guard(DeviceGuardHandle g);

/* op registration; library handles must live for the whole process */
AOTITorchError aoti_torch_library_init_def(const char* ns, const char* file, uint32_t line,
                                           TorchLibraryHandle* ret);
AOTITorchError aoti_torch_library_init_impl(const char* ns, const char* dispatch_key,
                                            const char* file, uint32_t line,
                                            TorchLibraryHandle* ret);
AOTITorchError aoti_torch_library_def(TorchLibraryHandle self, const char* schema);
AOTITorchError torch_library_impl(TorchLibraryHandle self, const char* name, fp8ops_boxed_fn fn,
                                  uint64_t extension_build_version); /* 2.10 */

/* raise RuntimeError(msg) through the C frames (does not return when !cond) */
void aoti_torch_check(bool cond, const char* func, const char* file, uint32_t line,
                      const char* msg);

/* libtorch_cuda.so, not global: resolved with dlopen(RTLD_NOLOAD) + dlsym, never linked */
typedef AOTITorchError (*fp8ops_get_current_cuda_stream_fn)(int32_t device_index, void** ret_stream);

#ifdef __cplusplus
}
#endif
#endif /* FP8OPS_TORCH_ABI_H */
