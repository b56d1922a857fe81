/*
 * ops.c -- the fp8ops dispatcher ops: boxed wrappers, the op table and
 * fp8ops_register(). Each wrapper unpacks the stack, validates every argument
 * (messages name the argument, expected vs found, and a remedy), allocates the
 * outputs through the shim, calls the fp8ops_* kernel for the device, releases
 * every handle it owns, and only then raises if something failed.
 *
 * Schemas (argument order of stack[]):
 *   cast(Tensor x, Tensor scale, ScalarType out_dtype, bool transpose)
 *       -> (Tensor out, Tensor out_t, Tensor amax)
 *   amax(Tensor x) -> Tensor
 *   amax_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv,
 *               Tensor fp8_max, float margin, int algo, Tensor(d!) overflow_count) -> ()
 *   gemm(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor bias,
 *        ScalarType out_dtype, bool use_fast_accum) -> Tensor
 *   cast_accumulate, linear_fwd, ln_linear_fwd(_res), linear_bwd, layernorm_bwd(_acc):
 *        Fp8Linear's fused calls (and its fused LayerNorm's backward), schemas
 *        at their wrappers below (cast + amax folded into a history slot + GEMMs).
 *   swiglu, swiglu_backward: the SwiGLU activation and its gradient.
 * `bias` is "absent" when it has no elements (schemas avoid T?, see STYLE.md).
 */
#include <dlfcn.h>
#include <float.h>
#include <stdio.h>
#include <string.h>

#include "common.h"
#include "ops.h"
#include "torch_abi.h"

// ----------------------------------------------------------------------------
// StableIValue decoding (torch 2.10 conventions)

static AtenTensorHandle sv_tensor(StableIValue v) { return (AtenTensorHandle)(uintptr_t)v; }
static StableIValue sv_from_tensor(AtenTensorHandle t) { return (StableIValue)(uintptr_t)t; }
static int32_t sv_i32(StableIValue v) { return (int32_t)(uint32_t)(v & 0xFFFFFFFFu); }
static int64_t sv_i64(StableIValue v) { int64_t r; memcpy(&r, &v, 8); return r; }
static double sv_f64(StableIValue v) { double r; memcpy(&r, &v, 8); return r; }
static bool sv_bool(StableIValue v) { return (v & 0xFFu) != 0; }

// ----------------------------------------------------------------------------
// CUDA plumbing resolved at import (see module.c)

static fp8ops_get_current_cuda_stream_fn g_get_stream;
void fp8ops_set_stream_getter(fp8ops_get_current_cuda_stream_fn fn) { g_get_stream = fn; }

// ----------------------------------------------------------------------------
// tensor descriptions and checks

typedef struct {
  AtenTensorHandle h;
  int32_t dtype, dev_type, dev_index;
  int64_t ndim, numel;
  int64_t sizes[8];
  int64_t elem; /* bytes per element (0: a dtype elem_size does not know) */
  bool contiguous;
  void* data;
} tinfo;

#define SHIM(call)                                                                       \
  do {                                                                                   \
    if ((call) != AOTI_TORCH_SUCCESS)                                                    \
      return fp8ops_set_error(FP8OPS_ERR_INVALID, "%s: internal error: shim call %s failed", \
                              op, #call);                                               \
  } while (0)

static const char* dtype_name(int32_t d) {
  if (d == aoti_torch_dtype_float32()) return "float32";
  if (d == aoti_torch_dtype_bfloat16()) return "bfloat16";
  if (d == aoti_torch_dtype_float16()) return "float16";
  if (d == aoti_torch_dtype_float8_e4m3fn()) return "float8_e4m3fn";
  if (d == aoti_torch_dtype_float8_e5m2()) return "float8_e5m2";
  if (d == aoti_torch_dtype_float64()) return "float64";
  if (d == aoti_torch_dtype_uint8()) return "uint8";
  if (d == aoti_torch_dtype_int32()) return "int32";
  if (d == aoti_torch_dtype_int64()) return "int64";
  if (d == aoti_torch_dtype_bool()) return "bool";
  if (d == aoti_torch_dtype_float8_e4m3fnuz()) return "float8_e4m3fnuz";
  if (d == aoti_torch_dtype_float8_e5m2fnuz()) return "float8_e5m2fnuz";
  if (d == aoti_torch_dtype_int8()) return "int8";
  if (d == aoti_torch_dtype_int16()) return "int16";
  if (d == aoti_torch_dtype_complex64()) return "complex64";
  if (d == aoti_torch_dtype_complex128()) return "complex128";
  return "another dtype (not a float type fp8ops takes)";
}

static const char* device_name(int32_t t) {
  if (t == aoti_torch_device_type_cpu()) return "cpu";
  if (t == aoti_torch_device_type_cuda()) return "cuda";
  return "another device";
}

/* "[2, 3]" into buf, which it returns. Called only where a message is written (inside
 * FP8OPS_REQUIRE's arguments, which run when the check fails): formatting costs host time that
 * small layers, bound by the host, would pay on every call. */
static const char* shape_str(const tinfo* t, char* buf, size_t n) {
  size_t o = (size_t)snprintf(buf, n, "[");
  for (int64_t i = 0; i < t->ndim && o < n; ++i)
    o += (size_t)snprintf(buf + o, n - o, i ? ", %lld" : "%lld", (long long)t->sizes[i]);
  if (o < n) snprintf(buf + o, n - o, "]");
  return buf;
}
/* buf must be an array (sizeof a pointer would truncate the text): a pointer fails to compile */
#define SHAPE(t, buf) \
  shape_str((t), (buf), sizeof(buf) + 0 * sizeof(char[sizeof(buf) > sizeof(char*) ? 1 : -1]))

/* bytes per element of the dtypes an op may be handed (0: another, not checked here) */
static int64_t elem_size(int32_t d) {
  if (d == aoti_torch_dtype_float32() || d == aoti_torch_dtype_int32()) return 4;
  if (d == aoti_torch_dtype_bfloat16() || d == aoti_torch_dtype_float16() || d == aoti_torch_dtype_int16())
    return 2;
  if (d == aoti_torch_dtype_float8_e4m3fn() || d == aoti_torch_dtype_float8_e5m2() ||
      d == aoti_torch_dtype_float8_e4m3fnuz() || d == aoti_torch_dtype_float8_e5m2fnuz() ||
      d == aoti_torch_dtype_uint8() || d == aoti_torch_dtype_int8() || d == aoti_torch_dtype_bool())
    return 1;
  if (d == aoti_torch_dtype_float64() || d == aoti_torch_dtype_int64() || d == aoti_torch_dtype_complex64())
    return 8;
  if (d == aoti_torch_dtype_complex128()) return 16;
  return 0;
}

static int describe(const char* op, const char* arg, AtenTensorHandle h, tinfo* t) {
  memset(t, 0, sizeof *t);
  t->h = h;
  int64_t* sizes;
  bool defined = false;
  SHIM(aoti_torch_is_defined(h, &defined)); /* (None for a Tensor argument arrives undefined) */
  FP8OPS_REQUIRE(defined, "%s: %s is None (an undefined tensor); pass a tensor", op, arg);
  SHIM(aoti_torch_get_dtype(h, &t->dtype));
  t->elem = elem_size(t->dtype);
  SHIM(aoti_torch_get_device_type(h, &t->dev_type));
  SHIM(aoti_torch_get_device_index(h, &t->dev_index));
  SHIM(aoti_torch_get_dim(h, &t->ndim));
  SHIM(aoti_torch_get_numel(h, &t->numel));
  SHIM(aoti_torch_is_contiguous(h, &t->contiguous));
  FP8OPS_REQUIRE(t->ndim <= 8, "%s: %s has %lld dims; at most 8 are supported", op, arg,
                 (long long)t->ndim);
  SHIM(aoti_torch_get_sizes(h, &sizes));
  for (int64_t i = 0; i < t->ndim; ++i) t->sizes[i] = sizes[i];
  FP8OPS_REQUIRE(t->dev_type == aoti_torch_device_type_cpu() ||
                     t->dev_type == aoti_torch_device_type_cuda(),
                 "%s: %s is on %s; expected a cpu or cuda tensor", op, arg,
                 device_name(t->dev_type));
  if (t->numel > 0) {
    /* storage resized to 0 bytes (FSDP frees unsharded parameters so): its data pointer is
     * NULL, or NULL plus the storage offset, and no kernel may read it */
    int64_t nbytes = 0;
    SHIM(aoti_torch_get_storage_size(h, &nbytes));
    FP8OPS_REQUIRE(nbytes > 0, "%s: %s has no storage (freed: resized to 0 bytes, as FSDP does to "
                   "parameters outside their forward); pass a tensor that holds its data", op, arg);
    /* a storage shrunk after the view was made (untyped_storage().resize_()): a kernel would
     * read and write past its end (the last element's offset, strides >= 0 in torch) */
    int64_t offset = 0, *strides, last = 0, size = t->elem;
    SHIM(aoti_torch_get_storage_offset(h, &offset));
    SHIM(aoti_torch_get_strides(h, &strides));
    for (int64_t i = 0; i < t->ndim; ++i) last += (t->sizes[i] - 1) * strides[i];
    FP8OPS_REQUIRE(size == 0 || (offset + last + 1) * size <= nbytes,
                   "%s: %s needs %lld bytes of its storage, which holds %lld (resized smaller after "
                   "the tensor was made); pass a tensor that holds its data", op, arg,
                   (long long)((offset + last + 1) * size), (long long)nbytes);
    SHIM(torch_get_mutable_data_ptr(h, &t->data));
  }
  return FP8OPS_OK;
}

static int require_dtype(const char* op, const char* arg, const tinfo* t, int32_t want) {
  FP8OPS_REQUIRE(t->dtype == want, "%s: %s must be %s, found %s", op, arg, dtype_name(want),
                 dtype_name(t->dtype));
  return FP8OPS_OK;
}

static int require_contiguous(const char* op, const char* arg, const tinfo* t) {
  FP8OPS_REQUIRE(t->contiguous, "%s: %s must be contiguous (row-major), found a strided view; "
                 "call .contiguous() on it first", op, arg);
  return FP8OPS_OK;
}

/* "cpu" or "cuda:0" (the shim gives a CPU tensor the index -1) */
static const char* device_str(const tinfo* t, char* buf, size_t n) {
  if (t->dev_type == aoti_torch_device_type_cuda())
    snprintf(buf, n, "cuda:%d", (int)t->dev_index);
  else
    snprintf(buf, n, "%s", device_name(t->dev_type));
  return buf;
}

static int require_same_device(const char* op, const char* arg, const tinfo* t,
                               const char* ref_arg, const tinfo* ref) {
  char d1[32], d2[32]; /* (formatted only when the check fails: see shape_str) */
  FP8OPS_REQUIRE(t->dev_type == ref->dev_type && t->dev_index == ref->dev_index,
                 "%s: %s is on %s but %s is on %s; expected all tensors on one device (move %s "
                 "to %s)", op, arg, device_str(t, d1, sizeof d1), ref_arg,
                 device_str(ref, d2, sizeof d2), arg, d2);
  return FP8OPS_OK;
}

static int require_scalar_f32(const char* op, const char* arg, const tinfo* t, const tinfo* ref,
                              const char* ref_arg) {
  FP8OPS_TRY(require_dtype(op, arg, t, aoti_torch_dtype_float32()));
  FP8OPS_REQUIRE(t->numel == 1, "%s: %s must hold exactly 1 element (a per-tensor fp32 scale), "
                 "found %lld", op, arg, (long long)t->numel);
  return require_same_device(op, arg, t, ref_arg, ref);
}

/* The amax slots an op writes (atomically, while its blocks still read the scales) must be
 * apart from every scale it reads: on CUDA a shared word would change the scale part-way
 * through the cast (the CPU reads it once), silently. (Two amax slots may be one: both casts
 * fold with the same signed max, so it ends as the larger amax.) n_w written slots first, then
 * the read ones (1 element each: one word or apart); NULL entries (not used) are skipped. */
static int require_slots_apart(const char* op, int n_w, int n, const tinfo* const* t,
                               const char* const* names) {
  for (int i = 0; i < n_w; ++i) {
    if (!t[i]) continue;
    for (int j = n_w; j < n; ++j)
      FP8OPS_REQUIRE(!t[j] || t[i]->data != t[j]->data, "%s: %s and %s share memory; the op "
                     "writes %s while it reads %s: pass separate tensors", op, names[i], names[j],
                     names[i], names[j]);
  }
  return FP8OPS_OK;
}

/* Bytes per element for a memory span: an upper bound, 8, for a dtype elem_size does not know
 * (such an argument is refused by its dtype check anyway). */
static int64_t span_elem(const tinfo* t) { return t->elem ? t->elem : 8; }

/* An amax slot the op writes must lie outside the `nbytes` from `lo` of an argument it reads:
 * a slot inside x (or the weight, the bias, a LayerNorm parameter, dy, an FP8 operand) would
 * change what a later pass of the op reads, silently (a probe's finding: the bias gradient sums
 * dy after the cast wrote the slot). torch's out= ops refuse such overlaps too. */
static int require_slot_outside(const char* op, const tinfo* slot, const char* slot_name,
                                const void* lo, int64_t nbytes, const char* arg) {
  if (!slot || slot->numel == 0 || !lo || nbytes <= 0) return FP8OPS_OK;
  const uintptr_t a = (uintptr_t)slot->data, b = (uintptr_t)lo;
  FP8OPS_REQUIRE(a + 4 <= b || b + (uintptr_t)nbytes <= a, "%s: %s lies inside %s's memory; the op "
                 "writes %s while it reads %s: pass an amax slot of its own (e.g. a view of the "
                 "layer's amax history)", op, slot_name, arg, slot_name, arg);
  return FP8OPS_OK;
}

/* require_slot_outside for a contiguous argument (every one passed here was checked to be). */
static int require_slot_outside_of(const char* op, const tinfo* slot, const char* slot_name,
                                   const tinfo* t, const char* arg) {
  return require_slot_outside(op, slot, slot_name, t->data, t->numel * span_elem(t), arg);
}

static int hp_code(const char* op, const char* arg, int32_t d, fp8ops_hp_dtype* out) {
  if (d == aoti_torch_dtype_float32()) *out = FP8OPS_F32;
  else if (d == aoti_torch_dtype_bfloat16()) *out = FP8OPS_BF16;
  else if (d == aoti_torch_dtype_float16()) *out = FP8OPS_F16;
  else
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "%s: %s must be float32, bfloat16 or float16, "
                            "found %s", op, arg, dtype_name(d));
  return FP8OPS_OK;
}

