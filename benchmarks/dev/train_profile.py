"""Where the GPU time of one training step goes, by kernel class and by kernel: any of
bench_train's variants (default BF16 eager vs fp8ops eager; fp8ops vs fp8ops_compiled compares
eager and compiled code).

Builds bench_train.py's models the same way (fp32 master, bf16 autocast, fused AdamW, lm_head
kept BF16), runs warm-up steps, then profiles a few steps with torch.profiler and sums the CUDA
kernel time per step into classes (FP8 GEMMs, BF16/FP32 GEMMs, fp8ops casts, attention,
optimizer, copies, other elementwise). Also prints the wall time per step and the share of it
the GPU was busy: a step whose GPU-busy time is well below its wall time is bound by the host.
    python benchmarks/dev/train_profile.py [--models 1b,small] [--batch 8] [--batch-1b 4]
"""
import argparse
import re
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_train  # noqa: E402
from bench_common import graphs_compiled  # noqa: E402

CLASSES = ("fp8 gemm", "bf16/fp32 gemm", "fp8ops cast+amax", "attention", "optimizer", "copy/cast (torch)",
           "other")


def kernel_class(name: str) -> str:
    n = name.lower()
    if "cast_transpose" in n or "cast_kernel" in n or "amax_update" in n or "amax_kernel" in n:
        return "fp8ops cast+amax"
    jet = re.search(r"nvjet_sm\d+_([a-z]+)_", n)
    if jet:  # cuBLAS's nvjet kernels name their operand types first: q = e4m3, r = e5m2, t = bf16
        return "fp8 gemm" if jet.group(1)[0] in "qr" else "bf16/fp32 gemm"
    if "gemm" in n or "xmma" in n or "cutlass" in n:
        return "fp8 gemm" if any(s in n for s in ("e4m3", "e5m2", "f8f8", "fp8")) else "bf16/fp32 gemm"
    if "flash" in n or "fmha" in n or "attention" in n or "sdpa" in n:
        return "attention"
    if "adam" in n or "multi_tensor" in n or "foreach" in n:
        return "optimizer"
    if "copy" in n or "memcpy" in n or "memset" in n or "to_copy" in n:
        return "copy/cast (torch)"
    return "other"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="1b,small")
    ap.add_argument("--variants", default="bf16,fp8ops")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--batch-1b", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=28,
                    help="warm-up steps, past policy auto's trial (26 steps): profiled steps inside it "
                         "mix BF16 and FP8 steps and the layers' first FP8 step (current scaling)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--fp8-policy", default="auto")
    ap.add_argument("--eager-loss", action="store_true", help="compiled variants: the loss eager (bench_train's flag)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per variant")
    ap.add_argument("--json", default=None, help="also write {model: {variant: {kernel: ms per step}}} here")
    args = ap.parse_args()
    dump: dict = {}
    import fp8ops
    # (a block past torch's recompile limit would run eager, and the "compiled" profile would
    # show eager's kernels: fail instead)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    GPT, GPTConfig, lm_filter, loss_fn = bench_train.import_gpt()
    bargs = SimpleNamespace(fp8_policy=args.fp8_policy, fp8_recipe="delayed", lr=6e-4, compile_scope="blocks",
                            eager_loss=args.eager_loss)
    for mname in args.models.split(","):
        spec = bench_train.MODELS[mname]
        B = args.batch_1b if (mname == "1b" and args.batch_1b) else (args.batch or spec["batch"])
        T = spec["cfg"]["block_size"]
        gen = torch.Generator().manual_seed(1234)
        batch = (torch.randint(0, bench_train.VOCAB, (B, T), generator=gen).cuda(),
                 torch.randint(0, bench_train.VOCAB, (B, T), generator=gen).cuda())
        print(f"\n== {mname}, batch {B} x {T} = {B * T} tokens/step", flush=True)
        for v in args.variants.split(","):
            torch._dynamo.reset()
            graphs0 = graphs_compiled()
            model, call, opt, cfg, note = bench_train.build(v, GPT, GPTConfig, lm_filter, loss_fn, spec["cfg"],
                                                            bargs, fp8ops, batch)

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = call(*batch)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            for _ in range(args.warmup):
                step()
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                ev[0].record()
                for i in range(args.steps):
                    step()
                    ev[i + 1].record()
                torch.cuda.synchronize()
            wall = statistics.median(ev[i].elapsed_time(ev[i + 1]) for i in range(args.steps))
            per_class = dict.fromkeys(CLASSES, 0.0)
            per_kernel = {}
            per_count: dict = {}
            for e in prof.events():
                if e.device_type != torch.autograd.DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                    continue  # (a record_function range on the GPU timeline spans kernels counted already)
                us = getattr(e, "device_time", None)
                if us is None:
                    us = e.cuda_time
                per_class[kernel_class(e.name)] += us
                per_kernel[e.name] = per_kernel.get(e.name, 0.0) + us
                per_count[e.name] = per_count.get(e.name, 0) + 1
            busy = sum(per_class.values()) / args.steps / 1e3
            graphs = graphs_compiled() - graphs0
            print(f"-- {v} ({note}; {graphs} compiled graph(s)): wall {wall:.1f} ms/step (profiled), GPU busy "
                  f"{busy:.1f} ms/step ({100 * busy / wall:.0f} %)", flush=True)
            verdicts = {}  # policy "auto": per layer shape, FP8 or BF16 and the measured speedup
            for m in model.modules():
                for (rows, _dt), (wins, speedup) in getattr(m, "fp8_policy", {}).items():
                    verdicts[(m.in_features, m.out_features, rows)] = f"{'FP8' if wins else 'BF16'} ({speedup:.2f}x)"
            if verdicts:
                print("   policy: " + ", ".join(f"{k}->{n} M={r}: {v}" for (k, n, r), v in sorted(verdicts.items())))
            for c in CLASSES:
                print(f"   {c:20s} {per_class[c] / args.steps / 1e3:8.2f} ms/step")
            dump.setdefault(mname, {})[v] = {"wall_ms": wall, "busy_ms": busy, "graphs": graphs, "kernels_ms": {
                k: us / args.steps / 1e3 for k, us in per_kernel.items()}, "kernel_counts": {
                k: n / args.steps for k, n in per_count.items()}}
            for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:args.top]:
                print(f"     {us / args.steps / 1e3:7.2f} ms  {name[:110]}")
            del model, call, opt
            torch.cuda.empty_cache()
    if args.json:
        import json  # noqa: PLC0415
        Path(args.json).write_text(json.dumps(dump, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
