"""Does the host's time to queue one fwd + bwd (+ fp8ops.step) depend on the shape, and does
anything in it wait for the GPU? bench_linear reads its host-bound rows at 0.42-0.87 ms of host
time per iteration, the larger at GPT-2's M=16384 shapes, while a 256^3 layer queues in ~0.4 ms:
either the host runs slower there or something in the iteration blocks on the GPU (a
synchronize, a blocking copy, cudaMalloc / cudaFree). Per shape and layer kind:
  loop     host ms per iteration queuing `--iters` iterations back to back after a synchronize
           (bench_linear's "host ms") and the CUDA events' span per iteration;
  occupied the same host time while the GPU is kept busy by a sleep kernel queued first: an
           iteration that waits on the GPU anywhere then reads the sleep's length, one that
           does not reads its pure host time;
  blocking the profiler's count per iteration of CUDA runtime calls that can block the host
           (synchronizes, memcpy without Async, malloc / free), and their host ms.
    python benchmarks/dev/host_by_shape.py [--shapes 256x256x256,16384x768x3072] [--rounds 3]
"""
import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import fp8ops
from layer_iteration import layer_and_batch, make_iteration  # this folder

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="256x256x256,2048x768x768,4096x4096x4096,16384x768x3072,"
                                     "16384x3072x768,16384x4096x4096")
ap.add_argument("--iters", type=int, default=10)
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--sleep-ms", type=float, default=300.0, help="the sleep kernel's length (occupied)")
args = ap.parse_args()
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaMalloc", "cudaFree", "cuMemAlloc", "cuMemFree",
            "cudaHostAlloc", "cuMemcpyDtoH", "cudaStreamQuery")


def sleep_cycles(ms: float) -> int:
    """cycles for torch.cuda._sleep that last ~ms on this GPU (calibrated once)."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    torch.cuda._sleep(10_000_000)
    e.record()
    e.synchronize()
    return int(10_000_000 * ms / max(s.elapsed_time(e), 1e-3))


def loop_times(it):
    torch.cuda.synchronize()
    for _ in range(3):
        it()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    h0 = time.perf_counter()
    s.record()
    for _ in range(args.iters):
        it()
    e.record()
    host = (time.perf_counter() - h0) * 1e3 / args.iters
    e.synchronize()
    return host, s.elapsed_time(e) / args.iters


def occupied_host(it, cycles):
    torch.cuda.synchronize()
    torch.cuda._sleep(cycles)
    h0 = time.perf_counter()
    for _ in range(args.iters):
        it()
    host = (time.perf_counter() - h0) * 1e3 / args.iters
    torch.cuda.synchronize()
    return host


def blocking_calls(it):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            it()
        torch.cuda.synchronize()
    out, n_runtime = {}, 0
    for ev in prof.key_averages():
        if ev.key.startswith(("cuda", "cu")) and not ev.key.startswith("cudaDeviceSynchronize"):
            n_runtime += ev.count
            if any(b in ev.key for b in BLOCKING):
                out[ev.key] = (ev.count / args.iters, ev.cpu_time_total / 1e3 / args.iters)
    return out, n_runtime / args.iters


def main():
    cycles = sleep_cycles(args.sleep_ms)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.iters} iterations per "
          f"measure, median of {args.rounds} rounds; sleep kernel {args.sleep_ms:.0f} ms")
    print("shape | layer | loop host ms | span ms | occupied host ms | runtime calls/it | "
          "blocking calls per iteration (count, host ms)")
    for shape in args.shapes.split(","):
        _, base, x, g = layer_and_batch(shape)
        fp8 = fp8ops.convert(torch.nn.Sequential(base), config=fp8ops.Fp8Config(policy="always"))[0]
        _, base, x, g = layer_and_batch(shape)
        its = {"bf16": make_iteration(base, x, g, False), "fp8ops": make_iteration(fp8, x, g, True)}
        for it in its.values():
            for _ in range(20):
                it()
        res = {k: ([], [], []) for k in its}
        for _ in range(args.rounds):
            for k, it in its.items():
                h, sp = loop_times(it)
                res[k][0].append(h)
                res[k][1].append(sp)
                res[k][2].append(occupied_host(it, cycles))
        for k, it in its.items():
            blk, n_rt = blocking_calls(it)
            med = [statistics.median(v) for v in res[k]]
            blk_s = ", ".join(f"{n} {c:.1f}x {ms:.3f}" for n, (c, ms) in sorted(blk.items())) or "none"
            print(f"{shape} | {k} | {med[0]:.3f} | {med[1]:.3f} | {med[2]:.3f} | {n_rt:.1f} | {blk_s}",
                  flush=True)
        del fp8, base, x, g, its
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
