"""c_attn's backward with its dy as q, k, v gradients: fp8ops::linear_bwd_cat (the cast reads
the three blocks in place) against torch.cat then fp8ops::linear_bwd_sink (what compiled code
ran before cat_grad_pass.py, with eager's cat kernel), GPU time per call (CUDA events, median of
rounds), and the two results compared bit for bit.
    python benchmarks/dev/cat_cast_bench.py [--shapes 32768x768,16384x2048] [--iters 50]
"""
import argparse
import statistics

import torch

from fp8ops import ops

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="32768x768,16384x2048", help="MxC: tokens x model width (dy is M x 3C)")
ap.add_argument("--iters", type=int, default=50)
ap.add_argument("--rounds", type=int, default=5)
args = ap.parse_args()
E4, E5, ST = torch.float8_e4m3fn, torch.float8_e5m2, ops.ST
dev = "cuda"


def timed(fn, iters, rounds):
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / iters)
    return statistics.median(out)


print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
for shape in args.shapes.split(","):
    M, C = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    # q, k, v gradients as the attention's backward leaves them: three [M, C] tensors
    blocks = [torch.randn(M, C, device=dev, dtype=torch.bfloat16) for _ in range(3)]
    w8t = torch.randn(C, 3 * C, device=dev).to(E4)
    x8t = torch.randn(C, M, device=dev).to(E4)
    f = lambda v: torch.tensor([v], device=dev)  # noqa: E731
    sg, sgi, swi, sxi = f(1.0), f(1.0), f(0.5), f(0.5)
    empty = torch.empty(0, device=dev, dtype=torch.bfloat16)
    tail = (ST[E5], ST[torch.bfloat16], ST[torch.float32], True, True, True)

    def old(amax):
        return torch.ops.fp8ops.linear_bwd_sink.default(torch.cat(blocks, 1), w8t, x8t, sg, amax, sgi, swi, sxi,
                                                        empty, *tail)

    def new(amax):
        return torch.ops.fp8ops.linear_bwd_cat.default(*blocks, w8t, x8t, sg, amax, sgi, swi, sxi, *tail)

    a1, a2 = f(0.0), f(0.0)
    same = all(torch.equal(x, y) for x, y in zip(old(a1), new(a2))) and torch.equal(a1, a2)
    cat_only = timed(lambda: torch.cat(blocks, 1), args.iters, args.rounds)
    t_old = timed(lambda: old(a1), args.iters, args.rounds)
    t_new = timed(lambda: new(a2), args.iters, args.rounds)
    print(f"M={M} C={C} (dy {M}x{3 * C}): cat + linear_bwd_sink {t_old:.3f} ms, linear_bwd_cat {t_new:.3f} ms "
          f"(saves {t_old - t_new:.3f} ms, {100 * (t_old - t_new) / t_old:.1f} %); torch.cat alone {cat_only:.3f} ms; "
          f"results bit-identical: {same}")
