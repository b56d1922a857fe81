"""What a stale delayed scale costs an E5M2 cast (CPU, torch's float8_e5m2 rounding): the
SQNR of x -> fp8 -> x when x's amax fills only `ratio` of the format's range, i.e. the scale
still fits an amax 1/ratio larger (a history's maximum from larger gradients), for Gaussian
and heavy-tailed synthetic data. Below ~2^-20 the smallest values start to flush and the
SQNR falls; above it a stale scale costs nothing measurable.
    python benchmarks/dev/stale_scale_sqnr.py [--n 4000000]
"""
import argparse

import torch

from fp8ops._reference import sqnr

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=4_000_000)
args = ap.parse_args()
E5M2_MAX = 57344.0


def cast(x: torch.Tensor, ratio: float) -> torch.Tensor:
    s = E5M2_MAX / x.abs().max() * ratio
    return (x * s).clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2).float() / s


torch.manual_seed(0)
n = args.n
signs = torch.sign(torch.randn(n))
data = {"gaussian": torch.randn(n),
        "student-t df=1": torch.distributions.StudentT(1.0).sample((n,)),
        "lognormal sigma=4": (torch.exp(torch.randn(n).double() * 4) * signs).float(),
        "lognormal sigma=6": (torch.exp(torch.randn(n).double() * 6) * signs).float()}
ks = (0, 5, 10, 14, 16, 18, 20, 22, 24)
print(f"{'data':20s} {'amax/rms':>9}  " + " ".join(f"{'2^-' + str(k):>6}" for k in ks) + "   (SQNR dB at range used)")
for name, x in data.items():
    x = x[torch.isfinite(x)]
    rms = x.square().mean().sqrt()
    print(f"{name:20s} {float(x.abs().max() / rms):9.3g}  " + " ".join(f"{sqnr(x, cast(x, 2.0 ** -k)):6.1f}" for k in ks))
