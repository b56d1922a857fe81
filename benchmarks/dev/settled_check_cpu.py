"""bench_train's settled check (one step against BF16 from the same weights, after a 28-step
AdamW warm-up on 4 random batches, no learning-rate warm-up) on the CPU, with fp8ops' CPU
reference kernels (bit-identical to the CUDA ones) and a small GPT of the example's
architecture: does the low per-parameter gradient SQNR seen on the 1B model appear here?
--checks 28,100,160 checks again as training goes on memorizing the 4 batches (the check's
own forward and backward fold into that step's amaxes, as bench_train's does); --recipe
current against delayed tells a stale scale from FP8's own rounding; --fp32-control adds
settled_check_fp32.py's FP32 reference (is the lowest parameter low for BF16 too?).
    python benchmarks/dev/settled_check_cpu.py [--seeds 3] [--checks 28] [--recipe delayed] [--fp32-control]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_train  # noqa: E402

import fp8ops  # noqa: E402
import fp8ops.conversion  # noqa: E402
from fp8ops.linear import Fp8Linear  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--seeds", type=int, default=3)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--width", type=int, default=256)
ap.add_argument("--seq", type=int, default=128)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--checks", default="28", help="comma-separated training steps after which to check")
ap.add_argument("--recipe", choices=("delayed", "current"), default="delayed")
ap.add_argument("--fp32-control", action="store_true", help="also compare both against FP32 gradients")
args = ap.parse_args()
checks = sorted(int(c) for c in args.checks.split(","))
bench_train.DEVICE = "cpu"
fp8ops.conversion.fp8_supported_here = lambda device=None: (True, "the CPU reference kernels")
GPT, GPTConfig, lm_filter, _ = bench_train.import_gpt()
if args.fp32_control:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from settled_check_fp32 import check_with_fp32
    bench_train.settled_check = check_with_fp32
V, T, B = bench_train.VOCAB, args.seq, args.batch
for seed in range(args.seeds):
    torch.manual_seed(seed)
    cfg = GPTConfig(n_layer=args.layers, n_head=4, n_embd=args.width, block_size=T, vocab_size=V, dropout=0.0)
    model = GPT(cfg)
    fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always", recipe=args.recipe), module_filter_fn=lm_filter)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.fp8_on_cpu = True
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, weight_decay=0.1, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(1234 + seed)
    batches = [(torch.randint(0, V, (B, T), generator=gen), torch.randint(0, V, (B, T), generator=gen))
               for _ in range(4)]
    for i in range(1, checks[-1] + 1):
        idx, tgt = batches[(i - 1) % 4]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i not in checks:
            continue
        ranges = [r["range_g"] for r in fp8ops.report(model, print_table=False) if r.get("range_g") is not None]
        chk = bench_train.settled_check(model, model, GPT, cfg, batches[0])
        print(f"[{args.recipe}] seed {seed}, step {i}: loss {loss.item():.3f}; check: loss {chk['loss']:.4f} vs "
              f"{chk['loss_bf16']:.4f}, gradients {chk['grad_sqnr_db']:.1f} dB, lowest {chk['min_param_sqnr_db']:.1f} "
              f"dB ({chk['min_param']}); dy range used {min(ranges):.2g}-{max(ranges):.2g}", flush=True)
