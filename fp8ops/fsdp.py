"""FP8 weight all-gather under FSDP2: each rank casts its shard of an Fp8Linear's
weight to FP8 (e4m3) before the all-gather, so FSDP2 communicates 1 byte per
weight element instead of 2 (bf16) or 4 (fp32), and the forward gets the FP8
weight it would have cast anyway.

    fp8ops.convert(model)
    fp8ops.enable_fsdp_fp8_all_gather(model)   # before fully_shard and the optimizer
    for block in model.blocks: fully_shard(block)
    fully_shard(model)

How (FSDP2's all-gather extension, torch >= 2.5): the layer's weight Parameter
wraps its master tensor in _Fp8MasterWeight, which FSDP2 shards like any tensor
and which behaves as that tensor for every op (optimizer, state_dict, clipping).
Before each all-gather FSDP2 calls its fsdp_pre_all_gather on the local shard:
the shard is cast with the layer's weight scale, the shard's amax folded into
the layer's amax history as the unsharded cast would. After it,
fsdp_post_all_gather wraps the gathered bytes in _Fp8GatheredWeight, which
Fp8Linear's forward consumes directly (the transpose for dgrad is one copy).

Scales: casting each shard with the same scale gives the bits of casting the
whole weight with it (the cast is elementwise), so results match the
unsharded path bit for bit. Delayed scaling (after its first update) uses the
history's scale, the same on every rank. Current scaling, and delayed scaling's
first step, need the whole weight's amax first: one max all-reduce of the
shards' amaxes per layer per all-gather (torchao does the same).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from . import ops
from .linear import V_H, V_S, W, Fp8Linear, _current_scale
from .scaling import note_replaced

# ops FSDP2 runs on a parameter while sharding, padding and moving it: their results
# stay _Fp8MasterWeight so the local shard keeps the all-gather hooks. Every other
# op sees the plain master tensor and returns plain tensors.
_PRESERVE = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default,
}


def _wrapper(cls, t: torch.Tensor, dtype: torch.dtype, requires_grad: bool):
    return torch.Tensor._make_wrapper_subclass(cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
                                               dtype=dtype, layout=t.layout, device=t.device,
                                               requires_grad=requires_grad)


class _Fp8MasterWeight(torch.Tensor):
    """The master weight (fp32 or bf16), carrying FSDP2's FP8 all-gather hooks."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return _wrapper(cls, tensor, tensor.dtype, tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self):
        return f"_Fp8MasterWeight({self._tensor!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func in _PRESERVE:
            return pytree.tree_map_only(torch.Tensor, cls, out)
        return out

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, spec, outer_size, outer_stride):
        return _Fp8MasterWeight(inner["_tensor"])

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if not isinstance(module, Fp8Linear):
            raise RuntimeError(f"fp8ops: an FP8 all-gather weight belongs to {type(module).__name__}, expected "
                               "an Fp8Linear; call fp8ops.enable_fsdp_fp8_all_gather(model) after "
                               "fp8ops.convert(model) and do not move the weight to another module")
        shard = self._tensor
        rows = shard.shape[0]
        padded_rows = -(-outer_size[0] // mesh.size())  # FSDP2 pads dim 0 to equal shards
        K = shard.shape[1]
        src = shard if shard.dtype in ops.HP_DTYPES else shard.float()
        src = src.contiguous()
        d = module.__dict__
        cfg = d["_fp8_config"]
        views = module._fp8_views(False)
        delayed = cfg.recipe == "delayed"
        current = not delayed or not d["_fp8_delayed_ready"]
        w_dt = d["fp8_dtypes"][W]
        if current:
            # the whole weight's amax: the max over the shards' (an empty shard adds 0)
            group = mesh.get_group()
            _current_scale(src, views, W, cfg.margin, keep_history=delayed,
                           reduce=lambda a: dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group))
        if not d["_fp8_cast_since_update"]:
            d["_fp8_cast_since_update"] = True
        out = None
        if rows:
            out, _ = ops._cast_accumulate(src, views[V_S + W], views[V_H + W], w_dt, False)
        if rows != padded_rows:  # the last ranks' shards of an uneven split: zero rows appended
            pad = torch.zeros(padded_rows, K, dtype=w_dt, device=shard.device)
            if rows:
                pad[:rows].copy_(out)
            out = pad
        return (out.view(torch.uint8),), w_dt

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        (data,) = all_gather_outputs
        if out is not None:
            return  # FSDP2 refilled the same buffer: the Parameter already wraps it
        # param_dtype: the master dtype, or MixedPrecisionPolicy's; the weight gradient comes back in it
        return _Fp8GatheredWeight(data.view(metadata), param_dtype), (data,)


