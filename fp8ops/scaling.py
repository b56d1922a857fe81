"""Delayed-scaling bookkeeping: after each optimizer step, update every
Fp8Linear's scales from its amax history (on CUDA one launch per 32 layers,
each layer's three tensors at once, counting NaN/inf amaxes), after reducing
this step's amaxes across the data-parallel ranks in ONE all-reduce for all
layers, so every rank casts with the same scales.

Hooked on torch.optim's global step post-hook, so a training loop needs no
extra call; `fp8ops.step(model)` does the same by hand (custom optimizers).
Also: scaling_state_dict / load_scaling_state_dict (kept out of the model's
state_dict so checkpoints stay the BF16 model's).
"""
from __future__ import annotations

import math
import numbers
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from . import _loader, loop_trial, ops, policy, policy_ranks
from . import linear as _linear
from .linear import G, Fp8LinearBase, _settled_bf16

# Every live Fp8Linear (weak: dead models are not kept alive). The optimizer
# hook matches layers by the identity of their *current* weight Parameter, so
# wrappers that swap Parameters after conversion (FSDP2's DTensor shards) work.
_LAYERS: "weakref.WeakSet[Fp8LinearBase]" = weakref.WeakSet()
# A WeakSet guards its iteration against the garbage collector's removals, not against another
# thread's additions: a layer made (convert, deepcopy: an EMA or checkpoint thread) while an
# optimizer step lists the layers made the step raise "Set changed size during iteration",
# after the weights had moved. Additions, removals and listings take this lock.
_LAYERS_LOCK = threading.RLock()
_hook_handles = None
# bumped where the live layers change (track, untrack) or a weight is replaced for the FSDP2
# FP8 all-gather: the optimizers' kept scans (_scan) are made again
_LAYER_GEN = [0]


def track(layer: Fp8LinearBase) -> None:
    with _LAYERS_LOCK:
        _LAYERS.add(layer)
        _LAYER_GEN[0] += 1
    if "_fp8_death_note" not in layer.__dict__:
        # (its dict, not the layer: a finalizer must not keep the layer alive; the buffers stay
        # until it has run)
        note = weakref.finalize(layer, _note_dead_slot, layer._buffers)
        note.atexit = False
        layer.__dict__["_fp8_death_note"] = note
    _install_hook()


def _note_dead_slot(buffers: dict) -> None:
    """A layer died: its fp8_grad_amax, should a compiled backward have written it since the
    last fold, is not a write lost to a copy (fold_grad_amax's warning)."""
    ga = buffers.get("fp8_grad_amax")
    if ga is not None and not ga.is_meta and _linear._TRACES[0]:  # (only compiled backwards write it)
        if len(_DEAD_SLOTS) > 65536:  # (no step has folded in a long while: a bound, not a record)
            _DEAD_SLOTS.clear()
        _DEAD_SLOTS.add(ga.data_ptr())


def live_layers() -> list[Fp8LinearBase]:
    """Every live Fp8Linear, a list made under the lock."""
    with _LAYERS_LOCK:
        return list(_LAYERS)


# the weights enable_fsdp_fp8_all_gather replaced by new Parameters: id -> (a weak reference to
# the old one, its layer's name). An optimizer built before that call steps the old ones, which
# no gradient reaches: its first step after it raises (checked again after each new call).
_REPLACED: dict[int, tuple] = {}
_replaced_calls = [0]


def note_replaced(old: torch.nn.Parameter, name: str) -> None:
    for key in [k for k, (ref, _) in _REPLACED.items() if ref() is None]:  # (weights gone since)
        del _REPLACED[key]
    _REPLACED[id(old)] = (weakref.ref(old), name)
    _replaced_calls[0] += 1
    _LAYER_GEN[0] += 1


def _check_not_replaced(optimizer) -> None:
    d = optimizer.__dict__
    if d.get("_fp8ops_replaced_checked") == _replaced_calls[0]:
        return
    stale = []
    # (a ZeroRedundancyOptimizer has no param_groups until its inner optimizer exists)
    for group in getattr(optimizer, "param_groups", None) or ():
        for p in group["params"]:
            entry = _REPLACED.get(id(p))
            if entry is not None and entry[0]() is p:
                stale.append(entry[1])
    if stale:
        raise RuntimeError(
            f"fp8ops: this optimizer holds weights that fp8ops.enable_fsdp_fp8_all_gather replaced ({len(stale)} "
            f"layer(s): {', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}); they get no gradient, so those "
            "layers would never train. Build the optimizer after enable_fsdp_fp8_all_gather (and fully_shard)")
    d["_fp8ops_replaced_checked"] = _replaced_calls[0]


def untrack(layer) -> None:
    """Forget a layer (a conversion undone)."""
    with _LAYERS_LOCK:
        _LAYERS.discard(layer)
        _LAYER_GEN[0] += 1
    note = layer.__dict__.get("_fp8_death_note")
    if note is not None:
        note.detach()


def _install_hook() -> None:
    global _hook_handles
    if _hook_handles is None:
        _hook_handles = (register_optimizer_step_pre_hook(_before_optimizer_step),
                         register_optimizer_step_post_hook(_after_optimizer_step))


def _layers_of(optimizer, by_bias: list | None = None) -> list[Fp8LinearBase]:
    """The layers whose scales this optimizer's step updates, ordered as its params (so every
    rank concatenates amaxes alike; layers that share one weight by creation, since a WeakSet
    iterates in an order of its own in each process). A layer goes with an optimizer that
    steps its weight or its bias (BitFit, a LoRA model's bias="all": a frozen weight, or one
    left out of the optimizer). Split between two (Muon for the weight, AdamW for the bias)
    both took it, until the forty-third session: two updates per step, half the history's
    window, `interval` counted twice. Now each takes it only if the other has not updated it
    since this one's last step: the first of the two to step does, once per step, in either
    order, and the other takes over when it stops stepping. Decided from the hooks' own
    counts (_HOOK_STEPS), never from which optimizers are still alive: ranks collect garbage
    at different times, and their update sets must pair up in the all-reduce. by_bias: where
    the layers taken through their bias alone are appended."""
    if not _LAYERS:
        return []
    since = _end_box(optimizer)[0]
    found = []
    for ref, by_weight, has_bias in _scan(optimizer):
        layer = ref()
        if layer is None:
            continue
        d = layer.__dict__
        if by_weight:
            # (one that holds the bias too takes it: a bias-only optimizer's update was no
            # split's, e.g. a BitFit phase before this optimizer, which missed its first update)
            if not has_bias and d.get("_fp8_bias_path_at", 0) > since:
                continue
        elif d.get("_fp8_weight_path_at", 0) <= since:
            if by_bias is not None:
                by_bias.append(layer)
        else:
            continue
        found.append(layer)
    return found


def _weight_and_bias(layer) -> tuple:
    """The Parameters an optimizer would hold for the layer (no Module.__getattr__: the hooks
    run this for layers x optimizers; a parametrized weight or bias is not in _parameters)."""
    ps = layer._parameters
    w, b = ps.get("weight"), ps.get("bias")
    if w is None or (b is None and "bias" not in ps):
        w, b = _held(layer, "weight"), _held(layer, "bias")
    return w, b