static int fp8_code(const char* op, const char* arg, int32_t d, fp8ops_fp8_format* out) {
  if (d == aoti_torch_dtype_float8_e4m3fn()) *out = FP8OPS_E4M3;
  else if (d == aoti_torch_dtype_float8_e5m2()) *out = FP8OPS_E5M2;
  else
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "%s: %s must be float8_e4m3fn or float8_e5m2, "
                            "found %s", op, arg, dtype_name(d));
  return FP8OPS_OK;
}

static int32_t torch_dtype_of_hp(fp8ops_hp_dtype d) {
  return d == FP8OPS_BF16 ? aoti_torch_dtype_bfloat16()
         : d == FP8OPS_F16 ? aoti_torch_dtype_float16() : aoti_torch_dtype_float32();
}

/* New contiguous tensor on t's device. */
static int new_tensor(const char* op, int64_t ndim, const int64_t* sizes, int32_t dtype,
                      const tinfo* like, AtenTensorHandle* out) {
  int64_t strides[8];
  int64_t s = 1;
  for (int64_t i = ndim - 1; i >= 0; --i) {
    strides[i] = s;
    s *= sizes[i] > 0 ? sizes[i] : 1;
  }
  if (aoti_torch_empty_strided(ndim, sizes, strides, dtype, like->dev_type, like->dev_index, out) ==
      AOTI_TORCH_SUCCESS)
    return FP8OPS_OK;
  /* torch's own message (out of memory, most likely) goes to stderr; this names the output.
   * "out of memory" beside an fp8ops op's name is what fp8ops/ops.py's _raise_if_oom looks
   * for: eager Python callers get torch.OutOfMemoryError, which training loops and batch-size
   * finders catch */
  tinfo shape;
  memset(&shape, 0, sizeof shape);
  shape.ndim = ndim;
  for (int64_t i = 0; i < ndim; ++i) shape.sizes[i] = sizes[i];
  char sh[96], dev[32];
  return fp8ops_set_error(FP8OPS_ERR_NOMEM, "%s: out of memory: could not allocate a %s %s "
                          "output on %s (torch's message, on stderr, says how much is free)", op,
                          SHAPE(&shape, sh), dtype_name(dtype), device_str(like, dev, sizeof dev));
}

/* *rows = the product of t's leading dims (all but the last), which a zero last dim lets be
 * anything torch allows: checked for int64 overflow */
static int leading_rows(const char* op, const char* name, const tinfo* t, int64_t* rows) {
  int64_t r = 1;
  for (int64_t i = 0; i + 1 < t->ndim; ++i)
    FP8OPS_REQUIRE(!__builtin_mul_overflow(r, t->sizes[i], &r), "%s: %s has more rows (the product "
                   "of its leading dims) than int64 holds; reshape it to [-1, last dim]", op, name);
  *rows = r;
  return FP8OPS_OK;
}

static void* data_of(AtenTensorHandle h) {
  void* p = NULL;
  if (torch_get_mutable_data_ptr(h, &p) != AOTI_TORCH_SUCCESS) return NULL;
  return p;
}

static void release(AtenTensorHandle* hs, int n) {
  for (int i = 0; i < n; ++i)
    if (hs[i]) {
      aoti_torch_delete_tensor_object(hs[i]);
      hs[i] = NULL;
    }
}

/* Raise RuntimeError with the last error; call after releasing every handle. */
static void raise_last_error(const char* func) {
  aoti_torch_check(false, func, __FILE__, __LINE__, fp8ops_last_error());
}

/* A boxed wrapper's last step, once it has released its inputs and scratch: on
 * success its n outputs go onto the stack, which then owns them; on failure
 * they are released and the error is raised. */
static void finish_boxed(const char* func, int rc, AtenTensorHandle* outs, int n,
                         StableIValue* stack) {
  if (rc != FP8OPS_OK) {
    release(outs, n);
    raise_last_error(func);
    return;
  }
  for (int i = 0; i < n; ++i) stack[i] = sv_from_tensor(outs[i]);
}

// ----------------------------------------------------------------------------
// CUDA context: guard, stream, capability

typedef struct {
  DeviceGuardHandle guard;
  void* stream;
} cuda_ctx;

static int cuda_enter(const char* op, const tinfo* t, cuda_ctx* c, int need_fp8) {
  c->guard = NULL;
  c->stream = NULL;
  FP8OPS_REQUIRE(fp8ops_built_with_cuda(), "%s: fp8ops was built without CUDA (%s)", op,
                 fp8ops_no_cuda_reason());
  FP8OPS_REQUIRE(g_get_stream != NULL, "%s: libtorch_cuda is not loaded, so fp8ops cannot find "
                 "torch's current CUDA stream", op);
  if (need_fp8) {
    int cc = 0;
    FP8OPS_TRY(fp8ops_device_capability(t->dev_index, &cc));
    FP8OPS_REQUIRE(cc >= 89, "%s: FP8 GEMM needs a GPU of compute capability 8.9 or newer "
                   "(Ada, Hopper, Blackwell); cuda:%d is sm_%d. fp8ops.convert falls back to "
                   "BF16 on such GPUs", op, (int)t->dev_index, cc);
  }
  SHIM(aoti_torch_create_device_guard(t->dev_index, &c->guard));
  if (g_get_stream(t->dev_index, &c->stream) != AOTI_TORCH_SUCCESS) {
    aoti_torch_delete_device_guard(c->guard);
    c->guard = NULL;
    return fp8ops_set_error(FP8OPS_ERR_CUDA, "%s: could not get the current CUDA stream", op);
  }
  return FP8OPS_OK;
}

static void cuda_exit(cuda_ctx* c) {
  if (c->guard) aoti_torch_delete_device_guard(c->guard);
  c->guard = NULL;
}

static bool is_cuda(const tinfo* t) { return t->dev_type == aoti_torch_device_type_cuda(); }

// ----------------------------------------------------------------------------
// cast(Tensor x, Tensor scale, ScalarType out_dtype, bool transpose)
//     -> (Tensor out, Tensor out_t, Tensor amax)
// cast_accumulate(Tensor x, Tensor scale, Tensor(a!) amax, ScalarType out_dtype,
//                 bool transpose) -> (Tensor out, Tensor out_t)

/* hamax == NULL: cast (amax is a new output, outs[2]); else cast_accumulate
 * (this input's amax is folded into the 1-element fp32 tensor hamax). */
static int run_cast(AtenTensorHandle hx, AtenTensorHandle hs, AtenTensorHandle hamax,
                    int32_t out_dtype, bool transpose, AtenTensorHandle outs[3]) {
  const char* op = hamax ? "fp8ops::cast_accumulate" : "fp8ops::cast";
  tinfo x, s, a;
  fp8ops_hp_dtype xd = FP8OPS_F32;
  fp8ops_fp8_format fmt = FP8OPS_E4M3;
  FP8OPS_TRY(describe(op, "x", hx, &x));
  FP8OPS_TRY(describe(op, "scale", hs, &s));
  FP8OPS_TRY(hp_code(op, "x", x.dtype, &xd));
  FP8OPS_TRY(fp8_code(op, "out_dtype", out_dtype, &fmt));
  FP8OPS_TRY(require_contiguous(op, "x", &x));
  FP8OPS_TRY(require_scalar_f32(op, "scale", &s, &x, "x"));
  FP8OPS_REQUIRE(x.ndim >= 1, "%s: x must have at least 1 dim, found a 0-dim tensor; "
                 "use x.reshape(1)", op);
  if (hamax) {
    FP8OPS_TRY(describe(op, "amax", hamax, &a));
    FP8OPS_TRY(require_scalar_f32(op, "amax", &a, &x, "x"));
    const tinfo* slots[2] = {&a, &s};
    const char* names[2] = {"amax", "scale"};
    FP8OPS_TRY(require_slots_apart(op, 1, 2, slots, names));
    FP8OPS_TRY(require_slot_outside_of(op, &a, "amax", &x, "x"));
  }
  const int64_t cols = x.sizes[x.ndim - 1];
  int64_t rows = 0; /* product of the leading dims (also when cols == 0) */
  FP8OPS_TRY(leading_rows(op, "x", &x, &rows));
  const int64_t tsz[2] = {cols, rows}, zero[1] = {0};
  FP8OPS_TRY(new_tensor(op, x.ndim, x.sizes, out_dtype, &x, &outs[0]));
  FP8OPS_TRY(transpose ? new_tensor(op, 2, tsz, out_dtype, &x, &outs[1])
                       : new_tensor(op, 1, zero, out_dtype, &x, &outs[1]));
  if (!hamax) FP8OPS_TRY(new_tensor(op, 0, NULL, aoti_torch_dtype_float32(), &x, &outs[2]));
  uint8_t* out = (uint8_t*)data_of(outs[0]);
  uint8_t* out_t = transpose ? (uint8_t*)data_of(outs[1]) : NULL;
  float* amax = hamax ? (float*)a.data : (float*)data_of(outs[2]);
  if (!is_cuda(&x))
    return hamax ? fp8ops_cast_accumulate_cpu(x.data, xd, rows, cols, s.data, fmt, out, out_t, amax)
                 : fp8ops_cast_cpu(x.data, xd, rows, cols, s.data, fmt, out, out_t, amax);
  cuda_ctx c;
  FP8OPS_TRY(cuda_enter(op, &x, &c, 0));
  int rc = hamax ? fp8ops_cast_accumulate_cuda(x.data, xd, rows, cols, s.data, fmt, out, out_t,
                                               amax, c.stream)
                 : fp8ops_cast_cuda(x.data, xd, rows, cols, s.data, fmt, out, out_t, amax, c.stream);
  cuda_exit(&c);
  return rc;
}

static void boxed_cast(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[2] = {sv_tensor(stack[0]), sv_tensor(stack[1])};
  AtenTensorHandle outs[3] = {NULL, NULL, NULL};
  int rc = run_cast(in[0], in[1], NULL, sv_i32(stack[2]), sv_bool(stack[3]), outs);
  release(in, 2);
  finish_boxed(__func__, rc, outs, 3, stack);
}

static void boxed_cast_accumulate(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[3] = {sv_tensor(stack[0]), sv_tensor(stack[1]), sv_tensor(stack[2])};
  AtenTensorHandle outs[3] = {NULL, NULL, NULL};
  int rc = run_cast(in[0], in[1], in[2], sv_i32(stack[3]), sv_bool(stack[4]), outs);
  release(in, 3);
  finish_boxed(__func__, rc, outs, 2, stack); /* (no outs[2]: the amax went into the slot) */
}

// ----------------------------------------------------------------------------
// amax(Tensor x) -> Tensor

static int run_amax(AtenTensorHandle hx, AtenTensorHandle* out) {
  const char* op = "fp8ops::amax";
  tinfo x;
  fp8ops_hp_dtype xd = FP8OPS_F32;
  FP8OPS_TRY(describe(op, "x", hx, &x));
  FP8OPS_TRY(hp_code(op, "x", x.dtype, &xd));
  FP8OPS_TRY(require_contiguous(op, "x", &x));
  FP8OPS_TRY(new_tensor(op, 0, NULL, aoti_torch_dtype_float32(), &x, out));
  float* amax = (float*)data_of(*out);
  if (!is_cuda(&x)) return fp8ops_amax_cpu(x.data, xd, x.numel, amax);
  cuda_ctx c;
  FP8OPS_TRY(cuda_enter(op, &x, &c, 0));
  int rc = fp8ops_amax_cuda(x.data, xd, x.numel, amax, c.stream);
  cuda_exit(&c);
  return rc;
}

static void boxed_amax(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle x = sv_tensor(stack[0]), out = NULL;
  int rc = run_amax(x, &out);
  release(&x, 1);
  finish_boxed(__func__, rc, &out, 1, stack);
}

// ----------------------------------------------------------------------------
// amax_update(Tensor(a!) amax_history, Tensor(b!) scale, Tensor(c!) scale_inv,
//             Tensor fp8_max, float margin, int algo, Tensor(d!) overflow_count) -> ()
// overflow_count: [n] int64 counters (+1 where this step's amax is NaN/inf),
// or empty for none. scale_inv may be a 1-D view with a stride (padding).

