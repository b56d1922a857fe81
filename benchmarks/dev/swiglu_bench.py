"""GPU time of the SwiGLU, alone and in a Llama-style MLP (c_proj(swiglu(c_fc(x))), no
biases), each timed back to back (CUDA events, median of 5 rounds):

1. the activation's forward + backward: torch's chunk, silu and mul (autograd) against
   fp8ops::swiglu and swiglu_backward (one pass each), bf16;
2. the MLP's forward + backward + scale update under bf16 autocast, fp32 master weights:
   BF16 (nn.Linear, torch's SwiGLU), fp8ops with the SwiGLU module left alone
   (fuse_swiglu=False: torch's SwiGLU between two FP8 linears), fp8ops fused (c_proj casts
   silu(gate) * up itself; its backward runs swiglu_backward); policy "always"; and the
   peak memory of one such step above the model and input.
Usage:
    python3 benchmarks/dev/swiglu_bench.py
"""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops import ops
from layernorm_bwd_bench import time_ms  # the same back-to-back timer (this folder is on sys.path)


class SiluAndMul(nn.Module):
    def forward(self, x):
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class MLP(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.c_fc = nn.Linear(d, 2 * hidden, bias=False)
        self.act = SiluAndMul()
        self.c_proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.c_proj(self.act(self.c_fc(x)))


def activation_alone():
    print("| M x H (bf16) | torch fwd+bwd ms | fp8ops fwd+bwd ms | speedup | fp8ops fwd GB/s | fp8ops bwd GB/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for M, H in ((16384, 5632), (16384, 11008), (32768, 2048)):
        x = torch.randn(M, 2 * H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dh = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)

        def torch_step():
            gate, up = x.chunk(2, dim=-1)
            (F.silu(gate) * up).backward(dh)

        def fp8ops_step():
            ops.swiglu(x).backward(dh)

        t_ref, t_f = time_ms(torch_step, reps=20), time_ms(fp8ops_step, reps=20)
        xd = x.detach()
        t_fwd = time_ms(lambda: ops.swiglu(xd))
        t_bwd = time_ms(lambda: ops.swiglu_backward(dh, xd))
        unit = M * H * 2  # bytes of one [M, H] bf16 tensor: forward moves 3 of them, backward 5
        print(f"| {M} x {H} | {t_ref:.3f} | {t_f:.3f} | {t_ref / t_f:.2f}x | {3 * unit / t_fwd / 1e6:.0f} | "
              f"{5 * unit / t_bwd / 1e6:.0f} |")


def mlp_variants(M, d, hidden):
    torch.manual_seed(0)
    base = MLP(d, hidden).cuda()
    x = torch.randn(M, d, device="cuda", requires_grad=True)
    g = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for name, fuse in (("bf16", None), ("fp8ops, SwiGLU unfused", False), ("fp8ops, SwiGLU fused", True)):
        model = copy.deepcopy(base)
        if fuse is not None:
            fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always", fuse_swiglu=fuse))
            assert model.c_proj.fp8_swiglu_input == fuse

        def step(model=model):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = model(x)
            y.backward(g)
            fp8ops.step(model)

        for _ in range(3):  # past delayed scaling's first step (current scales, unfused)
            step()
        t = time_ms(step, reps=20)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base_mem = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
        rows.append((name, t, peak))
        del model
    print(f"\nMLP {M} x {d} -> 2 x {hidden} -> {d}, fwd + bwd + scale update, bf16 autocast:")
    print("| variant | ms | x vs BF16 | peak MiB above the model |")
    print("|---|---:|---:|---:|")
    for name, t, peak in rows:
        print(f"| {name} | {t:.3f} | {rows[0][1] / t:.3f} | {peak:.0f} |")


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    activation_alone()
    mlp_variants(16384, 2048, 5632)   # the llama1b model's MLP (batch 8 x 2048 tokens)
    mlp_variants(8192, 4096, 11008)   # a 7B model's MLP


if __name__ == "__main__":
    main()