def _scan(optimizer) -> list:
    """The live layers this optimizer holds the weight or bias of, as (weak reference, held by
    its weight, holds the bias too), ordered as its params (see _layers_of). A scan of every
    live layer, kept on the optimizer while its parameter lists, the live layers and the
    Parameters registered on them stay as they were (the kept layers' weight and bias are
    checked at each step): with one optimizer per parameter (optimizer in backward) a scan
    per optimizer step cost layers x optimizers, 2.2 ms of host time per step for GPT-2
    small's 49 layers and 148 optimizers on the CPU box, 110 ms for 500 layers. (A Parameter
    written into a layer's _parameters directly, as FSDP2 does, is not seen: FSDP2 registers
    the same sharded Parameter again after each backward.)"""
    # (the params' ids in order: a group reordered in place orders the all-reduce otherwise;
    # the optimizer holds them, so an id stays its Parameter's while it is in the list)
    key = (_LAYER_GEN[0], _linear._REGISTRATIONS[0],
           tuple(tuple(map(id, g["params"])) for g in optimizer.param_groups))
    d = optimizer.__dict__
    kept = d.get("_fp8ops_scan")
    if kept is not None and kept[0] == key:
        for ref, w_ref, b_ref in kept[1]:
            layer = ref()
            if layer is not None:
                now_w, now_b = _weight_and_bias(layer)
                if now_w is not _deref(w_ref) or now_b is not _deref(b_ref):
                    break
        else:
            return kept[2]
    pos = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    found = []
    for layer in live_layers():
        w, b = _weight_and_bias(layer)
        iw, ib = pos.get(id(w)), None if b is None else pos.get(id(b))
        if iw is None and ib is None:
            continue
        at = ib if iw is None else iw if ib is None else min(iw, ib)
        ld = layer.__dict__
        found.append((at, ld.get("_fp8_serial", 0), ld.get("_fp8_copy", 0), weakref.ref(layer), w, b, iw, ib))
    found.sort(key=lambda f: f[:3])
    # (weak: a bias-only optimizer must not keep the frozen weights alive, a review's probe)
    checks = [(f[3], _weak(f[4]), _weak(f[5])) for f in found]
    entries = [(f[3], f[6] is not None, f[7] is not None) for f in found]
    d["_fp8ops_scan"] = (key, checks, entries)
    return entries


def _weak(t):
    return None if t is None else weakref.ref(t)


def _deref(ref):
    """(a Parameter freed since: _FREED, which no live Parameter is)"""
    if ref is None:
        return None
    t = ref()
    return _FREED if t is None else t


_FREED = object()


def _held(layer, name: str):
    """The Parameter an optimizer holds for a layer's weight or bias: under a parametrization
    (torch.nn.utils.parametrize, registered after convert) its original, not the attribute,
    whose read runs the parametrization (spectral_norm's power iteration: a review saw five
    steps of an unrelated optimizer change a model's spectral-norm state). None where it has
    no single original (a right_inverse that returns several, the old weight_norm)."""
    p = layer._modules.get("parametrizations")
    if p is not None and name in p:
        return getattr(p[name], "original", None)
    ps = layer._parameters
    if name in ps:
        return ps[name]
    if name + "_orig" in ps:
        # torch.nn.utils.prune, the old spectral_norm: a forward pre-hook sets the attribute
        # from <name>_orig at each call (a review: read, the layer matched no optimizer and
        # went back to current scales, a bias-only match rescanned at every step)
        return ps[name + "_orig"]
    if name + "_g" in ps:
        return None  # (the old weight_norm: g and v, no single original)
    return getattr(layer, name, None)


# the optimizer step hooks that ran so far (not ZeroRedundancyOptimizer's inner ones, see
# _before_optimizer_step): each optimizer keeps the count at its last step (_end_box),
# each layer the count of its last update through an optimizer that holds its weight and
# through one that holds its bias alone (_fp8_weight_path_at, _fp8_bias_path_at)
_HOOK_STEPS = [0]


def _end_box(optimizer) -> list:
    """[the hook count at this optimizer's last step]: a box the layers it took hold too
    (linear._left_by_its_optimizer), which keeps its count once the optimizer is freed."""
    box = optimizer.__dict__.get("_fp8ops_end_box")
    if box is None:
        box = optimizer.__dict__["_fp8ops_end_box"] = [0]
    return box


# update_scales calls so far (loop_trial keeps the count): each layer keeps the count at its
# last update (_fp8_updated_at) and each optimizer the count when its step began
# (_fp8ops_seen, kept while the step is open): an optimizer whose step runs another hooked
# one (SAM's base optimizer) then skips the layers the inner one updated.
# (The hooks are global: under torch.compile(opt.step), of any optimizer, dynamo would trace
# them and fail on the optimizer attributes they write; they run as eager code instead.
# torch._disable_dynamo imports dynamo at the first call, not at fp8ops' import: +1.6 s there)
@torch._disable_dynamo
def _before_optimizer_step(optimizer, args, kwargs) -> None:
    d = optimizer.__dict__
    if _REPLACED:
        _check_not_replaced(optimizer)
    if not d.get("_fp8ops_open"):
        d["_fp8ops_seen"] = loop_trial.optimizer_steps()
        d["_fp8ops_open"] = True
    # else this optimizer's step is still open: a subclass's step calling super().step() (the
    # hooks fire around both), maybe after stepping an inner optimizer: the count at the
    # outermost start stays, so the layers that inner one updated are skipped. (A step that
    # raised leaves it open too; its next post-step hook closes it.)
    # ZeroRedundancyOptimizer steps an inner optimizer that holds only this rank's shard of
    # the parameters: updating scales after it would update different layers on different
    # ranks (collectives that do not pair up: a hang). The outer one holds every parameter on
    # every rank, so the scales follow it alone.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        inner = getattr(optimizer, "optim", None)  # (overlap_with_ddp=True makes it later)
        if inner is not None:
            inner.__dict__["_fp8ops_inner"] = True


@torch._disable_dynamo
def _after_optimizer_step(optimizer, args, kwargs) -> None:
    d = optimizer.__dict__
    if not d.get("_fp8ops_inner"):
        _HOOK_STEPS[0] += 1
        by_bias = []
        layers = _layers_of(optimizer, by_bias)
        # (the forward reads it: a layer this optimizer steps past goes back to current scales,
        # linear._left_by_its_optimizer; also the layers an inner step updated, below: a
        # subclass's step calling super().step() runs these hooks twice on one optimizer. A box
        # of the optimizer's last count, not the optimizer: a freed one keeps its count, on
        # every rank alike, whenever each collects it)
        box = _end_box(optimizer)
        updater = (box, _HOOK_STEPS[0])
        for layer in layers:
            layer.__dict__["_fp8_updater"] = updater
        seen = d.get("_fp8ops_seen")
        if seen is not None and seen != loop_trial.optimizer_steps():
            # an optimizer stepped inside this one's step has updated some layers: once per step
            layers = [layer for layer in layers if layer.__dict__.get("_fp8_updated_at", 0) <= seen]
        if layers:
            update_scales(layers)
            bias_path = {id(layer) for layer in by_bias}
            for layer in layers:
                path = "_fp8_bias_path_at" if id(layer) in bias_path else "_fp8_weight_path_at"
                layer.__dict__[path] = _HOOK_STEPS[0]
        box[0] = _HOOK_STEPS[0]
    d["_fp8ops_open"] = False


def _reduce_amax(layers: list[Fp8LinearBase], group=None, flag: float | None = None):
    """Max-all-reduce row 0 (this step's amaxes) of every layer in one collective.
    Every rank passes the same layers in the same order (the optimizer's
    parameter order), so the concatenations line up and every rank then runs
    amax_update on identical histories: identical scales on every rank.
    flag: policy_ranks' "settled a verdict" flag, carried in the same
    collective; returns it max-reduced, as a one-element tensor on the
    layers' device (None without one). Only with ranks."""
    rows = [layer.fp8_amax_history[0] for layer in layers]
    if flag is not None:
        rows.append(torch.full((1,), flag, device=rows[0].device, dtype=torch.float32))
    flat = torch.cat(rows)
    dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=group)
    parts = list(flat.split([r.numel() for r in rows]))
    if flag is not None:
        rows.pop()
        flag = parts.pop()
    torch._foreach_copy_(rows, parts)
    return flag


# Fp8Linear's scaling buffers: rank-local state that DDP must not overwrite.
FP8_BUFFERS = _linear._SCALING_BUFFERS


