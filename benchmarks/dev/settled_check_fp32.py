"""Is a parameter that bench_train's settled check finds far below the others (the 1B model's
-2.0 dB on an H200, twentieth session) FP8 at fault, or a gradient that is small against the
rounding of its own terms (one that cancels across tokens)? The check is repeated with a third
gradient, the same model in FP32 (no autocast), as the reference for both: a cancelling
gradient is low for BF16 as well, and FP8's deficit against BF16 (FP8 vs FP32 minus BF16 vs
FP32, per parameter) stays near the median parameter's; a fault shows as one parameter whose
deficit stands out. Prints the parameters lowest by FP8 vs BF16, and the deficit's spread.
    cd benchmarks && python3 dev/settled_check_fp32.py --models 1b --variants fp8ops --batch-1b 8 --steps 2
(any bench_train arguments). settled_check_cpu.py --fp32-control uses it on the CPU. The check
runs on bench_train.copy_task's targets, as bench_train's own; SETTLED_RANDOM_TARGETS=1 gives it
the benchmark's random targets, as before copy_task (where block 0's gradients cancelled).
"""
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_train  # noqa: E402

SHOW = 8
COPY_TASK = os.environ.get("SETTLED_RANDOM_TARGETS") != "1"  # 1: the random targets of the runs before copy_task
FP32_CHUNKS = 4  # the FP32 pass in slices of the batch (a 1B model's FP32 activations fit an 80 GB GPU)


def _to_cpu(grads: dict) -> dict:
    """(the three gradient sets of a 1B model would take 12 GB of GPU memory)"""
    return {n: g.detach().float().cpu() for n, g in grads.items()}


def fp32_grads(ref, batch) -> tuple:
    """bench_train.model_grads without autocast, the batch's rows in FP32_CHUNKS slices: the mean
    loss's gradient is the mean of the slices' (equal slices)."""
    idx, tgt = batch
    ref.zero_grad(set_to_none=True)
    chunks = min(FP32_CHUNKS, idx.shape[0])
    assert idx.shape[0] % chunks == 0, f"batch {idx.shape[0]} must split into {chunks} equal slices"
    loss = 0.0
    for i, t in zip(idx.chunk(chunks), tgt.chunk(chunks)):
        _, part = ref(i, t)
        (part / chunks).backward()
        loss += float(part.detach()) / chunks
    return loss, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def check_with_fp32(model, call, GPT, cfg, batch) -> dict:
    """bench_train.settled_check's dict (FP8 against BF16), after printing the FP32 control."""
    batch = bench_train.copy_task(batch[0]) if COPY_TASK else batch
    ref = bench_train.reference_model(model, GPT, cfg)
    loss, g8 = bench_train.model_grads(model, call, batch)
    g8 = _to_cpu(g8)
    model.zero_grad(set_to_none=True)
    loss16, g16 = bench_train.model_grads(ref, ref, batch)
    g16 = _to_cpu(g16)
    loss32, g32 = fp32_grads(ref, batch)
    g32 = _to_cpu(g32)
    ref.zero_grad(set_to_none=True)
    overall, vs16 = bench_train.grad_sqnr(g8, g16)
    overall8_32, vs32_8 = bench_train.grad_sqnr(g8, g32)
    overall16_32, vs32_16 = bench_train.grad_sqnr(g16, g32)
    del ref, g8, g16, g32
    a, b, c = ({n: db for db, n in rows} for rows in (vs16, vs32_8, vs32_16))
    # FP8's deficit against BF16 per parameter, both measured against FP32 (finite ones only)
    deficit = {n: c[n] - b[n] for n in b if n in c and math.isfinite(b[n]) and math.isfinite(c[n])}
    med = statistics.median(deficit.values()) if deficit else math.nan
    print(f"\n[fp32 control] losses: fp8 {loss:.5f}, bf16 {loss16:.5f}, fp32 {loss32:.5f}; whole model: fp8 vs bf16 "
          f"{overall:.1f} dB, fp8 vs fp32 {overall8_32:.1f} dB, bf16 vs fp32 {overall16_32:.1f} dB")
    print(f"[fp32 control] FP8's deficit (bf16 vs fp32 - fp8 vs fp32) over {len(deficit)} parameters: median "
          f"{med:.1f} dB, range {min(deficit.values()):.1f}..{max(deficit.values()):.1f} dB")
    print(f"[fp32 control] {'parameter':40s} {'fp8/bf16':>9s} {'fp8/fp32':>9s} {'bf16/fp32':>9s} {'deficit':>8s}")
    for db, n in sorted(vs16)[:SHOW]:
        print(f"[fp32 control] {n:40s} {db:9.1f} {b.get(n, math.nan):9.1f} {c.get(n, math.nan):9.1f} "
              f"{deficit.get(n, math.nan):8.1f}")
    worst = min(vs16) if vs16 else (math.inf, "")
    return {"loss": loss, "loss_bf16": loss16, "grad_sqnr_db": overall, "min_param_sqnr_db": worst[0],
            "min_param": worst[1], "deficit_median_db": med,
            "min_param_deficit_db": deficit.get(worst[1], math.nan)}


if __name__ == "__main__":
    bench_train.settled_check = check_with_fp32
    sys.argv = ["bench_train.py"] + sys.argv[1:]
    sys.exit(bench_train.main())
