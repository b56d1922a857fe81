"""fp8ops.set_scaling_group under NCCL on two GPUs (tests/test_distributed.py runs the same
rules with gloo on the CPU): the ranks whose amaxes a model's scale updates reduce over.

    torchrun --nproc_per_node=2 benchmarks/dev/scaling_group_nccl.py

Each rank trains a one-layer model of its own on its own data (rank 1's inputs 100x rank 0's),
three optimizer steps with lr 0, delayed scaling; the layer's three scales (x, w, dy) after them:
  - "local" and a group of the rank alone give equal scales, bit for bit, and rank 0's input
    scale is ~100x rank 1's (no amax crossed ranks);
  - the default group (every rank) gives one set of scales on both ranks, the input scale that
    of rank 1's larger amaxes (rank 1's "local" input scale, bit for bit);
  - a "local" model only rank 0 trains, while rank 1 waits at a barrier, ends (no collective
    for rank 1 to join: under the default group this would wait out the timeout).
Prints PASS/FAIL on rank 0; exit status 1 if any check failed.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import fp8ops
from fp8ops.linear import Fp8Linear

X = 0  # the input's column of fp8_scale


def one_layer(dev) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(256, 256)).to(dev)
    return fp8ops.convert(m, config=fp8ops.Fp8Config(policy="always", amax_history_len=4))


def train(m: nn.Module, rank: int, dev) -> torch.Tensor:
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    g = torch.Generator(device=dev).manual_seed(7 + rank)
    for _ in range(3):
        m(torch.randn(64, 256, device=dev, generator=g) * (1 + 99 * rank)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert isinstance(m[0], Fp8Linear)
    return m[0].fp8_scale.detach().clone()


def main() -> int:
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    own = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group)
    m = one_layer(dev)
    assert fp8ops.set_scaling_group(m, "local") == 1
    local = train(m, rank, dev)
    m = one_layer(dev)
    fp8ops.set_scaling_group(m, own[rank])
    own_group = train(m, rank, dev)
    everyone = train(one_layer(dev), rank, dev)
    alone = None
    if rank == 0:
        m = one_layer(dev)
        fp8ops.set_scaling_group(m, "local")
        alone = train(m, rank, dev)
    dist.barrier()
    got = [None] * world
    dist.all_gather_object(got, {"local": local.cpu(), "own_group": own_group.cpu(), "everyone": everyone.cpu(),
                                 "alone": None if alone is None else alone.cpu()})
    failed = 0
    if rank == 0:
        def check(name, ok, detail):
            nonlocal failed
            print(f"{'PASS' if ok else 'FAIL'}: {name} ({detail})", flush=True)
            failed += not ok
        print(f"torch {torch.__version__}, {world} ranks, NCCL, {torch.cuda.get_device_name(dev)}")
        for r, g in enumerate(got):
            check(f"rank {r}: \"local\" and a group of the rank alone give equal scales",
                  torch.equal(g["local"], g["own_group"]), f"{g['local'].tolist()} vs {g['own_group'].tolist()}")
        ratio = float(got[0]["local"][X] / got[1]["local"][X])
        check("no amax crossed ranks: rank 0's input scale is ~100x rank 1's", 50 < ratio < 200, f"{ratio:.1f}x")
        check("the default group: one set of scales on every rank",
              all(torch.equal(g["everyone"], got[0]["everyone"]) for g in got),
              str([g["everyone"].tolist() for g in got]))
        check("the default group: the input scale of rank 1's larger amaxes",
              torch.equal(got[0]["everyone"][X], got[1]["local"][X]),
              f"{float(got[0]['everyone'][X]):.6g} vs rank 1's local {float(got[1]['local'][X]):.6g}")
        check("a \"local\" model only rank 0 trained ended, its scales rank 0's own",
              got[0]["alone"] is not None and torch.equal(got[0]["alone"], got[0]["local"]),
              str(None if got[0]["alone"] is None else got[0]["alone"].tolist()))
        print("all checks passed" if not failed else f"{failed} check(s) failed")
    flag = torch.tensor([failed], device=dev)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 1 if int(flag) else 0


if __name__ == "__main__":
    sys.exit(main())
