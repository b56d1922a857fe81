"""Kernel time of the dy cast inside linear_bwd, three ways (plain; with the bias gradient; with
the fused GELU gradient and the bias gradient), from torch.profiler over 20 calls each, for GPT-2
small's and the 1B model's gradient shapes. The argument is a label for the lines. To compare
register budgets, build twice with a different CT_MIN_BLOCKS_DB in csrc/cast.cu (RESULTS.md §5):
    python3 benchmarks/dev/dy_cast_kernel_times.py LABEL
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from fp8ops import ops

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


def main(label: str) -> None:
    for M, N, K in [(32768, 3072, 768), (32768, 768, 3072), (16384, 8192, 2048), (16384, 2048, 8192)]:
        gy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w8t = torch.randn(K, N, device="cuda").to(E4)
        x8t = torch.randn(K, M, device="cuda").to(E4)
        s, slot = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
        args = (gy, w8t, x8t, s, slot, s, s, s, E5, torch.bfloat16, torch.float32, True, True)
        variants = {"plain": lambda: ops.linear_bwd(*args),
                    "dbias": lambda: ops.linear_bwd(*args, True),
                    "dgelu+dbias": lambda: ops.linear_bwd(*args, True, gelu_input=h)}
        for name, fn in variants.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                for _ in range(20):
                    fn()
                torch.cuda.synchronize()
            ms = sum(e.device_time_total for e in p.key_averages()
                     if "cast_transpose" in e.key or "dbias_reduce" in e.key) / 20 / 1000
            gb = M * N * 2 * (3 if "dgelu" in name else 2) / 1e9  # read dy (and h), write dy8 and dy8t
            print(f"{label} {M}x{N} {name:12s} cast {ms:.4f} ms  {gb / ms:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "")
