"""A model on the second GPU while the first is current, in one process (needs two GPUs).
Nothing else runs the GPU paths off the current device: the C ops' device guard (kernels,
cuBLASLt handle and workspace on the tensors' GPU, with cuda:0 current), policy "auto"'s
timing and its trial in the loop on cuda:1 (its CUDA events recorded on the layers' GPU).

    python3 benchmarks/dev/second_gpu_check.py [--dim 1024] [--rows 4096]

Each check prints PASS or FAIL; the exit status is 1 if any failed.
 1. policy "auto" on cuda:1, cuda:0 current: its timing and trial run to a verdict for every
    layer, every loss is finite, and nothing is allocated on cuda:0 (its peak stays 0);
 2. the raw ops (cast with transpose, amax, gemm, amax_update) on cuda:1 give the bits they
    give on cuda:0, with cuda:0 current;
 3. an MLP block (LayerNorm, Linear, GELU, Linear) trained with policy "always" on cuda:1 and
    on cuda:0 from the same weights and data: losses, weights and scales equal bit for bit
    (two GPUs of one kind run the same kernels and cuBLASLt algorithms).
"""
import argparse
import copy
import os
import sys
import tempfile

os.environ.setdefault("FP8OPS_POLICY_CACHE", os.path.join(tempfile.mkdtemp(), "policy.json"))  # measure afresh

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import fp8ops  # noqa: E402
from fp8ops import loop_trial, ops  # noqa: E402
from fp8ops.linear import Fp8Linear  # noqa: E402

DEVICES = ("cuda:0", "cuda:1")  # the current GPU, the model's
failed = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'PASS' if ok else 'FAIL'}: {name}" + (f" ({detail})" if detail else ""), flush=True)
    if not ok:
        failed.append(name)


def block(d: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))


def train(model: nn.Module, xs: list, opt) -> list:
    losses = []
    for x in xs:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return [float(v) for v in losses]


def auto_on_second_gpu(d: int, rows: int) -> None:
    torch.manual_seed(0)
    model = fp8ops.convert(block(d).to("cuda:1"))  # policy "auto", the default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda:1").manual_seed(1)
    xs = [torch.randn(rows, d, device="cuda:1", generator=g) for _ in range(loop_trial.DECIDE_AT + 3)]
    losses = train(model, xs, opt)
    torch.cuda.synchronize(1)
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    settled = [bool(m.fp8_policy) and not m._fp8_pending for m in layers]
    verdicts = [f"{'FP8' if v[0] else 'BF16'} {v[1]:.2f}x" for m in layers for v in m.fp8_policy.values()]
    check("policy auto on cuda:1 with cuda:0 current: a verdict for every layer",
          bool(layers) and all(settled), f"{len(layers)} layers, verdicts {verdicts}")
    check("policy auto on cuda:1: every loss finite", all(map(lambda v: v == v and abs(v) < float("inf"), losses)),
          f"first {losses[0]:.4f}, last {losses[-1]:.4f}")
    fp8ops.report(model)
    check("nothing allocated on cuda:0 while the model on cuda:1 trained",
          torch.cuda.max_memory_allocated(0) == 0, f"peak {torch.cuda.max_memory_allocated(0)} bytes on cuda:0")


def raw_ops_alike(d: int, rows: int) -> None:
    got = {}
    for dev in DEVICES:
        g = torch.Generator(device=dev).manual_seed(3)
        x = torch.randn(rows, d, device=dev, generator=g, dtype=torch.bfloat16)
        w = torch.randn(2 * d, d, device=dev, generator=g, dtype=torch.bfloat16)
        one = torch.ones((), device=dev)
        x8, x8t, xa = ops.cast(x, 448.0 / x.abs().max().float(), torch.float8_e4m3fn, transpose=True)
        w8, _, wa = ops.cast(w, 448.0 / w.abs().max().float(), torch.float8_e4m3fn)
        y = ops.gemm(x8, w8, one / 2, one / 4, out_dtype=torch.bfloat16, use_fast_accum=True)
        hist = torch.rand(16, 3, device=dev, generator=g) * 100
        scale, scale_inv = torch.ones(3, device=dev), torch.ones(3, device=dev)
        ops.amax_update(hist, scale, scale_inv, torch.full((3,), 448.0, device=dev))
        got[dev] = [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in
                    (x8, x8t, xa, w8, wa, y, hist, scale, scale_inv, ops.amax(x))]
        assert all(t.device == torch.device(dev) for t in got[dev])
    same = [torch.equal(a, b.to(a.device)) for a, b in zip(got[DEVICES[0]], got[DEVICES[1]])]
    check("raw ops on cuda:1 with cuda:0 current give cuda:0's bits", all(same),
          "cast x, x^T, amax, cast w, amax, gemm, history, scale, scale_inv, amax: " + str(same))


def block_trains_alike(d: int, rows: int) -> None:
    torch.manual_seed(0)
    base = block(d)
    runs = {}
    for dev in DEVICES:
        model = fp8ops.convert(copy.deepcopy(base).to(dev), config=fp8ops.Fp8Config(policy="always"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator(device=dev).manual_seed(2)
        losses = train(model, [torch.randn(rows, d, device=dev, generator=g) for _ in range(6)], opt)
        state = {k: v.detach().to(DEVICES[0]) for k, v in model.state_dict().items()}
        scales = [m.fp8_scale.to(DEVICES[0]) for m in model.modules() if isinstance(m, Fp8Linear)]
        runs[dev] = (losses, state, scales)
    (l0, s0, c0), (l1, s1, c1) = runs[DEVICES[0]], runs[DEVICES[1]]
    diff = [k for k in s0 if not torch.equal(s0[k], s1[k])]
    check("an MLP block trained on cuda:1 and on cuda:0: losses equal bit for bit", l0 == l1, f"{l0} vs {l1}")
    check("... weights equal bit for bit", not diff, f"differ: {diff}" if diff else f"{len(s0)} tensors")
    check("... scales equal bit for bit", len(c0) == len(c1) == 2 and all(map(torch.equal, c0, c1)),
          f"{[c.tolist() for c in c0]} vs {[c.tolist() for c in c1]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=4096)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"needs two GPUs, found {torch.cuda.device_count()}")
        return 2
    torch.cuda.set_device(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, "
          f"fp8ops {fp8ops.__version__}", flush=True)
    auto_on_second_gpu(args.dim, args.rows)      # first: cuda:0's peak must still be 0
    raw_ops_alike(args.dim, args.rows)
    block_trains_alike(args.dim, args.rows)
    print(f"current device at the end: cuda:{torch.cuda.current_device()}")
    check("cuda:0 stayed current", torch.cuda.current_device() == 0)
    print(f"{len(failed)} check(s) failed: {failed}" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