class _Fp8GatheredWeight(torch.Tensor):
    """The unsharded weight FSDP2 hands the forward: FP8 data cast with the
    layer's weight scale, shaped like the master weight, with the dtype FSDP2
    gives unsharded parameters. Only Fp8Linear reads it; any other op raises
    (the FP8 values are not the weight's values)."""

    _VIEW_OPS = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default,
                 torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default}

    @staticmethod
    def __new__(cls, data: torch.Tensor, dtype: torch.dtype):
        return _wrapper(cls, data, dtype, False)

    def __init__(self, data: torch.Tensor, dtype: torch.dtype):
        self._data = data
        self._fp8ops_gathered = data  # what Fp8Linear looks for

    def __repr__(self):
        return f"_Fp8GatheredWeight(shape={tuple(self.shape)}, fp8={self._data.dtype})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in cls._VIEW_OPS and isinstance(args[0], cls):
            dtype = args[0].dtype
            inner = func(args[0]._data, *args[1:], **(kwargs or {}))
            return cls(inner, dtype)
        raise RuntimeError(
            f"fp8ops: {func} on an FSDP2-gathered FP8 weight. With fp8ops.enable_fsdp_fp8_all_gather the "
            "unsharded weight holds FP8 data that only Fp8Linear's forward reads; read the sharded "
            "parameter (outside forward) instead, or do not enable the FP8 all-gather for this model")

    def __tensor_flatten__(self):
        return ["_data"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return _Fp8GatheredWeight(inner["_data"], dtype)


def fp8_all_gather_enabled(layer: nn.Module) -> bool:
    """Is this layer's weight gathered in FP8 by FSDP2 (before or after fully_shard)?"""
    w = layer._parameters.get("weight")
    local = getattr(w, "_local_tensor", w)  # the shard of a fully_shard-ed weight (DTensor)
    return isinstance(local, _Fp8MasterWeight)


def enable_fsdp_fp8_all_gather(model: nn.Module) -> list[str]:
    """Make FSDP2 all-gather the FP8-run Fp8Linear weights of `model` in FP8. Call
    after fp8ops.convert(model) and before fully_shard and creating the optimizer
    (the weights become new Parameters). Returns the names of the layers enabled.
    Skipped: layers whose GEMMs are emulated (all-E5M2), HF Conv1D layers (their
    weight is stored transposed) and weights shared with another module (tied
    weights), which must stay plain tensors."""
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    done = []
    for name, m in model.named_modules():
        if not isinstance(m, Fp8Linear) or m.fp8_config.gemm_emulated:  # (an Fp8Conv1D is not one)
            continue
        w = m._parameters.get("weight")
        if w is None or owners.get(id(w), 0) > 1 or fp8_all_gather_enabled(m):
            continue
        if hasattr(w, "_local_tensor"):  # (a DTensor: sharded already; wrapping it breaks FSDP2's lazy init)
            raise RuntimeError(
                f"fp8ops.enable_fsdp_fp8_all_gather: the weight of {name or '<root>'} is already sharded (a "
                "DTensor): call it after fp8ops.convert(model) and before fully_shard, which then gathers "
                "the FP8 weights; nothing was changed")
        m.weight = nn.Parameter(_Fp8MasterWeight(w.data), requires_grad=w.requires_grad)
        note_replaced(w, name)  # (an optimizer built before this call would step w: its step raises)
        m.__dict__["_w_cache"] = None
        m.register_state_dict_post_hook(_plain_weight_in_state_dict)
        done.append(name)
    return done


def _plain_weight_in_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """state_dict() gives the master weight as the plain tensor it wraps (a DTensor of
    plain shards under fully_shard): checkpoints stay the BF16 model's, loadable
    with torch.load(weights_only=True) and into a model without fp8ops."""
    key = prefix + "weight"
    v = state_dict.get(key)
    if isinstance(v, _Fp8MasterWeight):
        state_dict[key] = v._tensor
    elif isinstance(getattr(v, "_local_tensor", None), _Fp8MasterWeight):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        state_dict[key] = DTensor.from_local(v._local_tensor._tensor, v.device_mesh, v.placements,
                                             run_check=False, shape=v.shape, stride=v.stride())
