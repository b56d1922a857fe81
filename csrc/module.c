/*
 * module.c -- PyInit__C: the thin CPython module. On import it finds torch's
 * CUDA stream getter (if libtorch_cuda is loaded), registers the fp8ops
 * dispatcher ops, and exposes build facts to the Python package. The only file
 * that includes Python.h. Limited API (abi3): one build for every CPython >= 3.10.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>

#include "fp8ops.h"
#include "ops.h"
#include "torch_abi.h"

static int g_cuda_registered;
static char g_cuda_reason[512];

/* _C.build_info() -> dict of facts for fp8ops.doctor */
static PyObject* py_build_info(PyObject* self, PyObject* noargs) {
  (void)self; (void)noargs;
  return Py_BuildValue("{s:i,s:s,s:i,s:s,s:s,s:K,s:s,s:s}", "built_with_cuda",
                       fp8ops_built_with_cuda(), "cuda_archs", fp8ops_cuda_archs(),
                       "cuda_kernels_registered", g_cuda_registered, "cuda_reason", g_cuda_reason,
                       "ops", fp8ops_op_names(), "torch_abi_version",
                       (unsigned long long)aoti_torch_abi_version(), "min_torch",
                       FP8OPS_TORCH_MIN_VERSION, "source_digest", fp8ops_source_digest());
}

/* _C.cublaslt_status() -> None if cuBLASLt is usable, else the reason */
static PyObject* py_cublaslt_status(PyObject* self, PyObject* noargs) {
  (void)self; (void)noargs;
  if (fp8ops_cublaslt_init() == FP8OPS_OK) Py_RETURN_NONE;
  return PyUnicode_FromString(fp8ops_last_error());
}

/* _C.amax_update_many(device, jobs): delayed-scaling update of many histories
 * in few launches, without the dispatcher: the optimizer-step hook's fast path
 * (scaling.py builds the jobs from Fp8Linear buffers it has checked). Each job
 * is a tuple (history, scale, scale_inv, fp8_max, overflow_count or 0 -- data
 * pointers as ints --, n, H, scale_inv_stride, margin, algo). */
static PyObject* py_amax_update_many(PyObject* self, PyObject* args) {
  (void)self;
  int device = 0;
  PyObject* list = NULL;
  if (!PyArg_ParseTuple(args, "iO!", &device, &PyList_Type, &list)) return NULL;
  /* a snapshot: parsing a job can run Python code (__index__, __float__) that
   * could change the list under us */
  PyObject* snap = PySequence_Tuple(list);
  if (!snap) return NULL;
  const Py_ssize_t count = PyTuple_Size(snap);
  fp8ops_amax_update_job* jobs = (fp8ops_amax_update_job*)calloc(count ? (size_t)count : 1,
                                                                  sizeof *jobs);
  if (!jobs) {
    Py_DECREF(snap);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < count; ++i) {
    unsigned long long h, s, si, m, o;
    long long n, H, stride;
    double margin;
    int algo;
    PyObject* job = PyTuple_GetItem(snap, i); /* borrowed; snap keeps it alive */
    if (!job || !PyTuple_Check(job)) {
      if (job) PyErr_SetString(PyExc_TypeError, "amax_update_many: each job must be a tuple");
      free(jobs);
      Py_DECREF(snap);
      return NULL;
    }
    if (!PyArg_ParseTuple(job, "KKKKKLLLdi;amax_update_many: a job is (history, "
                          "scale, scale_inv, fp8_max, overflow_count, n, H, scale_inv_stride, "
                          "margin, algo)", &h, &s, &si, &m, &o, &n, &H, &stride, &margin, &algo)) {
      free(jobs);
      Py_DECREF(snap);
      return NULL;
    }
    jobs[i].amax_history = (float*)(uintptr_t)h;
    jobs[i].scale = (float*)(uintptr_t)s;
    jobs[i].scale_inv = (float*)(uintptr_t)si;
    jobs[i].fp8_max = (const float*)(uintptr_t)m;
    jobs[i].overflow_count = (int64_t*)(uintptr_t)o;
    jobs[i].n = n;
    jobs[i].H = H;
    jobs[i].scale_inv_stride = stride;
    jobs[i].margin = (float)margin;
    jobs[i].algo = algo;
  }
  const int rc = fp8ops_amax_update_many(device, jobs, count);
  free(jobs);
  Py_DECREF(snap);
  if (rc != FP8OPS_OK) {
    PyErr_SetString(PyExc_RuntimeError, fp8ops_last_error());
    return NULL;
  }
  Py_RETURN_NONE;
}

