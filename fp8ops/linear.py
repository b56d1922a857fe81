"""Fp8Linear: nn.Linear whose forward and backward run FP8 GEMMs through the
fp8ops ops. Not a public API: users call fp8ops.convert(model).

Data flow (hybrid format; DESIGN.md):
    forward   x  -cast(e4m3, s_x, transpose)-> x8, x8t   (x8t saved for wgrad: FP8, not BF16)
              W  -cast(e4m3, s_w, transpose)-> W8, W8t   (once per optimizer step, cached)
              y  = gemm(x8, W8) / (s_x s_w) + b
    backward  dy -cast(e5m2, s_g, transpose)-> g8, g8t
              dx = gemm(g8, W8t) / (s_g s_w)
              dW = gemm(g8t, x8t) / (s_g s_x)            (weight's dtype: fp32 or bf16 master)
    fused GELU (gelu_fusion.py): a consumer with fp8_gelu_input casts gelu(x) from x;
              a producer with fp8_gelu_output casts dy * gelu'(y) from dy and its output y
              (under torch.compile: where inductor's pass finds the pair, gelu_grad_pass.py)
    fused SwiGLU (swiglu_fusion.py): a consumer with fp8_swiglu_input casts silu(gate) * up
              from x = [gate | up]; its backward returns x's gradient (swiglu_backward)

Scaling state lives in non-persistent buffers (never in state_dict):
    fp8_amax_history [H, 3]   columns: 0 input, 1 weight, 2 grad_output; row 0 = this step
    fp8_scale [3], fp8_scale_inv [3] (padded: stride 4), fp8_max [3], fp8_overflow_count [3] (int64)
    fp8_grad_amax [1]         compiled backwards' dy amax, folded into the history at the step
Delayed scaling updates them after optimizer steps (see scaling.py); current
scaling recomputes each tensor's scale from its own amax before each cast.
"""
from __future__ import annotations

import functools
import itertools
import sys
import warnings
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from . import gelu_grad_pass, ops
from ._reference import FP8_MAX
from .config import Fp8Config
from .policy import rows_bucket
from .swiglu import swiglu

X, W, G = 0, 1, 2
# _Fp8LinearFn's act_in: the fused activation of the input (see there)
GELU_GRAD_HERE, GELU_GRAD_PRODUCER, SWIGLU_IN = 1, 2, 3
# the attribute of a layer output whose GELU a consumer may take over (Fp8Linear.forward)
GELU_BOX = "_fp8ops_gelu_box"
# Fp8Linear._fp8_views(): one flat tuple, indexed by these offsets (+ X / W / G)
V_S, V_SI, V_H = 0, 3, 6   # scale[i:i+1], scale_inv[i:i+1], history[0, i]: per-tensor views
V_OVERFLOW = 9             # fp8_overflow_count
V_BUFFERS = 10             # fp8_amax_history, fp8_scale, fp8_scale_inv, fp8_max (whole)
V_GRAD_AMAX = 14           # fp8_grad_amax (see _scaled_grad_output)
# the scaling state's buffers (not persistent: no state_dict holds them)
_SCALING_BUFFERS = ("fp8_amax_history", "fp8_scale", "fp8_scale_inv", "fp8_max", "fp8_overflow_count",
                    "fp8_grad_amax")

# Each Fp8Linear's place in the order of creation, kept by copies and pickles (a model that one
# rank built and sent to the others orders alike everywhere), with copies counted apart (_COPIES,
# 0 for the original): what orders layers that share one weight Parameter alike on every rank
# (scaling._layers_of)
_SERIAL = itertools.count()
_COPIES = itertools.count(1)

# Set by policy.tune_policy() around its one forward: the layers make their policy decision and
# return the plain result, touching no scaling state.
_POLICY_ONLY = False


# Parameters registered on FP8 layers so far (register_parameter: `layer.weight = p` too):
# the optimizer hooks' scans of which layers an optimizer holds are kept until it moves
# (scaling._scan)
_REGISTRATIONS = [0]


# How many times torch.compile has traced an FP8 forward in this process. Compiled code sets no
# flag when it casts (eager code sets _fp8_cast_since_update): update_scales looks for its casts
# in the layers' amax histories instead (scaling._find_compiled_casts).
_TRACES = [0]


def _cast_traced() -> bool:
    """Run by dynamo while it traces a layer's FP8 forward, not by the compiled
    code: a side effect of the graph (the flag eager code sets) would make
    dynamo break the graph inside an activation-checkpointed region, at every
    layer. It takes nothing of the layer: any per-layer value read here would be
    a guard, and every transformer block compiled on its own (blk.compile()) would
    then get a graph of its own, past torch._dynamo's recompile limit (8) at the
    ninth block, after which every block runs eager."""
    _TRACES[0] += 1
    return True


# what torch.compiler.assume_constant_result does (dynamo calls the function once while
# tracing and keeps its result), without importing dynamo (a second) at import time
_cast_traced._dynamo_marked_constant = True


def _settled_bf16(d: dict) -> bool:
    """Has policy "auto" settled BF16 for every shape this layer (its __dict__) met?"""
    return (d["_fp8_config"].policy == "auto" and not d["_fp8_pending"] and bool(d["fp8_policy"])
            and not any(wins for wins, _ in d["fp8_policy"].values()))


def _padded(scale_inv: torch.Tensor) -> torch.Tensor:
    """scale_inv [3] as a view with stride 4 into fresh storage: every entry
    16-byte aligned, which cuBLASLt wants of the GEMMs' scale pointers (an
    unaligned one costs the GEMM a copy into its workspace: two extra
    memcpys per call). amax_update writes through the stride."""
    out = torch.empty(scale_inv.shape[0], 4, device=scale_inv.device, dtype=scale_inv.dtype)[:, 0]
    return out.copy_(scale_inv)