static int run_amax_update(AtenTensorHandle hh, AtenTensorHandle hs, AtenTensorHandle hsi,
                           AtenTensorHandle hm, double margin, int64_t algo,
                           AtenTensorHandle ho) {
  const char* op = "fp8ops::amax_update";
  tinfo h, s, si, m, o;
  const int32_t f32 = aoti_torch_dtype_float32();
  FP8OPS_TRY(describe(op, "amax_history", hh, &h));
  FP8OPS_TRY(describe(op, "scale", hs, &s));
  FP8OPS_TRY(describe(op, "scale_inv", hsi, &si));
  FP8OPS_TRY(describe(op, "fp8_max", hm, &m));
  FP8OPS_TRY(require_dtype(op, "amax_history", &h, f32));
  FP8OPS_TRY(require_dtype(op, "scale", &s, f32));
  FP8OPS_TRY(require_dtype(op, "scale_inv", &si, f32));
  FP8OPS_TRY(require_dtype(op, "fp8_max", &m, f32));
  FP8OPS_TRY(require_contiguous(op, "amax_history", &h));
  FP8OPS_TRY(require_contiguous(op, "scale", &s));
  /* scale_inv: contiguous, or a 1-D strided view (Fp8Linear pads it so that
   * every entry is 16-byte aligned for the GEMMs' scale pointers) */
  int64_t si_stride = 1;
  if (!si.contiguous) {
    int64_t* st = NULL;
    SHIM(aoti_torch_get_strides(hsi, &st));
    FP8OPS_REQUIRE(si.ndim == 1 && st[0] >= 1, "%s: scale_inv must be contiguous or a 1-D view "
                   "with a positive stride, found a strided %lld-D view; call .contiguous() on "
                   "it first", op, (long long)si.ndim);
    si_stride = st[0];
  }
  FP8OPS_TRY(require_contiguous(op, "fp8_max", &m));
  FP8OPS_TRY(require_same_device(op, "scale", &s, "amax_history", &h));
  FP8OPS_TRY(require_same_device(op, "scale_inv", &si, "amax_history", &h));
  FP8OPS_TRY(require_same_device(op, "fp8_max", &m, "amax_history", &h));
  FP8OPS_REQUIRE(h.ndim == 1 || h.ndim == 2, "%s: amax_history must be [H] (one tensor) or "
                 "[H, n] (n tensors), found %lld dims", op, (long long)h.ndim);
  const int64_t H = h.sizes[0], n = h.ndim == 2 ? h.sizes[1] : 1;
  FP8OPS_REQUIRE(H >= 1, "%s: amax_history needs at least 1 row (history length), found 0", op);
  FP8OPS_REQUIRE(s.numel == n, "%s: scale must have %lld elements (one per amax_history "
                 "column), found %lld", op, (long long)n, (long long)s.numel);
  FP8OPS_REQUIRE(si.numel == n, "%s: scale_inv must have %lld elements, found %lld", op,
                 (long long)n, (long long)si.numel);
  FP8OPS_REQUIRE(m.numel == n, "%s: fp8_max must have %lld elements, found %lld", op,
                 (long long)n, (long long)m.numel);
  FP8OPS_REQUIRE(algo == 0 || algo == 1, "%s: algo must be 0 (max) or 1 (most_recent), "
                 "found %lld", op, (long long)algo);
  /* (Fp8Config's range: 2^margin beyond it flushes every scale to 0 or freezes it) */
  FP8OPS_REQUIRE(margin == margin && margin > -64 && margin < 64,
                 "%s: margin must be a number in (-64, 64) (scale = fp8_max / amax / 2^margin), "
                 "found %g", op, margin);
  FP8OPS_TRY(describe(op, "overflow_count", ho, &o));
  int64_t* counts = NULL;
  if (o.numel > 0) {
    FP8OPS_TRY(require_dtype(op, "overflow_count", &o, aoti_torch_dtype_int64()));
    FP8OPS_TRY(require_contiguous(op, "overflow_count", &o));
    FP8OPS_TRY(require_same_device(op, "overflow_count", &o, "amax_history", &h));
    FP8OPS_REQUIRE(o.numel == n, "%s: overflow_count must have %lld elements (one per "
                   "amax_history column) or none, found %lld", op, (long long)n,
                   (long long)o.numel);
    counts = (int64_t*)o.data;
  }
  if (n == 0) return FP8OPS_OK;
  /* The op writes the history, scale, scale_inv (= 1 / scale) and the counts, column by column
   * (on CUDA in parallel): bytes of one shared with another, or with fp8_max, which it reads,
   * would be read back after another column's write. Compared as byte ranges: a view
   * overlapping another part-way shares memory too. */
  {
    const uintptr_t lo[5] = {(uintptr_t)h.data, (uintptr_t)s.data, (uintptr_t)si.data,
                             (uintptr_t)o.data, (uintptr_t)m.data};
    const uintptr_t len[5] = {(uintptr_t)(4 * H * n), (uintptr_t)(4 * n),
                              (uintptr_t)(4 * ((n - 1) * si_stride + 1)),
                              (uintptr_t)(counts ? 8 * n : 0), (uintptr_t)(4 * n)};
    const char* names[5] = {"amax_history", "scale", "scale_inv", "overflow_count", "fp8_max"};
    for (int i = 0; i < 4; ++i)     /* the written ones */
      for (int j = i + 1; j < 5; ++j)
        FP8OPS_REQUIRE(len[i] == 0 || len[j] == 0 || lo[i] + len[i] <= lo[j] ||
                       lo[j] + len[j] <= lo[i],
                       "%s: scale, scale_inv and amax_history must be three tensors of their own, "
                       "and overflow_count and fp8_max apart from them: found %s and %s sharing "
                       "memory; pass separate tensors", op, names[i], names[j]);
  }
  if (!is_cuda(&h))
    return fp8ops_amax_update_cpu(h.data, s.data, si.data, m.data, n, H, (float)margin,
                                  (fp8ops_amax_algo)algo, counts, si_stride);
  cuda_ctx c;
  FP8OPS_TRY(cuda_enter(op, &h, &c, 0));
  int rc = fp8ops_amax_update_cuda(h.data, s.data, si.data, m.data, n, H, (float)margin,
                                   (fp8ops_amax_algo)algo, counts, si_stride, c.stream);
  cuda_exit(&c);
  return rc;
}

static void boxed_amax_update(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[5] = {sv_tensor(stack[0]), sv_tensor(stack[1]), sv_tensor(stack[2]),
                            sv_tensor(stack[3]), sv_tensor(stack[6])};
  int rc = run_amax_update(in[0], in[1], in[2], in[3], sv_f64(stack[4]), sv_i64(stack[5]), in[4]);
  release(in, 5);
  finish_boxed(__func__, rc, NULL, 0, stack);
}

// ----------------------------------------------------------------------------
// FP8 GEMM plumbing shared by gemm, linear_fwd and linear_bwd

/* One FP8 GEMM operand: its handle (to copy it when misaligned), data, format. */
typedef struct {
  AtenTensorHandle h;
  const void* data;
  fp8ops_fp8_format fmt;
} gemm_operand;

/* What a CUDA GEMM op owns until it returns: one workspace, reused by the op's
 * GEMMs in stream order, and copies of misaligned operands. Released after the
 * GEMMs are queued: torch's caching allocator reuses memory in stream order. */
#define MAX_COPIES 6
typedef struct {
  AtenTensorHandle workspace;
  AtenTensorHandle copies[MAX_COPIES];
} gemm_scratch;

static void scratch_release(gemm_scratch* s) {
  release(&s->workspace, 1);
  release(s->copies, MAX_COPIES);
}

/* A contiguous copy of t in a fresh allocation; *data points into it. */
static int clone_to(const char* op, AtenTensorHandle t, AtenTensorHandle* copy, const void** data) {
  void* p = NULL;
  SHIM(aoti_torch_clone(t, copy));
  SHIM(torch_get_mutable_data_ptr(*copy, &p));
  *data = p;
  return FP8OPS_OK;
}

/* cuBLASLt FP8 needs 16-byte aligned operands: a view that starts at an odd
 * offset is copied into a fresh (aligned) allocation first. */
static int aligned_data(const char* op, AtenTensorHandle h, const void** data, gemm_scratch* s) {
  if (((uintptr_t)*data & 15u) == 0) return FP8OPS_OK;
  for (int i = 0; i < MAX_COPIES; ++i)
    if (!s->copies[i]) return clone_to(op, h, &s->copies[i], data);
  return fp8ops_set_error(FP8OPS_ERR_INVALID, "%s: internal error: too many operand copies", op);
}

static int require_gemm_dims(const char* op, int64_t M, int64_t N, int64_t K) {
  FP8OPS_REQUIRE(M % 16 == 0 && N % 16 == 0 && K % 16 == 0 && M > 0 && N > 0 && K > 0,
                 "%s: FP8 GEMM on CUDA needs M, N and K to be positive multiples of 16 "
                 "(got M=%lld, N=%lld, K=%lld); pad the tensors or exclude this layer via "
                 "module_filter_fn", op, (long long)M, (long long)N, (long long)K);
  return FP8OPS_OK;
}

/* bias: absent (no elements) or [N] in the GEMM's bias dtype on ref's device;
 * *ptr = its data or NULL. */
static int check_bias(const char* op, const tinfo* bias, int64_t N, int32_t out_dtype,
                      fp8ops_hp_dtype od, const tinfo* ref, const char* ref_arg,
                      const void** ptr) {
  *ptr = NULL;
  if (bias->numel == 0) return FP8OPS_OK;
  const fp8ops_hp_dtype want = fp8ops_gemm_bias_dtype(od);
  FP8OPS_REQUIRE(bias->ndim == 1 && bias->numel == N, "%s: bias must be 1-D [N] = [%lld], "
                 "found %lld elements in %lld dims", op, (long long)N, (long long)bias->numel,
                 (long long)bias->ndim);
  FP8OPS_REQUIRE(bias->dtype == torch_dtype_of_hp(want), "%s: bias must be %s for out_dtype "
                 "%s (cuBLASLt's FP8 bias rule), found %s", op,
                 dtype_name(torch_dtype_of_hp(want)), dtype_name(out_dtype),
                 dtype_name(bias->dtype));
  FP8OPS_TRY(require_contiguous(op, "bias", bias));
  FP8OPS_TRY(require_same_device(op, "bias", bias, ref_arg, ref));
  *ptr = bias->data;
  return FP8OPS_OK;
}

/* *out = a[M, K] . b[N, K]^T * sa * sb (+ bias[N]) in out_dtype, on the device
 * of `like` (CPU reference or cuBLASLt; CUDA callers are inside cuda_enter). */
static int gemm_into(const char* op, gemm_operand a, gemm_operand b, int64_t M, int64_t N,
                     int64_t K, const float* sa, const float* sb, AtenTensorHandle hbias,
                     const void* bias, int32_t out_dtype, fp8ops_hp_dtype od, bool fast_accum,
                     const tinfo* like, void* stream, gemm_scratch* s, AtenTensorHandle* out) {
  const int64_t osz[2] = {M, N};
  if (!is_cuda(like)) {
    FP8OPS_TRY(new_tensor(op, 2, osz, out_dtype, like, out));
    return fp8ops_gemm_cpu(a.data, a.fmt, b.data, b.fmt, M, N, K, sa, sb, bias, od,
                           data_of(*out));
  }
  FP8OPS_TRY(require_gemm_dims(op, M, N, K));
  FP8OPS_TRY(aligned_data(op, a.h, &a.data, s));
  FP8OPS_TRY(aligned_data(op, b.h, &b.data, s));
  if (bias) FP8OPS_TRY(aligned_data(op, hbias, &bias, s));
  FP8OPS_TRY(fp8ops_cublaslt_init());
  const int64_t ws = (int64_t)fp8ops_gemm_workspace_bytes();
  if (!s->workspace)
    FP8OPS_TRY(new_tensor(op, 1, &ws, aoti_torch_dtype_uint8(), like, &s->workspace));
  FP8OPS_TRY(new_tensor(op, 2, osz, out_dtype, like, out));
  return fp8ops_gemm_cuda(a.data, a.fmt, b.data, b.fmt, M, N, K, sa, sb, bias, od,
                          data_of(*out), fast_accum, data_of(s->workspace), (size_t)ws,
                          like->dev_index, stream);
}

/* A CUDA op's body runs between cuda_enter and cuda_exit: this keeps one exit. */
#define CUDA_BODY(op, ref, need_fp8, rc, body) \
  do {                                         \
    cuda_ctx c_ = {NULL, NULL};                \
    if (is_cuda(ref)) FP8OPS_TRY(cuda_enter(op, ref, &c_, need_fp8)); \
    void* stream = c_.stream;                  \
    (void)stream;                              \
    rc = FP8OPS_OK;                            \
    body;                                      \
    cuda_exit(&c_);                            \
  } while (0)

// ----------------------------------------------------------------------------
// gemm(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor bias,
//      ScalarType out_dtype, bool use_fast_accum) -> Tensor

static int run_gemm(AtenTensorHandle ha, AtenTensorHandle hb, AtenTensorHandle hsa,
                    AtenTensorHandle hsb, AtenTensorHandle hbias, int32_t out_dtype,
                    bool fast_accum, AtenTensorHandle* out, gemm_scratch* scratch) {
  const char* op = "fp8ops::gemm";
  tinfo a, b, sa, sb, bias;
  fp8ops_fp8_format af = FP8OPS_E4M3, bf = FP8OPS_E4M3;
  fp8ops_hp_dtype od = FP8OPS_BF16;
  char sh1[96], sh2[96];
  FP8OPS_TRY(describe(op, "a", ha, &a));
  FP8OPS_TRY(describe(op, "b", hb, &b));
  FP8OPS_TRY(describe(op, "a_scale_inv", hsa, &sa));
  FP8OPS_TRY(describe(op, "b_scale_inv", hsb, &sb));
  FP8OPS_TRY(describe(op, "bias", hbias, &bias));
  FP8OPS_TRY(fp8_code(op, "a", a.dtype, &af));
  FP8OPS_TRY(fp8_code(op, "b", b.dtype, &bf));
  FP8OPS_TRY(hp_code(op, "out_dtype", out_dtype, &od));
  FP8OPS_REQUIRE(!(af == FP8OPS_E5M2 && bf == FP8OPS_E5M2), "%s: a and b are both "
                 "float8_e5m2; FP8 tensor cores need at least one float8_e4m3fn operand", op);
  FP8OPS_REQUIRE(a.ndim == 2, "%s: a must be 2-D [M, K], found %lld dims", op, (long long)a.ndim);
  FP8OPS_REQUIRE(b.ndim == 2, "%s: b must be 2-D [N, K], found %lld dims", op, (long long)b.ndim);
  FP8OPS_REQUIRE(a.sizes[1] == b.sizes[1], "%s: a %s and b %s must share the inner dim K "
                 "(a is [M, K], b is [N, K]: out = a @ b.T)", op, SHAPE(&a, sh1), SHAPE(&b, sh2));
  FP8OPS_TRY(require_contiguous(op, "a", &a));
  FP8OPS_TRY(require_contiguous(op, "b", &b));
  FP8OPS_TRY(require_same_device(op, "b", &b, "a", &a));
  FP8OPS_TRY(require_scalar_f32(op, "a_scale_inv", &sa, &a, "a"));
  FP8OPS_TRY(require_scalar_f32(op, "b_scale_inv", &sb, &a, "a"));
  const int64_t M = a.sizes[0], K = a.sizes[1], N = b.sizes[0];
  const void* bias_ptr = NULL;
  FP8OPS_TRY(check_bias(op, &bias, N, out_dtype, od, &a, "a", &bias_ptr));
  if (is_cuda(&a)) FP8OPS_TRY(require_gemm_dims(op, M, N, K));
  const gemm_operand ga = {ha, a.data, af}, gb = {hb, b.data, bf};
  int rc;
  CUDA_BODY(op, &a, 1, rc,
            rc = gemm_into(op, ga, gb, M, N, K, sa.data, sb.data, hbias, bias_ptr, out_dtype, od,
                           fast_accum, &a, stream, scratch, out));
  return rc;
}