def exclude_from_ddp_broadcast(model: torch.nn.Module) -> list[str]:
    """Keep DDP from broadcasting the FP8 scaling buffers; returns their names.

    DDP (broadcast_buffers=True, its default) copies rank 0's buffers to every
    rank before each forward. Row 0 of fp8_amax_history accumulates the amaxes
    of every micro-batch of a step; the broadcast would replace a rank's
    earlier micro-batches' amaxes by rank 0's before the all-reduce in
    update_scales sees them (and costs a broadcast of every history per
    forward). The scales themselves need no broadcast: every rank computes the
    same ones. DDP reads the names to skip from the wrapped (root) module's
    `_ddp_params_and_buffers_to_ignore`; convert_to_fp8_training sets it on the
    model it converts, so call this yourself when DDP wraps another module
    (or pass DDP(broadcast_buffers=False))."""
    names = [f"{name}.{b}" if name else b
             for name, m in model.named_modules() if isinstance(m, Fp8LinearBase) for b in FP8_BUFFERS]
    # DDP(torch.compile(model)): DDP finds this list through the OptimizedModule's attribute
    # lookup, and names the buffers under its _orig_mod
    names += ["_orig_mod." + n for n in names]
    if names:
        old = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
        # what DistributedDataParallel._set_params_and_buffers_to_ignore_for_model sets
        model._ddp_params_and_buffers_to_ignore = old + [n for n in names if n not in old]
    return names


def _fast_job(layer: Fp8LinearBase, counts: bool = True):
    """(device index, job) for _C.amax_update_many -- the step's update of all
    CUDA layers in a few launches, without a dispatcher call per layer -- or
    None when this layer must take the checked op (CPU, or buffers that are not
    the float32 CUDA tensors of the layout Fp8Linear made: a user replaced them).
    Checked on every call, since the C side trusts the pointers it is given.
    counts: count this step's NaN/inf amaxes (a null pointer: not)."""
    bufs = layer._buffers
    h, s, si, m, o = (bufs["fp8_amax_history"], bufs["fp8_scale"], bufs["fp8_scale_inv"], bufs["fp8_max"],
                      bufs["fp8_overflow_count"])
    f32 = torch.float32
    if not (h.is_cuda and h.dtype is f32 and s.dtype is f32 and si.dtype is f32 and m.dtype is f32
            and o.dtype is torch.int64 and h.dim() == 2 and h.is_contiguous()):
        return None
    dev, n = h.device, h.shape[1]
    if not (s.device == dev and si.device == dev and m.device == dev and o.device == dev
            and s.shape == (n,) and si.shape == (n,) and m.shape == (n,) and o.shape == (n,)
            and s.is_contiguous() and m.is_contiguous() and o.is_contiguous() and si.stride(0) >= 1):
        return None
    hp, sp, sip, op = h.data_ptr(), s.data_ptr(), si.data_ptr(), o.data_ptr()
    # the kernel writes history, scale, scale_inv and the counts: buffers a user made share
    # memory take the checked op, which refuses them by name (here a block would read back
    # what another wrote). Checked once per layout (~4 us), then compared with the last one
    layout = (hp, sp, sip, op, h.shape[0], n, si.stride(0))
    d = layer.__dict__
    if d.get("_fp8_apart_layout") != layout:
        spans = sorted(((hp, hp + 4 * h.numel()), (sp, sp + 4 * n), (sip, sip + 4 * ((n - 1) * si.stride(0) + 1)),
                        (op, op + 8 * n)))
        if any(spans[i][1] > spans[i + 1][0] for i in range(3)):
            return None
        # (a storage resized smaller than its buffer: the checked op refuses it by name; a resize
        # moves the memory, so the layout changes and this runs again)
        if any(t.untyped_storage().nbytes() < (t.storage_offset() + k) * t.element_size()
               for t, k in ((h, h.numel()), (s, n), (si, (n - 1) * si.stride(0) + 1), (m, n), (o, n))):
            return None
        d["_fp8_apart_layout"] = layout
    cfg = layer.__dict__["_fp8_config"]
    return dev.index, (hp, sp, sip, m.data_ptr(), op if counts else 0, n,
                       h.shape[0], si.stride(0), float(cfg.margin), ops.AMAX_ALGOS[cfg.amax_compute_algo])


def _find_compiled_casts(layers: list[Fp8LinearBase]) -> list[Fp8LinearBase]:
    """Set _fp8_cast_since_update of the layers whose compiled code cast since the last update.
    Compiled code sets no flag (linear._cast_traced), but every cast folds its amax into row 0
    of the layer's history (nonzero, or NaN, after a cast; each update and each reset leave it
    0) and bumps the history's version counter. A layer with no cast on record is looked up in
    row 0 when its history was written since the last look, or a new trace happened: all such
    layers of a device in one read (one sync), so a layer nothing calls, or that runs BF16, is
    read once, and again only after a new trace. Before the step's all-reduce of the amaxes:
    this rank's own casts, as eager code flags them. Not during a CUDA graph capture, where a
    read cannot sync, nor on the meta device. Returns the layers found with no cast, for
    _note_no_cast."""
    gen = _linear._TRACES[0]
    if gen == 0:
        return []  # (no compiled FP8 forward in this process: eager code set every flag)
    todo = []
    no_cast = []
    for layer in layers:
        d = layer.__dict__
        if d["_fp8_cast_since_update"]:
            continue
        h = layer._buffers["fp8_amax_history"]
        if d["_fp8_cast_looked_at"] == (gen, h._version):
            no_cast.append(layer)  # (nothing wrote its history since the last look)
        else:
            todo.append(layer)
    # (a layer on a device that cannot be read now is looked up at a later update)
    for layer, cast in _by_readable_device(todo, _row0_written):
        if cast:
            layer.__dict__["_fp8_cast_since_update"] = True
        else:
            no_cast.append(layer)
    return no_cast


def _by_readable_device(layers: list[Fp8LinearBase], read) -> list[tuple]:
    """(layer, read's verdict on it): read takes the layers of one device and returns a verdict
    each, in one read of their histories (one sync). Layers on the meta device, or on a CUDA
    device during a graph capture (where a read cannot sync), are left out."""
    by_device: dict = {}
    for layer in layers:
        by_device.setdefault(layer._buffers["fp8_amax_history"].device, []).append(layer)
    out = []
    for device, found in by_device.items():
        if device.type == "meta" or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            continue
        out += zip(found, read(found))
    return out


def _row0_written(layers: list[Fp8LinearBase]) -> list[bool]:
    """Is row 0 of each layer's amax history nonzero (or NaN)? One read for all (one device)."""
    with torch.no_grad():
        rows = torch.stack([layer._buffers["fp8_amax_history"][0] for layer in layers])
        return rows.ne(0).any(dim=1).tolist()


def _row0_primed(layers: list[Fp8LinearBase]) -> list[tuple]:
    """For each layer: (does row 0 of its amax history hold a finite amax > 0, for each of its
    tensors (x, w, dy); row 0's amaxes; the step before's, in the last row, where the update
    rolls row 0 (torch.roll(h, -1, 0)), or None for a one-row history). One read for all (one
    device)."""
    with torch.no_grad():
        hs = [layer._buffers["fp8_amax_history"] for layer in layers]
        row0, last = torch.stack([torch.stack([h[0] for h in hs]), torch.stack([h[-1] for h in hs])]).tolist()
    return [([math.isfinite(a) and a > 0 for a in r], r, q if h.shape[0] > 1 else None)
            for r, q, h in zip(row0, last, hs)]


# updates a layer waits on current scaling for a usable amax of each of its tensors (see
# _unprimed); after that it turns to delayed scaling anyway, and stops costing a read per step
_PRIMING_UPDATES = 4
# a layer that waited for one keeps current scaling while an amax grows more than _GROWTH-fold
# from one step to the next, up to _GROWING_UPDATES updates in all
_GROWTH, _GROWING_UPDATES = 1.25, 12


