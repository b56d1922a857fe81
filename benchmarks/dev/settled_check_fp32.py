"""Is a parameter that bench_train's settled check finds far below the others (the 1B model's
-2.0 dB on an H200, twentieth session) FP8 at fault, or is BF16, the check's reference, itself
unreliable there? The check is repeated with a third gradient, the same model in FP32 (no
autocast), as the reference for both. Where a gradient is small against the rounding of its
terms (one that cancels across tokens) or the model's state is so sensitive that any rounding
moves its gradients, BF16 is far from FP32 as well, and FP8's deficit against BF16 (BF16 vs
FP32 minus FP8 vs FP32) stays near the median parameter's; a fault shows as FP8 far from FP32
where BF16 is close. Prints the parameters lowest by FP8 vs BF16, and the deficit's spread.
    cd benchmarks && python3 dev/settled_check_fp32.py --models 1b --variants fp8ops --batch-1b 8 --steps 2
(any bench_train arguments). settled_check_cpu.py --fp32-control uses it on the CPU.
bench_train's own check runs the FP32 pass only where FP8 against BF16 fails, as its arbiter.
"""
import math
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_train  # noqa: E402

SHOW = 8


def check_with_fp32(model, call, GPT, cfg, batch) -> dict:
    """bench_train.settled_check's dict (FP8 against BF16), after printing the FP32 control."""
    bt = bench_train
    ref = bt.reference_model(model, GPT, cfg)
    loss, g8 = bt.model_grads(model, call, batch)
    g8 = bt.grads_to_cpu(g8)
    model.zero_grad(set_to_none=True)
    loss16, g16 = bt.model_grads(ref, ref, batch)
    g16 = bt.grads_to_cpu(g16)
    loss32, g32 = bt.model_grads(ref, ref, batch, autocast=False, slices=4)
    g32 = bt.grads_to_cpu(g32)
    ref.zero_grad(set_to_none=True)
    overall, vs16 = bt.grad_sqnr(g8, g16)
    t8, t16 = bt.squared_errors(g8, g32), bt.squared_errors(g16, g32)  # (also the arbiter's input)
    overall8_32, vs32_8 = bt.terms_sqnr(t8)
    overall16_32, vs32_16 = bt.terms_sqnr(t16)
    _, b, c = ({n: db for db, n in rows} for rows in (vs16, vs32_8, vs32_16))
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
    chk = {"loss": loss, "loss_bf16": loss16, "grad_sqnr_db": overall, "min_param_sqnr_db": worst[0],
           "min_param": worst[1], "loss_fp32": loss32, **bt.fp32_arbiter(t8, t16),
           "deficit_median_db": med, "min_param_deficit_db": deficit.get(worst[1], math.nan)}
    chk["verdict"] = bt.settled_verdict(chk)
    del ref, g8, g16, g32
    print(f"[fp32 control] bench_train's verdict: {chk['verdict']}; " + bt.settled_check_line(chk))
    return chk


if __name__ == "__main__":
    bench_train.settled_check = check_with_fp32
    sys.argv = ["bench_train.py"] + sys.argv[1:]
    sys.exit(bench_train.main())