static void boxed_gemm(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[5] = {sv_tensor(stack[0]), sv_tensor(stack[1]), sv_tensor(stack[2]),
                            sv_tensor(stack[3]), sv_tensor(stack[4])};
  AtenTensorHandle out = NULL;
  gemm_scratch scratch = {0};
  int rc = run_gemm(in[0], in[1], in[2], in[3], in[4], sv_i32(stack[5]), sv_bool(stack[6]), &out,
                    &scratch);
  release(in, 5);
  scratch_release(&scratch); /* stream-ordered: the GEMM that reads them is queued first */
  finish_boxed(__func__, rc, &out, 1, stack);
}

// ----------------------------------------------------------------------------
// linear_fwd(Tensor x, Tensor w, Tensor x_scale, Tensor(a!) x_amax, Tensor x_scale_inv,
//            Tensor w_scale, Tensor(b!) w_amax, Tensor w_scale_inv, Tensor bias,
//            ScalarType x_fp8_dtype, ScalarType w_fp8_dtype, ScalarType out_dtype,
//            bool use_fast_accum, bool save_xt, bool save_wt, bool gelu_input=False,
//            bool swiglu_input=False) -> (Tensor y, Tensor x8t, Tensor w8, Tensor w8t)
//
// Fp8Linear's forward in one call: x8 (, x8t) = cast(x * x_scale) with x's
// amax folded into x_amax; y = gemm(x8, w8) * x_scale_inv * w_scale_inv + bias.
// w [N, K] is either already FP8 (used as is; w8 and w8t come back empty) or in
// high precision: then it is cast here first, w8 (, w8t when save_wt) =
// cast(w * w_scale) with its amax folded into w_amax, and returned for reuse
// until the next optimizer step. x8 is a temporary; x8t (the transpose, for
// the weight gradient) is returned when save_xt, else empty. gelu_input: x is
// the input h of a GELU and the layer's input is gelu_tanh(h): the cast reads
// h and casts its GELU (amax and x8t are the GELU's; cast_cpu.c / cast.cu).
// swiglu_input: x is [M, 2K], a SwiGLU's input (gate | up), and the layer's
// input is silu(gate) * up [M, K]: cast in the cast's pass where
// fp8ops_swiglu_cast_fusable, else computed into a buffer first.
// One dispatcher call instead of up to five: small layers are bound by the
// host's per-op cost, not by the GPU.

/* ln_linear_fwd's LayerNorm: its weight and bias (fp32 [K], or empty: none),
 * eps and rms (an RMSNorm) in; mean and rstd ([M] fp32) out. ln_linear_fwd_res:
 * res in (NULL: none), and out as sum the norm's input x + res. */
typedef struct {
  AtenTensorHandle weight, bias;
  double eps;
  bool rms;
  AtenTensorHandle res;
  AtenTensorHandle mean, rstd, sum;
} ln_args;

#define LFWD_NIN 9
static int run_linear_fwd(AtenTensorHandle in[LFWD_NIN], int32_t x_fp8, int32_t w_fp8,
                          int32_t out_dtype, bool fast_accum, bool save_xt, bool save_wt,
                          bool gelu, bool swiglu, ln_args* ln, AtenTensorHandle outs[4],
                          AtenTensorHandle* x8, AtenTensorHandle* act, gemm_scratch* scratch) {
  const char* op = !ln ? "fp8ops::linear_fwd" : ln->res ? "fp8ops::ln_linear_fwd_res"
                                                         : "fp8ops::ln_linear_fwd";
  tinfo x, w, xs, xa, xsi, ws, wa, wsi, bias, lw, lb, res;
  fp8ops_hp_dtype xd = FP8OPS_F32, od = FP8OPS_BF16, wd = FP8OPS_F32, rd = FP8OPS_F32;
  const void* xln = NULL; /* what the norm reads: x, or x + res */
  fp8ops_fp8_format xf = FP8OPS_E4M3, wf = FP8OPS_E4M3;
  char sh1[96], sh2[96];
  FP8OPS_TRY(describe(op, "x", in[0], &x));
  FP8OPS_TRY(describe(op, "w", in[1], &w));
  FP8OPS_TRY(describe(op, "x_scale", in[2], &xs));
  FP8OPS_TRY(describe(op, "x_amax", in[3], &xa));
  FP8OPS_TRY(describe(op, "x_scale_inv", in[4], &xsi));
  FP8OPS_TRY(describe(op, "w_scale", in[5], &ws));
  FP8OPS_TRY(describe(op, "w_amax", in[6], &wa));
  FP8OPS_TRY(describe(op, "w_scale_inv", in[7], &wsi));
  FP8OPS_TRY(describe(op, "bias", in[8], &bias));
  FP8OPS_TRY(hp_code(op, "x", x.dtype, &xd));
  const bool cast_w = w.dtype != aoti_torch_dtype_float8_e4m3fn() &&
                      w.dtype != aoti_torch_dtype_float8_e5m2();
  if (cast_w) {
    FP8OPS_REQUIRE(hp_code(op, "w", w.dtype, &wd) == FP8OPS_OK, "%s: w must be float8_e4m3fn or "
                   "float8_e5m2 (already cast), or float32, bfloat16 or float16 (cast here), "
                   "found %s", op, dtype_name(w.dtype));
    FP8OPS_TRY(fp8_code(op, "w_fp8_dtype", w_fp8, &wf));
  } else {
    FP8OPS_TRY(fp8_code(op, "w", w.dtype, &wf));
  }
  FP8OPS_TRY(fp8_code(op, "x_fp8_dtype", x_fp8, &xf));
  FP8OPS_TRY(hp_code(op, "out_dtype", out_dtype, &od));
  FP8OPS_REQUIRE(!(xf == FP8OPS_E5M2 && wf == FP8OPS_E5M2), "%s: x and w would both be "
                 "float8_e5m2; FP8 tensor cores need at least one float8_e4m3fn operand", op);
  FP8OPS_REQUIRE(x.ndim == 2, "%s: x must be 2-D [M, K], found %lld dims; reshape it to "
                 "(-1, in_features)", op, (long long)x.ndim);
  FP8OPS_REQUIRE(w.ndim == 2, "%s: w must be 2-D [N, K], found %lld dims", op, (long long)w.ndim);
  FP8OPS_REQUIRE(!(gelu && swiglu), "%s: gelu_input and swiglu_input are exclusive", op);
  if (swiglu)
    FP8OPS_REQUIRE(x.sizes[1] == 2 * w.sizes[1], "%s: with swiglu_input, x %s must be [M, 2K] "
                   "(the SwiGLU's gate and up halves) for w [N, K] = %s", op, SHAPE(&x, sh1),
                   SHAPE(&w, sh2));
  else
    FP8OPS_REQUIRE(x.sizes[1] == w.sizes[1], "%s: x %s and w %s must share the inner dim K "
                   "(x is [M, K], w is [N, K]: y = x @ w.T)", op, SHAPE(&x, sh1),
                   SHAPE(&w, sh2));
  FP8OPS_TRY(require_contiguous(op, "x", &x));
  FP8OPS_TRY(require_contiguous(op, "w", &w));
  FP8OPS_TRY(require_same_device(op, "w", &w, "x", &x));
  FP8OPS_TRY(require_scalar_f32(op, "x_scale", &xs, &x, "x"));
  FP8OPS_TRY(require_scalar_f32(op, "x_amax", &xa, &x, "x"));
  FP8OPS_TRY(require_scalar_f32(op, "x_scale_inv", &xsi, &x, "x"));
  if (cast_w) {
    FP8OPS_TRY(require_scalar_f32(op, "w_scale", &ws, &x, "x"));
    FP8OPS_TRY(require_scalar_f32(op, "w_amax", &wa, &x, "x"));
  }
  FP8OPS_TRY(require_scalar_f32(op, "w_scale_inv", &wsi, &x, "x"));
  {
    const tinfo* slots[6] = {&xa, cast_w ? &wa : NULL, &xs, &xsi, cast_w ? &ws : NULL, &wsi};
    const char* names[6] = {"x_amax", "w_amax", "x_scale", "x_scale_inv", "w_scale", "w_scale_inv"};
    FP8OPS_TRY(require_slots_apart(op, 2, 6, slots, names));
  }
  const int64_t M = x.sizes[0], K = w.sizes[1], N = w.sizes[0];
  const void* bias_ptr = NULL;
  FP8OPS_TRY(check_bias(op, &bias, N, out_dtype, od, &x, "x", &bias_ptr));
  if (is_cuda(&x)) FP8OPS_TRY(require_gemm_dims(op, M, N, K));
  fp8ops_ln_params lnp = {NULL, NULL, NULL, NULL};
  if (ln) {
    FP8OPS_TRY(describe(op, "ln_weight", ln->weight, &lw));
    FP8OPS_TRY(describe(op, "ln_bias", ln->bias, &lb));
    const tinfo* pp[2] = {&lw, &lb};
    const char* names[2] = {"ln_weight", "ln_bias"};
    for (int i = 0; i < 2; ++i) {
      if (pp[i]->numel == 0 && K > 0) continue; /* none: ones / zeros */
      FP8OPS_REQUIRE(pp[i]->ndim == 1 && pp[i]->numel == K &&
                     pp[i]->dtype == aoti_torch_dtype_float32(),
                     "%s: %s must be float32 [K] = [%lld] (the LayerNorm's, as float32) or "
                     "empty (none), found %s %s", op, names[i], (long long)K,
                     dtype_name(pp[i]->dtype), SHAPE(pp[i], sh2));
      FP8OPS_TRY(require_contiguous(op, names[i], pp[i]));
      FP8OPS_TRY(require_same_device(op, names[i], pp[i], "x", &x));
    }
    /* (eps as the kernels take it, a float: 1e300 is inf there, and rstd would be 0; compared
     * as a double, since converting one beyond float's range is undefined in C) */
    FP8OPS_REQUIRE(ln->eps >= 0.0 && ln->eps <= (double)FLT_MAX, "%s: eps must be a finite float >= 0, "
                   "found %g", op, ln->eps);
    FP8OPS_REQUIRE(!ln->rms || lb.numel == 0, "%s: an RMSNorm has no bias (rms=True), found ln_bias "
                   "with %lld elements; pass an empty ln_bias with rms=True", op, (long long)lb.numel);
    FP8OPS_REQUIRE(K > 0, "%s: x %s has no features to normalize (K = 0); a LayerNorm needs K > 0",
                   op, SHAPE(&x, sh1));
    xln = x.data;
    if (ln->res) {
      FP8OPS_TRY(describe(op, "res", ln->res, &res));
      FP8OPS_REQUIRE(res.ndim == 2 && res.sizes[0] == M && res.sizes[1] == x.sizes[1],
                     "%s: res %s must have x's shape %s", op, SHAPE(&res, sh1), SHAPE(&x, sh2));
      FP8OPS_TRY(hp_code(op, "res", res.dtype, &rd));
      FP8OPS_REQUIRE(fp8ops_add_res_dtypes_ok(xd, rd), "%s: res must have x's dtype %s (or, with "
                     "x float32, be bfloat16 or float16), found %s; convert it with .to(x.dtype)",
                     op, dtype_name(x.dtype), dtype_name(res.dtype));
      FP8OPS_TRY(require_contiguous(op, "res", &res));
      FP8OPS_TRY(require_same_device(op, "res", &res, "x", &x));
      FP8OPS_TRY(new_tensor(op, 2, x.sizes, x.dtype, &x, &ln->sum));
      xln = data_of(ln->sum);
    }
    const int64_t msz[1] = {M};
    FP8OPS_TRY(new_tensor(op, 1, msz, aoti_torch_dtype_float32(), &x, &ln->mean));
    FP8OPS_TRY(new_tensor(op, 1, msz, aoti_torch_dtype_float32(), &x, &ln->rstd));
    lnp.mean = (const float*)data_of(ln->mean);
    lnp.rstd = (const float*)data_of(ln->rstd);
    lnp.gamma = lw.numel ? (const float*)lw.data : NULL;
    lnp.beta = lb.numel ? (const float*)lb.data : NULL;
    save_xt = true; /* the LayerNorm cast writes the transpose */
  }
  {
    const tinfo* written[2] = {&xa, cast_w ? &wa : NULL};
    const char* wnames[2] = {"x_amax", "w_amax"};
    for (int i = 0; i < 2; ++i) {
      FP8OPS_TRY(require_slot_outside_of(op, written[i], wnames[i], &x, "x"));
      FP8OPS_TRY(require_slot_outside_of(op, written[i], wnames[i], &w, "w"));
      FP8OPS_TRY(require_slot_outside_of(op, written[i], wnames[i], &bias, "bias"));
      if (ln) {
        FP8OPS_TRY(require_slot_outside_of(op, written[i], wnames[i], &lw, "ln_weight"));
        FP8OPS_TRY(require_slot_outside_of(op, written[i], wnames[i], &lb, "ln_bias"));
        if (ln->res) FP8OPS_TRY(require_slot_outside_of(op, written[i], wnames[i], &res, "res"));
      }
    }
  }
  const int64_t xsz[2] = {M, K}, xtsz[2] = {K, M}, wtsz[2] = {K, N}, zero[1] = {0};
  const int32_t w8_dtype = cast_w ? w_fp8 : w.dtype;
  FP8OPS_TRY(new_tensor(op, 2, xsz, x_fp8, &x, x8));
  FP8OPS_TRY(new_tensor(op, save_xt ? 2 : 1, save_xt ? xtsz : zero, x_fp8, &x, &outs[1]));
  FP8OPS_TRY(new_tensor(op, cast_w ? 2 : 1, cast_w ? w.sizes : zero, w8_dtype, &x, &outs[2]));
  FP8OPS_TRY(new_tensor(op, cast_w && save_wt ? 2 : 1, cast_w && save_wt ? wtsz : zero, w8_dtype,
                        &x, &outs[3]));
  uint8_t* p8 = (uint8_t*)data_of(*x8);
  uint8_t* p8t = save_xt ? (uint8_t*)data_of(outs[1]) : NULL;
  uint8_t* pw8 = cast_w ? (uint8_t*)data_of(outs[2]) : (uint8_t*)w.data;
  uint8_t* pw8t = cast_w && save_wt ? (uint8_t*)data_of(outs[3]) : NULL;
  const gemm_operand a = {*x8, p8, xf}, b = {cast_w ? outs[2] : in[1], pw8, wf};
  /* the SwiGLU: in the cast's pass, or first into *act, which is then cast */
  const bool swiglu_fused =
      swiglu && is_cuda(&x) && fp8ops_swiglu_cast_fusable(x.data, M, K, p8, p8t);
  const void* xc = x.data; /* what the plain cast reads */
  if (swiglu && !swiglu_fused) {
    FP8OPS_TRY(new_tensor(op, 2, xsz, x.dtype, &x, act));
    xc = data_of(*act);
  }
  int rc;
  CUDA_BODY(op, &x, 1, rc, {
    if (cast_w)
      rc = is_cuda(&x) ? fp8ops_cast_accumulate_cuda(w.data, wd, N, K, ws.data, wf, pw8, pw8t,
                                                      wa.data, stream)
                       : fp8ops_cast_accumulate_cpu(w.data, wd, N, K, ws.data, wf, pw8, pw8t,
                                                     wa.data);
    /* (M == 0: no rows to normalize, and the empty mean and rstd have no data pointer; the
     * plain cast below casts the nothing there is) */
    if (rc == FP8OPS_OK && ln && ln->res && M > 0)
      rc = is_cuda(&x) ? fp8ops_add_layernorm_stats_cuda(x.data, xd, res.data, rd, M, K,
                                                         (float)ln->eps, ln->rms, (void*)xln,
                                                         (float*)lnp.mean, (float*)lnp.rstd,
                                                         stream)
                       : fp8ops_add_layernorm_stats_cpu(x.data, xd, res.data, rd, M, K,
                                                        (float)ln->eps, ln->rms, (void*)xln,
                                                        (float*)lnp.mean, (float*)lnp.rstd);
    else if (rc == FP8OPS_OK && ln && M > 0)
      rc = is_cuda(&x) ? fp8ops_layernorm_stats_cuda(x.data, xd, M, K, (float)ln->eps, ln->rms,
                                                     (float*)lnp.mean, (float*)lnp.rstd, stream)
                       : fp8ops_layernorm_stats_cpu(x.data, xd, M, K, (float)ln->eps, ln->rms,
                                                    (float*)lnp.mean, (float*)lnp.rstd);
    if (rc == FP8OPS_OK && ln && M > 0)
      rc = is_cuda(&x) ? fp8ops_ln_cast_accumulate_cuda(xln, xd, M, K, &lnp, xs.data, xf, p8,
                                                         p8t, xa.data, stream)
                       : fp8ops_ln_cast_accumulate_cpu(xln, xd, M, K, &lnp, xs.data, xf, p8,
                                                        p8t, xa.data);
    else if (rc == FP8OPS_OK && gelu)
      rc = is_cuda(&x) ? fp8ops_gelu_cast_accumulate_cuda(x.data, xd, M, K, xs.data, xf, p8, p8t,
                                                           xa.data, stream)
                       : fp8ops_gelu_cast_accumulate_cpu(x.data, xd, M, K, xs.data, xf, p8, p8t,
                                                          xa.data);
    else if (rc == FP8OPS_OK && swiglu_fused)
      rc = fp8ops_swiglu_cast_accumulate_cuda(x.data, xd, M, K, xs.data, xf, p8, p8t, xa.data,
                                              stream);
    else if (rc == FP8OPS_OK) {
      if (swiglu)
        rc = is_cuda(&x) ? fp8ops_swiglu_cuda(x.data, xd, M, K, (void*)xc, stream)
                         : fp8ops_swiglu_cpu(x.data, xd, M, K, (void*)xc);
      if (rc == FP8OPS_OK)
        rc = is_cuda(&x) ? fp8ops_cast_accumulate_cuda(xc, xd, M, K, xs.data, xf, p8, p8t,
                                                        xa.data, stream)
                         : fp8ops_cast_accumulate_cpu(xc, xd, M, K, xs.data, xf, p8, p8t,
                                                       xa.data);
    }
    if (rc == FP8OPS_OK)
      rc = gemm_into(op, a, b, M, N, K, xsi.data, wsi.data, in[8], bias_ptr, out_dtype, od,
                     fast_accum, &x, stream, scratch, &outs[0]);
  });
  return rc;
}

