"""Benchmark forward + backward of ONE linear layer: BF16 vs fp8ops (eager, compiled) vs torchao.

Every variant trains the way a real run does: fp32 master weights (or --master bf16) under
torch.autocast(bf16); x [M, K] is a bf16 activation that requires grad; one iteration is
    y = layer(x); y.backward(g)                       (g [M, N] bf16; grads set to None first)
and, for fp8ops, fp8ops.step(layer) once per iteration, i.e. one optimizer step per fwd+bwd: the
weight is re-cast every iteration (no weight-cast reuse across iterations: the honest case for
training without gradient accumulation). Variants:
  bf16              nn.Linear under autocast (cuBLAS BF16)
  bf16_compiled     torch.compile of it: what torch.compile's own per-call cost does to a
                    layer that has nothing for it to fuse (the yardstick for fp8ops_compiled)
  fp8ops            fp8ops.convert(layer, config=Fp8Config(policy="always")): delayed scaling, hybrid
  fp8ops_compiled   torch.compile of the converted layer
  bf16_graphs,      torch.compile(mode="reduce-overhead") of nn.Linear / the converted layer:
  fp8ops_graphs     inductor replays each step's kernels as CUDA graphs (cudagraph_mark_step_begin()
                    starts each iteration; a graph torch skipped is reported per shape). Opt-in:
                    on one layer they measured slower than eager everywhere (see RESULTS.md §4,
                    twentieth session), BF16 and FP8 alike
  torchao_compiled  torchao.float8.convert_to_float8_training (tensorwise dynamic) + torch.compile
  torchao           the same without compile
GEMM ceiling: the three GEMMs of fwd+bwd on operands already cast (torch._scaled_mm: fwd e4m3 with
fast accumulation, dgrad/wgrad e5m2 x e4m3; wgrad out fp32 with fp32 master) vs three BF16 mms:
the most any FP8 linear can gain; the gap to it is casts, transposes, amax and per-call overhead.

Targets (fp8ops eager vs BF16 eager): >= 1.75x at 16384x4096->14336, >= 1.65x at 16384x4096->4096,
>= 1.3x at 16384x768->3072 and 16384x3072->768, >= 1.4x at 4096^3; and fp8ops compiled >= fp8ops
eager (PASS within 2 % timing noise).

    python benchmarks/bench_linear.py                       # all shapes
    python benchmarks/bench_linear.py --quick --plot linear.png --json linear.json
    python benchmarks/bench_linear.py --shapes 16384x4096x14336 --profile --profile-dir prof/

Napkin math for M x K -> N (FLOPs = 3 GEMMs x 2MNK = 6MNK):
  16384x4096->14336: 5.77 TFLOP -> BF16 at ~700 TFLOP/s 8.2 ms; FP8 at ~1250 4.6 ms (ceiling ~1.8x).
    Cast bytes per iteration (fp8ops, delayed): x read 2MK + write 2MK (x8, x8t) = 268 MB;
    W (fp32 master) read 4NK + write 2NK = 352 MB; dy read 2MN + write 2MN = 940 MB; total ~1.56 GB
    = ~0.5 ms at 3 TB/s -> expected ~1.6-1.7x on H100 unless casts overlap nothing.
  16384x768->3072: 0.23 TFLOP -> BF16 ~0.35 ms, FP8 ~0.2 ms; casts ~0.42 GB = 0.14 ms -> ~1.3x at best.
  2048x768->768: 14.5 GFLOP: launch/Python overhead bound (~15 kernels per fwd+bwd for fp8ops).
The BF16 baseline also pays autocast's fp32->bf16 weight cast (read 4NK, write 2NK) each iteration.

Timing (--timing loop, the default): the variants take turns in interleaved rounds; in each,
a variant runs a few untimed iterations and then reps/rounds iterations back to back between
two CUDA events (no synchronize inside: the pace of a training loop); the mean per iteration,
median over the rounds. The wall time of queuing the timed iterations is kept too (the
"fp8ops host ms" column, each variant's `<v>_host_ms` in the JSON), and each target line says
"host-bound" where it is >= 90 % of the iteration (the GPU waited on the host; or the host
blocked on the GPU: a synchronize inside the step, or a launch queue filled by far more
iterations per round than the default) and "GPU-bound" below. --timing bursts is the method of
the first seven sessions (an event per iteration right after a synchronize, median over
iterations), which reads host-heavy variants slower and the large GPU-bound shapes ~10 % faster
for FP8 (see bench_interleaved). Compile happens in the warm-up, outside the timed region.
Validation (once per shape, before timing, on the 3rd iteration after two scale updates): output
and grads of each FP8 variant vs BF16 eager: SQNR >= 25 dB (y), >= 20 dB (dx, dW).
Note: torchao >= 0.18 patches inductor's min/max codegen when convert_to_float8_training runs;
torchao variants are therefore built after the fp8ops ones for each shape.
"""
import argparse
import copy
import os
import statistics
import sys
import time

