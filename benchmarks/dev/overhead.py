"""Host overhead and hidden synchronisation of each fp8ops op on the GPU.

For each op: (1) host microseconds per call on tiny tensors (launch-bound);
(2) host time to enqueue 50 calls on large tensors vs the GPU time they take:
an op that synchronises makes enqueue time ~= GPU time. Run:
    python benchmarks/dev/overhead.py
"""
import time

import torch

import fp8ops
from fp8ops import ops


def host_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def enqueue_vs_gpu(fn, n=50):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    e0.record()
    for _ in range(n):
        fn()
    e1.record()
    enq = (time.perf_counter() - t) * 1e3
    e1.synchronize()
    return enq, e0.elapsed_time(e1)


dev = "cuda"
e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
s = torch.ones(1, device=dev)
sv = torch.ones(3, device=dev)[1:2]  # a 4-byte-offset view, as Fp8Linear passes
xs = torch.randn(16, 16, device=dev, dtype=torch.bfloat16)
a8 = torch.randn(16, 16, device=dev).to(e4)
xl = torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16)
al = torch.randn(16384, 3072, device=dev).to(e4)
bl = torch.randn(768, 3072, device=dev).to(e4)
slot = torch.zeros(4, 3, device=dev)[0, 1]
gl = torch.randn(16384, 768, device=dev, dtype=torch.bfloat16)
wl8t = torch.randn(3072, 768, device=dev).to(e4)
xl8t = torch.randn(3072, 16384, device=dev).to(e4)
rows = [
    ("torch.add tiny", lambda: torch.add(xs, xs), None),
    ("ops.cast tiny (autograd layer)", lambda: ops.cast(xs, s, e4, True), lambda: ops.cast(xl, s, e5, True)),
    ("ops.amax tiny", lambda: ops.amax(xs), lambda: ops.amax(xl)),
    ("ops.gemm tiny", lambda: ops.gemm(a8, a8, s, s, None, torch.bfloat16, False),
     lambda: ops.gemm(al, bl, s, s, None, torch.bfloat16, False)),
    ("ops.gemm tiny, offset scale", lambda: ops.gemm(a8, a8, sv, sv, None, torch.bfloat16, False),
     lambda: ops.gemm(al, bl, sv, sv, None, torch.bfloat16, False)),
    ("torch._scaled_mm tiny", lambda: torch._scaled_mm(a8, a8.t(), s, s, out_dtype=torch.bfloat16),
     lambda: torch._scaled_mm(al, bl.t(), s, s, out_dtype=torch.bfloat16)),
    ("cast_accumulate tiny", lambda: ops.cast_accumulate(xs, s, slot, e4, True),
     lambda: ops.cast_accumulate(xl, s, slot, e4, True)),
    ("linear_fwd tiny (cast+GEMM)", lambda: ops.linear_fwd(xs, a8, s, slot, s, s),
     lambda: ops.linear_fwd(xl, bl, s, slot, s, s)),
    ("linear_fwd tiny (+ weight cast)", lambda: ops.linear_fwd(xs, xs, s, slot, s, s, w_scale=s, w_amax=slot),
     lambda: ops.linear_fwd(xl, bl.to(torch.bfloat16), s, slot, s, s, w_scale=s, w_amax=slot)),
    ("linear_bwd tiny (cast+2 GEMMs)",
     lambda: ops.linear_bwd(xs, a8, a8, s, slot, s, s, s),
     lambda: ops.linear_bwd(gl, wl8t, xl8t, s, slot, s, s, s)),
    ("amax_update 1x3", lambda: ops.amax_update(torch.zeros(4, 3, device=dev), torch.ones(3, device=dev),
                                                torch.ones(3, device=dev), torch.full((3,), 448.0, device=dev)), None),
]
print(f"{'op':34} {'host us/call':>12} {'enqueue ms/50':>14} {'gpu ms/50':>10}")
for name, tiny, big in rows:
    h = host_us(tiny)
    enq, gpu = enqueue_vs_gpu(big) if big else (float("nan"), float("nan"))
    print(f"{name:34} {h:12.1f} {enq:14.2f} {gpu:10.2f}")

lin = fp8ops.convert(torch.nn.Linear(768, 3072, bias=False).to(dev), config=fp8ops.Fp8Config(policy="always"))
ref = torch.nn.Linear(768, 3072, bias=False).to(dev)
x = torch.randn(16384, 768, device=dev, requires_grad=True)
g = torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16)


def it(m, step):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(x)
    y.backward(g)
    if step:
        fp8ops.step(m)


for name, fn in [("bf16 linear fwd+bwd", lambda: it(ref, False)), ("fp8ops linear fwd+bwd+step", lambda: it(lin, True)),
                 ("fp8ops linear fwd+bwd (cached W)", lambda: it(lin, False))]:
    enq, gpu = enqueue_vs_gpu(fn, 20)
    print(f"{name:34} enqueue {enq / 20:.3f} ms/iter, GPU {gpu / 20:.3f} ms/iter")

# Host cost of one whole layer call on tiny tensors (host-bound: the GPU work is negligible):
# what the Fp8Linear wrapper, its autograd.Function and its two C calls cost over nn.Linear's.
xt = torch.randn(64, 64, device=dev, requires_grad=True)
gt = torch.randn(64, 64, device=dev, dtype=torch.bfloat16)
ref_t = torch.nn.Linear(64, 64, bias=False).to(dev)
lin_t = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False).to(dev)),
                       config=fp8ops.Fp8Config(policy="always"))


def tiny_it(m, step, bwd=True):
    xt.grad = None
    for p in m.parameters():
        p.grad = None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = m(xt)
    if bwd:
        y.backward(gt)
    if step:
        fp8ops.step(m)


for name, fn in [("tiny nn.Linear fwd+bwd", lambda: tiny_it(ref_t, False)),
                 ("tiny Fp8Linear fwd+bwd+step", lambda: tiny_it(lin_t, True)),
                 ("tiny Fp8Linear fwd+bwd (cached W)", lambda: tiny_it(lin_t, False)),
                 ("tiny nn.Linear fwd", lambda: tiny_it(ref_t, False, False)),
                 ("tiny Fp8Linear fwd (cached W)", lambda: tiny_it(lin_t, False, False)),
                 ("fp8ops.step alone (nothing cast)", lambda: fp8ops.step(lin_t))]:
    print(f"{name:34} host {host_us(fn, 1000):7.1f} us/iter")