static void boxed_linear_fwd(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[LFWD_NIN];
  for (int i = 0; i < LFWD_NIN; ++i) in[i] = sv_tensor(stack[i]);
  AtenTensorHandle outs[4] = {NULL, NULL, NULL, NULL}, x8 = NULL, act = NULL;
  gemm_scratch scratch = {0};
  int rc = run_linear_fwd(in, sv_i32(stack[9]), sv_i32(stack[10]), sv_i32(stack[11]),
                          sv_bool(stack[12]), sv_bool(stack[13]), sv_bool(stack[14]),
                          sv_bool(stack[15]), sv_bool(stack[16]), NULL, outs, &x8, &act, &scratch);
  release(in, LFWD_NIN);
  release(&x8, 1); /* stream-ordered, after the GEMM that reads it */
  release(&act, 1);
  scratch_release(&scratch);
  finish_boxed(__func__, rc, outs, 4, stack);
}

// ----------------------------------------------------------------------------
// ln_linear_fwd(Tensor x, Tensor ln_weight, Tensor ln_bias, float eps, Tensor w,
//               Tensor x_scale, Tensor(a!) x_amax, Tensor x_scale_inv, Tensor w_scale,
//               Tensor(b!) w_amax, Tensor w_scale_inv, Tensor bias,
//               ScalarType x_fp8_dtype, ScalarType w_fp8_dtype, ScalarType out_dtype,
//               bool use_fast_accum, bool save_wt, bool rms=False)
//     -> (Tensor y, Tensor x8t, Tensor w8, Tensor w8t, Tensor mean, Tensor rstd)
//
// linear_fwd of LayerNorm(x): x is the LayerNorm's input; its per-row mean and
// rstd are computed here (returned for the LayerNorm's backward) and the cast
// normalizes each element as it loads it (ln_weight, ln_bias: float32 [K], or
// empty for none), so the LayerNorm's output is never written. x8t is always
// returned. rms: RMSNorm(x) instead (mean comes back as zeros; fp8ops.h).

//
// ln_linear_fwd_res(Tensor x, Tensor res, <ln_linear_fwd's other arguments>)
//     -> (<ln_linear_fwd's results>, Tensor sum)
//
// ln_linear_fwd of sum = x + res (res: x's shape, x's dtype or, with x float32,
// bfloat16 or float16), sum written (x's dtype) and returned as the add would
// have: a pre-norm block's residual add fused into the next norm's statistics
// pass (fp8ops.h add_layernorm_stats). Compiled code's residual_pass.py
// calls it.

/* stack: ln_linear_fwd's arguments, or ln_linear_fwd_res's (res second) */
static void ln_linear_fwd_boxed(StableIValue* stack, bool with_res) {
  const int o = with_res ? 1 : 0; /* the arguments after x move by one */
  const int k_idx[LFWD_NIN] = {0, 4 + o, 5 + o, 6 + o, 7 + o, 8 + o, 9 + o, 10 + o, 11 + o};
  AtenTensorHandle in[LFWD_NIN];
  for (int i = 0; i < LFWD_NIN; ++i) in[i] = sv_tensor(stack[k_idx[i]]);
  ln_args ln = {sv_tensor(stack[1 + o]), sv_tensor(stack[2 + o]), sv_f64(stack[3 + o]),
                sv_bool(stack[17 + o]), with_res ? sv_tensor(stack[1]) : NULL, NULL, NULL, NULL};
  AtenTensorHandle outs[4] = {NULL, NULL, NULL, NULL}, x8 = NULL;
  gemm_scratch scratch = {0};
  int rc = run_linear_fwd(in, sv_i32(stack[12 + o]), sv_i32(stack[13 + o]),
                          sv_i32(stack[14 + o]), sv_bool(stack[15 + o]), true,
                          sv_bool(stack[16 + o]), false, false, &ln, outs, &x8, NULL, &scratch);
  release(in, LFWD_NIN);
  release(&ln.weight, 1);
  release(&ln.bias, 1);
  release(&ln.res, 1);
  release(&x8, 1); /* stream-ordered, after the GEMM that reads it */
  scratch_release(&scratch);
  AtenTensorHandle all[7] = {outs[0], outs[1], outs[2], outs[3], ln.mean, ln.rstd, ln.sum};
  finish_boxed(__func__, rc, all, with_res ? 7 : 6, stack);
}

static void boxed_ln_linear_fwd(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  ln_linear_fwd_boxed(stack, false);
}

static void boxed_ln_linear_fwd_res(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  ln_linear_fwd_boxed(stack, true);
}

// ----------------------------------------------------------------------------
// linear_bwd(Tensor gy, Tensor w8t, Tensor x8t, Tensor g_scale, Tensor(a!) g_amax,
//            Tensor g_scale_inv, Tensor w_scale_inv, Tensor x_scale_inv, Tensor gelu_input,
//            ScalarType g_fp8_dtype, ScalarType dx_dtype, ScalarType dw_dtype,
//            bool need_dx, bool need_dw, bool need_db=False) -> (Tensor dx, Tensor dw, Tensor db)
//
// Fp8Linear's backward in one call: g8 (, g8t) = cast(gy * g_scale) with gy's
// amax folded into g_amax; dx = gemm(g8, w8t) * g_scale_inv * w_scale_inv
// [M, K] when need_dx; dw = gemm(g8t, x8t) * g_scale_inv * x_scale_inv [N, K]
// when need_dw; db = the column sums of gy [N], fp32 (the bias gradient, in
// fp8ops_dbias_cpu's order; on CUDA fused into the cast's pass over gy) when
// need_db. gy is [M, N], w8t [K, N], x8t [K, M]; an output (and the operand
// it alone reads) that is not needed is empty. gelu_input (empty: none) is the
// layer's output h [M, N] when a GELU of it was fused into the next layer:
// gy is then the gradient of gelu_tanh(h), and everything above uses
// dy = gy * gelu_tanh'(h) instead, computed in the cast's pass (CUDA fast
// path) or in a pass of its own (fp8ops_gelu_grad_*).

