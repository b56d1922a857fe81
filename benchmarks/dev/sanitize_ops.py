"""Small CUDA workload for compute-sanitizer (memcheck/racecheck/initcheck/
synccheck): every fp8ops op on awkward and aligned shapes, and one Fp8Linear
fwd+bwd. Prints OK at the end; run as
    compute-sanitizer --tool memcheck python3 benchmarks/dev/sanitize_ops.py
With the argument "scaled_mm" it runs no fp8ops code at all: torch._scaled_mm
(torch's own cuBLASLt FP8 GEMM) followed by GELU, the control for initcheck's
report on GELU reading an FP8 GEMM's output.
"""
import sys

import torch

dev = "cuda"
torch.manual_seed(0)
if sys.argv[1:] == ["scaled_mm"]:
    one = torch.ones((), device=dev)
    for (M, N, out) in ((64, 512, torch.bfloat16), (128, 64, torch.float32)):  # the shapes flagged in fp8ops
        a = torch.randn(M, 256, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(N, 256, device=dev).to(torch.float8_e4m3fn)
        bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
        for with_bias in (False, True):
            for fast in (False, True):
                print(f"--- torch._scaled_mm {M}x256x{N} out={out} bias={with_bias} fast_accum={fast}", flush=True)
                y = torch._scaled_mm(a, b.t(), one, one, bias=bias if with_bias else None, out_dtype=out,
                                     use_fast_accum=fast)
                torch.nn.functional.gelu(y).float().sum().item()
    print("OK")
    sys.exit(0)

import fp8ops  # noqa: E402
from fp8ops import _loader, ops  # noqa: E402
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
# the optimizer hook's many-layer update: 33 histories of Fp8Linear's width (3 columns), two launches
keep = []
for H in [1024] * 32 + [5]:
    t = (torch.rand(H, 3, device=dev), torch.ones(3, device=dev), torch.ones(3, device=dev),
         torch.full((3,), 448.0, device=dev), torch.zeros(3, dtype=torch.int64, device=dev))
    keep.append(t)
_loader._C.amax_update_many(torch.cuda.current_device(), [
    (t[0].data_ptr(), t[1].data_ptr(), t[2].data_ptr(), t[3].data_ptr(), t[4].data_ptr(), 3, t[0].shape[0], 1, 0.0,
     ops.AMAX_ALGOS["max"]) for t in keep])
if torch.cuda.get_device_capability() >= (8, 9):
    a = torch.randn(128, 256, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(64, 256, device=dev).to(torch.float8_e4m3fn)
    one = torch.ones(1, device=dev)
    for out in (torch.bfloat16, torch.float16, torch.float32):
        bias = torch.randn(64, device=dev).to(ops._bias_dtype(out))
        for fast in (False, True):
            for bb in (bias, None):
                # initcheck control: a torch op reading the GEMM's output
                print(f"--- fp8ops gemm out={out} bias={bb is not None} fast_accum={fast}", flush=True)
                torch.nn.functional.gelu(ops.gemm(a, b, one, one, bb, out, fast)).sum().item()
    # the fused calls, with operands at 16-byte-misaligned offsets too (copied in C)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    x = torch.randn(128, 256, device=dev, dtype=torch.bfloat16)
    slot = torch.zeros(4, 3, device=dev)[0, 1]
    w8, w8t = ops.cast_accumulate(torch.randn(64, 256, device=dev), one, slot, e4, True)
    y, x8t, _, _ = ops.linear_fwd(x, w8, one, slot, one, one, torch.randn(64, device=dev, dtype=torch.bfloat16))
    ops.linear_fwd(x, torch.randn(64, 256, device=dev), one, slot, one, one, w_scale=one, w_amax=slot.clone(), save_wt=True)
    gy = torch.randn(128, 64, device=dev, dtype=torch.bfloat16)
    ops.linear_bwd(gy, w8t, x8t, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, True)
    # the bias gradient: fused into the cast (400 rows: a partial last tile), and the separate
    # column-sum pass (gy at a misaligned offset; no transpose wanted)
    print("--- linear_bwd with db", flush=True)
    gy4 = torch.randn(400, 64, device=dev, dtype=torch.bfloat16)
    x8t4 = torch.randn(256, 400, device=dev).to(e4)
    ops.linear_bwd(gy4, w8t, x8t4, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, True,
                   True)[2].sum().item()
    gyo = torch.randn(1 + 128 * 64, device=dev, dtype=torch.bfloat16)[1:].view(128, 64)
    ops.linear_bwd(gyo, w8t, x8t, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, True,
                   True)[2].sum().item()
    ops.linear_bwd(gy, w8t, x8t, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, False,
                   True)[2].sum().item()
    odd = torch.empty(1 + 64 * 256, device=dev, dtype=torch.uint8).view(e4)[1:].view(64, 256)
    odd.copy_(w8)
    ops.linear_fwd(x, odd, one, slot, one, one)
    # the fused GELU: its cast (transposing, elementwise, unaligned), its gradient fused into
    # the gradient cast (400 rows: a partial last tile; with and without the bias gradient), and
    # the separate gradient pass (no transpose wanted; gy at a misaligned offset)
    print("--- fused GELU", flush=True)
    ops.linear_fwd(x, w8, one, slot, one, one, gelu_input=True)
    ops.linear_fwd(x, w8, one, slot, one, one, save_xt=False, gelu_input=True)
    xo = torch.randn(1 + 128 * 256, device=dev, dtype=torch.bfloat16)[1:].view(128, 256)
    ops.linear_fwd(xo, w8, one, slot, one, one, gelu_input=True)
    h4 = torch.randn(400, 64, device=dev, dtype=torch.bfloat16)
    for db in (False, True):
        ops.linear_bwd(gy4, w8t, x8t4, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, True,
                       db, gelu_input=h4)[0].sum().item()
    ops.linear_bwd(gy, w8t, x8t, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, False,
                   True, gelu_input=torch.randn_like(gy))[0].sum().item()
    ops.linear_bwd(gyo, w8t, x8t, one, slot, one, one, one, e5, torch.bfloat16, torch.float32, True, True,
                   True, gelu_input=torch.randn_like(gy))[0].sum().item()
    # the fused LayerNorm: the statistics and the normalizing cast (a partial tile; x at a
    # misaligned offset: the general kernel)
    print("--- fused LayerNorm", flush=True)
    lw, lb = torch.randn(256, device=dev), torch.randn(256, device=dev)
    ops.ln_linear_fwd(torch.randn(400, 256, device=dev), lw, lb, 1e-5, w8, one, slot, one, one)
    ops.ln_linear_fwd(x, lw, lb, 1e-5, w8, one, slot, one, one)
    ops.ln_linear_fwd(xo, lw, lb, 1e-5, w8, one, slot, one, one)[0].sum().item()
    lw2, lb2 = torch.randn(2048, device=dev), torch.randn(2048, device=dev)  # the widest vector statistics
    ops.ln_linear_fwd(torch.randn(32, 2048, device=dev), lw2, lb2, 1e-5, torch.zeros(16, 2048, device=dev).to(
        torch.float8_e4m3fn), one, slot, one, one)[0].sum().item()
    # its backward: a partial CTA, more rows per warp, two warps per row (fp8ops.h), each dtype
    for M, K, dt in ((400, 256, torch.float32), (20000, 64, torch.bfloat16), (37, 1024, torch.float16),
                     (45, 2048, torch.float32), (9, 1040, torch.bfloat16), (13, 4096, torch.float32),
                     (70, 3072, torch.bfloat16)):
        xl = torch.randn(M, K, device=dev).to(dt)
        _, mu, rs = torch.native_layer_norm(xl.float(), [K], None, None, 1e-5)
        ops.layernorm_bwd(torch.randn_like(xl), xl, mu.view(-1), rs.view(-1), torch.randn(K, device=dev))[1].sum().item()
    # x and dy at misaligned offsets: read from the op's aligned copies
    xm = torch.randn(64 * 96 + 1, device=dev).to(torch.bfloat16)[1:].view(64, 96)
    _, mu, rs = torch.native_layer_norm(xm.float(), [96], None, None, 1e-5)
    ops.layernorm_bwd(torch.randn(64 * 96 + 3, device=dev).to(torch.bfloat16)[3:].view(64, 96), xm, mu.view(-1),
                      rs.view(-1), torch.randn(96, device=dev))[0].float().sum().item()
    # the residual adds fused into the norm (residual_pass.py): the statistics' one pass (fp32 x,
    # bf16 res; the widest rows), the add kernel first (a misaligned res), dx + dres with its copy
    print("--- residual adds", flush=True)
    xr = torch.randn(400, 256, device=dev)
    ops.ln_linear_fwd(xr, lw, lb, 1e-5, w8, one, slot, one, one, res=torch.randn_like(xr).bfloat16())[6].sum().item()
    ops.ln_linear_fwd(torch.randn(32, 2048, device=dev), lw2, lb2, 1e-5, torch.zeros(16, 2048, device=dev).to(
        torch.float8_e4m3fn), one, slot, one, one, res=torch.randn(32, 2048, device=dev))[6].sum().item()
    rmis = torch.randn(400 * 256 + 1, device=dev).bfloat16()[1:].view(400, 256)
    ops.ln_linear_fwd(xr, lw, lb, 1e-5, w8, one, slot, one, one, res=rmis)[6].sum().item()
    xb = torch.randn(400, 256, device=dev).bfloat16()  # bf16 + bf16: 16-byte residual vectors
    ops.ln_linear_fwd(xb, lw, lb, 1e-5, w8, one, slot, one, one, res=torch.randn_like(xb))[6].float().sum().item()
    for M, K, copy_dtype in ((400, 256, torch.bfloat16), (45, 2048, torch.float16), (13, 4096, torch.bfloat16)):
        xl = torch.randn(M, K, device=dev)
        _, mu, rs = torch.native_layer_norm(xl, [K], None, None, 1e-5)
        ops.layernorm_bwd(torch.randn_like(xl), xl, mu.view(-1), rs.view(-1), torch.randn(K, device=dev),
                          dres=torch.randn_like(xl), copy_dtype=copy_dtype)[2].float().sum().item()
    # a bf16 dres at a misaligned offset (read from the op's aligned copy), no copy
    xl = torch.randn(64, 96, device=dev).bfloat16()
    _, mu, rs = torch.native_layer_norm(xl.float(), [96], None, None, 1e-5)
    ops.layernorm_bwd(torch.randn_like(xl), xl, mu.view(-1), rs.view(-1), None,
                      dres=torch.randn(64 * 96 + 1, device=dev).bfloat16()[1:].view(64, 96))[0].float().sum().item()
    # the RMSNorm variant, without weight / bias (the kernels' ones and zeros): vector and scalar
    # statistics, the backward with and without gamma
    print("--- fused RMSNorm", flush=True)
    ops.ln_linear_fwd(torch.randn(400, 256, device=dev), None, None, 1e-6, w8, one, slot, one, one, rms=True)
    ops.ln_linear_fwd(xo, lw, None, 1e-6, w8, one, slot, one, one, rms=True)[0].sum().item()
    for M, K, dt, g in ((400, 256, torch.float32, None), (45, 2048, torch.bfloat16, torch.randn(2048, device=dev)),
                        (21, 4096, torch.float32, torch.randn(4096, device=dev))):
        xl = torch.randn(M, K, device=dev).to(dt)
        rs = torch.rsqrt(xl.float().square().mean(1) + 1e-6)
        ops.layernorm_bwd(torch.randn_like(xl), xl, torch.zeros(M, device=dev), rs, g, rms=True)[1].sum().item()
    # the SwiGLU: the fused cast (a partial tile: 400 rows, 48 columns of a 64-wide tile),
    # the buffer path (no transpose wanted; x at a misaligned offset), and the activation's
    # own kernels (16-byte vectors; one element at a time for 13 columns and a misaligned x)
    print("--- SwiGLU", flush=True)
    w48 = torch.randn(64, 48, device=dev).to(e4)
    xs = torch.randn(400, 96, device=dev, dtype=torch.bfloat16)
    ops.linear_fwd(xs, w48, one, slot, one, one, swiglu_input=True)[0].sum().item()
    ops.linear_fwd(xs, w48, one, slot, one, one, save_xt=False, swiglu_input=True)[0].sum().item()
    xso = torch.randn(1 + 400 * 96, device=dev, dtype=torch.bfloat16)[1:].view(400, 96)
    ops.linear_fwd(xso, w48, one, slot, one, one, swiglu_input=True)[0].sum().item()
    for xa in (torch.randn(37, 2 * 40, device=dev), torch.randn(37, 26, device=dev, dtype=torch.float16), xso,
               torch.randn(3, 5, 2 * 64, device=dev, dtype=torch.bfloat16)):
        ops.swiglu(xa).sum().item()
        ops.swiglu_backward(torch.randn(*xa.shape[:-1], xa.shape[-1] // 2, device=dev).to(xa.dtype),
                            xa).sum().item()
    print("--- Fp8Linear", flush=True)
    mlp = torch.nn.Sequential(torch.nn.LayerNorm(256), torch.nn.Linear(256, 512), torch.nn.GELU("tanh"),
                              torch.nn.Linear(512, 256))
    lin = fp8ops.convert(mlp.to(dev), config=fp8ops.Fp8Config(policy="always"))
    assert lin[3].fp8_gelu_input and lin[1].fp8_gelu_output and lin[1].fp8_ln_input is lin[0]
    x = torch.randn(64, 256, device=dev, requires_grad=True)
    for _ in range(2):  # the second step runs the fused GELU
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lin(x).float().sum().backward()
        fp8ops.step(lin)
torch.cuda.synchronize()
print("OK")