def _unprimed(layers: list[Fp8LinearBase]) -> set:
    """Of these layers (cast since the last update, still on current scaling), those whose
    row 0 holds no finite amax > 0 for one of its tensors this step: e.g. the input gradient of
    a layer before a zero-initialised projection (exactly 0 in the first step), or the weight
    of that projection. The update keeps such a tensor's scale as it was, the 1.0 of a fresh
    state, which no amax ever set: cast with it, the next step's small gradients would flush
    to zero. Those layers stay on current scaling for another step, up to _PRIMING_UPDATES
    updates (a tensor that stays 0, a branch the loss never reaches, then costs no read per
    step). Such a layer then stays on current scaling while one of its amaxes still grows more
    than _GROWTH-fold per step, up to _GROWING_UPDATES updates: a weight that starts at 0 grows
    ~k * lr under AdamW, and so do the gradients before it and the inputs after it; cast with
    the step before's amax, such a tensor saturated (a probe: 7.2 dB at step 2, 13.5 at step 3,
    against ~25-30 dB of FP8's noise). A layer that had its amaxes at the first update (the last
    row then is no step's record) turns to delayed scaling there, as before; with interval > 1
    every layer waits its first update (see first_of_many) and the growth rule judges it at the
    second. Read after the all-reduce (every rank decides alike), before the update rolls row 0
    away: one read of all such layers of a device per update, in practice at the first updates
    only. Not during a CUDA graph capture, where a read cannot sync, nor on the meta device:
    ready there."""
    out = set()
    for layer, (cols, row0, last) in _by_readable_device(layers, _row0_primed):
        d = layer.__dict__
        waited = d.get("_fp8_priming_waits", 0)
        # the step before's amaxes: a one-row history keeps none (they are kept here while the
        # layer waits; after a resume, none: it waits once more)
        before = last if last is not None else d.get("_fp8_wait_amax")
        grows = before is None or any(a > b * _GROWTH for a, b in zip(row0, before))
        # with interval > 1 row 0 holds the max over several steps, which a tensor that started
        # at 0 has left by the first update: no step of it tells growth, so every layer waits
        # one update and is judged at the next by the growth rule
        first_of_many = not waited and d["_fp8_config"].interval > 1
        if (not all(cols) and waited + 1 < _PRIMING_UPDATES) or first_of_many or (
                waited and grows and waited + 1 < _GROWING_UPDATES):
            d["_fp8_priming_waits"] = waited + 1
            d["_fp8_wait_amax"] = row0
            out.add(layer)
        else:
            d["_fp8_priming_waits"] = 0
            d.pop("_fp8_wait_amax", None)
            if not cols[G]:
                # no gradient has reached it yet (a frozen part, a loss term switched on later):
                # its dy scale is still the fresh 1.0, which would flush the first gradient that
                # comes. Its backward casts dy with dy's current scale until its weight has had a
                # gradient at an update (_grad_seen); x and w go on to delayed scaling.
                d["_fp8_grad_unset"] = True
    return out


def _grad_seen(layers: list[Fp8LinearBase]) -> None:
    """A layer whose dy scale no amax has set yet (_unprimed) once a backward has cast a dy with
    a finite amax > 0 in it (with dy's current scale, the amax folded into row 0): delayed
    scaling takes it from here. Read (one sync per device) only for such layers whose weight
    has a gradient now, in practice once, at the step a frozen part first trains; a layer whose
    weight never gets one (frozen, with its input's gradient needed) keeps scaling dy from its
    own amax (one amax pass more per backward, no fused GELU gradient)."""
    seen = [layer for layer in layers if "_fp8_grad_unset" in layer.__dict__ and layer.weight.grad is not None]
    if seen:
        for layer, (cols, _, _) in _by_readable_device(seen, _row0_primed):
            if cols[G]:
                del layer.__dict__["_fp8_grad_unset"]


def _note_no_cast(layers: list[Fp8LinearBase]) -> None:
    """After the update's own writes to the histories (the all-reduce, the CPU op): the state
    _find_compiled_casts compares with at the next update."""
    gen = _linear._TRACES[0]
    for layer in layers:
        layer.__dict__["_fp8_cast_looked_at"] = (gen, layer._buffers["fp8_amax_history"]._version)


def update_scales(layers: list[Fp8LinearBase], group=None) -> None:
    """One optimizer step has happened for these layers. Their amaxes are reduced over
    the ranks of each layer's scaling group (set_scaling_group; else `group`, None:
    every rank), one collective per group, in the order the groups first appear."""
    serial = loop_trial.note_optimizer_step()  # (policy auto's trial counts its steps by these too)
    # every live layer's, not only these: also a frozen one no optimizer steps (a LoRA base whose
    # input still needs its gradient), whose dy amax and NaN/inf counts eager code records too
    # (the list of every live layer built only once a compiled FP8 forward exists: eager steps skip it)
    if _linear._TRACES[0]:
        fold_grad_amax(live_layers(), every_live=True)
    for g, members in by_scaling_group(layers, group):
        _update_group(members, g, serial)


# data pointers of fp8_grad_amax slots that compiled backwards wrote (linear_bwd_sink and
# linear_bwd_cat note each write in C: csrc/amax_writes.c) and no fold has read yet
_WRITTEN: set = set()
_LOST_WRITE_WARNED = [False]  # (fold_grad_amax's warning about writes no live layer holds: once)
_DEAD_SLOTS: set = set()      # fp8_grad_amax data pointers of layers that died since the last step's fold


def _written_grad_amaxes() -> set | None:
    """The fp8_grad_amax slots written since their last fold (by data pointer), or None
    where any may have been: a CUDA graph captured such a write (a replay notes nothing),
    or an fp8ops build without the record; and while this fold is being captured itself (an
    optimizer step in a CUDA graph: its replays must read every layer, whichever wrote).
    The emulated GEMMs' casts declare their write and note nothing: fold_grad_amax reads
    those layers always."""
    core = _loader._C
    if core is None or not hasattr(core, "take_amax_writes") or (
            torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()):
        return None
    new = core.take_amax_writes()
    if new is None:
        return None
    _WRITTEN.update(new)
    return _WRITTEN


class _FoldViews:
    """One layer's views that fold_grad_amax reads and writes, kept while its buffers are
    these objects over this memory (~9 us per layer and step on the CPU box to make them).
    .data: no version counter moves. A layer whose history was not written since the last
    look is not read again (_find_compiled_casts); no backward still to come reads these."""
    __slots__ = ("hb", "gb", "ob", "ptrs", "device", "h", "ga", "slot", "slot_bits", "ga_bits", "count")

    def __init__(self, hb: torch.Tensor, gb: torch.Tensor, ob: torch.Tensor):
        self.hb, self.gb, self.ob = hb, gb, ob
        self.ptrs = (hb.data_ptr(), gb.data_ptr(), ob.data_ptr())
        self.device = hb.device
        self.h, self.ga = hb.data, gb.data.reshape(1)
        self.slot = self.h[0, G:G + 1]                 # row 0's dy amax
        self.slot_bits, self.ga_bits = self.slot.view(torch.int32), self.ga.view(torch.int32)
        self.count = ob.data[G:G + 1]                  # dy's NaN/inf count


