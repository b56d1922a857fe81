"""Host cost of a C op inside a Python backward, against the op alone and against the
autograd engine's own hand-off. For CUDA tensors the engine runs backward on its device
thread; the caller waits. A small shape keeps the GPU ahead of the host (pure host time).
    python benchmarks/dev/engine_thread_cost.py
"""
import collections
import time

import torch

from fp8ops import Fp8Config, ops
from fp8ops.linear import G, V_H, V_S, V_SI, W, X, Fp8Linear
from layer_iteration import make_iteration  # this folder

M = K = N = 256
dev = "cuda"
lin = Fp8Linear(K, N, bias=False, device=dev, config=Fp8Config(policy="always"))
views = lin._fp8_views(False)
x_dt, w_dt, g_dt = lin.fp8_dtypes
x = torch.randn(M, K, device=dev, dtype=torch.bfloat16, requires_grad=True)
g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
_, x8t, _, w8t = ops._linear_fwd_raw(
    x.detach(), lin.weight.detach(), views[V_S + X], views[V_H + X], views[V_SI + X], views[V_S + W],
    views[V_H + W], views[V_SI + W], ops._empty_bias_for(x, torch.bfloat16), x_dt, w_dt, torch.bfloat16,
    True, True, True)
inner = collections.defaultdict(float)
no_gelu = ops._empty_for(g, torch.bfloat16)  # linear_bwd's gelu_input: none


def bwd():
    return ops._linear_bwd_raw(g, w8t, x8t, views[V_S + G], views[V_H + G], views[V_SI + G], views[V_SI + W],
                               views[V_SI + X], no_gelu, g_dt, torch.bfloat16, torch.float32, True, True, False)


class Bare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 1

    @staticmethod
    def backward(ctx, gy):
        return gy


class WithOp(Bare):
    """The same, with linear_bwd in its backward (timed there)."""

    @staticmethod
    def backward(ctx, gy):
        t = time.perf_counter()
        dx, _, _ = bwd()
        inner["linear_bwd inside the backward"] += time.perf_counter() - t
        return dx


def timeit(name, fn, n=200):
    """best of 5 loops of n calls, host us per call (and the timed parts inside)"""
    best, parts = float("inf"), {}
    for _ in range(5):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        inner.clear()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        us = (time.perf_counter() - t) / n * 1e6
        if us < best:
            best, parts = us, {k: round(v / n * 1e6, 1) for k, v in inner.items()}
    torch.cuda.synchronize()
    print(f"{name:52} {best:7.1f} us  {parts or ''}", flush=True)


model = torch.nn.Sequential(Fp8Linear(K, N, bias=False, device=dev, config=Fp8Config(policy="always")))
ref = torch.nn.Linear(K, N, bias=False, device=dev)


ref_iteration = make_iteration(ref, x, g, step=False)
fp8_iteration = make_iteration(model, x, g, step=True)
timeit("linear_bwd alone", bwd)
for threads in (True, False):
    torch.autograd.set_multithreading_enabled(threads)
    tag = "" if threads else ", engine multithreading off"
    timeit("Function, bare backward" + tag, lambda: Bare.apply(x).backward(g))
    timeit("Function, linear_bwd in its backward" + tag, lambda: WithOp.apply(x).backward(g))
    timeit("nn.Linear fwd+bwd" + tag, ref_iteration)
    timeit("Fp8Linear fwd+bwd+step" + tag, fp8_iteration)
torch.autograd.set_multithreading_enabled(True)
