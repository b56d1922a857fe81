"""Muon for the hidden weight matrices, AdamW for the rest (biases, norms, embeddings, head):
the split that made every FP8 layer's scales update twice per step before the forty-third
session. Trains the example's GPT (gpt2 arch, with biases) from one seed in BF16 and with
fp8ops, on the example's default corpus, and prints the loss curves side by side, tokens/s,
and each FP8 layer's step count (must equal the optimizer steps).

    cd benchmarks/dev && python3 muon_split_check.py --steps 200
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
import fp8ops  # noqa: E402
from fp8ops.linear import Fp8LinearBase  # noqa: E402
from gpt2 import GPT, GPTConfig  # noqa: E402
from train_fp8 import default_corpus  # noqa: E402


def optimizers(model, lr_muon: float, lr_adamw: float):
    """(Muon, AdamW): Muon takes the 2-D weights of the blocks (not the embeddings or head)."""
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and ".h." in f".{n}"]
    ids = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if id(p) not in ids]
    return (torch.optim.Muon(hidden, lr=lr_muon, weight_decay=0.0),
            torch.optim.AdamW(rest, lr=lr_adamw, betas=(0.9, 0.95), weight_decay=0.0))


def train(use_fp8: bool, data: torch.Tensor, args) -> dict:
    torch.manual_seed(args.seed)
    cfg = GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block)
    model = GPT(cfg).to(args.device)
    if use_fp8:
        # (policy "always": at this model's small shapes "auto" runs most layers BF16, whose
        # updates then roll rows with nothing cast, by design; every layer here casts each step)
        fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always"))
    opts = optimizers(model, args.lr_muon, args.lr_adamw)
    g = torch.Generator(device="cpu").manual_seed(args.seed + 1)
    losses, t0, timed_from = [], None, args.steps // 4
    for step in range(args.steps):
        if step == timed_from:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        ix = torch.randint(len(data) - args.block - 1, (args.batch,), generator=g)
        batch = torch.stack([data[i:i + args.block + 1] for i in ix.tolist()]).to(args.device, non_blocking=True)
        x, y = batch[:, :-1].long(), batch[:, 1:].long()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
        losses.append(loss.item() if step % args.log_every == 0 or step == args.steps - 1 else None)
    torch.cuda.synchronize()
    tps = (args.steps - timed_from) * args.batch * args.block / (time.perf_counter() - t0)
    layers = [m for m in model.modules() if isinstance(m, Fp8LinearBase)]
    return {"losses": losses, "tokens_per_s": tps, "fp8_steps": sorted({m.fp8_step for m in layers}),
            "fp8_layers": len(layers), "fallback_calls": sum(m.fp8_fallback_calls for m in layers),
            # the update rolls row 0 (this step's amaxes) to the last row: the last k rows are the
            # last k steps', none 0 unless an update came with nothing cast (a second one per step)
            "history_zero_rows": sum(int(m.fp8_amax_history[-min(args.steps, m.fp8_amax_history.shape[0] - 1):]
                                         .eq(0).any(dim=1).sum()) for m in layers)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--n_layer", type=int, default=4)
    p.add_argument("--n_head", type=int, default=8)
    p.add_argument("--n_embd", type=int, default=512)
    p.add_argument("--lr_muon", type=float, default=0.02)
    p.add_argument("--lr_adamw", type=float, default=3e-3)
    p.add_argument("--log_every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.device = "cuda"
    raw, desc = default_corpus()
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, corpus {desc}")
    runs = {name: train(name == "fp8ops", data, args) for name in ("bf16", "fp8ops")}
    print("step  " + "  ".join(f"{n:>8}" for n in runs))
    for i, _ in enumerate(runs["bf16"]["losses"]):
        row = [runs[n]["losses"][i] for n in runs]
        if row[0] is not None:
            print(f"{i:4d}  " + "  ".join(f"{v:8.4f}" for v in row))
    for n, r in runs.items():
        print(f"{n}: {r['tokens_per_s']:,.0f} tokens/s; FP8 layers {r['fp8_layers']}, their step counts "
              f"{r['fp8_steps']} (optimizer steps {args.steps}), calls that ran BF16 {r['fallback_calls']}, history rows "
              f"of the last steps with a 0 amax: {r['history_zero_rows']}")
    f = runs["fp8ops"]
    ok = f["fp8_steps"] == [args.steps] and f["fp8_layers"] > 0 and f["history_zero_rows"] == 0
    print("CHECK", "ok" if ok else "FAILED", f"(FP8 / BF16 tokens/s {f['tokens_per_s'] / runs['bf16']['tokens_per_s']:.3f}x, "
          f"final loss {f['losses'][-1]:.4f} vs {runs['bf16']['losses'][-1]:.4f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
