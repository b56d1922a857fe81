"""Small CUDA workload for compute-sanitizer (memcheck/racecheck/initcheck/
synccheck): every fp8ops op on awkward and aligned shapes, and one Fp8Linear
fwd+bwd. Prints OK at the end; run as
    compute-sanitizer --tool memcheck python3 benchmarks/dev/sanitize_ops.py
"""
import torch

import fp8ops
from fp8ops import ops

dev = "cuda"
torch.manual_seed(0)
for shape in [(1, 16), (5, 160), (217, 256), (3, 7), (64, 48), (256, 4096)]:
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        x = (torch.randn(shape, device=dev) * 10).to(dt)
        s = torch.tensor([2.0], device=dev)
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            for t in (False, True):
                ops.cast(x, s, fp8, t)
        ops.amax(x)
base = torch.randn(1 + 64 * 48, device=dev, dtype=torch.bfloat16)
ops.cast(base[1:].view(64, 48), torch.ones(1, device=dev), torch.float8_e4m3fn, True)  # unaligned
for H, n in [(1, 1), (31, 3), (1024, 7), (5, 1000)]:
    h = torch.rand(H, n, device=dev)
    ops.amax_update(h, torch.ones(n, device=dev), torch.ones(n, device=dev), torch.full((n,), 448.0, device=dev), 0.0, "max")
if torch.cuda.get_device_capability() >= (8, 9):
    a = torch.randn(128, 256, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(64, 256, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)
    for out in (torch.bfloat16, torch.float16, torch.float32):
        bias = torch.randn(64, device=dev).to(ops._bias_dtype(out))
        ops.gemm(a, b, one, one, bias, out, True)
        ops.gemm(a, b, one, one, None, out, False)
    lin = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to(dev),
                         config=fp8ops.Fp8Config(policy="always"))
    x = torch.randn(64, 256, device=dev, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lin(x).float().sum().backward()
torch.cuda.synchronize()
print("OK")