def fold_grad_amax(layers: list[Fp8LinearBase], every_live: bool = False) -> None:
    """Compiled backwards fold dy's amax into each layer's fp8_grad_amax, not into its
    history (linear._scaled_grad_output): fold it in there as eager backward's casts do, and
    zero it. Before anything reads row 0 (the update, its all-reduce, a saved scaling state, the
    report), at each optimizer step for every live layer whose slot a compiled backward wrote
    since its last fold (_written_grad_amaxes; every live layer where that is not known), in a
    few launches per device for all of them. Delayed scaling: the max over the bits as int32,
    as the casts' atomicMax folds.
    Where dy is on current scaling its scale stays in copies in compiled code: the NaN/inf
    count of the step's amax here (eager code counts each cast), and under the current recipe
    the scale of the step's largest amax is set as well (one amax_update_many call per device
    on CUDA), with that amax in row 0 in place of the one there (eager code leaves the last
    cast's in both). No version counter moves (.data, raw pointers): an eager backward still to
    come sets dy's scale itself under current scaling, and this also runs in scaling_state_dict
    and the report. every_live: `layers` are every live layer (the step's fold), so a recorded
    slot none of them holds was a freed layer's, and is forgotten.
    Nothing to do where no FP8 forward was ever compiled in this process."""
    if _linear._TRACES[0] == 0:
        return
    written = _written_grad_amaxes()
    # the recorded slots this fold reads: forgotten once it has folded them (a fold that raises
    # forgets none, so the next one reads them again)
    read: list = []
    seen = set(written) if every_live and written is not None else None
    held: set = set()      # the live layers' fp8_grad_amax data pointers (every_live: seen - held was lost)
    delayed: dict = {}     # device -> (row 0's dy slots, fp8_grad_amax), as int32
    current: dict = {}     # device -> (row 0's dy slots, fp8_grad_amax): the current recipe's
    scale_jobs: dict = {}  # device -> amax_update_many jobs: the current recipe's CUDA layers
    unready: dict = {}     # device -> (overflow count slots, fp8_grad_amax): delayed scaling's first step
    core = _loader._C
    with torch.no_grad():
        for layer in layers:
            bufs, d = layer._buffers, layer.__dict__
            c = d.get("_fp8_fold_views")
            hb, gb, ob = bufs.get("fp8_amax_history"), bufs.get("fp8_grad_amax"), bufs.get("fp8_overflow_count")
            if hb is None or gb is None or ob is None:
                continue
            gp = gb.data_ptr()
            held.add(gp)
            if c is None or c.hb is not hb or c.gb is not gb or c.ob is not ob \
                    or c.ptrs != (hb.data_ptr(), gp, ob.data_ptr()):
                if hb.is_meta:
                    continue
                # (new buffers, or new memory under them: read once, whatever the record says;
                # recorded, so that should this fold raise, the next reads it again)
                c = d["_fp8_fold_views"] = _FoldViews(hb, gb, ob)
                if written is not None:
                    written.add(gp)
            elif written is not None and gp not in written and d.get("_fp8_fn") is _linear._Fp8LinearFn:
                continue  # no compiled backward wrote its dy amax since the last fold: still 0
            read.append(gp)
            if d["_fp8_config"].recipe == "delayed":
                if not d["_fp8_delayed_ready"]:
                    waiting = unready.get(c.device)
                    if waiting is None:
                        waiting = unready[c.device] = ([], [])
                    waiting[0].append(c.count)
                    waiting[1].append(c.ga)
                found = delayed.get(c.device)
                if found is None:
                    found = delayed[c.device] = ([], [])
                found[0].append(c.slot_bits)
                found[1].append(c.ga_bits)
                continue
            h, ga, slot = c.h, c.ga, c.slot
            job = _grad_scale_job(layer, ga) if core is not None else None
            if job is None:
                # (CPU, or buffers of another layout: the checked op, one layer at a time, the
                # layer done before the next, which may refuse its buffers: nothing counted twice)
                cfg = d["_fp8_config"]
                ops._amax_update(ga.clone().reshape(1, 1), bufs["fp8_scale"].data[G:G + 1],
                                 bufs["fp8_scale_inv"].data[G:G + 1], bufs["fp8_max"].data[G:G + 1],
                                 float(cfg.margin), "most_recent",
                                 overflow_count=bufs["fp8_overflow_count"].data[G:G + 1])
                slot.copy_(torch.where(ga != 0, ga, slot))
                ga.zero_()
                _WRITTEN.discard(read.pop())  # (folded: a later layer's refusal raises after this)
                continue
            scale_jobs.setdefault(job[0], []).append(job[1])
            found = current.setdefault(h.device, ([], []))
            found[0].append(slot)
            found[1].append(ga)
        # (what follows raises nothing a layer's buffers could cause, and needs no sync: also inside
        # a CUDA graph capture of the optimizer step. The scale jobs read fp8_grad_amax, and roll it
        # as a one-row history: before the zeroing, as the slots)
        for counts, grad_amaxes in unready.values():
            # (the layers waiting for their first update: one device's in five launches, where
            # each took three)
            if len(counts) == 1:
                counts[0].add_(grad_amaxes[0].isfinite().logical_not())
            else:
                bad = torch.cat(grad_amaxes).isfinite().logical_not_().to(torch.int64)
                torch._foreach_add_(counts, list(bad.split(1)))
        for slots, grad_amaxes in delayed.values():
            torch._foreach_maximum_(slots, grad_amaxes)
        for slots, grad_amaxes in current.values():
            ga_all = torch.cat(grad_amaxes)
            torch._foreach_copy_(slots, list(torch.where(ga_all != 0, ga_all, torch.cat(slots)).split(1)))
        for device, jobs in scale_jobs.items():
            core.amax_update_many(device, jobs)
        for found in (*delayed.values(), *current.values()):
            torch._foreach_zero_(found[1])
    _WRITTEN.difference_update(read)
    if seen is not None:
        lost = seen.difference(held, _DEAD_SLOTS)
        _DEAD_SLOTS.clear()
        if lost and not _LOST_WRITE_WARNED[0]:
            _LOST_WRITE_WARNED[0] = True
            warnings.warn(
                f"fp8ops: compiled backwards wrote dy's amax into {len(lost)} buffer(s) that no live Fp8Linear "
                "holds, so those amaxes did not reach any layer's scaling state (dy's scale kept its value, NaN/inf "
                "in dy went uncounted). Saved-tensor hooks that copy what autograd saves (save_on_cpu, activation "
                "offloading) around a graph that torch.compile traced under compiled autograd without them do "
                "this: dynamo does not retrace when such hooks change. Trace under the hooks (torch._dynamo.reset(), "
                "then run under them: those layers then run BF16, saying so), or keep the hooks off. (A layer "
                "whose buffers moved, .to(), .cuda() or share_memory(), between its backward and this optimizer step "
                "leaves its old buffer here; nothing is lost then.) Said once per process", stacklevel=3)
        _WRITTEN.difference_update(seen)  # (what no live layer holds: a freed layer's slots, or copies)


def _grad_scale_job(layer: Fp8LinearBase, grad_amax: torch.Tensor):
    """(device index, job) for _C.amax_update_many: dy's scale from the step's largest
    compiled dy amax (fp8_grad_amax as a one-row history, "most_recent": a zero or NaN/inf
    amax keeps the scale, and a NaN/inf is counted), or None where _fast_job refuses the
    layer's buffers, or fp8_grad_amax is not one float32 on their device apart from them (the
    kernel writes it: it rolls the one-row history)."""
    found = _fast_job(layer)
    if found is None:
        return None
    dev, (hp, sp, sip, mp, op, n, H, stride, margin, _algo) = found
    if not (grad_amax.dtype is torch.float32 and grad_amax.numel() == 1 and grad_amax.is_cuda
            and grad_amax.device.index == dev and G < n):
        return None
    gp = grad_amax.data_ptr()
    spans = ((hp, 4 * H * n), (sp, 4 * n), (sip, 4 * ((n - 1) * stride + 1)), (mp, 4 * n), (op, 8 * n))
    if any(start < gp + 4 and gp < start + size for start, size in spans):
        return None
    return dev, (gp, sp + 4 * G, sip + 4 * G * stride, mp + 4 * G, op + 8 * G, 1, 1, stride,
                 margin, ops.AMAX_ALGOS["most_recent"])


def by_scaling_group(layers: list[Fp8LinearBase], group=None) -> list[tuple]:
    """[(group, its layers)]: each layer's scaling group (set_scaling_group; else `group`,
    None: every rank), in the order the groups first appear (every rank alike)."""
    groups: list = []
    for layer in layers:
        g = layer.__dict__.get("_fp8_group", group)
        for known, members in groups:
            if known is g:
                members.append(layer)
                break
        else:
            groups.append((g, [layer]))
    return groups


def set_scaling_group(model: torch.nn.Module, group) -> int:
    """The ranks whose amaxes the scale updates of model's FP8 layers reduce over:
    a torch.distributed ProcessGroup (e.g. the data-parallel group of a pipeline
    stage, or of one of several models trained by one launch), or "local" (this
    rank's own amaxes, no collective: a model only this rank trains). By default
    every rank of the default group takes part, which is right where every rank
    holds a data-parallel copy of the model, and wrong (other layers' amaxes, or a
    collective the other ranks never join: a hang) otherwise. Every rank of the
    group must give its layers the same group, and step them together. Returns the
    number of layers set."""
    if not (_is_local(group) or isinstance(group, dist.ProcessGroup)):
        raise TypeError(f"fp8ops.set_scaling_group: group must be a torch.distributed ProcessGroup or \"local\", "
                        f"found {type(group).__name__}; for every rank pass dist.group.WORLD")
    n = 0
    for m in _unwrapped(model).modules():
        if isinstance(m, Fp8LinearBase):
            m.__dict__["_fp8_group"] = group
            n += 1
    return n