/* _C.take_amax_writes() -> None, or a set of ints: the data pointers of the amax slots
 * that ops with an undeclared amax write wrote since the last call (amax_writes.c);
 * None: any slot may have been written (a CUDA graph captured such a write). */
static PyObject* py_take_amax_writes(PyObject* self, PyObject* noargs) {
  (void)self; (void)noargs;
  static uintptr_t slots[FP8OPS_AMAX_WRITES_MAX]; /* (the GIL serializes callers) */
  int count = 0;
  if (fp8ops_take_amax_writes(slots, &count)) Py_RETURN_NONE;
  PyObject* out = PySet_New(NULL);
  for (int i = 0; out && i < count; ++i) {
    PyObject* v = PyLong_FromUnsignedLongLong((unsigned long long)slots[i]);
    if (!v || PySet_Add(out, v) < 0) Py_CLEAR(out);
    Py_XDECREF(v);
  }
  return out;
}

static PyMethodDef k_methods[] = {
    {"amax_update_many", py_amax_update_many, METH_VARARGS,
     "Delayed-scaling update of many histories on one CUDA device, in few launches."},
    {"build_info", py_build_info, METH_NOARGS, "Build and registration facts."},
    {"cublaslt_status", py_cublaslt_status, METH_NOARGS, "None, or why cuBLASLt is unusable."},
    {"take_amax_writes", py_take_amax_writes, METH_NOARGS,
     "The amax slots compiled backwards wrote since the last call (a set of data pointers), "
     "or None: any may have been."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef k_module = {PyModuleDef_HEAD_INIT, "fp8ops._C",
                                      "fp8ops C core: registers torch.ops.fp8ops.*", -1,
                                      k_methods, NULL, NULL, NULL, NULL};

/* torch's current-stream getter lives in libtorch_cuda.so, which torch loads
 * with RTLD_LOCAL: find the already-loaded copy, never load one ourselves. */
static fp8ops_get_current_cuda_stream_fn find_stream_getter(void) {
  fp8ops_get_current_cuda_stream_fn fn = NULL;
  void* h = dlopen("libtorch_cuda.so", RTLD_NOLOAD | RTLD_LAZY);
  if (!h) return NULL;
  *(void**)(&fn) = dlsym(h, "aoti_torch_get_current_cuda_stream");
  dlclose(h); /* drops only the reference NOLOAD took; torch keeps it loaded */
  return fn;
}

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* m = PyModule_Create(&k_module);
  if (!m) return NULL;
  int with_cuda = 0;
  if (!fp8ops_built_with_cuda()) {
    snprintf(g_cuda_reason, sizeof g_cuda_reason, "built without CUDA (%s)",
             fp8ops_no_cuda_reason());
  } else {
    fp8ops_get_current_cuda_stream_fn fn = find_stream_getter();
    if (!fn) {
      snprintf(g_cuda_reason, sizeof g_cuda_reason,
               "this torch has no CUDA (libtorch_cuda.so is not loaded)");
    } else {
      fp8ops_set_stream_getter(fn);
      with_cuda = 1;
    }
  }
  if (fp8ops_register(with_cuda) != FP8OPS_OK) {
    PyErr_Format(PyExc_ImportError, "fp8ops: %s", fp8ops_last_error());
    Py_DECREF(m);
    return NULL;
  }
  g_cuda_registered = with_cuda;
  return m;
}
