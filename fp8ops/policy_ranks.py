"""policy="auto" across data-parallel ranks: every rank ends up running a
layer's shape alike, and no collective ever depends on the shapes a rank saw.

Each rank settles its own verdicts (policy.measure, or the trial in its loop)
without a collective in forward. Under DDP / FSDP2 ranks may see different
shapes -- an uneven last batch, variable-length sequences, a call with an odd
row count that runs BF16 without asking the policy -- so a collective issued
when a rank first meets a shape would be issued a different number of times on
different ranks: it hangs, or pairs up with another collective (DDP's gradient
all-reduce) and corrupts both. (Before, a verdict was all-reduced there.)

Instead the ranks agree at the optimizer steps, in update_scales, which every
rank reaches with the same layers in the same order: a flag "this rank settled
something since the last exchange" rides on the step's one amax all-reduce (its
own one-element all-reduce where no delayed layer is due). The reduced flag is
copied to the host without waiting and read at the next step (one step later it
has long arrived: no synchronization of the host with the GPU per step); where
it was set, an all_gather_object of the settled verdicts follows, on every rank
alike -- once per new shape, not per step. A shape then runs FP8 only where every
rank that settled it chose FP8, and every rank adopts the agreed verdict, also
for a shape it has not met yet. Until then (two steps at most) a rank runs its
own verdict. A layer that no optimizer steps (a frozen one) is exchanged only by
tune_policy.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist


def world(group=None) -> int:
    """The data-parallel world size (1 outside torch.distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def takes_part(layers) -> bool:
    """Do these layers exchange verdicts at the step? Decided from their configs
    alone, which every rank shares, so every rank issues the same collectives."""
    return any(layer.fp8_config.policy == "auto" for layer in layers)


def settled(layer, key, wins: bool, speedup: float, why: str | None = None) -> None:
    """Record a verdict this rank settled for layer's key (M bucket, dtype); under
    torch.distributed it waits for the next step's exchange."""
    d = layer.__dict__
    d["fp8_policy"][key] = (wins, speedup)
    if why is not None:
        d["fp8_policy_why"][key] = why
    d["_fp8_bf16_key"] = None  # (the BF16 shortcut of an earlier call may be this key's)
    if world() > 1:
        d["_fp8_unagreed"].add(key)


def flag(layers) -> float:
    """1.0 where this rank settled a verdict of these layers since the last exchange."""
    return 1.0 if any(layer.__dict__["_fp8_unagreed"] for layer in layers) else 0.0


def reduce_flag(layers, group, value: float):
    """The flag max-reduced over the ranks, for a step without an amax all-reduce
    to carry it (a one-element tensor on the layers' device)."""
    t = torch.full((1,), value, device=layers[0].fp8_amax_history.device, dtype=torch.float32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


# the first layer of an update_scales call -> (event or None, host tensor): the previous
# step's reduced flag on its way to the host (weak: a dead model's entry goes with it)
_in_flight: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def before_step(layers, group) -> None:
    """At each step, before this step's flag is made: act on the previous step's
    reduced flag (every rank reads the same value, so every rank gathers, or
    none). The gather takes everything settled so far, this step's too."""
    prev = _in_flight.pop(layers[0], None)
    if prev is not None:
        event, host = prev
        if event is not None:
            event.synchronize()  # recorded a step ago: long complete
        if host.item():
            agree(layers, group)


def send(layers, reduced) -> None:
    """This step's reduced flag on its way to the host, for the next step. (Under
    CUDA-graph capture nothing is sent: the copy would not run until a replay, and
    the verdicts are flagged again at the next step; every rank captures alike.)"""
    if reduced.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return
        with torch.cuda.device(reduced.device):  # the copy's stream and the event's: the flag's GPU
            host = torch.zeros(1, dtype=reduced.dtype, pin_memory=True)
            host.copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        _in_flight[layers[0]] = (event, host)
    else:
        _in_flight[layers[0]] = (None, reduced)


def agree(layers, group=None) -> None:
    """Every rank calls this with the same layers in the same order, once the
    reduced flag said some rank settled something: all ranks' settled verdicts
    are gathered and each rank adopts, per (layer, key), FP8 only where every
    rank that settled it chose FP8."""
    from . import loop_trial  # noqa: PLC0415

    mine = []
    for i, layer in enumerate(layers):
        d = layer.__dict__
        for key in sorted(d["_fp8_unagreed"], key=str):
            wins, speedup = d["fp8_policy"][key]
            mine.append((i, key, wins, speedup, d["fp8_policy_why"].get(key)))
        d["_fp8_unagreed"].clear()
    everyone = [None] * world(group)
    dev = layers[0].fp8_amax_history.device
    # (under NCCL the objects travel through the current CUDA device: the layers' one, also
    # where the script never called torch.cuda.set_device)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        dist.all_gather_object(everyone, mine, group=group)
    me = dist.get_rank(group)
    votes: dict[tuple, list] = {}
    for rank, verdicts in enumerate(everyone):
        for i, key, wins, speedup, why in verdicts:
            votes.setdefault((i, key), []).append((rank, wins, speedup, why))
    for (i, key), vs in votes.items():
        layer = layers[i]
        d = layer.__dict__
        wins = all(v[1] for v in vs)
        speedup = min(v[2] for v in vs)
        own = next((v for v in vs if v[0] == me), None)
        why = (own or vs[0])[3]
        if len(vs) < len(everyone) or not all(v[1] == wins for v in vs):
            no = [str(v[0]) for v in vs if not v[1]]
            why = ((why + "; ") if why else "") + (
                f"across ranks: BF16, rank(s) {', '.join(no)} chose BF16" if no else
                f"across ranks: FP8, chosen by rank(s) {', '.join(str(v[0]) for v in vs)}")
        d["fp8_policy"][key] = (wins, speedup)
        if why is not None:
            d["fp8_policy_why"][key] = why
        if key in d["_fp8_pending"]:  # this rank's own trial for it is moot now
            del d["_fp8_pending"][key]
            loop_trial.forget(layer, key)
        d["_fp8_bf16_key"] = None  # the BF16 shortcut may belong to a verdict that changed


def agree_now(layers, group=None) -> None:
    """Exchange at once (tune_policy: every rank calls it at the same point)."""
    if world(group) > 1 and layers and takes_part(layers) and reduce_flag(layers, group, flag(layers)).item():
        agree(layers, group)

