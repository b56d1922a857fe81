"""DDP with policy "auto" where the ranks meet different shapes: every step each
rank's batch has its own row count (some not a multiple of 16, which runs BF16
without asking the policy), as variable-length sequences give. Before the
verdicts were exchanged at the optimizer step (fp8ops/policy_ranks.py), each
rank issued an all-reduce per new shape in forward, a different number on each
rank: a hang, or a collective paired with DDP's own. Checks that the run ends,
that every rank holds the same verdicts afterwards, and that the loss is finite.
(The row counts, 4096-4213, fall in one of policy.rows_bucket's quarter octaves:
since those, one timing and one trial settle them all.) With one process
(--nproc_per_node=1) it shows the same for variable-length batches alone.
--zero: the optimizer is torch's ZeroRedundancyOptimizer (each rank steps its own shard
of the parameters with an inner optimizer; the scales must still update once per step on
every rank, for every layer). Both modes also check that every rank holds the same scales.

    torchrun --nproc_per_node=2 benchmarks/dev/ddp_uneven_policy.py [--steps 40] [--timeout 120] [--zero]

With an fp8ops from before that change the run stops at the watchdog's timeout.
"""
import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fp8ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait (NCCL watchdog)")
    ap.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer(AdamW) instead of AdamW")
    args = ap.parse_args()
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(0)
    d = args.dim
    model = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)).cuda()
    model = fp8ops.convert(model)  # policy "auto" (the default)
    ddp = DDP(model)
    if args.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    t0 = time.perf_counter()
    for step in range(args.steps):
        # rows differ by rank and step: 8 distinct multiples of 16 per rank, every 7th step odd
        rows = 4096 + 16 * ((step * (rank + 3)) % 8) + (5 if (step + rank) % 7 == 0 else 0)
        x = torch.randn(rows, d, device="cuda", generator=g)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ddp(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not torch.isfinite(loss):
            raise SystemExit(f"rank {rank}: loss {loss.item()} at step {step}")
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    verdicts = {name: sorted((k[0], str(k[1]), v[0]) for k, v in m.fp8_policy.items())
                for name, m in model.named_modules() if hasattr(m, "fp8_policy")}
    scales = {name: (m.fp8_step, m.fp8_scale.tolist()) for name, m in model.named_modules()
              if hasattr(m, "fp8_scale")}
    everyone, all_scales = [None] * world, [None] * world
    dist.all_gather_object(everyone, verdicts)
    dist.all_gather_object(all_scales, scales)
    if rank == 0:
        same = all(v == everyone[0] for v in everyone)
        same_scales = all(v == all_scales[0] for v in all_scales)
        print(f"optimizer {'ZeroRedundancyOptimizer(AdamW)' if args.zero else 'AdamW'}; (steps seen, scales) "
              f"per layer on rank 0: {all_scales[0]}; identical on every rank: {same_scales}")
        for name, vs in everyone[0].items():
            fp8 = sum(1 for v in vs if v[2])
            print(f"{name}: {len(vs)} shapes settled, {fp8} FP8, {len(vs) - fp8} BF16")
        print(f"{args.steps} steps on {world} ranks in {elapsed:.1f} s; verdicts identical on every rank: {same}; "
              f"last loss {loss.item():.4f}")
        fp8ops.report(model)
        if not same or not same_scales:
            raise SystemExit("verdicts or scales differ between ranks")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