#define LBWD_NIN 9
// (blocks: linear_bwd_cat's gy, described by gy_blocks, cast from its column blocks in
// place; in[0] and in[8] (gelu_input) are then unused. in[8] NULL: no gelu_input.
// gy: what the messages call dy (linear_bwd_cat's: its blocks side by side). note_amax: the op
// does not declare its write to g_amax, so it notes it (amax_writes.c).)
static int run_linear_bwd(const char* op, const char* gy, AtenTensorHandle in[LBWD_NIN],
                          const fp8ops_col_blocks* blocks, const tinfo* gy_blocks, int32_t g_fp8,
                          int32_t dx_dtype, int32_t dw_dtype, bool need_dx, bool need_dw,
                          bool need_db, bool note_amax, AtenTensorHandle outs[3],
                          AtenTensorHandle tmp[4], gemm_scratch* scratch) {
  tinfo g, wt, xt, gs, ga, gsi, wsi, xsi, gi;
  fp8ops_hp_dtype gd = FP8OPS_F32, dxd = FP8OPS_BF16, dwd = FP8OPS_F32;
  fp8ops_fp8_format gf = FP8OPS_E5M2, wf = FP8OPS_E4M3, xf = FP8OPS_E4M3;
  char sh1[96], sh2[96];
  if (blocks)
    g = *gy_blocks;
  else
    FP8OPS_TRY(describe(op, gy, in[0], &g));
  FP8OPS_TRY(describe(op, "w8t", in[1], &wt));
  FP8OPS_TRY(describe(op, "x8t", in[2], &xt));
  FP8OPS_TRY(describe(op, "g_scale", in[3], &gs));
  FP8OPS_TRY(describe(op, "g_amax", in[4], &ga));
  FP8OPS_TRY(describe(op, "g_scale_inv", in[5], &gsi));
  FP8OPS_TRY(describe(op, "w_scale_inv", in[6], &wsi));
  FP8OPS_TRY(describe(op, "x_scale_inv", in[7], &xsi));
  if (in[8])
    FP8OPS_TRY(describe(op, "gelu_input", in[8], &gi));
  else
    memset(&gi, 0, sizeof gi);
  FP8OPS_TRY(hp_code(op, gy, g.dtype, &gd));
  FP8OPS_TRY(fp8_code(op, "g_fp8_dtype", g_fp8, &gf));
  FP8OPS_REQUIRE(g.ndim == 2, "%s: gy must be 2-D [M, N], found %lld dims; reshape it to "
                 "(-1, out_features)", op, (long long)g.ndim);
  FP8OPS_TRY(require_contiguous(op, gy, &g));
  FP8OPS_TRY(require_scalar_f32(op, "g_scale", &gs, &g, gy));
  FP8OPS_TRY(require_scalar_f32(op, "g_amax", &ga, &g, gy));
  FP8OPS_TRY(require_scalar_f32(op, "g_scale_inv", &gsi, &g, gy));
  const int64_t M = g.sizes[0], N = g.sizes[1];
  int64_t K = 0;
  /* both output dtypes, needed or not: an output not asked for is still allocated (empty) */
  FP8OPS_TRY(hp_code(op, "dx_dtype", dx_dtype, &dxd));
  FP8OPS_TRY(hp_code(op, "dw_dtype", dw_dtype, &dwd));
  if (need_dx) {
    FP8OPS_TRY(fp8_code(op, "w8t", wt.dtype, &wf));
    FP8OPS_REQUIRE(!(gf == FP8OPS_E5M2 && wf == FP8OPS_E5M2), "%s: g_fp8_dtype and w8t are "
                   "both float8_e5m2; FP8 tensor cores need at least one float8_e4m3fn operand", op);
    FP8OPS_REQUIRE(wt.ndim == 2 && wt.sizes[1] == N, "%s: w8t must be [K, N] for %s %s "
                   "(the transposed FP8 weight), found %s", op, gy, SHAPE(&g, sh1),
                   SHAPE(&wt, sh2));
    FP8OPS_TRY(require_contiguous(op, "w8t", &wt));
    FP8OPS_TRY(require_same_device(op, "w8t", &wt, gy, &g));
    FP8OPS_TRY(require_scalar_f32(op, "w_scale_inv", &wsi, &g, gy));
    K = wt.sizes[0];
  }
  if (need_dw) {
    FP8OPS_TRY(fp8_code(op, "x8t", xt.dtype, &xf));
    FP8OPS_REQUIRE(!(gf == FP8OPS_E5M2 && xf == FP8OPS_E5M2), "%s: g_fp8_dtype and x8t are "
                   "both float8_e5m2; FP8 tensor cores need at least one float8_e4m3fn operand", op);
    FP8OPS_REQUIRE(xt.ndim == 2 && xt.sizes[1] == M && (!need_dx || xt.sizes[0] == K),
                   "%s: x8t must be [K, M]%s for %s %s (the transposed FP8 input), found %s", op,
                   need_dx ? " with K = w8t.shape[0]" : "", gy, SHAPE(&g, sh1),
                   SHAPE(&xt, sh2));
    FP8OPS_TRY(require_contiguous(op, "x8t", &xt));
    FP8OPS_TRY(require_same_device(op, "x8t", &xt, gy, &g));
    FP8OPS_TRY(require_scalar_f32(op, "x_scale_inv", &xsi, &g, gy));
    K = xt.sizes[0];
  }
  {
    const tinfo* slots[5] = {&ga, &gs, &gsi, need_dx ? &wsi : NULL, need_dw ? &xsi : NULL};
    const char* names[5] = {"g_amax", "g_scale", "g_scale_inv", "w_scale_inv", "x_scale_inv"};
    FP8OPS_TRY(require_slots_apart(op, 1, 5, slots, names));
    if (!blocks) /* (blocks: the caller checked them) */
      FP8OPS_TRY(require_slot_outside_of(op, &ga, "g_amax", &g, gy));
    if (need_dx) FP8OPS_TRY(require_slot_outside_of(op, &ga, "g_amax", &wt, "w8t"));
    if (need_dw) FP8OPS_TRY(require_slot_outside_of(op, &ga, "g_amax", &xt, "x8t"));
  }
  if (is_cuda(&g) && (need_dx || need_dw)) FP8OPS_TRY(require_gemm_dims(op, M, N, K));
  const int64_t zero[1] = {0}, tsz[2] = {N, M};
  FP8OPS_TRY(new_tensor(op, 2, g.sizes, g_fp8, &g, &tmp[0]));
  if (need_dw) FP8OPS_TRY(new_tensor(op, 2, tsz, g_fp8, &g, &tmp[1]));
  if (!need_dx) FP8OPS_TRY(new_tensor(op, 1, zero, dx_dtype, &g, &outs[0]));
  if (!need_dw) FP8OPS_TRY(new_tensor(op, 1, zero, dw_dtype, &g, &outs[1]));
  const int32_t f32 = aoti_torch_dtype_float32();
  const int64_t nsz[1] = {N};
  FP8OPS_TRY(new_tensor(op, 1, need_db ? nsz : zero, f32, &g, &outs[2]));
  int64_t partial_floats = 0;
  if (need_db && N > 0 && is_cuda(&g)) {
    partial_floats = fp8ops_dbias_workspace_floats(M, N);
    const int64_t psz[1] = {partial_floats};
    FP8OPS_TRY(new_tensor(op, 1, psz, f32, &g, &tmp[2]));
  }
  /* (N == 0: nothing to sum, and the empty output has no data pointer) */
  float* db = need_db && N > 0 ? (float*)data_of(outs[2]) : NULL;
  float* partial = tmp[2] ? (float*)data_of(tmp[2]) : NULL;
  uint8_t* p8 = (uint8_t*)data_of(tmp[0]);
  uint8_t* p8t = need_dw ? (uint8_t*)data_of(tmp[1]) : NULL;
  /* the fused GELU's gradient: in the cast's pass, or first into tmp[3] */
  const bool gelu = gi.numel > 0;
  bool gelu_fused = false;
  const void* gx = g.data; /* what is cast: gy, or gy * gelu'(h) in tmp[3] */
  if (gelu) {
    FP8OPS_REQUIRE(gi.ndim == 2 && gi.sizes[0] == M && gi.sizes[1] == N, "%s: gelu_input must be "
                   "[M, N] = %s like gy (the layer's output, the fused GELU's input), found %s",
                   op, SHAPE(&g, sh1), SHAPE(&gi, sh2));
    FP8OPS_REQUIRE(gi.dtype == g.dtype, "%s: gelu_input must have gy's dtype %s, found %s", op,
                   dtype_name(g.dtype), dtype_name(gi.dtype));
    FP8OPS_TRY(require_contiguous(op, "gelu_input", &gi));
    FP8OPS_TRY(require_same_device(op, "gelu_input", &gi, gy, &g));
    FP8OPS_TRY(require_slot_outside_of(op, &ga, "g_amax", &gi, "gelu_input"));
    gelu_fused = is_cuda(&g) && fp8ops_dgelu_cast_fusable(g.data, gi.data, M, N, p8, p8t);
    if (!gelu_fused) {
      FP8OPS_TRY(new_tensor(op, 2, g.sizes, g.dtype, &g, &tmp[3]));
      gx = data_of(tmp[3]);
    }
  }
  const gemm_operand a_dx = {tmp[0], p8, gf}, b_dx = {in[1], wt.data, wf};
  const gemm_operand a_dw = {tmp[1], p8t, gf}, b_dw = {in[2], xt.data, xf};
  int rc;
  CUDA_BODY(op, &g, need_dx || need_dw, rc, {
    if (note_amax) fp8ops_note_amax_write(ga.data, stream);
    if (blocks) {
      rc = fp8ops_blocks_cast_accumulate_cuda(blocks, gd, M, gs.data, gf, p8, p8t, ga.data, db,
                                              partial, partial_floats, stream);
    } else if (gelu_fused) {
      rc = fp8ops_dgelu_cast_accumulate_cuda(g.data, gi.data, gd, M, N, gs.data, gf, p8, p8t,
                                             ga.data, db, partial, partial_floats, stream);
    } else if (is_cuda(&g)) {
      if (gelu) rc = fp8ops_gelu_grad_cuda(g.data, gi.data, gd, M * N, (void*)gx, stream);
      if (rc == FP8OPS_OK)
        rc = db ? fp8ops_cast_accumulate_dbias_cuda(gx, gd, M, N, gs.data, gf, p8, p8t,
                                                    ga.data, db, partial, partial_floats,
                                                    stream)
                : fp8ops_cast_accumulate_cuda(gx, gd, M, N, gs.data, gf, p8, p8t, ga.data,
                                              stream);
    } else {
      if (gelu) rc = fp8ops_gelu_grad_cpu(g.data, gi.data, gd, M * N, (void*)gx);
      if (rc == FP8OPS_OK)
        rc = fp8ops_cast_accumulate_cpu(gx, gd, M, N, gs.data, gf, p8, p8t, ga.data);
      if (rc == FP8OPS_OK && db) rc = fp8ops_dbias_cpu(gx, gd, M, N, db);
    }
    if (rc == FP8OPS_OK && need_dx)
      rc = gemm_into(op, a_dx, b_dx, M, K, N, gsi.data, wsi.data, NULL, NULL, dx_dtype, dxd, false,
                     &g, stream, scratch, &outs[0]);
    if (rc == FP8OPS_OK && need_dw)
      rc = gemm_into(op, a_dw, b_dw, N, K, M, gsi.data, xsi.data, NULL, NULL, dw_dtype, dwd, false,
                     &g, stream, scratch, &outs[1]);
  });
  return rc;
}

/* linear_bwd and linear_bwd_sink: one schema but g_amax's declaration */
static void boxed_linear_bwd_as(const char* func, const char* op, bool sink, StableIValue* stack) {
  AtenTensorHandle in[LBWD_NIN];
  for (int i = 0; i < LBWD_NIN; ++i) in[i] = sv_tensor(stack[i]);
  AtenTensorHandle outs[3] = {NULL, NULL, NULL}, tmp[4] = {NULL, NULL, NULL, NULL};
  gemm_scratch scratch = {0};
  int rc = run_linear_bwd(op, "gy", in, NULL, NULL, sv_i32(stack[9]), sv_i32(stack[10]),
                          sv_i32(stack[11]), sv_bool(stack[12]), sv_bool(stack[13]),
                          sv_bool(stack[14]), sink, outs, tmp, &scratch);
  release(in, LBWD_NIN);
  release(tmp, 4); /* stream-ordered, after the kernels that read them */
  scratch_release(&scratch);
  finish_boxed(func, rc, outs, 3, stack);
}

static void boxed_linear_bwd(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  boxed_linear_bwd_as(__func__, "fp8ops::linear_bwd", false, stack);
}

static void boxed_linear_bwd_sink(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  boxed_linear_bwd_as(__func__, "fp8ops::linear_bwd_sink", true, stack);
}

// ----------------------------------------------------------------------------
// linear_bwd_cat(Tensor gy_a, Tensor gy_b, Tensor gy_c, Tensor w8t, Tensor x8t,
//                Tensor g_scale, Tensor g_amax, Tensor g_scale_inv, Tensor w_scale_inv,
//                Tensor x_scale_inv, ScalarType g_fp8_dtype, ScalarType dx_dtype,
//                ScalarType dw_dtype, bool need_dx, bool need_dw, bool need_db=False)
//     -> (Tensor dx, Tensor dw, Tensor db)
//
// linear_bwd_sink (compiled code's; g_amax's write not declared) of
// gy = cat([gy_a, gy_b, gy_c], dim=1), the concatenation never written: each
// block is [M, n_i] with its own row stride (one element to the next column).
// Called by inductor's pass where a layer's output was split (cat_grad_pass.py:
// the q, k, v gradients of an attention projection). On CUDA, for the shapes
// fp8ops_blocks_cast_fusable takes, the cast reads the blocks in place; else
// (and on the CPU) they are copied side by side first. Bit for bit the plain
// op on the concatenation either way.