import torch

from bench_common import cudagraph_skips, graph_breaks, start, table, write_json  # noqa: E402
import torch.nn as nn

ALL_SHAPES = ("16384x768x3072,16384x3072x768,16384x2048x8192,16384x4096x4096,16384x4096x14336,"
              "16384x14336x4096,16384x8192x8192,4096x4096x4096,2048x768x768")
QUICK_SHAPES = "16384x4096x14336,16384x4096x4096,16384x768x3072,16384x3072x768,4096x4096x4096"
TARGETS = {(16384, 4096, 14336): 1.75, (16384, 4096, 4096): 1.65, (16384, 768, 3072): 1.3,
           (16384, 3072, 768): 1.3, (4096, 4096, 4096): 1.4}
COMPILE_TOLERANCE = 0.02  # fp8ops compiled counts as ">= eager" within 2 % timing noise
# a variant is host-bound in a row where queuing its iterations took this share of their span or
# more (the GPU waited on the host); GPU-bound below it (measured, one H200: GPU-bound rows 4-89 %
# of the span, host-bound ones 99-100 %)
HOST_BOUND = 0.9
VARIANTS = ("bf16", "bf16_compiled", "fp8ops", "fp8ops_compiled", "fp8ops_auto", "bf16_graphs", "fp8ops_graphs",
            "torchao_compiled", "torchao")
# the CUDA-graph variants are opt-in: on one layer they were slower than eager at every shape
# measured (results/linear_graphs_h200_s20.txt), and each costs a compile per shape
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if not v.endswith("_graphs"))
SQNR_Y, SQNR_GRAD = 25.0, 20.0
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
DEVICE = "cuda"  # tests/test_benchmarks.py runs this script's logic with "cpu" (events on the host clock)


# ------------------------------------------------------------------------------------------------
# helpers


