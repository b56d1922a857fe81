"""Attribute racecheck hazards in cuBLASLt's FP8 GEMM kernels: run ONE side of
tests/test_gemm.py::test_gemm_cuda_vs_scaled_mm (same operands, bias, scales, fast-accum
settings) at the shapes where racecheck reported hazards inside nvjet_sm90_qq* kernels.
    compute-sanitizer --tool racecheck --nvtx yes python3 benchmarks/dev/racecheck_gemm_control.py scaled_mm
    compute-sanitizer --tool racecheck --nvtx yes python3 benchmarks/dev/racecheck_gemm_control.py fp8ops
If torch._scaled_mm alone reproduces them, the hazards belong to cuBLASLt's kernel, not to
fp8ops' use of it (both call cublasLtMatmul; fp8ops does not choose the kernel's code)."""
import sys

import torch

who = sys.argv[1]
shapes = [(1024, 768, 3072), (2048, 4096, 4096)]  # (M, N, K) as the test parametrizes them
E4 = torch.float8_e4m3fn
if who == "fp8ops":
    from fp8ops import ops
for M, N, K in shapes:
    for fast_accum in (False, True):
        gen = torch.Generator(device="cuda").manual_seed(M)
        a = torch.randn(M, K, device="cuda", generator=gen).to(E4)
        b = torch.randn(N, K, device="cuda", generator=gen).to(E4)
        sa, sb = torch.tensor([0.7], device="cuda"), torch.tensor([1.3], device="cuda")
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        if who == "fp8ops":
            y = ops.gemm(a, b, sa, sb, bias, torch.bfloat16, fast_accum)
        else:
            y = torch._scaled_mm(a, b.t(), sa, sb, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)
        torch.cuda.synchronize()
        print(f"{who} M={M} N={N} K={K} fast_accum={fast_accum}: done", flush=True)
print("OK")