def _is_local(group) -> bool:
    return isinstance(group, str) and group == "local"


def _update_group(layers: list[Fp8LinearBase], group, serial: int) -> None:
    """update_scales for the layers of one scaling group."""
    # Every delayed layer whose interval is due is updated, also one that cast
    # nothing since the last update (policy "auto" chose BF16 for its shape, or
    # nothing called it): its row 0 holds 0, and its history window counts
    # optimizer steps, not calls. So the all-reduce gets the same layers on every
    # rank (a layer one rank skipped, e.g. an expert it routed no token to,
    # another may have cast), and N ranks keep the histories of one process.
    delayed = [l for l in layers if l.fp8_config.recipe == "delayed"]
    due = [l for l in delayed if (l.fp8_step + 1) % l.fp8_config.interval == 0]
    no_cast = _find_compiled_casts(due)
    # policy "auto" under DDP / FSDP2: the verdicts the ranks settled since the last step are
    # exchanged here (policy_ranks.py), flagged in the amax all-reduce where there is one
    ranks = not _is_local(group) and policy_ranks.world(group) > 1
    if ranks:
        _check_not_broadcast(layers)
    exchange = ranks and policy_ranks.takes_part(layers)
    if exchange:
        policy_ranks.before_step(layers, group)
    flag = policy_ranks.flag(layers) if exchange else None
    if due and ranks:
        flag = _reduce_amax(due, group, flag)
    elif exchange:
        flag = policy_ranks.reduce_flag(layers, group, flag)
    if exchange:
        policy_ranks.send(layers, flag)
    for layer in layers:
        d = layer.__dict__
        d["fp8_step"] = d["fp8_step"] + 1  # not Module.__setattr__: per layer per step
        d["_fp8_updated_at"] = serial
        d.pop("_fp8_scaling_loaded", None)  # (a weight load from now on restarts the scaling)
    # each layer: the scales of its 3 tensors, the history roll, and the count of
    # this step's NaN/inf amaxes (the scale was kept for those). CUDA layers: all
    # of a device's layers in one launch (32 per launch) through _C; others (CPU)
    # one checked dispatcher op each.
    fast = {}
    core = _loader._C  # None when the C core did not load (no layer then runs FP8 on CUDA)
    update = torch.ops.fp8ops.amax_update.default
    _grad_seen(due)
    unprimed = _unprimed([l for l in due if l.__dict__["_fp8_cast_since_update"]
                          and not l.__dict__["_fp8_delayed_ready"]])
    for layer in due:
        d = layer.__dict__
        # a layer on current scales this step counted its NaN/inf amaxes per cast (_current_scale)
        counts = d["_fp8_delayed_ready"]
        if d["_fp8_rest_due"]:
            d["_fp8_rest_due"] = False
            if (not d["_fp8_pristine"] and not ranks and _settled_bf16(d)
                    and not (layer.fp8_amax_history.is_cuda and torch.cuda.is_current_stream_capturing())):
                # policy "auto" settled BF16 for every shape it met, after the layer had cast
                # (its trial's FP8 steps): it rests as if never cast, so the updates skip it
                # from now on (one update per step cost 34 us of host time on an H200 host; a
                # BF16 layer should cost what nn.Linear costs). Its history would only roll
                # zeros; if it casts again (a new shape that FP8 wins) it starts from current
                # scales, as a fresh conversion does. At the optimizer step no backward of an
                # FP8 forward is left to check the scales.
                layer._reset_fp8_state(keep_step=True)
        if d["_fp8_cast_since_update"]:
            # from now on the casts use the history's scales (a layer that has cast nothing here
            # keeps current scaling for its first cast: its history may hold no amax yet; under
            # DDP a rank that skipped the layer another rank cast does so for one cast; one whose
            # history holds no amax of some tensor yet keeps it too, see _unprimed)
            d["_fp8_pristine"] = False
            if layer not in unprimed:
                d["_fp8_delayed_ready"] = True
        # (the flag stays True from here on: forward sets it only while it is False, so compiled
        # code, which meets it True after the first update, traces no side effect, which an
        # activation-checkpointed region would refuse: a graph break per layer)
        if d["_fp8_pristine"] and not ranks:
            # never cast (e.g. policy "auto" runs it BF16): its history is all 0 and its scales
            # 1, which the update would leave as they are; a layer left in BF16 should cost what
            # an nn.Linear costs. (Under DDP / FSDP2 another rank's amax may arrive through the
            # all-reduce above: updated there.)
            continue
        job = _fast_job(layer, counts) if core is not None else None
        if job is not None:
            fast.setdefault(job[0], []).append(job[1])
            continue
        cfg = d["_fp8_config"]
        bufs = layer._buffers
        h = bufs["fp8_amax_history"]
        update(h, bufs["fp8_scale"], bufs["fp8_scale_inv"], bufs["fp8_max"], float(cfg.margin),
               ops.AMAX_ALGOS[cfg.amax_compute_algo], bufs["fp8_overflow_count"] if counts else ops._no_counts(h))
    for device, jobs in fast.items():
        core.amax_update_many(device, jobs)
    # the C kernels write the scales through raw pointers: tell autograd's version counters, which
    # a backward still to come of an earlier forward checks (linear._check_scales_unchanged)
    scale_invs = tuple(layer._buffers["fp8_scale_inv"] for layer in layers)
    torch._C._increment_version(scale_invs)
    if ranks:
        for layer, si in zip(layers, scale_invs):
            layer.__dict__["_fp8_si_version"] = si._version
    _note_no_cast(no_cast)


_warned_broadcast = False


def _check_not_broadcast(layers: list[Fp8LinearBase]) -> None:
    """DDP with broadcast_buffers=True copies rank 0's buffers to every rank before each
    forward unless its root module names them in _ddp_params_and_buffers_to_ignore, which
    convert() sets on the model it converts. A DDP around another module (a parent of the
    converted model) overwrites each rank's amaxes of the earlier micro-batches. The copy
    bumps the buffers' version counters, which nothing else between two updates of a layer on
    delayed scaling does: warn. (Under the current recipe a compiled forward writes its scales
    back through the graph's copy, which bumps the counter too: those layers are not read.)"""
    global _warned_broadcast
    if _warned_broadcast:
        return
    for layer in layers:
        v = layer.__dict__.get("_fp8_si_version")
        if v is not None and layer._buffers["fp8_scale_inv"]._version != v \
                and layer.__dict__["_fp8_config"].recipe == "delayed":
            _warned_broadcast = True
            warnings.warn(
                "fp8ops: the FP8 scaling buffers were overwritten between two optimizer steps, most likely by DDP's "
                "broadcast_buffers: DDP wraps a module that fp8ops.convert did not convert itself (a parent of the "
                "converted model), so it does not know to skip them. Every rank then loses the amaxes of its "
                "earlier micro-batches. Pass DDP(..., broadcast_buffers=False), or call "
                "fp8ops.exclude_from_ddp_broadcast(module) on the module you wrap before DDP", stacklevel=3)
            return


_warned_step = False