def bench_interleaved(fns: dict, reps: int, rounds: int, warmup: int = 2, lead_in: int = 8,
                      timing: str = "loop", host: dict | None = None) -> dict:
    """ms per iteration of each fn; fns take turns in `rounds` rounds, max(1, reps // rounds)
    timed iterations each per round.
    timing "loop": each fn's round is lead_in untimed iterations, then the timed ones back to back
      between two CUDA events with no synchronize in between, the way a training loop runs; the
      mean per iteration, median over rounds. Host-bound where the host is slower than the GPU:
      `host` (a dict, filled when given) gets each fn's host ms per iteration (the wall time of
      queuing the timed iterations, median over rounds), which is ~ the events' span where the
      GPU waited on the host and well below it where the host ran ahead.
    timing "bursts" (the method of the first seven sessions): right after a synchronize, an event
      after every iteration; the median of the per-iteration times. It is biased both ways
      (benchmarks/dev/burst_vs_continuous.py, one H200): the first iterations after a synchronize
      cost the host more, so host-heavy variants read slow (fp8ops at 4096^3: 1.11-1.32x in bursts
      of 6 vs 1.43-1.55x back to back), and at large shapes BF16 reads slower and FP8 faster than
      in a loop that runs on (16384x4096->14336: 1.92x vs 1.75x)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    host_times = {k: [] for k in fns}
    per_round = max(1, reps // rounds)
    for _ in range(rounds):
        for k, fn in fns.items():
            if timing == "loop":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                for _ in range(lead_in):
                    fn()
                h0 = time.perf_counter()  # (before the start event: a pause between the two counts as host time)
                start.record()
                for _ in range(per_round):
                    fn()
                end.record()
                host_times[k].append((time.perf_counter() - h0) * 1e3 / per_round)
                end.synchronize()
                times[k].append(start.elapsed_time(end) / per_round)
                continue
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(per_round + 1)]
            torch.cuda.synchronize()
            ev[0].record()
            for i in range(per_round):
                fn()
                ev[i + 1].record()
            torch.cuda.synchronize()
            times[k] += [ev[i].elapsed_time(ev[i + 1]) for i in range(per_round)]
    if host is not None and timing == "loop":
        host.update({k: statistics.median(v) for k, v in host_times.items()})
    return {k: statistics.median(v) for k, v in times.items()}


# ------------------------------------------------------------------------------------------------

def parse_shapes(s: str) -> list[tuple[int, int, int]]:
    return [tuple(int(v) for v in tok.lower().split("x")) for tok in s.split(",")]


def sqnr(ref: torch.Tensor, x: torch.Tensor) -> float:
    ref, x = ref.detach().double(), x.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - x).norm().clamp(min=1e-30)))


def to_fp8(x: torch.Tensor, dt: torch.dtype):
    scale = FP8_MAX[dt] / x.float().abs().amax().clamp(min=1e-12)
    return (x.float() * scale).clamp(-FP8_MAX[dt], FP8_MAX[dt]).to(dt), (1.0 / scale).float().reshape(())


def torchao_convert():
    """torchao.float8.convert_to_float8_training, or None with the reason printed."""
    try:
        from torchao.float8 import convert_to_float8_training
        return convert_to_float8_training, None
    except Exception as e:  # noqa: BLE001 -- not installed, or broken against this torch
        return None, f"torchao not importable ({type(e).__name__}: {e}); torchao columns skipped"


def compiled_as(name: str, mod: nn.Module) -> nn.Module:
    """The variant's module: torch.compile'd ("_compiled"), with CUDA graphs ("_graphs"), or as is."""
    if name.endswith("_graphs"):
        return torch.compile(mod, mode="reduce-overhead")
    return torch.compile(mod) if name.endswith("_compiled") else mod


def build_variant(name: str, base: nn.Module, args, fp8ops, ao_convert):
    """(module to call, the Fp8Linear to step or None)."""
    mod = copy.deepcopy(base)
    if name.startswith("bf16"):
        return compiled_as(name, mod), None
    if name.startswith("fp8ops"):
        # fp8ops_auto: the default policy users get (a shape FP8 does not speed up runs BF16)
        cfg = fp8ops.Fp8Config(policy="auto" if name == "fp8ops_auto" else "always", recipe=args.recipe)
        mod = fp8ops.convert(mod, config=cfg)
        if not any(type(m).__name__ == "Fp8Linear" for m in mod.modules()):
            raise RuntimeError(f"fp8ops.convert left the layer unconverted: "
                               f"{getattr(mod, '_fp8ops_decisions', {})}")
        layer = mod
        return compiled_as(name, mod), layer
    mod = ao_convert(mod)
    return compiled_as(name, mod), None


def vs_eager_target(row: dict, row_valid: dict, v: str, label: str, no_graphs: bool) -> dict:
    """The target "fp8ops <v> (compiled, graphs) >= fp8ops eager", within COMPILE_TOLERANCE, with
    BF16's own ratio beside it (torch.compile's per-call cost); NO-GRAPHS where torch ran the
    graphs variant without CUDA graphs, INVALID where its outputs did not match BF16's."""
    ms = row[f"fp8ops_{v}_ms"]
    vd = "PASS" if ms <= row["fp8ops_ms"] * (1 + COMPILE_TOLERANCE) else "MISS"
    if no_graphs:
        vd = "NO-GRAPHS"
    elif vd == "PASS" and not row_valid.get(f"fp8ops_{v}", {}).get("ok", True):
        vd = "INVALID"
    bf16_v = row[f"bf16_{v}_ms"]
    return {"what": f"fp8ops {label} >= fp8ops eager at {row['M']}x{row['K']}->{row['N']} "
                    f"(within {COMPILE_TOLERANCE:.0%})",
            "value": row["fp8ops_ms"] / ms, "verdict": vd,
            f"bf16_{v}_vs_eager": row["bf16_ms"] / bf16_v if bf16_v else None}


def make_step(mod, fp8_layer, x, g, fp8ops, autocast_dtype, graphs: bool = False):
    params = list(mod.parameters())

    def step():
        if graphs:
            # a new iteration: the graphs' outputs of the last one (y, the grads) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        x.grad = None
        for p in params:
            p.grad = None
        with torch.autocast(DEVICE, dtype=autocast_dtype):
            y = mod(x)
        y.backward(g)
        if fp8_layer is not None:
            fp8ops.step(fp8_layer)  # = one optimizer step: scales update, the weight is re-cast
        return y
    return step


