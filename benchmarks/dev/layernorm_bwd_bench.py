"""GPU time of the fused LayerNorm's backward: fp8ops' layernorm_bwd (one read
of x and dy) against torch's native_layer_norm_backward (a dx kernel, then a
column-sum kernel for dgamma / dbeta), on GPT-2's, the 1B model's and 4096-wide LayerNorm shapes, and
its RMSNorm variant against torch's fused RMSNorm backward, each timed
back to back (CUDA events, median of 5 rounds of 50 calls). Usage:
    python3 benchmarks/dev/layernorm_bwd_bench.py
"""
import torch

from fp8ops import ops


def time_ms(fn, reps=50, rounds=5):
    for _ in range(5):
        fn()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return sorted(out)[len(out) // 2]


def main():
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| M x K | dtype | torch ms | fp8ops ms | speedup | GB/s fp8ops (x, dy read; dx written) | max |dx| diff |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for M, K, dt in ((32768, 768, torch.float32), (8192, 768, torch.float32), (32768, 768, torch.bfloat16),
                     (16384, 1024, torch.float32), (16384, 1024, torch.bfloat16), (16384, 2048, torch.float32),
                     (16384, 2048, torch.bfloat16), (16384, 1536, torch.float32), (16384, 4096, torch.float32),
                     (16384, 4096, torch.bfloat16), (16384, 3072, torch.float32)):
        x = (torch.randn(M, K, device="cuda") * 2 + 0.5).to(dt)
        dy = torch.randn(M, K, device="cuda").to(dt)
        w = torch.randn(K, device="cuda") * 0.1 + 1
        b = torch.zeros(K, device="cuda")
        _, mean, rstd = torch.native_layer_norm(x, [K], w.to(dt), b.to(dt), 1e-5)
        wd, bd = w.to(dt), b.to(dt)
        t_ref = time_ms(lambda: torch.ops.aten.native_layer_norm_backward(dy, x, [K], mean, rstd, wd, bd,
                                                                          [True, True, True]))
        m1, r1 = mean.view(-1), rstd.view(-1)
        t_f = time_ms(lambda: ops.layernorm_bwd(dy, x, m1, r1, w))
        dx, _ = ops.layernorm_bwd(dy, x, m1, r1, w)
        dx_ref = torch.ops.aten.native_layer_norm_backward(dy, x, [K], mean, rstd, wd, bd, [True, True, True])[0]
        gbs = 3 * x.numel() * x.element_size() / t_f / 1e6
        print(f"| {M} x {K} | {str(dt)[6:]} | {t_ref:.4f} | {t_f:.4f} | {t_ref / t_f:.2f}x | {gbs:.0f} | "
              f"{(dx.float() - dx_ref.float()).abs().max().item():.2e} |")

    # the RMSNorm variant against torch's fused RMSNorm backward (the kernel F.rms_norm's backward runs)
    print("\n| M x K (RMSNorm) | dtype | torch _fused_rms_norm_backward ms | fp8ops ms | speedup | max |dx| diff |")
    print("|---|---|---:|---:|---:|---:|")
    for M, K, dt in ((16384, 2048, torch.float32), (16384, 4096, torch.float32), (16384, 4096, torch.bfloat16)):
        x = (torch.randn(M, K, device="cuda") * 2 + 0.5).to(dt)
        dy = torch.randn(M, K, device="cuda").to(dt)
        w = torch.randn(K, device="cuda") * 0.1 + 1
        wd = w.to(dt)
        _, rstd = torch.ops.aten._fused_rms_norm(x, [K], wd, 1e-5)
        t_ref = time_ms(lambda: torch.ops.aten._fused_rms_norm_backward(dy, x, [K], rstd, wd, [True, True]))
        zeros, r1 = torch.zeros(M, device="cuda"), rstd.view(-1)
        t_f = time_ms(lambda: ops.layernorm_bwd(dy, x, zeros, r1, w, rms=True))
        dx = ops.layernorm_bwd(dy, x, zeros, r1, w, rms=True)[0]
        dx_ref = torch.ops.aten._fused_rms_norm_backward(dy, x, [K], rstd, wd, [True, True])[0]
        print(f"| {M} x {K} | {str(dt)[6:]} | {t_ref:.4f} | {t_f:.4f} | {t_ref / t_f:.2f}x | "
              f"{(dx.float() - dx_ref.float()).abs().max().item():.2e} |")


if __name__ == "__main__":
    main()
