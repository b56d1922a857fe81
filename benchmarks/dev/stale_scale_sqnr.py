"""What a stale delayed scale costs an FP8 cast (CPU, torch's float8 rounding): the SQNR of
x -> fp8 -> x when x's amax fills only `ratio` of the format's range, i.e. the scale still
fits an amax 1/ratio larger (a history's maximum from larger tensors), for Gaussian and
heavy-tailed synthetic data. E5M2 (gradients): below ~2^-20 the smallest values start to
flush and the SQNR falls; above it a stale scale costs nothing measurable. E4M3 (inputs and
weights), with 14 binades fewer: the same point is near 2^-8 (fp8ops.report's notes).
    python benchmarks/dev/stale_scale_sqnr.py [--n 4000000] [--fmt e5m2|e4m3]
"""
import argparse

import torch

from fp8ops._reference import sqnr

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=4_000_000)
ap.add_argument("--fmt", choices=("e5m2", "e4m3"), default="e5m2")
args = ap.parse_args()
FP8 = {"e5m2": (torch.float8_e5m2, 57344.0), "e4m3": (torch.float8_e4m3fn, 448.0)}[args.fmt]


def cast(x: torch.Tensor, ratio: float) -> torch.Tensor:
    dtype, fmax = FP8
    s = fmax / x.abs().max() * ratio
    return (x * s).clamp(-fmax, fmax).to(dtype).float() / s


torch.manual_seed(0)
n = args.n
signs = torch.sign(torch.randn(n))
data = {"gaussian": torch.randn(n),
        "student-t df=1": torch.distributions.StudentT(1.0).sample((n,)),
        "lognormal sigma=4": (torch.exp(torch.randn(n).double() * 4) * signs).float(),
        "lognormal sigma=6": (torch.exp(torch.randn(n).double() * 6) * signs).float()}
ks = (0, 5, 10, 14, 16, 18, 20, 22, 24) if args.fmt == "e5m2" else (0, 2, 4, 6, 7, 8, 9, 10, 12, 14)
print(f"{'data':20s} {'amax/rms':>9}  " + " ".join(f"{'2^-' + str(k):>6}" for k in ks) + "   (SQNR dB at range used)")
for name, x in data.items():
    x = x[torch.isfinite(x)]
    rms = x.square().mean().sqrt()
    print(f"{name:20s} {float(x.abs().max() / rms):9.3g}  " + " ".join(f"{sqnr(x, cast(x, 2.0 ** -k)):6.1f}" for k in ks))