def gemm_ceiling_fns(x, w_hp, g, master_fp32: bool):
    """(fp8 fn, bf16 fn): the three GEMMs of one fwd+bwd, operands pre-cast / pre-transposed."""
    x, w_hp = x.detach(), w_hp.detach()
    x8, sx = to_fp8(x, E4M3)
    w8, sw = to_fp8(w_hp, E4M3)
    g8, sg = to_fp8(g, E5M2)
    x8t, w8t, g8t = x8.t().contiguous(), w8.t().contiguous(), g8.t().contiguous()
    wgrad_dt = torch.float32 if master_fp32 else torch.bfloat16
    xb, wb, gb = x, w_hp.to(torch.bfloat16), g

    def fp8():
        torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16, use_fast_accum=True)
        torch._scaled_mm(g8, w8t.t(), scale_a=sg, scale_b=sw, out_dtype=torch.bfloat16)
        torch._scaled_mm(g8t, x8t.t(), scale_a=sg, scale_b=sx, out_dtype=wgrad_dt)

    def bf16():
        torch.mm(xb, wb.t())
        torch.mm(gb, wb)
        torch.mm(gb.t(), xb)
    return fp8, bf16


def run_profile(args, fns: dict, shape, out_dir: str) -> dict:
    """torch.profiler over a few iterations of each variant: top kernels, launches per fwd+bwd."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    os.makedirs(out_dir, exist_ok=True)
    iters = args.profile_iters
    summary = {}
    M, K, N = shape
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(iters):
                fn()
            torch.cuda.synchronize()
        events = prof.events()
        gpu = [e for e in events if e.device_type == DeviceType.CUDA]
        launches = [e for e in events if e.device_type == DeviceType.CPU and e.name in
                    ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")]
        per_kernel = {}  # name -> [count, total us]
        for e in gpu:
            c = per_kernel.setdefault(e.name, [0, 0.0])
            c[0] += 1
            c[1] += e.time_range.elapsed_us()
        top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])
        gpu_us = sum(c[1] for c in per_kernel.values())
        lines = [f"{name} {M}x{K}->{N}: {len(gpu) / iters:.1f} GPU ops (kernels, memcpy, memset) and "
                 f"{len(launches) / iters:.1f} kernel-launch API calls per fwd+bwd; GPU busy "
                 f"{gpu_us / iters / 1e3:.3f} ms per fwd+bwd",
                 f"  {'us/iter':>9} {'%':>5} {'n/iter':>6}  kernel"]
        for k, (cnt, us) in top[:args.profile_rows]:
            lines.append(f"  {us / iters:9.1f} {100 * us / max(gpu_us, 1e-9):5.1f} {cnt / iters:6.1f}  {k[:110]}")
        tbl = prof.key_averages().table(sort_by="self_device_time_total", row_limit=args.profile_rows)
        path = os.path.join(out_dir, f"linear_profile_{M}x{K}x{N}_{name}.txt")
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n\nall GPU ops:\n")
            for k, (cnt, us) in top:
                f.write(f"  {us / iters:9.1f} us/iter {cnt / iters:6.1f}/iter  {k}\n")
            f.write("\ntorch.profiler key_averages, by self device time:\n" + tbl + "\n")
        try:
            prof.export_chrome_trace(os.path.join(out_dir, f"linear_trace_{M}x{K}x{N}_{name}.json"))
        except Exception as e:  # noqa: BLE001
            print(f"note: chrome trace export failed for {name}: {e}")
        summary[name] = {"gpu_ops_per_iter": len(gpu) / iters, "launch_calls_per_iter": len(launches) / iters,
                         "gpu_busy_ms_per_iter": gpu_us / iters / 1e3, "table": path,
                         "top_kernels": [{"name": k, "us_per_iter": us / iters, "count_per_iter": cnt / iters}
                                         for k, (cnt, us) in top[:args.profile_rows]]}
        print("\n" + "\n".join(lines) + f"\n  (full table: {path})")
    return summary


def write_plot(path: str, result: dict) -> None:
    rows = result["rows"]
    series = [v for v in ("fp8ops", "fp8ops_compiled", "fp8ops_auto", "fp8ops_graphs", "torchao_compiled", "torchao")
              if any(r.get(f"{v}_speedup") for r in rows)]
    labels = [f"{r['M']}x{r['K']}\n->{r['N']}" for r in rows]
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    if plt is not None:
        fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4.5))
        width = 0.8 / max(1, len(series))
        for i, v in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
            ax.bar(xs, [r.get(f"{v}_speedup") or 0 for r in rows], width, label=v.replace("_", " "))
        for j, r in enumerate(rows):
            tgt = TARGETS.get((r["M"], r["K"], r["N"]))
            if tgt:
                ax.hlines(tgt, j - 0.45, j + 0.45, colors="k", linestyles="dashed", linewidth=1)
            if r.get("gemm_ceiling_speedup"):
                ax.plot([j], [r["gemm_ceiling_speedup"]], "k^", markersize=5)
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("fwd+bwd speedup vs BF16 eager")
        ax.set_title(f"one linear layer, {result['env'].get('gpu', '?')}, torch {result['env']['torch']} "
                     f"(dashes: targets; triangles: GEMM ceiling)", fontsize=9)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        print(f"plot written to {path}")
        return
    try:
        from PIL import Image, ImageDraw
    except ImportError:
        print("note: --plot needs matplotlib or Pillow; neither is installed, no plot written")
        return
    # a plain bar chart with Pillow
    W, H, pad = max(600, 110 * len(rows)), 420, 50
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    ymax = max([2.0] + [r.get(f"{v}_speedup") or 0 for r in rows for v in series]) * 1.1
    colors = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
    y_of = lambda v: H - pad - (H - 2 * pad) * v / ymax
    d.line([(pad, y_of(1.0)), (W - 10, y_of(1.0))], fill=(150, 150, 150))
    slot = (W - pad - 10) / max(1, len(rows))
    bw = slot * 0.8 / max(1, len(series))
    for j, r in enumerate(rows):
        x0 = pad + j * slot + slot * 0.1
        for i, v in enumerate(series):
            val = r.get(f"{v}_speedup") or 0
            d.rectangle([x0 + i * bw, y_of(val), x0 + (i + 1) * bw - 2, y_of(0)], fill=colors[i % 4])
        tgt = TARGETS.get((r["M"], r["K"], r["N"]))
        if tgt:
            d.line([(x0, y_of(tgt)), (x0 + slot * 0.8, y_of(tgt))], fill=(0, 0, 0))
        d.text((x0, H - pad + 5), labels[j].replace("\n", ""), fill=(0, 0, 0))
    for i, v in enumerate(series):
        d.rectangle([pad + 150 * i, 10, pad + 150 * i + 12, 22], fill=colors[i % 4])
        d.text((pad + 150 * i + 16, 10), v, fill=(0, 0, 0))
    d.text((5, y_of(1.0) - 6), "1.0x", fill=(0, 0, 0))
    d.text((5, 30), f"speedup vs BF16 eager (max {ymax:.1f}); lines: targets", fill=(0, 0, 0))
    img.save(path)
    print(f"plot written to {path} (Pillow; install matplotlib for a nicer one)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", default=ALL_SHAPES, help="comma-separated MxKxN (tokens x in -> out)")
    ap.add_argument("--quick", action="store_true", help=f"only the target shapes: {QUICK_SHAPES}")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument("--master", choices=("fp32", "bf16"), default="fp32", help="weight (master) dtype")
    ap.add_argument("--bias", action="store_true", help="layers with bias (default: none, as in Llama)")
    ap.add_argument("--recipe", choices=("delayed", "current"), default="delayed", help="fp8ops recipe")
    ap.add_argument("--reps", type=int, default=60, help="timed iterations per variant, split over the rounds")
    ap.add_argument("--rounds", type=int, default=3, help="interleaving rounds")
    ap.add_argument("--timing", choices=("loop", "bursts"), default="loop",
                    help="loop: each round's iterations back to back after a lead-in, as in training; "
                         "bursts: per-iteration events right after a synchronize (sessions 1-7; biased, see bench_interleaved)")
    ap.add_argument("--warmup", type=int, default=28,
                    help="warm-up iterations: compile, and policy auto's trial (26 iterations)")
    ap.add_argument("--no-ceiling", action="store_true", help="skip the GEMM-only ceiling")
    ap.add_argument("--profile", action="store_true", help="profile one shape with torch.profiler")
    ap.add_argument("--profile-shape", default="16384x4096x14336", help="MxKxN to profile")
    ap.add_argument("--profile-dir", default="linear_profile", help="where the profile tables/traces go")
    ap.add_argument("--profile-variants", default=None,
                    help="comma-separated variants to profile (default: every variant measured)")
    ap.add_argument("--profile-iters", type=int, default=5)
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart of speedup by shape")
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    args = ap.parse_args()
    shapes = parse_shapes(QUICK_SHAPES if args.quick else args.shapes)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variants {bad}; choose from {VARIANTS}")
    if "bf16" not in variants:
        variants.insert(0, "bf16")  # the baseline of every ratio
    variants.sort(key=lambda v: (v != "bf16", v.startswith("torchao")))  # bf16 first, torchao last

    env = start(args.json)
    if env is None:
        return 0
    import fp8ops

    ao_convert, ao_why = (None, None)
    if any(v.startswith("torchao") for v in variants):
        ao_convert, ao_why = torchao_convert()
        if ao_convert is None:
            print(f"note: {ao_why}")
            variants = [v for v in variants if not v.startswith("torchao")]
    master = torch.float32 if args.master == "fp32" else torch.bfloat16
    result = {"env": env, "args": vars(args), "variants": variants, "notes": [ao_why] if ao_why else [],
              "rows": [], "targets": [], "validation_failures": []}
    print(f"variants: {', '.join(variants)}; master weights {args.master}; autocast bf16; "
          f"fp8ops recipe {args.recipe}, policy always")

    for (M, K, N) in shapes:
        torch._dynamo.reset()  # fresh compile caches per shape: no recompile limits, no stale guards
        torch.manual_seed(0)
        base = nn.Linear(K, N, bias=args.bias, device=DEVICE, dtype=master)
        x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16) * 1e-3  # gradients are small
        steps, errors, row_valid, ref, breaks, verdicts, skipped = {}, {}, {}, None, {}, {}, {}
        for v in variants:  # bf16 first (the reference); torchao last (it patches inductor, see docstring)
            try:
                gb0, skips0 = graph_breaks(), cudagraph_skips()
                mod, layer = build_variant(v, base, args, fp8ops, ao_convert)
                fn = make_step(mod, layer, x, g, fp8ops, torch.bfloat16, graphs=v.endswith("_graphs"))
                outs = None
                n_warm = max(3, args.warmup)
                for i in range(n_warm):
                    y = fn()
                    if i == n_warm - 1:
                        # validation: the last warm-up iteration, the path the timed rounds take (policy
                        # auto's trial has settled by then; its first steps run BF16 whatever it chooses).
                        # The weights never change here (no optimizer), so BF16's reference is the same
                        # in every iteration
                        # (copies: a CUDA graph's next replay overwrites its outputs)
                        outs = tuple(t.detach().float().clone() for t in (y, x.grad, mod_weight(mod).grad))
                    del y
                torch.cuda.synchronize()
                steps[v] = fn
                for m in mod.modules():  # policy "auto": what it measured and chose for this shape
                    for k, (wins, speedup) in getattr(m, "fp8_policy", {}).items():
                        verdicts[v] = {"rows": k[0], "fp8": bool(wins), "measured_speedup": speedup,
                                       "loop_trial": m.fp8_policy_why.get(k)}
                if v.endswith(("_compiled", "_graphs")) and graph_breaks() > gb0:
                    breaks[v] = graph_breaks() - gb0
                    print(f"  note: {v} {M}x{K}->{N}: {breaks[v]} torch.compile graph break(s)")
                if v.endswith("_graphs") and cudagraph_skips() > skips0:
                    # (its time is then torch.compile's without graphs: said, not hidden)
                    skipped[v] = cudagraph_skips() - skips0
                    print(f"  note: {v} {M}x{K}->{N}: torch skipped CUDA graphs {skipped[v]} time(s)")
                # ---- validation against BF16 eager (same weights, same x and g)
                if v == "bf16":
                    ref = outs
                elif ref is not None:
                    dy, ddx, ddw = (sqnr(r, o) for r, o in zip(ref, outs))
                    ok = dy >= SQNR_Y and ddx >= SQNR_GRAD and ddw >= SQNR_GRAD
                    row_valid[v] = {"ok": ok, "sqnr_y": dy, "sqnr_dx": ddx, "sqnr_dw": ddw}
                    if not ok:
                        result["validation_failures"].append(
                            f"{v} {M}x{K}->{N}: SQNR y {dy:.1f} dB (>= {SQNR_Y}), dx {ddx:.1f}, "
                            f"dW {ddw:.1f} (>= {SQNR_GRAD})")
                del outs, mod, layer, fn
            except Exception as e:  # noqa: BLE001 -- one broken variant must not stop the others
                errors[v] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"  {v} {M}x{K}->{N}: FAILED to run: {errors[v]}")
        del ref
        ok_all = all(r["ok"] for r in row_valid.values())
        print(("All results match. Starting benchmarks." if ok_all else
               "VALIDATION FAILED (timing anyway; marked '!'): " + "; ".join(
                   f"{v}: y {r['sqnr_y']:.1f} dx {r['sqnr_dx']:.1f} dW {r['sqnr_dw']:.1f} dB"
                   for v, r in row_valid.items() if not r["ok"]))
              + f"  [{M}x{K}->{N}: " + ", ".join(f"{v} y/dx/dW {r['sqnr_y']:.0f}/{r['sqnr_dx']:.0f}/"
                                                  f"{r['sqnr_dw']:.0f} dB" for v, r in row_valid.items()) + "]")

        fns = dict(steps)
        if not args.no_ceiling:
            fns["ceil_fp8"], fns["ceil_bf16"] = gemm_ceiling_fns(x, base.weight, g, master == torch.float32)
        skips0 = cudagraph_skips()
        host = {}
        t = bench_interleaved(fns, args.reps, args.rounds, timing=args.timing, host=host)
        if cudagraph_skips() > skips0:
            # torch can also give up on graphs while they run (e.g. too many re-recordings); the
            # counter does not say which variant: both graph variants' times are then suspect
            for v in (v for v in steps if v.endswith("_graphs")):
                skipped[v] = skipped.get(v, 0) + cudagraph_skips() - skips0
            print(f"  note: {M}x{K}->{N}: torch skipped CUDA graphs {cudagraph_skips() - skips0} time(s) "
                  "during the timed rounds")
        flop = 6.0 * M * N * K
        row = {"M": M, "K": K, "N": N, "bias": args.bias, "master": args.master, "errors": errors,
               "validation": row_valid, "graph_breaks": breaks, "cudagraph_skips": skipped,
               "policy_verdicts": verdicts}
        for v in VARIANTS:
            ms = t.get(v)
            row[f"{v}_ms"] = ms
            row[f"{v}_host_ms"] = host.get(v)  # (timing "loop" only)
            row[f"{v}_host_bound"] = (host[v] >= HOST_BOUND * ms) if (ms and v in host) else None
            row[f"{v}_tflops"] = flop / (ms * 1e-3) / 1e12 if ms else None
            row[f"{v}_speedup"] = (t["bf16"] / ms) if (ms and t.get("bf16")) else None
        if "ceil_fp8" in t:
            row["gemm_ceiling_fp8_ms"], row["gemm_ceiling_bf16_ms"] = t["ceil_fp8"], t["ceil_bf16"]
            row["gemm_ceiling_speedup"] = t["ceil_bf16"] / t["ceil_fp8"]
        verdicts = []
        tgt = TARGETS.get((M, K, N))
        if tgt and row["fp8ops_speedup"] is not None:
            vd = "PASS" if row["fp8ops_speedup"] >= tgt else "MISS"
            if vd == "PASS" and not row_valid.get("fp8ops", {}).get("ok", True):
                vd = "INVALID"  # fast, but its outputs did not match BF16's: no target is met so
            verdicts.append(vd)
            result["targets"].append({"what": f"fp8ops eager vs BF16 eager at {M}x{K}->{N} >= {tgt}x",
                                      "value": row["fp8ops_speedup"], "verdict": vd,
                                      "fp8ops_host_ms": row["fp8ops_host_ms"], "fp8ops_ms": row["fp8ops_ms"],
                                      "host_bound": row["fp8ops_host_bound"]})
        for v, tag, label in (("compiled", "c", "compiled"), ("graphs", "g", "graphs (compile mode=reduce-overhead)")):
            if row["fp8ops_ms"] and row[f"fp8ops_{v}_ms"]:
                tg = vs_eager_target(row, row_valid, v, label, no_graphs=f"fp8ops_{v}" in skipped)
                verdicts.append(f"{tag}:{tg['verdict']}")
                result["targets"].append(tg)
        row["target"] = " ".join(verdicts)
        result["rows"].append(row)
        write_json(args.json, result)
        print(f"  {M}x{K}->{N}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in t.items()), flush=True)
        del steps, fns, base, x, g
        torch.cuda.empty_cache()

    if args.profile:
        M, K, N = parse_shapes(args.profile_shape)[0]
        torch._dynamo.reset()
        torch.manual_seed(0)
        base = nn.Linear(K, N, bias=args.bias, device=DEVICE, dtype=master)
        x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16) * 1e-3
        pf = {}
        wanted = variants if not args.profile_variants else \
            [v for v in variants if v in args.profile_variants.split(",")]
        for v in wanted:
            try:
                mod, layer = build_variant(v, base, args, fp8ops, ao_convert)
                pf[v] = make_step(mod, layer, x, g, fp8ops, torch.bfloat16, graphs=v.endswith("_graphs"))
            except Exception as e:  # noqa: BLE001
                print(f"note: cannot profile {v}: {type(e).__name__}: {e}")
        result["profile"] = run_profile(args, pf, (M, K, N), args.profile_dir)
        write_json(args.json, result)
        del pf, base, x, g

    if args.plot and result["rows"]:
        try:
            write_plot(args.plot, result)
        except Exception as e:  # noqa: BLE001 -- a plot must never cost the numbers
            print(f"note: plot failed: {type(e).__name__}: {e}")

    # ---- results: targets, then the table last
    print()
    for n in result["notes"]:
        print(f"note: {n}")
    for f in result["validation_failures"]:
        print(f"validation failed: {f}")
    for tg in result["targets"]:
        ctx, gctx = tg.get("bf16_compiled_vs_eager"), tg.get("bf16_graphs_vs_eager")
        hb = tg.get("host_bound")
        print(f"target: {tg['what']}: {tg['value']:.2f}x -> {tg['verdict']}"
              + (f"  ({'host-bound' if hb else 'GPU-bound'}: queuing an iteration took "
                 f"{tg['fp8ops_host_ms']:.3f} of its {tg['fp8ops_ms']:.3f} ms)" if hb is not None else "")
              + (f"  (BF16 compiled vs eager: {ctx:.2f}x)" if ctx else "")
              + (f"  (BF16 graphs vs eager: {gctx:.2f}x)" if gctx else ""))
    shown = [v for v in VARIANTS if v in variants]
    loop_host = args.timing == "loop" and "fp8ops" in variants  # (the host column: loop timing only)
    short = {"bf16": "bf16", "bf16_compiled": "bf16 cmp", "fp8ops": "fp8ops", "fp8ops_compiled": "fp8ops cmp",
             "fp8ops_auto": "fp8ops auto", "bf16_graphs": "bf16 graphs", "fp8ops_graphs": "fp8ops graphs",
             "torchao_compiled": "ao cmp", "torchao": "ao eager"}
    hdr = ["shape MxK->N"] + [f"{short[v]} ms" for v in shown] + \
          [f"{short[v]} x" for v in shown if v != "bf16"] + (["fp8ops host ms"] if loop_host else []) + \
          ["fp8ops TF/s", "GEMM ceil x", "target"]
    rows = []
    for r in result["rows"]:
        flag = "" if all(x["ok"] for x in r["validation"].values()) else "!"
        cells = [f"{r['M']}x{r['K']}->{r['N']}{flag}"]
        cells += ["err" if v in r["errors"] else ("-" if r[f"{v}_ms"] is None else f"{r[f'{v}_ms']:.3f}")
                  for v in shown]
        cells += ["-" if r[f"{v}_speedup"] is None else f"{r[f'{v}_speedup']:.2f}x" for v in shown if v != "bf16"]
        if loop_host:
            hms, hb = r.get("fp8ops_host_ms"), r.get("fp8ops_host_bound")
            cells += ["-" if hms is None else f"{hms:.3f}{' (bound)' if hb else ''}"]
        cells += ["-" if r["fp8ops_tflops"] is None else f"{r['fp8ops_tflops']:.0f}",
                  f"{r['gemm_ceiling_speedup']:.2f}x" if r.get("gemm_ceiling_speedup") else "-",
                  r["target"]]
        rows.append(cells)
    print(table(hdr, rows, title=(f"one linear fwd+bwd, {args.master} master + bf16 autocast, "
                                  f"bias={args.bias}; x = speedup vs BF16 eager; TF/s = 6MNK / time; "
                                  + (f"median over {args.rounds} rounds of {args.reps // args.rounds} iterations back to back"
                                   if args.timing == "loop" else f"median of {args.reps} iterations in bursts")
                                  + (f"; fp8ops host ms = the host's time to queue one iteration, '(bound)' "
                                     f"where >= {HOST_BOUND:.0%} of the iteration (host-bound)" if loop_host else "")
                                  + "; target c: = compiled >= eager, g: = graphs >= eager")))
    failed = bool(result["validation_failures"]) or any(r["errors"] for r in result["rows"])
    return 1 if failed else 0


def mod_weight(mod: nn.Module) -> torch.Tensor:
    """The weight Parameter of the (possibly compiled / converted) single linear layer."""
    return getattr(mod, "_orig_mod", mod).weight


if __name__ == "__main__":
    sys.exit(main())