def _is_padded(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0 and t.stride(0) % 4 == 0


def _saved_tensors_hooks_under_compile() -> bool:
    """Are saved-tensor hooks (torch.autograd.graph.saved_tensors_hooks, save_on_cpu) active
    while torch.compile traces an Fp8Linear on delayed scaling, or under compiled autograd? Run
    at trace time, its answer a constant of the graph (dynamo does not guard on such Python
    hooks: a graph keeps what it was traced with). Such a graph saves the layer's padded
    fp8_scale_inv (stride 4: cuBLASLt's aligned scale pointers) for its backward; hooks that copy
    what is saved hand the backward a contiguous copy, which failed inductor's stride check, and
    with that check off dy's amaxes came out NaN. Under compiled autograd it also saves the
    buffer the backward writes dy's amax into (_keep_scales), whose copy would take that write.
    Eager code keeps w's and dy's scales and dy's amax slot on its context, out of the hooks'
    reach (x's scale_inv, saved, is only read, by a C op that takes any stride), and the current
    recipe saves clones of them. So under hooks the traced layers run nn.Linear's computation, saying
    so. torch.utils.checkpoint's own hooks keep what is saved (a holder, then detach()ed views
    of the recomputation): not these."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None or getattr(hooks[0], "__qualname__", "").startswith(_CHECKPOINT_HOOKS):
        return False
    warnings.warn(
        "fp8ops: torch.compile traced Fp8Linear layers while saved-tensor hooks were active "
        "(torch.autograd.graph.saved_tensors_hooks or save_on_cpu): those layers run nn.Linear's "
        "computation in this graph, no FP8, since hooks that copy what is saved would hand the compiled "
        "backward copies of the layers' padded scale buffers (delayed scaling) or of the buffer it writes "
        "dy's amax into (compiled autograd). To train them in FP8, run the model eagerly under the hooks "
        "(eager Fp8Linear keeps its scales out of them), compile it without the hooks (activation "
        "checkpointing instead of offloading), or use Fp8Config(recipe=\"current\") without compiled "
        "autograd", stacklevel=1)
    return True


# (torch.utils.checkpoint's pack hooks: nested functions of these classes' __init__)
_CHECKPOINT_HOOKS = ("_checkpoint_hook.", "_recomputation_hook.")
# torch.compiler.assume_constant_result without importing dynamo at import time (see _cast_traced)
_saved_tensors_hooks_under_compile._dynamo_marked_constant = True


def _is_dtensor(t: torch.Tensor) -> bool:
    # without importing torch.distributed.tensor (0.4 s): no DTensor exists before it is imported
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


class _SecondDerivativeRefused(torch.autograd.Function):
    """The first-order gradients as they are, in a graph whose backward raises. dy is an input,
    so whatever differentiates through these gradients reaches it (jvp's and hvp's dummy
    cotangent is dy; a gradient penalty's path runs through dy to what produced it), while a
    second derivative that never passes through this layer (a BF16 head's Hessian) does not."""

    @staticmethod
    def forward(ctx, gy, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(
            "Fp8Linear: a second derivative through FP8 casts is not computed: a gradient taken with "
            "create_graph=True (a gradient penalty, second-order meta-learning, torch.autograd.functional's "
            "jvp / hvp / hessian) is being differentiated through an FP8 layer, whose share of it would be "
            "missing. Keep such layers out of FP8 (fp8ops.convert(model, module_filter_fn=...))")


def _once_differentiable(fn):
    """The autograd functions' backward, which refuses what it cannot compute. With
    create_graph=True (grad mode on in there) its gradients come through
    _SecondDerivativeRefused, which raises when they are differentiated: torch's
    once_differentiable hung its error on detached copies, so torch.autograd.grad of them
    (allow_unused=True) gave None, and jvp / hvp zeros, for these layers' share, silently. A
    backward batched by torch's legacy vmap (torch.autograd.functional's vectorize=True,
    torch.autograd.grad's is_grads_batched=True) raises, saying so."""
    once = once_differentiable(fn)

    @functools.wraps(fn)
    def backward(ctx, *grads):
        if torch.compiler.is_compiling():
            # (traced, as before: inductor and aot_eager refuse create_graph=True themselves, while
            # the "eager" backend still drops these layers' share; the checks below call what dynamo
            # does not trace)
            return once(ctx, *grads) if torch.is_grad_enabled() else fn(ctx, *grads)
        if _is_legacy_batched(grads[0]):
            raise RuntimeError(
                "Fp8Linear backward: batched by torch's legacy vmap (torch.autograd.functional.jacobian / "
                "hessian with vectorize=True, torch.autograd.grad with is_grads_batched=True), which FP8 casts "
                "do not support: pass vectorize=False, or take the gradients one at a time")
        try:
            if not torch.is_grad_enabled():
                return fn(ctx, *grads)
            with torch.no_grad():
                out = fn(ctx, *grads)
        except RuntimeError as e:
            ops._raise_if_oom(e)  # (a C op's failed allocation as torch.OutOfMemoryError)
            raise
        at = [i for i, g in enumerate(out) if isinstance(g, torch.Tensor)]
        if not at or not grads[0].requires_grad:
            # (dy needs no gradient: plain outputs, as torch's once_differentiable gives; a second
            # derivative through this layer's weight alone then goes unseen, as it did there)
            return out
        refused = _SecondDerivativeRefused.apply(grads[0], *(out[i] for i in at))
        out = list(out)
        for i, g in zip(at, refused):
            out[i] = g
        return tuple(out)
    return backward


_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", lambda t: False)


_BASE_APPLY: dict = {}


def _apply(fn_cls, compiling: bool, *args):
    """fn_cls.apply(*args). In eager code (where no functorch transform is active:
    Fp8Linear.forward sends those calls down the plain path),
    autograd.Function.apply's Python wrapper only unwraps functorch's dead
    wrappers (none exist then) and calls the C apply: that is called directly
    (a few us per call on the hot path of small layers). torch.compile traces
    the real apply."""
    if compiling:
        return fn_cls.apply(*args)
    base = _BASE_APPLY.get(fn_cls)
    if base is None:
        base = _BASE_APPLY[fn_cls] = super(torch.autograd.Function, fn_cls).apply
    try:
        return base(*args)
    except RuntimeError as e:
        ops._raise_if_oom(e)  # (a C op's failed allocation as torch.OutOfMemoryError)
        raise


def _current_scale(t2d: torch.Tensor, views: tuple, col: int, margin: float, keep_history: bool = False,
                   reduce=None, count: bool = True):
    """Current (dynamic) scaling of one tensor: its amax now -> scale. Reuses
    amax_update with most_recent, so the rules (zero / non-finite amax keeps the
    previous scale) are the same code, and a NaN/inf amax is counted in the
    layer's fp8_overflow_count here, per cast. keep_history: delayed scaling
    before its first scale update, which casts each tensor with its own current
    scale while row 0 of the history goes on collecting the step's maximum (the
    casts fold each amax in): the amax_update here runs on a scratch copy
    instead, and the update that ends this counts nothing for that step
    (scaling.update_scales): a layer no optimizer steps (a frozen LoRA base)
    stays here and still counts. reduce(amax): in place, e.g. the max over the
    shards of an FSDP2 weight. count=False: a NaN/inf amax is left to the update to count (a
    layer on delayed scaling whose dy alone is scaled here, scaling._unprimed)."""
    history, scale, scale_inv, fp8_max = views[V_BUFFERS:V_BUFFERS + 4]
    with torch.no_grad():
        a = ops._amax_raw(t2d.detach())
        if reduce is not None:
            a = a.reshape(1)
            reduce(a)
        if keep_history:
            h = a.reshape(1, 1)
        else:
            h = history[:1, col:col + 1]
            h.copy_(a.reshape(1, 1))
        # a NaN/inf amax keeps the previous scale; amax_update counts the event
        # in the same launch
        ops._amax_update(h, scale[col:col + 1], scale_inv[col:col + 1], fp8_max[col:col + 1], margin, "most_recent",
                         overflow_count=views[V_OVERFLOW][col:col + 1] if count else None)


def _scaled_grad_output(ctx, gy: torch.Tensor):
    """Backward's first step for every autograd function: dy made contiguous, and what
    its cast takes, (g2, scale, scale_inv, amax slot).

    Eager code: the layer's buffers. Under current scaling (or delayed scaling's first
    step, or while no gradient has set dy's scale) dy's scale is set there from its own
    amax first; the cast folds dy's amax into row 0 of the history.

    Compiled code (ctx.compiled) writes no buffer that a forward writes or a backward
    reads. torch.compile saves what a backward reads with a version check, and a second
    compiled forward of the layer may run before this backward (two inputs through one
    model, a no_grad forward in between, pipeline schedules): a declared write to the
    history here failed those checks, and behind them folded dy's amax into a
    forward-time copy of the whole history. Instead the cast folds dy's amax into
    fp8_grad_amax, a [1] buffer that only these casts (fp8ops::linear_bwd_sink, whose
    schema does not declare that write) and eager code touch (scaling.fold_grad_amax: at each
    optimizer step, in scaling_state_dict and in the report); the scales come from
    _keep_scales, and under current scaling dy's scale is computed into copies (the buffers
    keep theirs until the step)."""
    static = ctx.static
    current, margin, delayed, current_g = static[5], static[6], static[9], static[12]
    g2 = gy.contiguous()
    if not ctx.compiled:
        views = ctx.views
        if current_g:
            # (dy alone on its current scale, the layer on delayed scaling: the update counts its NaN/inf)
            _current_scale(g2, views, G, margin, keep_history=delayed, count=current)
        return g2, views[V_S + G], views[V_SI + G], views[V_H + G]
    sg, sg_inv, fp8_max, g_amax = ctx.g_scales
    if current_g:
        sg, sg_inv = sg.clone(), sg_inv.clone()
        with torch.no_grad():
            ops._amax_update(ops._amax_raw(g2.detach()).reshape(1, 1), sg, sg_inv, fp8_max[G:G + 1], margin,
                             "most_recent")
    return g2, sg, sg_inv, g_amax


def _keep_scales(ctx, views: tuple, static: tuple) -> tuple:
    """The scales backward reads besides x's: keeps w's scale_inv (ctx.sw_inv) in eager
    code. Returns (x's scale_inv, *the rest), all to be saved with save_for_backward; the
    rest is empty in eager code, and in compiled code w's scale_inv, dy's scale and
    scale_inv, fp8_max and, under compiled autograd, dy's amax slot, which backward hands
    to _take_scales. Copies of those a later forward of the layer may write first: under
    current scaling each forward rescales x (eager code reads w's and dy's live, as nothing
    else changes them before this backward; compiled code's version checks would refuse
    the write).
    Compiled autograd (torch._dynamo.compiled_autograd._enable) miscounts the inputs of an
    AOT backward that reads tensors held on ctx, and failed (an IndexError in torch's
    call_aot_bwd_prologue): compiled code saves them. Held on ctx, the amax slot reaches
    the compiled backward as the layer's buffer itself; saved, saved-tensor hooks that copy
    (save_on_cpu) would hand it a copy to write dy's amax into, lost. So the slot is saved
    only where a forward is traced under compiled autograd (which the hooks then refuse:
    Fp8Linear.forward)."""
    compiled = ctx.compiled = torch.compiler.is_compiling()
    sx_inv, sw_inv = views[V_SI + X], views[V_SI + W]
    if static[5]:
        sx_inv = sx_inv.clone()
        if compiled:
            sw_inv = sw_inv.clone()
    if not compiled:
        ctx.sw_inv = sw_inv
        return (sx_inv,)
    sg, sg_inv = views[V_S + G], views[V_SI + G]
    if static[5]:
        sg, sg_inv = sg.clone(), sg_inv.clone()
    kept = (sw_inv, sg, sg_inv, views[V_BUFFERS + 3])
    if _compiled_autograd_on():
        ctx.g_amax_slot = None
        kept += (views[V_GRAD_AMAX],)
    else:
        ctx.g_amax_slot = views[V_GRAD_AMAX]
    ctx.n_kept = len(kept)
    return (sx_inv, *kept)


def _take_scales(ctx, saved: tuple) -> tuple:
    """Backward's saved tensors: in compiled code sets ctx.sw_inv and ctx.g_scales = (dy's
    scale, scale_inv, fp8_max, amax slot) from what _keep_scales saved after the others;
    returns the others."""
    if not ctx.compiled:
        return saved
    n = len(saved) - ctx.n_kept
    ctx.sw_inv, sg, sg_inv, fp8_max, *slot = saved[n:]
    ctx.g_scales = (sg, sg_inv, fp8_max, slot[0] if slot else ctx.g_amax_slot)
    return saved[:n]


def _compiled_autograd_on() -> bool:
    """Is compiled autograd on where torch.compile traces a forward? Run at trace time, its
    answer a constant of the graph (as _saved_tensors_hooks_under_compile's)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(ca, "compiled_autograd_enabled", False))


_compiled_autograd_on._dynamo_marked_constant = True


def swap_class(mod: nn.Module, cls: type, init) -> nn.Module:
    """mod.__class__ = cls, then init() (which sets the new class's state): a conversion in
    place. If init raises, mod is put back as it was (class, attributes, buffers): no
    half-converted module is left behind."""
    orig, keys, bufs = mod.__class__, set(mod.__dict__), set(mod._buffers)
    mod.__class__ = cls
    try:
        init()
    except BaseException:
        unswap_class(mod, orig, keys, bufs)
        raise
    return mod


def unswap_class(mod: nn.Module, orig: type, keys: set, bufs: set) -> None:
    """Undo swap_class: the class, and the attributes and buffers mod did not have before."""
    from .scaling import untrack  # noqa: PLC0415 -- scaling imports this module
    untrack(mod)
    mod.__class__ = orig
    for k in set(mod.__dict__) - keys:
        del mod.__dict__[k]
    for k in set(mod._buffers) - bufs:
        del mod._buffers[k]
        mod._non_persistent_buffers_set.discard(k)


class _Fp8LinearFn(torch.autograd.Function):
    """views: the layer's _fp8_views() tuple (scaling buffers and their
    per-tensor slices); static: the call's constant settings (see forward).
    w_in is the weight's FP8 cast from this step's cache (w8t its transpose),
    or, when w8t is None, the weight itself: linear_fwd then casts it in the
    same C call and store(w8, w8t) keeps the cast for the step's later calls.
    The fused activations (gelu_fusion.py, swiglu_fusion.py), two static fields:
    act_in: x2 is a GELU's input h and the layer computes linear(gelu_tanh(h)),
      the GELU fused into x's cast. GELU_GRAD_HERE: backward applies the GELU's
      gradient to dx with torch's gelu_backward (h is kept for it, as torch's
      GELU would keep it); GELU_GRAD_PRODUCER: dx is the gradient of gelu(h),
      and h's producer (a layer with gelu_out) applies the GELU's gradient.
      SWIGLU_IN: x2 is [M, 2K] = [gate | up] and the layer computes
      linear(silu(gate) * up), the SwiGLU fused into x's cast; backward turns dx
      into x2's gradient (swiglu_backward; x2 is kept for it, as torch's silu
      and mul would keep gate, up and silu(gate)).
    gelu_out: None, or the box of this output's GELU (see Fp8Linear.forward):
      when the consumer marked it taken, gy is the gradient of gelu(y) and the
      cast of gy applies the GELU's gradient in its own pass (linear_bwd's
      gelu_input: y is kept for it, as the consumer keeps it anyway)."""

    @staticmethod
    def forward(ctx, x2, weight, bias, w_in, w8t, b_lp, views, static, store):
        (x_dtype, w_dtype, g_dtype, out_dtype, fast_accum, current, margin, need_wgrad, need_dgrad, delayed,
         act_in, gelu_out, _current_g) = static
        assert not ((act_in or gelu_out) and current), "the fused activations need known scales (forward unfuses them)"
        if current:
            _current_scale(x2, views, X, margin, keep_history=delayed)
        if b_lp is None:
            b_lp = ops._empty_bias_for(x2, out_dtype)
        # one C call: [cast the weight,] cast x (amaxes folded into history row 0), GEMM
        st = ops.ST  # (dtypes as ScalarType codes: cheaper to pass)
        y, x8t, w8_new, w8t_new = ops._linear_fwd_raw(
            x2, w_in, views[V_S + X], views[V_H + X], views[V_SI + X], views[V_S + W], views[V_H + W],
            views[V_SI + W], b_lp, st[x_dtype], st[w_dtype], st[out_dtype], fast_accum, need_wgrad, need_dgrad,
            act_in in (GELU_GRAD_HERE, GELU_GRAD_PRODUCER), act_in == SWIGLU_IN)
        if w8t is None:
            w8t = w8t_new
            if store is not None:
                store(w8_new, w8t_new)
        sx_inv, *scales = _keep_scales(ctx, views, static)
        keep_x = act_in in (GELU_GRAD_HERE, SWIGLU_IN) and need_dgrad
        ctx.save_for_backward(x8t, w8t, sx_inv, x2 if keep_x else None, y if gelu_out is not None else None, *scales)
        _keep_context(ctx, views, static, weight, bias, x2)
        return y

    @staticmethod
    @_once_differentiable  # (a second derivative through FP8 casts is not computed: it raises)
    def backward(ctx, gy):
        _check_scales_unchanged(ctx)  # (before the saved tensors: their check would raise less clearly)
        x8t, w8t, sx_inv, h, y = _take_scales(ctx, ctx.saved_tensors)
        need_dx = ctx.static[8] and ctx.needs_input_grad[0]
        need_db = ctx.b_dtype is not None and ctx.needs_input_grad[2]
        dx, dw, db = _linear_grads(ctx, gy, x8t, w8t, sx_inv, y, need_dx, ctx.needs_input_grad[1], need_db)
        if h is not None and need_dx and ctx.static[10] == SWIGLU_IN:
            dx = ops._swiglu_backward_raw(dx, h)  # the gradient of [gate | up], one pass
        elif h is not None and need_dx:
            # no producer to pass the gradient to (cuBLASLt's FP8 DGELU epilogue runs as a
            # separate pass, measured on an H200: torch's own kernel does the same pass here);
            # compiled code's may move into the producer's gradient cast (gelu_grad_pass.py)
            if torch.compiler.is_compiling():
                dx = gelu_grad_pass.gelu_tanh_backward(dx, h)
            else:
                dx = torch.ops.aten.gelu_backward(dx, h, approximate="tanh")
        return dx, dw, db, None, None, None, None, None, None


def _left_by_its_optimizer(d: dict) -> bool:
    """Has the optimizer whose step last took this layer (scaling._after_optimizer_step) stepped
    since without it? The layer left it: a weight Parameter assigned that the optimizer does
    not hold, its parameters taken out of the optimizer's groups. No update will come, so the
    delayed scales would stay those of its last update for good (a review's probe: a weight
    assigned 20x larger, 0.6 dB output SQNR at every later step). It goes back to current
    scales, as a layer no optimizer steps casts, until an update comes, and its weight cast is
    no longer kept for the step (a frozen weight may change through .data). Decided from the
    hooks' counts only, which every rank sees alike: the layer holds a box of the optimizer's
    last count, not the optimizer, whose liveness differs between ranks (each frees a replaced
    one at its own garbage collection, in a reference cycle such as accelerate's), and under
    the FSDP2 FP8 all-gather a layer back on current scales all-reduces its weight's amax (two
    review probes hung). A freed optimizer counts no more steps: a layer it had not stepped past
    keeps its scales (frozen layers left out of a new optimizer, README). Eager code only:
    compiled code reads the flag as a guard."""
    up = d.get("_fp8_updater")
    if up is None or up[0][0] <= up[1]:  # (the optimizer's last count, in a box it keeps)
        return False
    d["_fp8_delayed_ready"] = False
    d["_w_cache"] = None
    d.pop("_fp8_updater", None)
    d.pop("_fp8_updated_at", None)  # (no cast kept for the step: see _weight_fp8)
    return True


def _keep_context(ctx, views, static, weight, bias, x2) -> None:
    """What both autograd functions' backward reads besides the saved tensors (compiled
    code: no view of the layer's buffers; _keep_scales holds the amax slot). After
    _keep_scales, which set ctx.compiled."""
    compiled = ctx.compiled
    ctx.views, ctx.static = None if compiled else views, static
    ctx.w_dtype = weight.dtype
    ctx.b_dtype = None if bias is None else bias.dtype
    ctx.x2_dtype = x2.dtype
    # the scales' generation: a scale update (update_scales) or a state load between this
    # forward and its backward bumps it (eager only: compiled code keeps no Python context)
    ctx.si_version = None if compiled else views[V_BUFFERS + 2]._version


def _check_scales_unchanged(ctx) -> None:
    """Backward pairs the FP8 tensors cast in forward with the layer's live
    scale_inv: after a scale update in between, that would silently give wrong
    gradients. nn.Linear raises when an optimizer step changed its weight between
    forward and backward; so does this."""
    # (not under compiled autograd: a version read there breaks its graph at every layer)
    if ctx.si_version is not None and not torch.compiler.is_compiling() \
            and ctx.views[V_BUFFERS + 2]._version != ctx.si_version:
        raise RuntimeError(
            "Fp8Linear backward: this layer's FP8 scales changed between its forward and this backward (an "
            "optimizer step or fp8ops.step updated them, a state was loaded, or DDP's broadcast_buffers copied "
            "rank 0's: see fp8ops.exclude_from_ddp_broadcast), so the FP8 tensors saved in forward no longer "
            "match them. Run backward before the optimizer step, as nn.Linear requires of its weight (it raises "
            "'modified by an inplace operation' there)")


def _linear_grads(ctx, gy, x8t, w8t, sx_inv, y, need_dx: bool, wants_dw: bool, need_db: bool):
    """The FP8 backward of both autograd functions: (dx, dw, db), None where not
    needed. y: the layer's output if it offered its GELU to a consumer (gelu_out)."""
    g_dtype, need_wgrad, gelu_out = ctx.static[2], ctx.static[7], ctx.static[11]
    if y is None or not gelu_out[0]:  # no consumer applied this output's GELU with the gradient passed on
        y = ops._empty_bias_for(gy, gy.dtype)  # (any empty tensor: no GELU gradient here)
    g2, sg, sg_inv, g_amax = _scaled_grad_output(ctx, gy)
    need_dw = need_wgrad and wants_dw
    w_out = ctx.w_dtype if ctx.w_dtype in ops.HP_DTYPES else torch.float32
    st = ops.ST  # (dtypes as ScalarType codes: cheaper to pass)
    # one C call: cast gy (amax folded into its slot; with the bias gradient, gy's
    # column sums, in the same pass), dgrad and wgrad GEMMs
    bwd = ops._linear_bwd_sink_raw if ctx.compiled else ops._linear_bwd_raw  # (see _scaled_grad_output)
    dx, dw, db = bwd(g2, w8t, x8t, sg, g_amax, sg_inv, ctx.sw_inv, sx_inv, y, st[g_dtype], st[ctx.x2_dtype], st[w_out],
                     need_dx, need_dw, need_db)
    return (dx if need_dx else None), (dw if need_dw else None), (db.to(ctx.b_dtype) if need_db else None)


class _Fp8LayerNormLinearFn(torch.autograd.Function):
    """_Fp8LinearFn of LayerNorm(x2) or RMSNorm(x2) (rms; the fused norm,
    layernorm_fusion.py): forward normalizes x2 inside its cast (ln_linear_fwd:
    the norm's output is never written); backward turns the linear's dx into
    the norm's input, weight and bias gradients (_layer_norm_backward)."""

    @staticmethod
    def forward(ctx, x2, ln_w, ln_b, weight, bias, w_in, w8t, b_lp, views, static, store, eps, rms):
        (x_dtype, w_dtype, g_dtype, out_dtype, fast_accum, current, margin, need_wgrad, need_dgrad, delayed,
         act_in, gelu_out, _current_g) = static
        assert not current and not act_in, "the fused LayerNorm needs known scales and no fused activation input"
        # fp32 [K] copies of the norm's parameters (free for fp32 ones); none: an empty tensor
        lw = ops._empty_for(x2, torch.float32) if ln_w is None else ln_w.detach().float()
        lb = ops._empty_for(x2, torch.float32) if ln_b is None else ln_b.detach().float()
        if b_lp is None:
            b_lp = ops._empty_bias_for(x2, out_dtype)
        st = ops.ST  # (dtypes as ScalarType codes: cheaper to pass)
        y, x8t, w8_new, w8t_new, mean, rstd = ops._ln_linear_fwd_raw(
            x2, lw, lb, eps, w_in, views[V_S + X], views[V_H + X], views[V_SI + X], views[V_S + W],
            views[V_H + W], views[V_SI + W], b_lp, st[x_dtype], st[w_dtype], st[out_dtype], fast_accum, need_dgrad,
            rms)
        if w8t is None:
            w8t = w8t_new
            if store is not None:
                store(w8_new, w8t_new)
        sx_inv, *scales = _keep_scales(ctx, views, static)
        # (not the shared empty "none": made under inference_mode it could not be saved)
        ctx.save_for_backward(x8t, w8t, sx_inv, x2, mean, rstd, ln_w, ln_b,
                              None if ln_w is None else lw, y if gelu_out is not None else None, *scales)
        _keep_context(ctx, views, static, weight, bias, x2)
        ctx.rms = rms
        return y

    @staticmethod
    @_once_differentiable  # (a second derivative through FP8 casts is not computed: it raises)
    def backward(ctx, gy):
        _check_scales_unchanged(ctx)  # (before the saved tensors: their check would raise less clearly)
        x8t, w8t, sx_inv, x2, mean, rstd, ln_w, ln_b, lw, y = _take_scales(ctx, ctx.saved_tensors)
        need = ctx.needs_input_grad
        need_ln = need[0] or need[1] or need[2]
        need_db = ctx.b_dtype is not None and need[4]
        dxn, dw, db = _linear_grads(ctx, gy, x8t, w8t, sx_inv, y, need_ln and ctx.static[8], need[3], need_db)
        dx = dlw = dlb = None
        if dxn is not None:
            gamma = ops._empty_for(x2, torch.float32) if lw is None else lw
            dx, dlw, dlb = _layer_norm_backward(dxn, x2, mean, rstd, ln_w, ln_b, gamma, need, ctx.rms)
        return dx, dlw, dlb, dw, db, None, None, None, None, None, None, None, None


def _layer_norm_backward(dxn, x2, mean, rstd, ln_w, ln_b, gamma, need, rms):
    """The fused norm's input, weight and bias gradients from the linear's dx:
    fp8ops' one-pass kernel where the shape allows, eager and compiled alike
    (the check reads shapes and strides only), else torch's LayerNorm backward
    or the RMSNorm's formula. gamma: ln_w as fp32 [K] (empty without a
    weight), as the forward made it."""
    M, K = x2.shape
    if not ops.layernorm_bwd_fusable(dxn, x2):
        if rms:
            return _rms_norm_backward(dxn, x2, rstd, ln_w, need)
        return torch.ops.aten.native_layer_norm_backward(
            dxn, x2, [K], mean.view(M, 1), rstd.view(M, 1), ln_w, ln_b,
            [need[0], ln_w is not None and need[1], ln_b is not None and need[2]])
    dx, dgb = ops._layernorm_bwd_raw(dxn, x2, mean, rstd, gamma, rms)
    dlw = dgb[0].to(ln_w.dtype) if ln_w is not None and need[1] else None
    dlb = dgb[1].to(ln_b.dtype) if ln_b is not None and need[2] else None
    return (dx if need[0] else None), dlw, dlb


def _rms_norm_backward(dy, x2, rstd, ln_w, need):
    """RMSNorm's backward for shapes layernorm_bwd does not take (torch has no
    public one): xhat = x * rstd, g = dy * w, dx = rstd * (g - xhat * mean(g *
    xhat)), dw = sum over rows of dy * xhat; in fp32."""
    r = rstd.unsqueeze(1)
    xhat = x2.float() * r
    d = dy.float()
    g = d if ln_w is None else d * ln_w.float()
    dx = (r * (g - xhat * (g * xhat).mean(1, keepdim=True))).to(x2.dtype) if need[0] else None
    dlw = (d * xhat).sum(0).to(ln_w.dtype) if ln_w is not None and need[1] else None
    return dx, dlw, None


def _normalize(ln: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The fused norm's own computation, for calls that do not fuse it."""
    if isinstance(ln, nn.RMSNorm):
        return F.rms_norm(x, ln.normalized_shape, ln.weight, ln.eps)
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class _GeluGradToProducer(torch.autograd.Function):
    """gelu_tanh(h) whose backward passes the gradient on unchanged: h's producer
    (an Fp8Linear with fp8_gelu_output) applies gelu_tanh'(h) in its own
    gradient cast. The consumer's paths that do not fuse the GELU use it."""

    @staticmethod
    def forward(ctx, h):
        return F.gelu(h, approximate="tanh")

    @staticmethod
    def backward(ctx, g):
        return g


def _gelu_of_input(x: torch.Tensor, box: list | None) -> torch.Tensor:
    """A fused-GELU consumer's unfused GELU of its input x: if x's producer offers
    to apply the gradient (box: the one the layer input carried), it is told so
    and gets the gradient of gelu(x)."""
    if box is not None and torch.is_grad_enabled():
        box[0] = True
        return _GeluGradToProducer.apply(x)
    return F.gelu(x, approximate="tanh")


class _DequantGathered(torch.autograd.Function):
    """An FSDP2 FP8-gathered weight (fsdp.py) as a high-precision tensor: its FP8
    values times scale_inv; the gradient passes through to the weight unchanged."""

    @staticmethod
    def forward(ctx, w, scale_inv):
        return (w._fp8ops_gathered.float() * scale_inv).to(w.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


def _hook_registration_that_warns(name: str, kind: str, sees_input: bool, sees_grad_output: bool):
    """nn.Module's `name` (a hook registration) on an Fp8Linear: warns first if the layer is
    fused (Fp8Linear._warn_hook_on_fused), then registers as nn.Module does."""
    base = getattr(nn.Module, name)

    @functools.wraps(base)
    def register(self, hook, *args, **kwargs):
        self._warn_hook_on_fused(kind, sees_input, sees_grad_output)
        return base(self, hook, *args, **kwargs)
    return register


# Fp8Config fields the conversion built the layer's state from (its dtypes, fp8_max, GEMM
# function, fusions): an assignment of fp8_config must keep them (Fp8Linear.fp8_config)
_FIXED_AT_CONVERSION = ("fp8_format", "fuse_gelu", "fuse_layernorm", "fuse_swiglu")


def _history_rows(config: Fp8Config) -> int:
    """The amax history's rows a layer converted with config has."""
    return config.amax_history_len if config.recipe == "delayed" else 1


class Fp8LinearBase(nn.Module):
    """A linear layer's FP8 forward and backward, its scaling state and policy: every FP8 layer
    fp8ops makes is one (Fp8Linear, an nn.Linear; Fp8Conv1D, a transformers Conv1D with its
    [in, out] weight). Not an nn.Linear itself, so that a layer whose weight is not
    nn.Linear's [out, in] is never one: tools that dispatch on the type (PEFT's LoRA, whose
    merge added its update transposed, transformers' weight init) see Fp8Conv1D as the Conv1D
    it is. A subclass sets in_features, out_features, weight and bias, then calls
    _init_fp8_state."""

    def register_parameter(self, name: str, param) -> None:
        super().register_parameter(name, param)
        _REGISTRATIONS[0] += 1

    def _init_fp8_state(self, config: Fp8Config) -> None:
        self.__dict__["_fp8_config"] = config  # (not the property's setter: nothing to compare with yet)
        self._fp8_serial, self._fp8_copy = next(_SERIAL), 0
        dev = self.weight.device
        x_dt, w_dt, g_dt = self.fp8_dtypes = config.dtypes()
        H = _history_rows(config)
        # fp32 whatever torch.set_default_dtype says: the C ops take fp32 scaling state only
        f32 = torch.float32
        self.register_buffer("fp8_amax_history", torch.zeros(H, 3, device=dev, dtype=f32), persistent=False)
        self.register_buffer("fp8_scale", torch.ones(3, device=dev, dtype=f32), persistent=False)
        self.register_buffer("fp8_scale_inv", _padded(torch.ones(3, device=dev, dtype=f32)), persistent=False)
        self.register_buffer("fp8_max", torch.tensor([FP8_MAX[x_dt], FP8_MAX[w_dt], FP8_MAX[g_dt]], device=dev,
                                                     dtype=f32), persistent=False)
        # per tensor (input, weight, grad_output): amaxes that were NaN/inf (the scale was kept)
        self.register_buffer("fp8_overflow_count", torch.zeros(3, dtype=torch.int64, device=dev), persistent=False)
        # compiled backwards fold dy's amax here, the step into the history (_scaled_grad_output)
        self.register_buffer("fp8_grad_amax", torch.zeros(1, device=dev, dtype=f32), persistent=False)
        self.fp8_step = 0               # optimizer steps seen
        self.fp8_fallback_calls = 0     # eager forwards that ran BF16 (input on CPU, M % 16 != 0, policy auto)
        # delayed: False until the first scale update at which each of its tensors had an amax
        # (scaling._unprimed); until then every cast uses its tensor's current scale (rank-local:
        # no collective outside the step's one all-reduce)
        self._fp8_delayed_ready = False
        self._w_cache = None            # (key, w8, w8t, bias in the GEMM's bias dtype, weakrefs to weight, bias)
        # has cast since the last scale update; True from the update that makes it ready on
        self._fp8_cast_since_update = False
        # (the trace count, the history's version counter) when update_scales last found no cast
        # of compiled code in the history (None: not since this state was made, reset or loaded)
        self._fp8_cast_looked_at = None
        # no cast and no load since the scaling state was made: the history is all 0 and the
        # scales 1, so a scale update would change nothing (update_scales skips it, one process)
        self._fp8_pristine = True
        # policy "auto" settled BF16 for every shape since the last optimizer step: it rests then
        self._fp8_rest_due = False
        self.fp8_on_cpu = False         # tests: run the FP8 path on CPU with the C reference kernels
        # the fused GELU (gelu_fusion.py). fp8_gelu_input: the layer computes
        # linear(gelu_tanh(x)), the GELU fused into x's cast on the FP8 path.
        # fp8_gelu_output: this layer's output feeds only such a layer, which may leave
        # the GELU's gradient to this layer's gradient cast (see forward).
        self.fp8_gelu_input = False
        self.fp8_gelu_output = False
        # the fused SwiGLU (swiglu_fusion.py): the layer takes x = [gate | up] (2 * in_features
        # wide) and computes linear(silu(gate) * up), fused into x's cast on the FP8 path
        self.fp8_swiglu_input = False
        # the fused LayerNorm (layernorm_fusion.py): the nn.LayerNorm whose output this layer
        # takes, applied inside x's cast on the FP8 path (kept out of _modules: the
        # LayerNorm stays where it is in the model, with its parameters)
        self.__dict__["fp8_ln_input"] = None
        self.fp8_policy_measuring = False  # policy.py's throwaway layers skip the policy
        self.fp8_policy = {}            # (M bucket, dtype) -> (fp8 wins, speedup): policy="auto" verdicts (policy.rows_bucket)
        self.fp8_policy_why = {}        # (M bucket, dtype) -> how the trial in the loop decided it (loop_trial.py)
        self._fp8_pending = {}          # (M bucket, dtype) -> Timing: waiting for that trial
        self._fp8_bf16_key = None       # (shape, dtype, device, autocast) of the last call policy sent to BF16
        self._fp8_unagreed = set()      # keys settled here, not yet exchanged with the other ranks (policy_ranks.py)
        if config.gemm_emulated:
            from .emulated import Fp8LinearEmulatedFn  # noqa: PLC0415 -- emulated imports this module
            self._fp8_fn = Fp8LinearEmulatedFn  # all-E5M2: GEMMs on the FP8 values widened to BF16
        else:
            self._fp8_fn = _Fp8LinearFn
        from .scaling import track  # noqa: PLC0415 -- scaling imports this module
        track(self)                     # scales update after each optimizer step

    @property
    def fp8_config(self) -> Fp8Config:
        """The layer's Fp8Config. Its policy, margin, interval, amax_compute_algo and fast_accum
        are read at each call and may be changed by assigning a new config, as may recipe and
        amax_history_len where the history keeps its rows; the rest shaped the layer's state
        at conversion (see the setter)."""
        return self._fp8_config  # (not self.__dict__[...]: dynamo reads that as this property again)

    @fp8_config.setter
    def fp8_config(self, config: Fp8Config) -> None:
        # The FP8 dtypes and their maxima, the history's rows and the fused activation and norm
        # were set up from the config at conversion; a new config that changes them would run
        # the old ones while repr and the report show the new (a review's finding): refused.
        if not isinstance(config, Fp8Config):
            raise TypeError(f"Fp8Linear.fp8_config must be an fp8ops.Fp8Config, found {type(config).__name__}")
        old = self.__dict__.get("_fp8_config")
        if old is not None:
            fixed = [f for f in _FIXED_AT_CONVERSION if getattr(old, f) != getattr(config, f)]
            if _history_rows(old) != _history_rows(config):
                # (current scaling keeps one row of history, delayed amax_history_len)
                fixed.append("recipe" if old.recipe != config.recipe else "amax_history_len")
            if fixed:
                raise ValueError(
                    "Fp8Linear.fp8_config: " + ", ".join(f"{f} {getattr(old, f)!r} -> {getattr(config, f)!r}"
                                                          for f in fixed)
                    + " cannot change after conversion (the layer's FP8 dtypes, amax history and fusions "
                    "were set up from it); policy, margin, interval, amax_compute_algo and fast_accum can "
                    "(recipe and amax_history_len where the history keeps its rows). For the others, "
                    "convert a fresh copy of the unconverted model with fp8ops.convert(model, "
                    "config=Fp8Config(...))")
        self.__dict__["_fp8_config"] = config

    def extra_repr(self) -> str:
        gelu = ", input=gelu_tanh(x) (fused)" if self.fp8_gelu_input else ""
        gelu += ", output feeds a fused GELU" if self.fp8_gelu_output else ""
        gelu += ", input=silu(gate)*up of x=[gate|up] (fused)" if self.fp8_swiglu_input else ""
        ln = self.fp8_ln_input
        gelu += f", input={'RMSNorm' if isinstance(ln, nn.RMSNorm) else 'LayerNorm'}(x) (fused)" if ln is not None \
            else ""
        head = super().extra_repr()  # (nn.Linear's sizes and bias; nothing from nn.Module's)
        return (head + ", " if head else "") + f"fp8={self.fp8_config.short_str()}{gelu}"

    # ------------------------------------------------------------------ hooks after a fusion

    def _fused_hook_note(self, sees_input: bool, sees_grad_output: bool) -> str | None:
        """What a hook registered now would see that nn.Linear's would not (convert's fusions
        moved a norm or an activation into this layer), or None."""
        d = self.__dict__
        notes = []
        ln = d.get("fp8_ln_input")
        if sees_input:
            norm = "RMSNorm" if isinstance(ln, nn.RMSNorm) else "LayerNorm"
            what = (f"the {norm}'s input, not its output" if ln is not None
                    else "the GELU's input, not its output" if d.get("fp8_gelu_input")
                    else "the SwiGLU's input [gate | up], not its output" if d.get("fp8_swiglu_input") else None)
            if what is not None:
                notes.append(f"its input (and that input's gradient) is {what}, which this layer applies itself")
        if sees_grad_output and d.get("fp8_gelu_output"):
            notes.append("its output's gradient is the gradient of the GELU after it, which the next linear "
                         "applies, not of its own output")
        return "; ".join(notes) or None

    def _warn_hook_on_fused(self, kind: str, sees_input: bool, sees_grad_output: bool) -> None:
        note = self._fused_hook_note(sees_input, sees_grad_output)
        if note is not None:
            warnings.warn(
                f"fp8ops: a {kind} registered on an Fp8Linear that fp8ops.convert fused: {note}. Register "
                "hooks before convert (a hooked linear is left unfused), or convert with Fp8Config("
                "fuse_layernorm=False, fuse_gelu=False, fuse_swiglu=False)", stacklevel=3)

    # nn.Module's hook registrations, each warning first where a hook of its kind would see what
    # nn.Linear's would not (kind, sees the input, sees the output's gradient)
    register_forward_pre_hook = _hook_registration_that_warns("register_forward_pre_hook", "forward pre-hook",
                                                              True, False)
    register_forward_hook = _hook_registration_that_warns("register_forward_hook", "forward hook", True, False)
    register_full_backward_pre_hook = _hook_registration_that_warns("register_full_backward_pre_hook",
                                                                    "backward pre-hook", False, True)
    register_full_backward_hook = _hook_registration_that_warns("register_full_backward_hook", "backward hook",
                                                                True, True)

    # ------------------------------------------------------------------ scales

    def _weight_fp8(self, compute_dtype: torch.dtype, need_t: bool, views: tuple, compiling: bool,
                    current: bool = False):
        """The weight for this forward: (w_in, w8t, bias_lp, store). The weight
        is cast once per optimizer step (reused by micro-batches): on a cache
        hit w_in is the FP8 weight and w8t its transpose; on a miss w_in is the
        weight itself and w8t None, linear_fwd casts it in the same C call, and
        store(w8, w8t) caches the result. The bias is cast to the GEMM's bias
        dtype with it. The cache is keyed on the version counters, which the
        optimizer's in-place update bumps, and on the scale update count.

        FSDP2: forward sees the unsharded weight, a plain contiguous Parameter
        that FSDP2 refills by all-gather before each forward (and before the
        backward's recomputation under activation checkpointing). Neither its
        version counter nor (often) its data_ptr changes when the optimizer
        updates the shards, so there fp8_step alone invalidates the cache: the
        optimizer hook (scaling.py) bumps it, matching the layer through the
        sharded DTensor that is registered on the module again after backward.
        A state_dict load drops the cache explicitly (_load_from_state_dict).
        Only the weight of a layer whose scales an optimizer step (or
        fp8ops.step) has updated, and that requires grad, is cached, and only a
        call with grad enabled stores the cast (calls under no_grad, e.g.
        reentrant checkpointing's first forward, reuse it). A frozen weight, one
        only ever read under no_grad, or one no optimizer steps is cast afresh
        each call: an update through .data (an EMA teacher's, whose weights may
        still require grad) moves nothing the key reads. (So the first step's
        micro-batches cast again; a copy starts unstepped, see __setstate__.)"""
        w, b = self._param("weight"), self._param("bias")
        w8 = getattr(w, "_fp8ops_gathered", None)
        if w8 is not None:
            # FSDP2 gathered this weight in FP8 (fsdp.py), cast with this layer's weight scale
            b_lp = None if b is None else b.detach().to(ops._bias_dtype(compute_dtype))
            return w8, (w8.t().contiguous() if need_t else None), b_lp, None
        cacheable = not compiling and w.requires_grad and "_fp8_updated_at" in self.__dict__
        key = None if not cacheable else (w._version, w.data_ptr(), None if b is None else b._version,
                                          self.fp8_step, compute_dtype)
        cache = self._w_cache
        # the Parameter itself, not the view Fp8Conv1D computes with (a new one each call)
        w_id = self._parameters.get("weight")
        if w_id is None:
            w_id = w
        # (a cast made with the transpose also serves a call that needs none; the weak
        # references: a new tensor that lands on a freed weight's memory with version 0, as
        # functional_call's fast weights or a parametrization's output can, is another weight)
        if key is not None and cache is not None and cache[0] == key and (cache[2] is not None or not need_t) \
                and cache[4]() is w_id and (b is None or cache[5]() is b):
            return cache[1], (cache[2] if need_t else None), cache[3], None
        cfg = self.fp8_config
        w_hp = w.detach()
        if w_hp.dtype not in ops.HP_DTYPES:
            w_hp = w_hp.float()
        w_hp = w_hp.contiguous()  # (a strided weight: Fp8Conv1D's transpose view, cast once per step)
        if current:
            delayed = cfg.recipe == "delayed"
            _current_scale(w_hp, views, W, cfg.margin, keep_history=delayed)
        b_lp = None if b is None else b.detach().to(ops._bias_dtype(compute_dtype))
        store = None
        if key is not None and torch.is_grad_enabled():
            d = self.__dict__

            def store(w8, w8t):
                # (without need_t the op returns an empty w8t: kept as None, "not made")
                d["_w_cache"] = (key, w8, w8t if need_t else None, b_lp, weakref.ref(w_id),  # not Module.__setattr__
                                 None if b is None else weakref.ref(b))
        return w_hp, None, b_lp, store

    def _fp8_views(self, compiling: bool) -> tuple:
        """The scaling buffers and their per-tensor views as one flat tuple
        (indices V_*). Cached while the buffers are the same objects over the
        same memory (.to() / .cuda() replace them; FSDP2 moves them by
        assigning .data); sliced afresh under compile."""
        bufs = self._buffers
        h, s, si, m, o, ga = (bufs["fp8_amax_history"], bufs["fp8_scale"], bufs["fp8_scale_inv"], bufs["fp8_max"],
                              bufs["fp8_overflow_count"], bufs["fp8_grad_amax"])
        if not compiling:
            # (fp8_grad_amax is not checked: only compiled code, which slices afresh, reads it)
            ptrs = (h.data_ptr(), s.data_ptr(), si.data_ptr(), m.data_ptr(), o.data_ptr())
            cached = self.__dict__.get("_fp8_views_flat")
            if cached is not None:
                c, cptrs = cached
                if c[V_BUFFERS] is h and c[V_BUFFERS + 1] is s and c[V_BUFFERS + 2] is si \
                        and c[V_BUFFERS + 3] is m and c[V_OVERFLOW] is o and cptrs == ptrs:
                    return c
            if not _is_padded(si):
                # .to() / .cuda() / a load made the buffer contiguous again (a buffer made under
                # inference_mode, an evaluation's first call, would be an inference tensor: no
                # version counter, and training calls after it would fail)
                with torch.inference_mode(False):
                    si = bufs["fp8_scale_inv"] = _padded(si)
                self.__dict__["_fp8_si_version"] = None  # (a new tensor: see scaling._check_not_broadcast)
                ptrs = ptrs[:2] + (si.data_ptr(),) + ptrs[3:]
        c = (s[0:1], s[1:2], s[2:3], si[0:1], si[1:2], si[2:3], h[0, 0], h[0, 1], h[0, 2], o, h, s, si, m, ga)
        if not compiling:
            self.__dict__["_fp8_views_flat"] = (c, ptrs)
        return c

    def _reset_fp8_state(self, keep_step: bool = False) -> None:
        """Fresh scaling state, as convert() made it: amax history 0, scales 1, no steps seen
        and overflow counts 0 unless keep_step (the step count, which sets the phase of
        `interval`, and the run's NaN/inf counts go on). The buffers stay where they are."""
        bufs = self._buffers
        with torch.no_grad():
            bufs["fp8_amax_history"].zero_()
            bufs["fp8_scale"].fill_(1.0)
            bufs["fp8_scale_inv"].fill_(1.0)
            bufs["fp8_max"].copy_(torch.tensor([FP8_MAX[dt] for dt in self.fp8_dtypes], dtype=torch.float32))
            if not keep_step:
                bufs["fp8_overflow_count"].zero_()
            bufs["fp8_grad_amax"].zero_()
        d = self.__dict__
        if not keep_step:
            d["fp8_step"] = 0
        d.pop("_fp8_scaling_loaded", None)
        d.pop("_fp8_grad_unset", None)
        d["_fp8_delayed_ready"] = False
        d["_fp8_priming_waits"] = 0
        d.pop("_fp8_wait_amax", None)
        d["_fp8_cast_since_update"] = False
        d["_fp8_cast_looked_at"] = None
        d["_fp8_pristine"] = True
        d["_fp8_rest_due"] = False
        d["_w_cache"] = None
        d.pop("_fp8_updater", None)
        d["_fp8_si_version"] = None  # (written here: no broadcast, see scaling._check_not_broadcast)

    def _apply(self, fn, recurse=True):
        """.to() / .cuda() / .half() of the module: the scaling state keeps its
        fp32 values (a cast to fp16 would turn large scales into inf), and the
        cached weight cast, views and policy shortcut are dropped (they belong
        to the old device and dtype). Leaving the meta device (to_empty() of a
        model built there) gives the scaling state its initial values: the new
        buffers hold uninitialized memory, and no state_dict load fills them
        (they are not persistent)."""
        keep = {n: self._buffers[n] for n in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv", "fp8_max",
                                              "fp8_grad_amax") if self._buffers.get(n) is not None}
        was_meta = any(b.is_meta for b in keep.values())
        ret = super()._apply(fn, recurse)
        for n, old in keep.items():
            new = self._buffers[n]
            if new is not None and new.dtype != old.dtype:
                self._buffers[n] = old.to(new.device)
        if was_meta and not any(self._buffers[n].is_meta for n in keep):
            self._reset_fp8_state()
        self._forget_placement()
        return ret

    def _forget_placement(self) -> None:
        """Drop what belongs to the old device and dtype: the cached weight cast, the buffer
        views, policy "auto"'s BF16 shortcut and a trial under way."""
        d = self.__dict__
        d["_w_cache"] = None
        d["_fp8_bf16_key"] = None
        d["_fp8_si_version"] = None
        d.pop("_fp8_views_flat", None)
        d.pop("_fp8_fold_views", None)  # (scaling.fold_grad_amax's)
        if d.get("_fp8_pending"):
            from .loop_trial import forget  # noqa: PLC0415
            forget(self)
            d["_fp8_pending"] = {}

    def _param(self, name: str):
        """self.<name> without Module.__getattr__ on the hot path; a
        parametrized weight or bias (torch.nn.utils.parametrize) is not in
        _parameters and goes through the attribute."""
        p = self._parameters.get(name)
        if p is None and name not in self._parameters:
            return getattr(self, name)
        return p

    def _plain_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The nn.Linear computation, for calls that do not run FP8. Under the FSDP2
        FP8 all-gather (fsdp.py) the unsharded weight holds FP8 data: it is
        dequantized with its scale (the weight an FP8 call would have used)."""
        w, b = self._param("weight"), self._param("bias")
        if getattr(w, "_fp8ops_gathered", None) is not None:
            w = _DequantGathered.apply(w, self._buffers["fp8_scale_inv"][W:W + 1])
        d = self.__dict__
        if d["fp8_gelu_input"]:
            x = _gelu_of_input(x, getattr(x, GELU_BOX, None))
        elif d["fp8_swiglu_input"]:
            x = swiglu(x)
        ln = d["fp8_ln_input"]
        if ln is not None:
            x = _normalize(ln, x)
        return F.linear(x, w, b)

    def _fp8_pays(self, M: int, cdtype: torch.dtype, compiling: bool = False) -> bool:
        """policy="auto": is FP8 faster than BF16 for this shape on this GPU?
        Measured once per shape (policy.py); where FP8 wins on the GPU but loses
        alone, or gains little, a trial of a few steps of the caller's own loop,
        in blocks of BF16 and FP8, decides (loop_trial.py). One verdict covers a
        bucket of row counts (policy.rows_bucket), timed at its lowest. Under
        CUDA-graph capture nothing is measured and an unknown bucket runs FP8;
        compiled code measures nothing either and reads the verdicts as a step
        function of M (_compiled_verdict), so that one graph serves many M."""
        if compiling:
            return self._compiled_verdict(M, cdtype)
        M = rows_bucket(M)
        k = (M, cdtype)
        hit = self.fp8_policy.get(k)
        if hit is not None:
            return hit[0]
        if torch.cuda.is_current_stream_capturing():
            return True
        from . import loop_trial, policy, policy_ranks  # noqa: PLC0415
        # (no collective here: under DDP / FSDP2 the ranks exchange what they settled at the
        # next optimizer step, policy_ranks.py; ranks may meet different shapes)
        t = self._fp8_pending.get(k)
        if t is None:
            t = policy.measure(self, M, cdtype)
            wins, speedup = policy.verdict(t)
            if wins is not None:
                policy_ranks.settled(self, k, wins, speedup)
                self._fp8_note_verdict(wins)
                return wins
            self._fp8_pending[k] = t
        if _POLICY_ONLY:
            # tune_policy before torch.compile: compiled code spends far less host time per layer
            wins, why = t.gpu_speedup >= policy.MIN_SPEEDUP, "settled GPU-bound by tune_policy"
            loop_trial.forget(self, k)
        else:
            wins, why = loop_trial.decision(self, k, t)
            if why is None:
                return wins  # a step of the trial: BF16 or FP8, for every layer waiting on it alike
        del self._fp8_pending[k]
        policy_ranks.settled(self, k, wins, t.gpu_speedup if wins else t.alone_speedup, why)
        self._fp8_note_verdict(wins)
        return wins

    def _compiled_verdict(self, M, cdtype: torch.dtype) -> bool:
        """policy="auto" in compiled code, where nothing is measured: the verdict of the
        highest settled bucket at or below M (the lowest bucket's below it), FP8 where the
        layer has no verdict for the dtype. M may be symbolic (torch.compile(dynamic=True),
        or torch's automatic dynamic shapes from a second length on), and one graph then
        serves every M: choosing by M's own bucket would specialize M (bit_length), one
        recompile per length until torch's recompile limit (8) sends the model back to
        eager. Only the row counts where the verdict changes are compared with M, i.e. a
        guard each: a layer settled one way has one graph, FP8 from 4096 rows on two."""
        marks = sorted((lo, wins) for (lo, dt), (wins, _) in self.fp8_policy.items() if dt == cdtype)
        if not marks:
            return True
        wins = marks[0][1]
        for (_, before), (lo, now) in zip(marks, marks[1:]):
            if now != before and M >= lo:
                wins = now
        return wins

    def _fp8_note_verdict(self, wins: bool) -> None:
        """After a verdict: a layer now settled BF16 for every shape it met rests at the next
        optimizer step (scaling.update_scales) if it had cast."""
        if not wins and _settled_bf16(self.__dict__):
            self.__dict__["_fp8_rest_due"] = True

    def __getstate__(self):
        # the cached weight cast and views derive from this layer's tensors (a copy makes its
        # own), and FP8 tensors do not go through plain pickle (torch 2.11)
        state = self.__dict__.copy()
        state["_w_cache"] = None
        state.pop("_fp8_views_flat", None)
        state.pop("_fp8_fold_views", None)
        state.pop("_fp8_trial_watch", None)  # (a finalizer of this object: loop_trial._watch)
        state.pop("_fp8_death_note", None)   # (and scaling.track's)
        state.pop("_fp8_updater", None)  # (its optimizer's count: a copy has no optimizer yet)
        if not isinstance(state.get("_fp8_group", ""), str):
            # a ProcessGroup (scaling.set_scaling_group) does not pickle: a copy takes the
            # default group until it is set again ("local" is kept)
            del state["_fp8_group"]
        return state

    def __setstate__(self, state):
        # a whole Fp8Linear pickled by an fp8ops from before the fused SwiGLU
        state.setdefault("fp8_swiglu_input", False)
        if "fp8_config" in state:  # (pickled before the fp8_config property: its key then)
            state["_fp8_config"] = state.pop("fp8_config")
        state.setdefault("_fp8_unagreed", set())  # (and from before the exchange at the step)
        state.setdefault("_fp8_pristine", False)  # (and from before the pristine skip: update it)
        state.setdefault("_fp8_rest_due", False)
        state["_fp8_cast_looked_at"] = None  # (another object's counts, or another process's)
        # a copy is stepped by no optimizer yet (an EMA teacher made by deepcopy may never be):
        # its weight cast is not cached (_weight_fp8), and it casts with current scales, until
        # its first update; the history it brings then gives its delayed scales (a teacher's
        # would never be updated: its inputs and weights move away from them)
        state.pop("_fp8_updated_at", None)
        state.pop("_fp8_stepped_at", None)  # (the original's fp8ops.step, counted by this process)
        state.pop("_fp8_weight_path_at", None)  # (the hooks' counts of this process)
        state.pop("_fp8_bias_path_at", None)
        state["_fp8_delayed_ready"] = False
        state.pop("_fp8_trace_key", None)  # (what an fp8ops from before _TRACES pickled)
        state.setdefault("_fp8_serial", next(_SERIAL))
        state["_fp8_copy"] = next(_COPIES)
        super().__setstate__(state)
        if "fp8_grad_amax" not in self._buffers:  # (pickled by an fp8ops from before compiled backward's slot)
            h = self._buffers["fp8_amax_history"]
            self.register_buffer("fp8_grad_amax", torch.zeros(1, device=h.device, dtype=torch.float32),
                                 persistent=False)
        # a copy (copy.deepcopy, pickle, torch.load of a whole model) updates its scales after
        # optimizer steps as the original does
        from .scaling import track  # noqa: PLC0415 -- scaling imports this module
        track(self)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # The load writes the weight in place. Under FSDP2 it writes the sharded
        # parameter, which moves neither the version counter nor the storage of
        # the unsharded weight the cache key reads: drop the cached cast here.
        self._w_cache = None
        from .fsdp import _Fp8MasterWeight, fp8_all_gather_enabled  # noqa: PLC0415 -- fsdp imports this module
        fp8_gather = fp8_all_gather_enabled(self)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        w = self._parameters.get("weight")
        if fp8_gather and w is not None and not fp8_all_gather_enabled(self):
            # load_state_dict(assign=True) put the checkpoint's plain tensor in the FP8 master
            # weight's place: wrap it again, or FSDP2 would gather it in its own dtype, silently
            if hasattr(w, "_local_tensor"):
                error_msgs.append(f"{prefix}weight: load_state_dict(assign=True) replaced a weight that FSDP2 "
                                "gathers in FP8 (fp8ops.enable_fsdp_fp8_all_gather) after fully_shard; load "
                                "with assign=False, or before fully_shard and enable_fsdp_fp8_all_gather")
            else:
                self.weight = nn.Parameter(_Fp8MasterWeight(w.data), requires_grad=w.requires_grad)
        bufs = self._buffers
        meta = [n for n in _SCALING_BUFFERS if bufs.get(n) is not None and bufs[n].is_meta]
        if meta and not self.weight.is_meta:
            # load_state_dict(assign=True) into a model built on the meta device: the weight
            # now has storage, the scaling state (not in any state dict) is given its own here,
            # as to_empty() would (_apply)
            with torch.inference_mode(False):  # (buffers of their own, whatever the load ran under)
                for n in meta:
                    bufs[n] = torch.empty_like(bufs[n], device=self.weight.device)
            self._reset_fp8_state()
            self._forget_placement()
        elif prefix + "weight" in state_dict and not self.__dict__.get("_fp8_scaling_loaded"):
            # other weights (the best checkpoint, a rollback, an evaluation's swap): the amaxes
            # and scales of the old ones mean nothing for them, and delayed scaling would cast
            # with those for up to amax_history_len steps. The layer scales as if converted
            # after the load: its first casts use current scales. The step count (the phase of
            # `interval`) and the run's NaN/inf counts go on. (A scaling state restored by
            # load_scaling_state_dict just before this load, not yet used by a cast or a step,
            # is kept: it was saved for the weights a resume loads beside it.)
            self._reset_fp8_state(keep_step=True)

    # ----------------------------------------------------------------- forward

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 -- nn.Linear's name: layer(input=x) works
        x = input
        # The hot path of small layers is bound by host time: plain dict reads
        # instead of Module.__getattr__, is_compiling() asked once.
        d = self.__dict__
        compiling = torch.compiler.is_compiling()
        bf16_key = d.get("_fp8_bf16_key")
        if bf16_key is not None and not compiling:
            # policy "auto" chose BF16 for the input the last call had: a layer
            # left in BF16 should cost what an nn.Linear costs, so the repeat of
            # that call skips every other check
            ac = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
            if bf16_key == (x.shape, x.dtype, x.device, ac):
                d["fp8_fallback_calls"] += 1
                return self._plain_forward(x)
        if (not isinstance(x, torch.Tensor) or x.dtype not in ops.HP_DTYPES or (not x.is_cuda and not d["fp8_on_cpu"])
                or x.numel() == 0 or torch._C._are_functorch_transforms_active()):
            # (what nn.Linear does with it: an integer, bool, complex, float64 or FP8 input, or a
            # list, raises torch's error or runs under the caller's autocast; torch.func
            # transforms see the plain computation, which they can differentiate and batch)
            if not compiling:  # an int read in compiled code is a guard: one recompile per call
                d["fp8_fallback_calls"] += 1
                if isinstance(x, torch.Tensor) and x.device.type != "cuda" and not d["fp8_on_cpu"]:
                    d["_fp8_input_off_gpu"] = True  # (report: a model moved off the GPU, cannot_run_fp8)
            return self._plain_forward(x)
        width = 2 * self.in_features if d["fp8_swiglu_input"] else self.in_features
        if x.dim() == 0 or x.shape[-1] != width:
            raise ValueError(
                f"Fp8Linear: the input's last dimension must be {width} "
                f"({'2 * in_features: [gate | up] of the fused SwiGLU' if d['fp8_swiglu_input'] else 'in_features'}), "
                f"found input shape {tuple(x.shape)}; pass [..., {width}]")
        weight, bias = self._param("weight"), self._param("bias")
        if weight.dtype not in ops.HP_DTYPES:
            # (model.to(torch.float64) after convert: the FP8 path computes in fp32 at most)
            if not compiling:
                d["fp8_fallback_calls"] += 1
            return self._plain_forward(x)
        if _is_dtensor(weight):  # (compiled code too: an isinstance check, no guard of its own)
            raise RuntimeError(
                "Fp8Linear: the weight is a DTensor (a sharded FSDP2 or tensor-parallel parameter). Under "
                "FSDP2, call the model through a fully_shard-ed module that contains this layer, so that "
                "the weight is all-gathered before its forward; tensor parallelism is not supported.")
        if torch.is_autocast_enabled("cuda"):
            cdtype = torch.get_autocast_dtype("cuda")
        else:
            cdtype = x.dtype
            if cdtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
                # outside autocast nn.Linear refuses an input whose dtype is not its weight's
                # ("mat1 and mat2 must have the same dtype"): so does this layer, with torch's
                # error, where the FP8 path could run it (and the same call raise at its next
                # fallback: an odd row count, policy auto's BF16 verdict, a machine without FP8)
                return self._plain_forward(x)
        x2 = x if x.dim() == 2 and not compiling else x.reshape(-1, width)  # (eager: no view to make)
        cfg = d["_fp8_config"]
        if x2.shape[0] % 16 != 0 and x.is_cuda:
            # cuBLASLt FP8 needs M % 16 == 0; this call (e.g. an odd eval batch)
            # runs exactly as the nn.Linear would (under the caller's autocast)
            if not compiling:  # an int read in compiled code is a guard: one recompile per call
                d["fp8_fallback_calls"] += 1
            return self._plain_forward(x)
        if (cfg.policy == "auto" and x.is_cuda and not d["fp8_policy_measuring"] and not cfg.gemm_emulated
                and not self._fp8_pays(x2.shape[0], cdtype, compiling)):
            # policy "auto" measured BF16 faster for this shape: the plain path,
            # with nothing else to pay (update_scales skips a layer that cast nothing)
            if compiling:
                return self._plain_forward(x)
            d["fp8_fallback_calls"] += 1  # (eager only, as above)
            if (rows_bucket(x2.shape[0]), cdtype) in d["_fp8_pending"]:  # a BF16 step of the trial: decided later
                return self._plain_forward(x)
            ac = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
            d["_fp8_bf16_key"] = (x.shape, x.dtype, x.device, ac)
            if _settled_bf16(d):
                # BF16 for every shape it met: the trial's last FP8 weight cast (the weight's size
                # again in FP8, twice) would stay allocated until the next FP8 call, i.e. forever
                d["_w_cache"] = None
            return self._plain_forward(x)
        if _POLICY_ONLY and not d["fp8_policy_measuring"]:
            # (policy.measure's throwaway layer, which tune_policy's forward may create, must run
            # FP8: timed on the plain path, FP8 would measure as fast as BF16 and lose every verdict)
            return self._plain_forward(x)
        # an fp32 input (LayerNorm under autocast) is cast to fp8 directly: no
        # extra pass through bf16; its gradient comes back in fp32 as well
        x2 = x2.contiguous()
        # delayed scaling's first step casts with current scales (under torch.compile the
        # flag's flip at the first update costs one recompile)
        delayed = cfg.recipe == "delayed"
        if compiling and (delayed or _compiled_autograd_on()) and _saved_tensors_hooks_under_compile():
            return self._plain_forward(x)  # (it warned: see there)
        current = not delayed or not d["_fp8_delayed_ready"]
        if not current and not compiling:
            current = _left_by_its_optimizer(d)
        # dy from its own amax: with x and w, or while no gradient has set dy's scale (scaling._unprimed)
        current_g = current or "_fp8_grad_unset" in d
        # the fused GELU needs known scales (a current scale needs the GELU's amax, or the
        # GELU-gradient's, before the cast) and the real GEMMs (the emulated ones have no
        # fused GELU); otherwise the GELU runs on its own, as it did in the model
        fusable = not current and not cfg.gemm_emulated
        act_in = 0
        if d["fp8_gelu_input"]:
            box = None if compiling else getattr(x, GELU_BOX, None)
            if not fusable:
                x2 = _gelu_of_input(x2, box)
            elif box is not None and torch.is_grad_enabled():
                box[0] = True  # the producer applies the GELU's gradient
                act_in = GELU_GRAD_PRODUCER
            else:
                act_in = GELU_GRAD_HERE
        elif d["fp8_swiglu_input"]:
            if fusable:
                act_in = SWIGLU_IN
            else:
                x2 = swiglu(x2)
        # this output's GELU may be applied by its consumer: a box it marks when it also
        # leaves the GELU's gradient to this layer's backward (never under compile: no
        # tensor attributes there; an inductor pass pairs the two in the backward graph
        # instead, gelu_grad_pass.py)
        # (not while dy's scale comes from its own amax: the fused GELU gradient needs a known one)
        gelu_out = [False] if d["fp8_gelu_output"] and fusable and not current_g and not compiling \
            and torch.is_grad_enabled() else None
        ln = d["fp8_ln_input"]
        is_rms = isinstance(ln, nn.RMSNorm)
        # (the fused LayerNorm keeps x's dtype, torch's LayerNorm backward wants its weight's; an
        # RMSNorm only where layernorm_bwd takes its rows: torch's own RMSNorm kernels beat the
        # fallback formula, _rms_norm_backward)
        ln_fused = ln is not None and fusable and (ln.weight is None or ln.weight.dtype == x2.dtype) and (
            not x2.is_cuda or not is_rms or ops.layernorm_bwd_cols_ok(x2.shape[1], x2.dtype))
        if ln is not None and not ln_fused:
            x2 = _normalize(ln, x2)
        rms = ln_fused and is_rms
        ln_bias = None if not ln_fused or rms else ln.bias  # (an RMSNorm has no bias attribute)
        if compiling:
            _cast_traced()  # (no side effect for the graph, no guard on this layer)
            # (inductor's pass that may hand the GELU's gradient to the producer, and this layer's
            # cast the pieces of a concatenated dy: gelu_grad_pass.py, cat_grad_pass.py)
            gelu_grad_pass.install()
        elif not d["_fp8_cast_since_update"]:  # (once: see update_scales)
            d["_fp8_cast_since_update"] = True
            d.pop("_fp8_scaling_loaded", None)  # (a loaded scaling state in use: a weight load restarts it)
        grad = torch.is_grad_enabled()
        need_wgrad = grad and weight.requires_grad
        # (x2: after an unfused LayerNorm, whose parameters need the gradient too)
        need_dgrad = grad and (x2.requires_grad or (ln_fused and any(
            p is not None and p.requires_grad for p in (ln.weight, ln_bias))))
        views = self._fp8_views(compiling)
        w_in, w8t, b_lp, store = self._weight_fp8(cdtype, need_dgrad, views, compiling, current)
        x_dt, w_dt, g_dt = d["fp8_dtypes"]
        static = (x_dt, w_dt, g_dt, cdtype, cfg.fast_accum, current, float(cfg.margin), need_wgrad, need_dgrad,
                  delayed, act_in, gelu_out, current_g)
        if ln_fused:
            # RMSNorm's eps None: F.rms_norm's, the epsilon of its fp32 arithmetic for every input dtype
            # this path takes (not the bf16 epsilon the docs suggest: measured, torch 2.11)
            eps = ln.eps if ln.eps is not None else torch.finfo(torch.float32).eps
            y = _apply(_Fp8LayerNormLinearFn, compiling, x2, ln.weight, ln_bias, weight, bias, w_in, w8t, b_lp,
                       views, static, store, float(eps), rms)
        else:
            y = _apply(d["_fp8_fn"], compiling, x2, weight, bias, w_in, w8t, b_lp, views, static, store)
        if x.dim() != 2 or compiling:
            y = y.reshape(*x.shape[:-1], self.out_features)
        if gelu_out is not None:
            setattr(y, GELU_BOX, gelu_out)
        return y


class Fp8Linear(Fp8LinearBase, nn.Linear):
    """nn.Linear with FP8 forward and backward. Same parameters, same
    state_dict keys, shapes and dtypes as the nn.Linear it replaces."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None,
                 config: Fp8Config | None = None):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._init_fp8_state(config or Fp8Config())

    @classmethod
    def from_linear(cls, mod: nn.Linear, config: Fp8Config) -> "Fp8Linear":
        """Turn the nn.Linear `mod` itself into an Fp8Linear and return it: its
        Parameters, hooks of every kind, attributes, train/eval mode and every
        reference to it (a module shared by two parents) stay what they were."""
        if type(mod) is not nn.Linear:
            raise TypeError(f"Fp8Linear.from_linear: mod must be a plain nn.Linear, found {type(mod).__name__}; "
                            "subclasses may compute something else in forward")
        return swap_class(mod, cls, lambda: mod._init_fp8_state(config))