#define LBWD_CAT_NIN 10
#define GY_CAT "cat(gy_a, gy_b, gy_c)" /* the concatenation, as the messages name it */
static int run_linear_bwd_cat(AtenTensorHandle in[LBWD_CAT_NIN], int32_t g_fp8, int32_t dx_dtype,
                              int32_t dw_dtype, bool need_dx, bool need_dw, bool need_db,
                              AtenTensorHandle outs[3], AtenTensorHandle tmp[5],
                              gemm_scratch* scratch) {
  const char* op = "fp8ops::linear_bwd_cat";
  static const char* names[FP8OPS_MAX_BLOCKS] = {"gy_a", "gy_b", "gy_c"};
  tinfo p[FP8OPS_MAX_BLOCKS];
  fp8ops_col_blocks blocks;
  fp8ops_hp_dtype gd = FP8OPS_F32;
  char sh1[96];
  int64_t N = 0;
  for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
    FP8OPS_TRY(describe(op, names[i], in[i], &p[i]));
    FP8OPS_TRY(hp_code(op, names[i], p[i].dtype, &gd));
    FP8OPS_REQUIRE(p[i].ndim == 2, "%s: %s must be 2-D [M, n], found %lld dims; reshape it to "
                   "(-1, n)", op, names[i], (long long)p[i].ndim);
    if (i > 0) {
      FP8OPS_REQUIRE(p[i].sizes[0] == p[0].sizes[0], "%s: %s must have gy_a's %lld rows, found %s",
                     op, names[i], (long long)p[0].sizes[0], SHAPE(&p[i], sh1));
      FP8OPS_REQUIRE(p[i].dtype == p[0].dtype, "%s: %s must have gy_a's dtype %s, found %s", op,
                     names[i], dtype_name(p[0].dtype), dtype_name(p[i].dtype));
      FP8OPS_TRY(require_same_device(op, names[i], &p[i], "gy_a", &p[0]));
    }
    int64_t* st = NULL;
    SHIM(aoti_torch_get_strides(in[i], &st));
    const int64_t rows = p[i].sizes[0], n = p[i].sizes[1];
    const int64_t ld = rows > 1 ? st[0] : n;
    FP8OPS_REQUIRE(n <= 1 || st[1] == 1, "%s: %s's columns must be adjacent (stride 1), found "
                   "stride %lld; call .contiguous() on it first", op, names[i], (long long)st[1]);
    FP8OPS_REQUIRE(rows <= 1 || n == 0 || ld >= n, "%s: %s's rows must not overlap (row stride "
                   "%lld < %lld columns); call .contiguous() on it first", op, names[i],
                   (long long)ld, (long long)n);
    blocks.data[i] = p[i].data;
    blocks.cols[i] = n;
    blocks.ld[i] = ld;
    N += n;
  }
  {
    tinfo ga;
    FP8OPS_TRY(describe(op, "g_amax", in[6], &ga));
    for (int i = 0; i < FP8OPS_MAX_BLOCKS; ++i) {
      const int64_t rows = p[i].sizes[0], n = p[i].sizes[1];
      const int64_t span =
          rows > 0 && n > 0 ? ((rows - 1) * blocks.ld[i] + n) * span_elem(&p[i]) : 0;
      FP8OPS_TRY(require_slot_outside(op, &ga, "g_amax", p[i].data, span, names[i]));
    }
  }
  const int64_t M = p[0].sizes[0];
  /* the concatenation as the plain op sees it: [M, N], contiguous */
  tinfo g = p[0];
  g.sizes[1] = N;
  g.numel = M * N;
  g.contiguous = true;
  AtenTensorHandle in2[LBWD_NIN] = {NULL, in[3], in[4], in[5], in[6], in[7], in[8], in[9], NULL};
  /* (the fused cast writes the transposed FP8 dy, which only the weight gradient reads) */
  if (is_cuda(&g) && need_dw && fp8ops_blocks_cast_fusable(&blocks, gd, M))
    return run_linear_bwd(op, GY_CAT, in2, &blocks, &g, g_fp8, dx_dtype, dw_dtype, need_dx,
                          need_dw, need_db, true, outs, tmp, scratch);
  FP8OPS_TRY(new_tensor(op, 2, g.sizes, g.dtype, &g, &tmp[4]));
  void* cat = data_of(tmp[4]);
  int rc;
  CUDA_BODY(op, &g, 0, rc, {
    if (M * N > 0)
      rc = is_cuda(&g) ? fp8ops_blocks_copy_cuda(&blocks, gd, M, cat, stream)
                       : fp8ops_blocks_copy_cpu(&blocks, gd, M, cat);
  });
  if (rc != FP8OPS_OK) return rc;
  in2[0] = tmp[4];
  return run_linear_bwd(op, GY_CAT, in2, NULL, NULL, g_fp8, dx_dtype, dw_dtype, need_dx, need_dw,
                        need_db, true, outs, tmp, scratch);
}

static void boxed_linear_bwd_cat(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[LBWD_CAT_NIN];
  for (int i = 0; i < LBWD_CAT_NIN; ++i) in[i] = sv_tensor(stack[i]);
  AtenTensorHandle outs[3] = {NULL, NULL, NULL}, tmp[5] = {NULL, NULL, NULL, NULL, NULL};
  gemm_scratch scratch = {0};
  int rc = run_linear_bwd_cat(in, sv_i32(stack[10]), sv_i32(stack[11]), sv_i32(stack[12]),
                              sv_bool(stack[13]), sv_bool(stack[14]), sv_bool(stack[15]), outs,
                              tmp, &scratch);
  release(in, LBWD_CAT_NIN);
  release(tmp, 5); /* stream-ordered, after the kernels that read them */
  scratch_release(&scratch);
  finish_boxed(__func__, rc, outs, 3, stack);
}

// ----------------------------------------------------------------------------
// layernorm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight,
//               bool rms=False) -> (Tensor dx, Tensor dweight_bias)
//
// The fused LayerNorm's backward (ln_linear_fwd's mean and rstd): dx in x's
// dtype, and dweight_bias fp32 [2, K] = (dgamma, dbeta). weight: the
// LayerNorm's gamma as float32 [K], or empty when it has none. rms: an
// RMSNorm's backward (ln_linear_fwd(rms=True)'s statistics). One pass over x
// and dy where torch's native_layer_norm_backward makes two (fp8ops.h).
//
// layernorm_bwd_acc(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor weight,
//                   bool rms, Tensor dres, ScalarType copy_dtype)
//     -> (Tensor dx, Tensor dweight_bias, Tensor dx_copy)
//
// The same, with dx + dres written as dx (dres: x's shape and dtype): the
// gradient that reaches x from elsewhere, a residual stream's, added as dx is
// written instead of by an add kernel of its own, with that add's result
// (fp8ops.h). copy_dtype bfloat16 or float16 (x float32): dx_copy is that sum
// converted to it as well (the next branch's low-precision gradient, which the
// add's kernel would have written); x's dtype: none, dx_copy empty.
// Compiled code's residual_pass.py calls it.

#define LNB_SCRATCH 4 /* the CTAs' partial sums; aligned copies of dy, x and dres where needed */

/* dres_h NULL: layernorm_bwd (outs[2] untouched); else layernorm_bwd_acc, copy_dtype its
 * argument */
static int run_layernorm_bwd(AtenTensorHandle in[5], bool rms, AtenTensorHandle dres_h,
                             int32_t copy_dtype, AtenTensorHandle outs[3],
                             AtenTensorHandle scratch[LNB_SCRATCH]) {
  const char* op = dres_h ? "fp8ops::layernorm_bwd_acc" : "fp8ops::layernorm_bwd";
  tinfo dy, x, mean, rstd, w, dres;
  fp8ops_hp_dtype xd = FP8OPS_F32, cd = FP8OPS_F32;
  char sh1[96], sh2[96];
  FP8OPS_TRY(describe(op, "dy", in[0], &dy));
  FP8OPS_TRY(describe(op, "x", in[1], &x));
  FP8OPS_TRY(describe(op, "mean", in[2], &mean));
  FP8OPS_TRY(describe(op, "rstd", in[3], &rstd));
  FP8OPS_TRY(describe(op, "weight", in[4], &w));
  FP8OPS_TRY(hp_code(op, "x", x.dtype, &xd));
  FP8OPS_REQUIRE(x.ndim == 2, "%s: x must be 2-D [M, K], found %lld dims; reshape it to "
                 "(-1, normalized_shape)", op, (long long)x.ndim);
  FP8OPS_REQUIRE(dy.ndim == 2 && dy.sizes[0] == x.sizes[0] && dy.sizes[1] == x.sizes[1],
                 "%s: dy %s must have x's shape %s", op, SHAPE(&dy, sh1), SHAPE(&x, sh2));
  FP8OPS_REQUIRE(dy.dtype == x.dtype, "%s: dy must have x's dtype %s, found %s; convert it with "
                 ".to(x.dtype)", op, dtype_name(x.dtype), dtype_name(dy.dtype));
  FP8OPS_TRY(require_contiguous(op, "dy", &dy));
  FP8OPS_TRY(require_contiguous(op, "x", &x));
  FP8OPS_TRY(require_same_device(op, "dy", &dy, "x", &x));
  if (dres_h) {
    FP8OPS_TRY(describe(op, "dres", dres_h, &dres));
    FP8OPS_REQUIRE(dres.ndim == 2 && dres.sizes[0] == x.sizes[0] && dres.sizes[1] == x.sizes[1],
                   "%s: dres %s must have x's shape %s", op, SHAPE(&dres, sh1), SHAPE(&x, sh2));
    FP8OPS_REQUIRE(dres.dtype == x.dtype, "%s: dres must have x's dtype %s, found %s; convert it "
                   "with .to(x.dtype)", op, dtype_name(x.dtype), dtype_name(dres.dtype));
    FP8OPS_TRY(require_contiguous(op, "dres", &dres));
    FP8OPS_TRY(require_same_device(op, "dres", &dres, "x", &x));
    if (copy_dtype != x.dtype) {
      FP8OPS_REQUIRE(x.dtype == aoti_torch_dtype_float32() &&
                         (copy_dtype == aoti_torch_dtype_bfloat16() ||
                          copy_dtype == aoti_torch_dtype_float16()),
                     "%s: copy_dtype must be x's dtype %s (no copy), or bfloat16 or float16 with "
                     "x float32; found %s", op, dtype_name(x.dtype), dtype_name(copy_dtype));
      FP8OPS_TRY(hp_code(op, "copy_dtype", copy_dtype, &cd));
    }
  }
  const int64_t M = x.sizes[0], K = x.sizes[1];
  FP8OPS_REQUIRE(K > 0, "%s: x has no columns", op);
  const tinfo* vv[3] = {&mean, &rstd, &w};
  const char* names[3] = {"mean", "rstd", "weight"};
  const int64_t lens[3] = {M, M, K};
  for (int i = 0; i < 3; ++i) {
    if (i == 2 && w.numel == 0) continue; /* no weight: ones */
    char sh[96];
    FP8OPS_REQUIRE(vv[i]->ndim == 1 && vv[i]->numel == lens[i] &&
                   vv[i]->dtype == aoti_torch_dtype_float32(),
                   "%s: %s must be float32 [%lld]%s, found %s %s", op, names[i],
                   (long long)lens[i], i == 2 ? " or empty (none)" : "",
                   dtype_name(vv[i]->dtype), SHAPE(vv[i], sh));
    FP8OPS_TRY(require_contiguous(op, names[i], vv[i]));
    FP8OPS_TRY(require_same_device(op, names[i], vv[i], "x", &x));
  }
  const int64_t gsz[2] = {2, K};
  FP8OPS_TRY(new_tensor(op, 2, x.sizes, x.dtype, &x, &outs[0]));
  FP8OPS_TRY(new_tensor(op, 2, gsz, aoti_torch_dtype_float32(), &x, &outs[1]));
  void* dx = data_of(outs[0]);
  float* dgb = (float*)data_of(outs[1]);
  void* dcopy = NULL;
  if (dres_h) {
    const int64_t none[1] = {0};
    FP8OPS_TRY(cd != FP8OPS_F32 ? new_tensor(op, 2, x.sizes, copy_dtype, &x, &outs[2])
                                : new_tensor(op, 1, none, x.dtype, &x, &outs[2]));
    if (cd != FP8OPS_F32) dcopy = data_of(outs[2]);
  }
  const float* gamma = w.numel ? (const float*)w.data : NULL;
  if (!is_cuda(&x))
    return fp8ops_layernorm_bwd_cpu(dy.data, x.data, xd, M, K, (const float*)mean.data,
                                    (const float*)rstd.data, gamma, rms,
                                    dres_h ? dres.data : NULL, cd, dx, dcopy, dgb);
  FP8OPS_REQUIRE(fp8ops_layernorm_bwd_cols_ok(xd, K),
                 "%s: on CUDA, K must be a multiple of %d (of twice that above 1024, four times "
                 "that above 2048) and at most "
                 "%d; found K = %lld. Use torch.ops.aten.native_layer_norm_backward for this "
                 "shape", op, xd == FP8OPS_F32 ? 4 : 8, FP8OPS_LN_BWD_MAX_COLS, (long long)K);
  const int64_t pf = fp8ops_layernorm_bwd_partial_floats(M, K);
  const int64_t psz[1] = {pf > 0 ? pf : 1};
  FP8OPS_TRY(new_tensor(op, 1, psz, aoti_torch_dtype_float32(), &x, &scratch[0]));
  cuda_ctx c;
  FP8OPS_TRY(cuda_enter(op, &x, &c, 0));
  /* the kernel reads 16-byte vectors: a view at an odd offset (rare; x and dy are
   * usually whole allocations) is read from an aligned copy, on the op's stream */
  const void *dyp = dy.data, *xp = x.data, *rp = dres_h ? dres.data : NULL;
  int rc = FP8OPS_OK;
  if (M > 0 && ((uintptr_t)dyp & 15u) != 0) rc = clone_to(op, dy.h, &scratch[1], &dyp);
  if (rc == FP8OPS_OK && M > 0 && ((uintptr_t)xp & 15u) != 0)
    rc = clone_to(op, x.h, &scratch[2], &xp);
  if (rc == FP8OPS_OK && M > 0 && rp && ((uintptr_t)rp & 15u) != 0)
    rc = clone_to(op, dres.h, &scratch[3], &rp);
  if (rc == FP8OPS_OK)
    rc = fp8ops_layernorm_bwd_cuda(dyp, xp, xd, M, K, (const float*)mean.data,
                                   (const float*)rstd.data, gamma, rms, rp, cd, dx, dcopy,
                                   dgb, (float*)data_of(scratch[0]), psz[0], c.stream);
  cuda_exit(&c);
  return rc;
}

static void boxed_layernorm_bwd(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[5];
  for (int i = 0; i < 5; ++i) in[i] = sv_tensor(stack[i]);
  AtenTensorHandle outs[3] = {NULL, NULL, NULL}, scratch[LNB_SCRATCH] = {NULL, NULL, NULL, NULL};
  int rc = run_layernorm_bwd(in, sv_bool(stack[5]), NULL, 0, outs, scratch);
  release(in, 5);
  release(scratch, LNB_SCRATCH); /* stream-ordered, after the kernels that use it */
  finish_boxed(__func__, rc, outs, 2, stack);
}