def _require_module(fn: str, model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{fn}: model must be an nn.Module (the converted model), found {type(model).__name__}")


def step(model: torch.nn.Module) -> None:
    """Mark an optimizer step by hand (only needed with optimizers that do not
    subclass torch.optim.Optimizer, or whose step runs where no optimizer hook
    fires, and for layers no optimizer steps: frozen weight and bias, e.g. a
    LoRA model's base layers, which otherwise stay on current scaling, an
    extra amax pass per cast). Call it after the optimizer's step: layers a torch.optim
    optimizer's step has updated since their last fp8ops.step are left out (a second update
    per step would halve the history's window and count `interval` twice), and a warning says
    so, once; called before it, the first step updates those layers twice."""
    global _warned_step
    _require_module("fp8ops.step", model)
    layers = [m for m in model.modules() if isinstance(m, Fp8LinearBase)]
    # (an update since this model's last fp8ops.step came from an optimizer's hook)
    mine = [m for m in layers if m.__dict__.get("_fp8_updated_at", 0) <= m.__dict__.get("_fp8_stepped_at", 0)]
    if len(mine) < len(layers) and not _warned_step:
        _warned_step = True
        warnings.warn(f"fp8ops.step: {len(layers) - len(mine)} of the model's FP8 layers are stepped by a "
                      "torch.optim optimizer, whose step updated their scales already; fp8ops.step left them "
                      f"out and updated the other {len(mine)}. It is needed only for the layers no torch.optim "
                      "optimizer steps: those of an optimizer that does not subclass torch.optim.Optimizer (or "
                      "whose step runs where no optimizer hook fires), and frozen ones (a LoRA model's base "
                      "layers), which otherwise stay on current scaling",
                      stacklevel=2)
    if mine:
        update_scales(mine)
        # (as a weight's optimizer: an optimizer holding a bias of these then leaves them, see
        # _layers_of; called before that optimizer's step it updated them twice at the first)
        _HOOK_STEPS[0] += 1
        for m in mine:
            m.__dict__["_fp8_weight_path_at"] = _HOOK_STEPS[0]
            m.__dict__.pop("_fp8_updater", None)  # (its caller steps it by hand from here on)
    now = loop_trial.optimizer_steps()
    for m in layers:
        m.__dict__["_fp8_stepped_at"] = now  # (a hooked update after this call has a later count)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The module torch.compile (OptimizedModule) or DDP wraps, unwrapped all the way:
    scaling state is keyed by the names in the model itself, however it is wrapped."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel  # noqa: PLC0415

    while True:
        inner = model._modules.get("_orig_mod") if type(model).__name__ == "OptimizedModule" else None
        if inner is None and isinstance(model, (DistributedDataParallel, DataParallel)):
            inner = model.module
        if inner is None:
            return model
        model = inner


_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


# wrappers' own names inside a module path (torch's checkpoint_wrapper, which
# apply_activation_checkpointing puts around blocks, FSDP1's wrapper, a compiled block): a
# state saved with them loads into the model without them, and the other way round
_INNER_WRAPPERS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def _bare_name(key: str) -> str:
    while key.startswith(_WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    if any(w in key for w in _INNER_WRAPPERS):
        key = ".".join(part for part in key.split(".") if part not in _INNER_WRAPPERS)
    return key


def scaling_state_dict(model: torch.nn.Module) -> dict:
    """FP8 scaling state of every Fp8Linear, by module name (CPU tensors); the
    names of the model a torch.compile or DDP wrapper holds."""
    _require_module("scaling_state_dict", model)
    out = {}
    fold_grad_amax([m for m in model.modules() if isinstance(m, Fp8LinearBase)])  # (compiled backwards' dy amaxes)
    for name, m in _unwrapped(model).named_modules():
        if isinstance(m, Fp8LinearBase) and not m.fp8_amax_history.is_meta:  # (meta: no state before to_empty)
            out[name] = {
                "config": m.fp8_config.short_str(),
                "shape": (m.in_features, m.out_features),  # (a load into another layer's shape: refused)
                "amax_history": m.fp8_amax_history.detach().cpu().clone(),
                "scale": m.fp8_scale.detach().cpu().clone(),
                "scale_inv": m.fp8_scale_inv.detach().cpu().clone(),
                "step": m.fp8_step,
                "primed": m._fp8_delayed_ready,
                # (updates waited on current scaling so far: a resume goes on waiting, _unprimed)
                "priming_waits": m.__dict__.get("_fp8_priming_waits", 0),
                # (cumulative over the run, as report and the example's TensorBoard show them)
                "overflow_count": m.fp8_overflow_count.detach().cpu().clone(),
            }
            verdicts = _saved_verdicts(m)
            if verdicts is not None:
                out[name]["policy"] = verdicts
    return out


def _gpu_name(m: Fp8LinearBase) -> str | None:
    """The GPU whose speed m's policy "auto" verdicts are for (its own, or the current one
    while m still sits on the CPU or meta device); None without CUDA."""
    dev = m.fp8_amax_history.device
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def _saved_verdicts(m: Fp8LinearBase) -> dict | None:
    """m's settled policy "auto" verdicts, with the GPU and torch they were measured on (a
    resume elsewhere measures again): a resumed run then runs each shape as before, without
    its trial steps (which alternate BF16 and FP8). None where there are none."""
    if not m.fp8_policy:
        return None
    return {"gpu": _gpu_name(m), "torch": str(torch.__version__), "setup": policy.setup_of(m),
            "verdicts": [(M, str(dtype).replace("torch.", ""), bool(wins), float(speedup),
                          m.fp8_policy_why.get((M, dtype)))
                         for (M, dtype), (wins, speedup) in m.fp8_policy.items()]}


def _restore_verdicts(m: Fp8LinearBase, saved: dict | None) -> None:
    """Settle m's verdicts as saved, where they were measured on this GPU and torch, for
    m's recipe, format, accumulation and weight dtype (policy.setup_of), and m's policy is
    "auto". Under torch.distributed they are exchanged at the next step like
    any verdict (policy_ranks.settled): ranks that loaded different states still agree."""
    if (not isinstance(saved, Mapping) or m.fp8_config.policy != "auto" or saved.get("gpu") is None
            or saved.get("gpu") != _gpu_name(m) or saved.get("torch") != torch.__version__
            or saved.get("setup") != policy.setup_of(m)):
        return
    restored = []
    try:  # (verdicts of another form, a newer fp8ops' or a hand-made one: measured again instead)
        for M, dtype, wins, speedup, why in saved["verdicts"]:
            dt = getattr(torch, dtype)
            if not isinstance(dt, torch.dtype):
                return
            restored.append(((int(M), dt), bool(wins), float(speedup), why if isinstance(why, str) else None))
    except (KeyError, TypeError, ValueError, AttributeError):
        return
    for key, wins, speedup, why in restored:
        m._fp8_pending.pop(key, None)
        loop_trial.forget(m, key)
        note = "restored from the saved scaling state" if not why else why if why.endswith("; restored") \
            else f"{why}; restored"
        policy_ranks.settled(m, key, wins, speedup, note)
    if restored:
        m._fp8_note_verdict(False)  # (BF16 for every shape: it rests from the next step, as before the save)


def _recipe_and_format(config: str) -> list[str]:
    return config.split("/")[:2]


def _bad_saved_entry(name: str, what: str) -> ValueError:
    return ValueError(f"load_scaling_state_dict: {name}'s saved state {what}; it is not what "
                      "scaling_state_dict saves (a corrupt or hand-made checkpoint). Nothing was loaded; "
                      "leave the scaling state out of the load and the layers start their scaling afresh")


def _check_saved_form(name: str, s) -> None:
    """Refuse a layer's saved scaling state that is not scaling_state_dict's form (a dict of
    tensors and a step), naming the layer, before anything is loaded."""
    def bad(what: str) -> ValueError:
        return _bad_saved_entry(name, what)
    if not isinstance(s, Mapping):
        raise bad(f"is a {type(s).__name__}, not a dict")
    for key in ("amax_history", "scale", "scale_inv", "step"):
        if key not in s:
            raise bad(f"has no {key!r}")
    shape = s.get("shape", (0, 0))
    if not (isinstance(shape, (tuple, list)) and len(shape) == 2
            and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in shape)):
        raise bad(f"shape is {shape!r}, not (in_features, out_features)")
    if not isinstance(s.get("config", ""), str):
        raise bad(f"config is {s['config']!r}, not a string (Fp8Config.short_str())")
    for key in ("amax_history", "scale", "scale_inv", "overflow_count"):
        if key in s and not (isinstance(s[key], torch.Tensor) and s[key].is_floating_point() == (key != "overflow_count")):
            raise bad(f"{key} is {type(s[key]).__name__} {getattr(s[key], 'dtype', '')}, not a "
                      f"{'floating-point' if key != 'overflow_count' else 'integer'} tensor")
        if key in s and s[key].is_meta:
            raise bad(f"{key} is on the meta device: it holds no values")


def _check_saved_values(name: str, s) -> None:
    """Refuse saved values that would poison the layer's casts (a scale that is not finite and
    > 0: NaN outputs, and a gradient scale that stays NaN; a scale_inv that is not its inverse:
    outputs off by their ratio) or its bookkeeping, naming the layer, before anything loads."""
    def bad(what: str) -> ValueError:
        return _bad_saved_entry(name, what)
    scale, scale_inv = s["scale"].detach().float().cpu(), s["scale_inv"].detach().float().cpu()
    if not bool((torch.isfinite(scale) & (scale > 0) & torch.isfinite(1.0 / scale)).all()):
        # (a denormal scale's inverse is inf: amax_update keeps such a scale out as well)
        raise bad(f"holds the scales {scale.tolist()}: each must be finite and > 0, with a finite 1 / scale")
    if scale_inv.shape != scale.shape or not torch.allclose(scale_inv, 1.0 / scale, rtol=1e-5, atol=0.0):
        raise bad(f"holds scale_inv {scale_inv.tolist()} for scale {scale.tolist()}: each must be 1 / scale")
    history = s["amax_history"].detach()
    if bool((history < 0).any()):
        # (an amax is >= 0, or NaN / inf from a step that overflowed, which the update counts; a
        # negative one sets scales near 0, whose inverses overflow in the GEMM's scaling: NaN outputs)
        raise bad(f"holds a negative amax ({float(history[history < 0].min())}) in its amax_history: amaxes "
                  "are >= 0")
    step = s["step"]
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise bad(f"step is {step!r}: an int >= 0")
    if not isinstance(s.get("primed", True), bool):
        raise bad(f"primed is {s['primed']!r}: a bool")
    waits = s.get("priming_waits", 0)
    if isinstance(waits, bool) or not isinstance(waits, numbers.Integral) or waits < 0:
        raise bad(f"priming_waits is {waits!r}: an int >= 0")
    if "overflow_count" in s and bool((s["overflow_count"] < 0).any()):
        raise bad(f"overflow_count is {s['overflow_count'].tolist()}: counts >= 0")


def load_scaling_state_dict(model: torch.nn.Module, state: dict, strict: bool = False) -> list[str]:
    """Restore what scaling_state_dict saved (also from a state saved by an
    fp8ops that keyed a compiled or DDP-wrapped model by its wrapper's names).
    Layers without a state, or whose saved history length, recipe, FP8 format or
    shape (in, out) differ from theirs (the scales of one format mean nothing in
    another), keep their fresh state; returns the names that were not restored (raises instead,
    loading nothing, when strict; strict also refuses states of layers the model
    does not have). A non-empty state that names none of the model's FP8 layers raises
    ValueError, loading nothing."""
    _require_module("load_scaling_state_dict", model)
    if not isinstance(state, Mapping) or not all(isinstance(k, str) for k in state):
        bad_key = None if not isinstance(state, Mapping) else next(k for k in state if not isinstance(k, str))
        raise TypeError(f"load_scaling_state_dict: state must be what fp8ops.scaling_state_dict returned (a dict "
                        f"of layer names, str, to their states), found {type(state).__name__}"
                        + (f" with the key {bad_key!r} ({type(bad_key).__name__})" if isinstance(state, Mapping) else ""))
    skipped, matched, loads = [], set(), []
    bare = {_bare_name(k): v for k, v in state.items()}
    layers = [(n, m) for n, m in _unwrapped(model).named_modules() if isinstance(m, Fp8LinearBase)]
    for name, m in layers:
        s = state.get(name, bare.get(_bare_name(name)))
        if s is not None:
            matched.add(_bare_name(name))
            _check_saved_form(name, s)
        if (s is None or s["amax_history"].shape != m.fp8_amax_history.shape
                or ("config" in s and _recipe_and_format(s["config"]) != _recipe_and_format(m.fp8_config.short_str()))
                or ("shape" in s and tuple(s["shape"]) != (m.in_features, m.out_features))):
            # (the scales of one format mean nothing in another, nor a layer's amaxes in one of another
            # shape: its inputs saturate at the loaded scale; states saved before the forty-second
            # session hold no shape)
            skipped.append(name)
            continue
        if m.fp8_amax_history.is_meta:
            # (a copy into a meta buffer stores nothing, and the assign=True weight load or to_empty()
            # that gives the layer storage starts its scaling afresh: the load would be lost, silently)
            raise ValueError(f"load_scaling_state_dict: {name} is on the meta device (a model built under "
                             "torch.device('meta')), where its scaling state has no storage yet. Load the weights "
                             "(load_state_dict(..., assign=True)) or call to_empty() first, then the scaling "
                             "state. Nothing was loaded")
        for what in ("scale", "scale_inv", "overflow_count"):
            if what in s and tuple(s[what].shape) != tuple(m._buffers["fp8_" + what].shape):
                raise ValueError(f"load_scaling_state_dict: {name}'s saved {what} has shape {tuple(s[what].shape)}, "
                                 f"expected {tuple(m._buffers['fp8_' + what].shape)} (one per input, weight and "
                                 "gradient); the state is not from scaling_state_dict of this fp8ops. Nothing was "
                                 "loaded")
        _check_saved_values(name, s)
        loads.append((m, {**s, "step": int(s["step"]), "primed": bool(s.get("primed", True))}))
    if state and layers and not matched:
        # (strict=False loads what fits; a dict that fits nothing is another dict: a model's
        # state_dict(), a whole checkpoint. Loading nothing would restart every layer's scaling
        # with no word. An empty one is what a model without FP8 layers saved: it loads nothing)
        some = ", ".join(repr(k) for k in list(state)[:3]) + (", ..." if len(state) > 3 else "")
        tensors = any(isinstance(v, torch.Tensor) for v in state.values())
        raise ValueError(
            f"load_scaling_state_dict: none of the state's {len(state)} keys ({some}) names an FP8 layer of this "
            f"model (e.g. {layers[0][0]!r}){': its values are tensors, as in a model state_dict()' if tensors else ''}. "
            "Pass what fp8ops.scaling_state_dict(model) returned (e.g. the checkpoint's entry you saved it under). "
            "Nothing was loaded")
    unknown = sorted(k for k in bare if k not in matched)
    if strict and (skipped or unknown):
        what = ([f"no compatible state for {skipped} (missing, or saved with another amax history length, "
                 "recipe, FP8 format or layer shape)"] if skipped else []) + \
               ([f"states for layers this model does not have: {unknown}"] if unknown else [])
        raise KeyError(f"load_scaling_state_dict: {'; '.join(what)}. Nothing was loaded; pass strict=False to "
                       "load what fits and start the other layers' scaling afresh")
    for m, s in loads:  # (all checked first: a bad entry leaves the model as it was)
        with torch.no_grad():
            m.fp8_amax_history.copy_(s["amax_history"])
            m.fp8_scale.copy_(s["scale"])
            m.fp8_scale_inv.copy_(s["scale_inv"])
            if "overflow_count" in s:  # (not in a state an fp8ops before the twenty-seventh session saved)
                m.fp8_overflow_count.copy_(s["overflow_count"])
            m.fp8_grad_amax.zero_()  # (a compiled backward's dy amax, of the state this load replaces)
        m.fp8_step = s["step"]
        m._fp8_delayed_ready = s["primed"]
        m.__dict__.pop("_fp8_updater", None)  # (the optimizer before the load: see linear._left_by_its_optimizer)
        m.__dict__["_fp8_priming_waits"] = int(s.get("priming_waits", 0))
        m.__dict__.pop("_fp8_wait_amax", None)
        m.__dict__.pop("_fp8_grad_unset", None)
        h = s["amax_history"]
        if s["primed"] and h.shape[0] > 1 and not bool(h[:, G].ne(0).any()):
            # saved before any gradient reached it (see _unprimed). (A one-row history is all 0
            # after every update: it cannot tell.)
            m.__dict__["_fp8_grad_unset"] = True
        m._w_cache = None  # the cached weight cast was made with the old weight scale
        m.__dict__["_fp8_si_version"] = None  # (written here, not by a broadcast)
        m._fp8_pristine = False  # its history is the loaded one
        m._fp8_cast_since_update = False  # (ready, or not, as saved)
        m._fp8_cast_looked_at = None
        m.__dict__["_fp8_scaling_loaded"] = True  # (a weight load before its next cast or step keeps it)
        _restore_verdicts(m, s.get("policy"))
    return skipped