static void boxed_layernorm_bwd_acc(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[5];
  for (int i = 0; i < 5; ++i) in[i] = sv_tensor(stack[i]);
  AtenTensorHandle dres = sv_tensor(stack[6]);
  AtenTensorHandle outs[3] = {NULL, NULL, NULL}, scratch[LNB_SCRATCH] = {NULL, NULL, NULL, NULL};
  int rc = run_layernorm_bwd(in, sv_bool(stack[5]), dres, sv_i32(stack[7]), outs, scratch);
  release(in, 5);
  release(&dres, 1);
  release(scratch, LNB_SCRATCH); /* stream-ordered, after the kernels that use it */
  finish_boxed(__func__, rc, outs, 3, stack);
}

// ----------------------------------------------------------------------------
// swiglu(Tensor x) -> Tensor
// swiglu_backward(Tensor dh, Tensor x) -> Tensor
//
// The SwiGLU activation on its own (fp8ops.h): x [..., 2H] holds gate and up;
// swiglu returns silu(gate) * up [..., H], swiglu_backward the gradient of x
// [..., 2H] from the output's gradient dh [..., H]. One pass each.

/* dh == NULL: swiglu */
static int run_swiglu(AtenTensorHandle hx, AtenTensorHandle hdh, AtenTensorHandle* out) {
  const char* op = hdh ? "fp8ops::swiglu_backward" : "fp8ops::swiglu";
  tinfo x, dh;
  fp8ops_hp_dtype xd = FP8OPS_F32;
  char sh1[96], sh2[96];
  FP8OPS_TRY(describe(op, "x", hx, &x));
  FP8OPS_TRY(hp_code(op, "x", x.dtype, &xd));
  FP8OPS_TRY(require_contiguous(op, "x", &x));
  FP8OPS_REQUIRE(x.ndim >= 1 && x.sizes[x.ndim - 1] % 2 == 0, "%s: x %s must have an even last "
                 "dim (the gate and up halves of one projection's output)", op, SHAPE(&x, sh1));
  const int64_t H = x.sizes[x.ndim - 1] / 2;
  int64_t rows = 0;
  FP8OPS_TRY(leading_rows(op, "x", &x, &rows));
  int64_t hsz[8];
  for (int64_t i = 0; i < x.ndim; ++i) hsz[i] = x.sizes[i];
  hsz[x.ndim - 1] = H;
  if (hdh) {
    FP8OPS_TRY(describe(op, "dh", hdh, &dh));
    bool same = dh.ndim == x.ndim;
    for (int64_t i = 0; same && i < x.ndim; ++i) same = dh.sizes[i] == hsz[i];
    FP8OPS_REQUIRE(same, "%s: dh %s must have x's shape %s with the last dim halved", op,
                   SHAPE(&dh, sh2), SHAPE(&x, sh1));
    FP8OPS_REQUIRE(dh.dtype == x.dtype, "%s: dh must have x's dtype %s, found %s; convert it "
                   "with .to(x.dtype)", op, dtype_name(x.dtype), dtype_name(dh.dtype));
    FP8OPS_TRY(require_contiguous(op, "dh", &dh));
    FP8OPS_TRY(require_same_device(op, "dh", &dh, "x", &x));
  }
  FP8OPS_TRY(new_tensor(op, x.ndim, hdh ? x.sizes : hsz, x.dtype, &x, out));
  void* o = data_of(*out);
  if (!is_cuda(&x))
    return hdh ? fp8ops_swiglu_grad_cpu(dh.data, x.data, xd, rows, H, o)
               : fp8ops_swiglu_cpu(x.data, xd, rows, H, o);
  cuda_ctx c;
  FP8OPS_TRY(cuda_enter(op, &x, &c, 0));
  const int rc = hdh ? fp8ops_swiglu_grad_cuda(dh.data, x.data, xd, rows, H, o, c.stream)
                     : fp8ops_swiglu_cuda(x.data, xd, rows, H, o, c.stream);
  cuda_exit(&c);
  return rc;
}

static void boxed_swiglu(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle x = sv_tensor(stack[0]), out = NULL;
  int rc = run_swiglu(x, NULL, &out);
  release(&x, 1);
  finish_boxed(__func__, rc, &out, 1, stack);
}

static void boxed_swiglu_backward(StableIValue* stack, uint64_t nargs, uint64_t nret) {
  (void)nargs; (void)nret;
  AtenTensorHandle in[2] = {sv_tensor(stack[0]), sv_tensor(stack[1])}, out = NULL;
  int rc = run_swiglu(in[1], in[0], &out);
  release(in, 2);
  finish_boxed(__func__, rc, &out, 1, stack);
}

// ----------------------------------------------------------------------------
// amax_update of many histories, outside the dispatcher (module.c)

int fp8ops_amax_update_many(int device, const fp8ops_amax_update_job* jobs, int64_t count) {
  const char* op = "fp8ops amax_update_many";
  tinfo t;
  memset(&t, 0, sizeof t);
  t.dev_type = aoti_torch_device_type_cuda();
  t.dev_index = device;
  cuda_ctx c;
  FP8OPS_TRY(cuda_enter(op, &t, &c, 0));
  const int rc = fp8ops_amax_update_many_cuda(jobs, count, c.stream);
  cuda_exit(&c);
  return rc;
}

// ----------------------------------------------------------------------------
// the op table

typedef struct {
  const char* name;
  const char* schema;
  fp8ops_boxed_fn fn;
} op_row;

static const op_row k_ops[] = {
    {"cast", "cast(Tensor x, Tensor scale, ScalarType out_dtype, bool transpose) -> "
             "(Tensor out, Tensor out_t, Tensor amax)", boxed_cast},
    {"amax", "amax(Tensor x) -> Tensor", boxed_amax},
    {"amax_update", "amax_update(Tensor(a!) amax_history, Tensor(b!) scale, "
                    "Tensor(c!) scale_inv, Tensor fp8_max, float margin, int algo, "
                    "Tensor(d!) overflow_count) -> ()",
     boxed_amax_update},
    {"gemm", "gemm(Tensor a, Tensor b, Tensor a_scale_inv, Tensor b_scale_inv, Tensor bias, "
             "ScalarType out_dtype, bool use_fast_accum) -> Tensor", boxed_gemm},
    {"cast_accumulate", "cast_accumulate(Tensor x, Tensor scale, Tensor(a!) amax, "
                        "ScalarType out_dtype, bool transpose) -> (Tensor out, Tensor out_t)",
     boxed_cast_accumulate},
    {"linear_fwd", "linear_fwd(Tensor x, Tensor w, Tensor x_scale, Tensor(a!) x_amax, "
                   "Tensor x_scale_inv, Tensor w_scale, Tensor(b!) w_amax, Tensor w_scale_inv, "
                   "Tensor bias, ScalarType x_fp8_dtype, ScalarType w_fp8_dtype, "
                   "ScalarType out_dtype, bool use_fast_accum, bool save_xt, bool save_wt, "
                   "bool gelu_input=False, bool swiglu_input=False) -> "
                   "(Tensor y, Tensor x8t, Tensor w8, Tensor w8t)", boxed_linear_fwd},
    {"swiglu", "swiglu(Tensor x) -> Tensor", boxed_swiglu},
    {"swiglu_backward", "swiglu_backward(Tensor dh, Tensor x) -> Tensor", boxed_swiglu_backward},
    {"ln_linear_fwd", "ln_linear_fwd(Tensor x, Tensor ln_weight, Tensor ln_bias, float eps, "
                      "Tensor w, Tensor x_scale, Tensor(a!) x_amax, Tensor x_scale_inv, "
                      "Tensor w_scale, Tensor(b!) w_amax, Tensor w_scale_inv, Tensor bias, "
                      "ScalarType x_fp8_dtype, ScalarType w_fp8_dtype, ScalarType out_dtype, "
                      "bool use_fast_accum, bool save_wt, bool rms=False) -> (Tensor y, "
                      "Tensor x8t, Tensor w8, "
                      "Tensor w8t, Tensor mean, Tensor rstd)", boxed_ln_linear_fwd},
    {"ln_linear_fwd_res", "ln_linear_fwd_res(Tensor x, Tensor res, Tensor ln_weight, "
                          "Tensor ln_bias, float eps, Tensor w, Tensor x_scale, Tensor(a!) x_amax, "
                          "Tensor x_scale_inv, Tensor w_scale, Tensor(b!) w_amax, "
                          "Tensor w_scale_inv, Tensor bias, ScalarType x_fp8_dtype, "
                          "ScalarType w_fp8_dtype, ScalarType out_dtype, bool use_fast_accum, "
                          "bool save_wt, bool rms=False) -> (Tensor y, Tensor x8t, Tensor w8, "
                          "Tensor w8t, Tensor mean, Tensor rstd, Tensor sum)",
     boxed_ln_linear_fwd_res},
    {"layernorm_bwd", "layernorm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, "
                      "Tensor weight, bool rms=False) -> (Tensor dx, Tensor dweight_bias)",
     boxed_layernorm_bwd},
    {"layernorm_bwd_acc", "layernorm_bwd_acc(Tensor dy, Tensor x, Tensor mean, Tensor rstd, "
                          "Tensor weight, bool rms, Tensor dres, ScalarType copy_dtype) -> "
                          "(Tensor dx, Tensor dweight_bias, Tensor dx_copy)",
     boxed_layernorm_bwd_acc},
    {"linear_bwd", "linear_bwd(Tensor gy, Tensor w8t, Tensor x8t, Tensor g_scale, "
                   "Tensor(a!) g_amax, Tensor g_scale_inv, Tensor w_scale_inv, "
                   "Tensor x_scale_inv, Tensor gelu_input, ScalarType g_fp8_dtype, "
                   "ScalarType dx_dtype, ScalarType dw_dtype, bool need_dx, bool need_dw, "
                   "bool need_db=False) -> "
                   "(Tensor dx, Tensor dw, Tensor db)",
     boxed_linear_bwd},
    // linear_bwd for compiled code (fp8ops/linear.py, _scaled_grad_output): g_amax is a
    // layer's own accumulator, which nothing but these calls and eager code at the
    // optimizer step touches. Not declared written, so torch.compile neither saves a
    // version of it for the backward nor checks one: two compiled forwards of a layer
    // may run before their backwards (a declared write there raised "modified by an
    // inplace operation"). Not for other callers: compiled code would not see the write.
    {"linear_bwd_sink", "linear_bwd_sink(Tensor gy, Tensor w8t, Tensor x8t, Tensor g_scale, "
                        "Tensor g_amax, Tensor g_scale_inv, Tensor w_scale_inv, "
                        "Tensor x_scale_inv, Tensor gelu_input, ScalarType g_fp8_dtype, "
                        "ScalarType dx_dtype, ScalarType dw_dtype, bool need_dx, bool need_dw, "
                        "bool need_db=False) -> "
                        "(Tensor dx, Tensor dw, Tensor db)",
     boxed_linear_bwd_sink},
    // linear_bwd_sink of gy = cat([gy_a, gy_b, gy_c], dim=1), never written (above)
    {"linear_bwd_cat", "linear_bwd_cat(Tensor gy_a, Tensor gy_b, Tensor gy_c, Tensor w8t, "
                       "Tensor x8t, Tensor g_scale, Tensor g_amax, Tensor g_scale_inv, "
                       "Tensor w_scale_inv, Tensor x_scale_inv, ScalarType g_fp8_dtype, "
                       "ScalarType dx_dtype, ScalarType dw_dtype, bool need_dx, bool need_dw, "
                       "bool need_db=False) -> "
                       "(Tensor dx, Tensor dw, Tensor db)",
     boxed_linear_bwd_cat},
};
#define N_OPS (sizeof k_ops / sizeof k_ops[0])

/* never deleted: deleting a library handle deregisters its ops */
static TorchLibraryHandle g_def, g_cpu, g_cuda;

int fp8ops_register(int with_cuda) {
  if (aoti_torch_library_init_def("fp8ops", __FILE__, __LINE__, &g_def) != AOTI_TORCH_SUCCESS)
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "could not define the fp8ops op library "
                            "(is another copy of fp8ops already loaded?)");
  for (size_t i = 0; i < N_OPS; ++i)
    if (aoti_torch_library_def(g_def, k_ops[i].schema) != AOTI_TORCH_SUCCESS)
      return fp8ops_set_error(FP8OPS_ERR_INVALID, "could not define op fp8ops::%s", k_ops[i].name);
  if (aoti_torch_library_init_impl("fp8ops", "CPU", __FILE__, __LINE__, &g_cpu) != AOTI_TORCH_SUCCESS)
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "could not open the fp8ops CPU impl library");
  for (size_t i = 0; i < N_OPS; ++i)
    if (torch_library_impl(g_cpu, k_ops[i].name, k_ops[i].fn, FP8OPS_TORCH_BUILD_VERSION) !=
        AOTI_TORCH_SUCCESS)
      return fp8ops_set_error(FP8OPS_ERR_INVALID, "could not register CPU kernel fp8ops::%s",
                              k_ops[i].name);
  if (!with_cuda) return FP8OPS_OK;
  if (aoti_torch_library_init_impl("fp8ops", "CUDA", __FILE__, __LINE__, &g_cuda) != AOTI_TORCH_SUCCESS)
    return fp8ops_set_error(FP8OPS_ERR_INVALID, "could not open the fp8ops CUDA impl library");
  for (size_t i = 0; i < N_OPS; ++i)
    if (torch_library_impl(g_cuda, k_ops[i].name, k_ops[i].fn, FP8OPS_TORCH_BUILD_VERSION) !=
        AOTI_TORCH_SUCCESS)
      return fp8ops_set_error(FP8OPS_ERR_INVALID, "could not register CUDA kernel fp8ops::%s",
                              k_ops[i].name);
  return FP8OPS_OK;
}

const char* fp8ops_op_names(void) {
  return "cast amax amax_update gemm cast_accumulate linear_fwd ln_linear_fwd ln_linear_fwd_res "
         "linear_bwd "
         "linear_bwd_sink linear_bwd_cat layernorm_bwd layernorm_bwd_acc swiglu swiglu_backward";
}
