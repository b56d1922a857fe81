"""FP8 for any training script: the command-line flags and the one call that prepares a model.

    parser = argparse.ArgumentParser()
    fp8ops.add_fp8_args(parser)              # --use_fp8, --fp8_backend, --fp8_format, ...
    args = parser.parse_args()
    model = build_model().to(device)         # load a checkpoint here, before converting
    model, info = fp8ops.prepare_model(model, args)
    optimizer = torch.optim.AdamW(model.parameters())   # after prepare_model: TE swaps params
    for batch in data:
        with info["autocast"]():             # a no-op except for Transformer Engine
            loss = model(batch)

Backends (`--fp8_backend`):
  fp8ops   this package: per-layer FP8/BF16 decision, delayed or current scaling.
  torchao  torchao.float8 (current scaling only), when installed and the GPU is sm_89+.
  te       NVIDIA Transformer Engine (te.Linear + autocast), when installed and the GPU is sm_89+.
  bf16     no FP8.
A backend that cannot run here never stops the run: it continues in BF16 (or with fp8ops, given
`--fp8_fallback fp8ops`) and prints why, once.

Model state stays the BF16 model's for fp8ops and torchao (same keys, shapes, dtypes). Transformer
Engine adds `*._extra_state` keys; `portable_state_dict(model)` drops them (and torch.compile's
`_orig_mod.` prefix) so a checkpoint loads into any backend.
"""

import argparse
import contextlib
import logging
import warnings
from collections.abc import Mapping

import torch
import torch.nn as nn

from .config import MAX_HISTORY

__all__ = ["add_fp8_args", "config_from_args", "prepare_model", "portable_state_dict"]

BACKENDS = ("fp8ops", "torchao", "te", "bf16")
FORMATS = ("hybrid", "e4m3", "e5m2")

# FP8 GEMMs (cuBLASLt, torch._scaled_mm, TE) need both weight dimensions to be multiples of 16.
_FP8_DIM_MULTIPLE = 16


def _int_in(lo: int, hi: int | None = None):
    """argparse type: an int in [lo, hi], refused at parse time with the flag's name (not
    later by Fp8Config, after the model was built, or never on a run that falls back)."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, found {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected an integer {'>= %d' % lo if hi is None else 'in [%d, %d]' % (lo, hi)}"
                                             f", found {v}")
        return v
    parse.__name__ = "int"  # (argparse names the type in some messages)
    return parse


def add_fp8_args(parser):
    """Add the "FP8" argument group to an argparse parser; returns the group."""
    g = parser.add_argument_group("FP8", "FP8 training (see fp8ops.training for the backends)")
    g.add_argument("--use_fp8", action="store_true",
                   help="train the model's linear layers in FP8 where the GPU supports it "
                        "(default: off, plain BF16/FP32)")
    g.add_argument("--fp8_backend", choices=BACKENDS, default="fp8ops",
                   help="FP8 implementation (default: %(default)s); torchao and te are used "
                        "only when installed, else the run continues without them and says so")
    g.add_argument("--fp8_fallback", choices=("bf16", "fp8ops"), default="bf16",
                   help="what to run when --fp8_backend torchao/te cannot run here "
                        "(default: %(default)s)")
    g.add_argument("--fp8_recipe", choices=("delayed", "current"), default="delayed",
                   help="delayed: scale from the amax history (Transformer Engine's recipe); "
                        "current: scale from this tensor's amax (default: %(default)s)")
    g.add_argument("--fp8_format", choices=FORMATS, default="hybrid",
                   help="hybrid: E4M3 forward, E5M2 gradients; e4m3: E4M3 everywhere; e5m2: E5M2 "
                        "everywhere, fp8ops only, for numerics studies: its GEMMs run in BF16 "
                        "on the FP8 values (no tensor core multiplies E5M2 by E5M2), so it is "
                        "slower than BF16 (default: %(default)s)")
    g.add_argument("--fp8_margin", type=_int_in(-63, 16), default=0,
                   help="scale = fp8_max / amax / 2**margin, an int in [-63, 16] (E4M3 spans 2**17.8: from 17 on "
                        "nearly every value casts to 0) (default: %(default)s)")
    g.add_argument("--fp8_interval", type=_int_in(1), default=1,
                   help="delayed scaling: update scales every N >= 1 steps (default: %(default)s)")
    g.add_argument("--fp8_amax_history_len", type=_int_in(1, MAX_HISTORY), default=1024,
                   help=f"delayed scaling: amax history length, in [1, {MAX_HISTORY}] (default: %(default)s)")
    g.add_argument("--fp8_amax_compute_algo", choices=("max", "most_recent"), default="max",
                   help="delayed scaling: reduce the history by max or take the most recent "
                        "(default: %(default)s)")
    g.add_argument("--fp8_policy", choices=("auto", "always"), default="auto",
                   help="fp8ops only. auto: layers measured slower in FP8 on this GPU run BF16; "
                        "always: every eligible layer runs FP8 (default: %(default)s)")
    return g


def config_from_args(args):
    """The `fp8ops.Fp8Config` the parsed FP8 flags describe."""
    from fp8ops.config import Fp8Config  # lazy: fp8ops/__init__ imports this module

    return Fp8Config(
        recipe=args.fp8_recipe,
        fp8_format=args.fp8_format,
        margin=args.fp8_margin,
        interval=args.fp8_interval,
        amax_history_len=args.fp8_amax_history_len,
        amax_compute_algo=args.fp8_amax_compute_algo,
        policy=args.fp8_policy,
    )


def portable_state_dict(model):
    """model.state_dict() with the keys of the plain model, whatever backend or compile wraps it.

    Drops Transformer Engine's `*._extra_state` (FP8 metadata; a plain model has no such key and
    TE#199 shows strict loading then fails) and torch.compile's `_orig_mod.` prefix.
    """
    model = getattr(model, "_orig_mod", model)
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def _fp8_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    add_fp8_args(parser)
    return parser


def _defaults() -> dict:
    """add_fp8_args' flags at their defaults, by dest."""
    return vars(_fp8_parser().parse_args([]))


def _with_fp8_defaults(args) -> argparse.Namespace:
    """prepare_model's args as a Namespace holding every FP8 flag: parsed arguments, or a
    hand-made Namespace or mapping (a config file's), the flags it lacks at add_fp8_args'
    defaults; a value outside a flag's choices is refused, naming it."""
    if isinstance(args, Mapping):
        given = dict(args)
    elif isinstance(args, argparse.Namespace):
        given = vars(args)
    elif not isinstance(args, (str, bytes, list, tuple, int, float)) and args is not None:
        # a config object: its public attributes, class attributes and slots too
        given = {k: v for k in dir(args) if not k.startswith("_") and not callable(v := getattr(args, k, None))}
    else:
        raise TypeError(f"prepare_model: args must be the parsed arguments (an argparse.Namespace) or a mapping of "
                        f"the FP8 flags, found {type(args).__name__}")
    parser = _fp8_parser()
    defaults = vars(parser.parse_args([]))
    unknown = sorted(k for k in given if k.startswith("fp8_") and k not in defaults)
    if unknown and not isinstance(args, argparse.Namespace):
        # (a misspelt key of a config file would run at the flag's default, silently; a parser's
        # own extra fp8_ flags are the script's business)
        warnings.warn(f"prepare_model: args has {', '.join(map(repr, unknown))}, which no FP8 flag reads (the FP8 "
                      f"flags: {', '.join(sorted(defaults))}); a misspelling runs at the default", stacklevel=3)
    merged = {**defaults, **given}
    for action in parser._actions:
        if action.choices is not None and merged.get(action.dest) not in action.choices:
            raise ValueError(f"prepare_model: args.{action.dest} (--{action.dest}) must be one of "
                             f"{tuple(action.choices)}, found {merged.get(action.dest)!r}")
    return argparse.Namespace(**merged)


def prepare_model(model, args, logger=print, module_filter_fn=None, precision="BF16"):
    """Set `model` up for the FP8 flags in `args`; the one call a training script makes.

    Call it after the model is on its device and after loading any checkpoint, and build the
    optimizer after it. `module_filter_fn(module, fqn) -> bool` chooses which nn.Linear may
    convert (e.g. to keep a tied lm_head out). `precision` names what non-FP8 layers run in,
    for the messages ("BF16" under autocast; "FP32" for a CPU run). Prints each decision once
    through `logger`.

    Returns (model, info) with info keys:
      backend      what runs: "fp8ops", "torchao", "te" or "bf16" (no FP8 backend: the layers run
                   in `precision`, which the summary names, e.g. "fp32 (no CUDA GPU ...)")
      requested    the backend asked for, or None without --use_fp8
      fp8_layers   number of linear layers that run FP8
      linear_layers  number of nn.Linear layers the model had
      reason       why FP8 is off (or partly off), or None
      summary      the one-line decision that was printed
      autocast     zero-argument callable returning the context manager to run forward in
      config       the Fp8Config (fp8ops backend) or None
    """
    args = _with_fp8_defaults(args)
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    info = dict(backend="bf16", requested=None, fp8_layers=0, linear_layers=n_linear,
                reason=None, summary="", autocast=contextlib.nullcontext, config=None)
    backend = getattr(args, "fp8_backend", "fp8ops")

    if not getattr(args, "use_fp8", False):
        info["reason"] = "FP8 not requested"
        info["summary"] = f"{precision.lower()} (FP8 not requested)"
        hint = "add --use_fp8 to train in FP8"
        if backend not in ("fp8ops", "bf16"):
            hint = f"--fp8_backend {backend} has no effect without --use_fp8"
        logger(f"FP8: off, training in {precision} (FP8 not requested; {hint})")
        return model, info
    if backend == "bf16":
        info["reason"] = "--fp8_backend bf16"
        info["summary"] = f"{precision.lower()} (--fp8_backend bf16)"
        logger(f"FP8: off, training in {precision} (--fp8_backend bf16)")
        return model, info

    info["requested"] = backend
    if backend == "fp8ops":
        return _prepare_fp8ops(model, args, logger, module_filter_fn, info, precision)
    backend_args = args
    if args.fp8_format == "e5m2":
        # torchao and Transformer Engine have no all-E5M2 recipe (no FP8 tensor core multiplies
        # E5M2 by E5M2; fp8ops emulates those GEMMs). Keep the format closest to it (for that
        # backend only: a fallback to fp8ops keeps e5m2).
        logger(f"FP8: --fp8_format e5m2 is not available with --fp8_backend {backend}; "
               "using hybrid: E4M3 forward, E5M2 gradients")
        backend_args = argparse.Namespace(**{**vars(args), "fp8_format": "hybrid"})

    name = {"torchao": "torchao", "te": "Transformer Engine"}[backend]
    if getattr(args, "fp8_policy", "auto") != "auto":
        logger(f"FP8: --fp8_policy {args.fp8_policy} is fp8ops' (per-layer FP8-or-BF16 by timing); {name} "
               "runs every layer it converts in FP8, so it does not apply")
    if backend == "te" and getattr(args, "fsdp_fp8_all_gather", False):
        logger("FP8: --fsdp_fp8_all_gather is not wired for Transformer Engine here; FSDP2 gathers its "
               "weights in their own dtype")
    prepare = _prepare_torchao if backend == "torchao" else _prepare_te
    # (without a GPU that is the reason, not a missing package an install would not help)
    reason = _gpu_reason(model) if not torch.cuda.is_available() else None
    if reason is None:
        reason = prepare(model, backend_args, logger, module_filter_fn, info)
    if reason is None:
        return info.pop("model", model), info

    # The requested backend cannot run here: say why, then carry on without it.
    if not reason.startswith(name):
        reason = f"{name} cannot run here: {reason}"
    if getattr(args, "fp8_fallback", "bf16") == "fp8ops":
        logger(f"FP8: {reason}; falling back to fp8ops (--fp8_fallback fp8ops"
               + (", which keeps --fp8_format e5m2)" if args.fp8_format == "e5m2" else ")"))
        return _prepare_fp8ops(model, args, logger, module_filter_fn, info, precision)
    info["reason"] = reason
    info["summary"] = f"{precision.lower()} ({reason})"
    logger(f"FP8: off, continuing in {precision}: {reason}")
    return model, info


# ------------------------------------------------------------------------------------------------
# fp8ops

def _prepare_fp8ops(model, args, logger, module_filter_fn, info, precision):
    import fp8ops

    convert = getattr(fp8ops, "convert_to_fp8_training", None)
    if convert is None:
        # Only while the package is half-installed; a normal import always has convert.
        reason = "fp8ops.convert_to_fp8_training is not available in this install"
        info.update(reason=reason, summary=f"{precision.lower()} ({reason})")
        logger(f"FP8: off, continuing in {precision}: {reason}")
        return model, info

    config = config_from_args(args)
    info["config"] = config
    before = {fqn for fqn, m in model.named_modules() if type(m) is nn.Linear}
    # convert never raises for environment reasons: on a machine without FP8 it leaves the
    # layers as nn.Linear and records why, which the report below reads back. Its own warning
    # would repeat the line this function prints, so it is held back here.
    with _quiet_convert():
        model = convert(model, config=config, module_filter_fn=module_filter_fn) or model

    rows = _report_rows(model)
    if rows is not None:
        fp8_rows = [r for r in rows if r.get("backend") == "fp8ops"]
        n_fp8 = len(fp8_rows)
        bf16_reasons = {}
        for r in rows:
            if r.get("backend") != "fp8ops":
                why = r.get("reason") or "no reason recorded"
                bf16_reasons[why] = bf16_reasons.get(why, 0) + 1
    else:
        n_fp8 = sum(type(m) is not nn.Linear for fqn, m in model.named_modules() if fqn in before)
        bf16_reasons = {}
    n_bf16 = max(len(before) - n_fp8, sum(bf16_reasons.values()))
    info["fp8_layers"] = n_fp8
    recipe = f"{config.recipe} scaling, {config.fp8_format}"
    if config.gemm_emulated:
        recipe += " (GEMMs emulated in BF16: FP8 numerics, not FP8 speed)"

    if n_fp8 == 0:
        reason = _why_no_fp8(fp8ops, bf16_reasons)
        info.update(backend="bf16", reason=reason, summary=f"{precision.lower()} (fp8ops: {reason})")
        logger(f"FP8: off, continuing in {precision}: {reason}")
        return model, info

    info["backend"] = "fp8ops"
    from .linear import Fp8LinearBase  # noqa: PLC0415
    param = next((m.weight for m in model.modules() if isinstance(m, Fp8LinearBase)), None)
    if param is not None and param.device.type == "cpu" and torch.cuda.is_available():
        # convert checked this machine, not where the model lives: every call would fall back
        logger(f"FP8 note: the converted layers' weights are on the CPU, and fp8ops runs FP8 on CUDA tensors "
               f"only: they compute in {precision} until the model moves to the GPU (model.cuda())")
    # policy "auto" settles per shape at a layer's first CUDA forward, after this call.
    later, runs = "", "run FP8"
    if config.policy == "auto" and not config.gemm_emulated:
        # converted is not yet running FP8: the policy decides per shape on the GPU
        runs = "converted to FP8"
        later = (". Policy auto: a layer FP8 does not speed up on this GPU switches to BF16 at its "
                 "first forward or after a trial of a few steps (fp8ops.report shows which; the "
                 "summary at the end counts what ran)")
    detail = "; ".join(f"{n} x {why}" for why, n in sorted(bf16_reasons.items(), key=lambda kv: -kv[1]))
    if n_bf16:
        info["reason"] = detail or "see fp8ops.report(model)"
        info["summary"] = f"fp8ops ({n_fp8} FP8 layers, {n_bf16} {precision})"
        logger(f"FP8: on (fp8ops, {recipe}): {n_fp8} linear layers {runs}, {n_bf16} run {precision}"
               f" ({info['reason']}){later}")
    else:
        info["summary"] = f"fp8ops ({n_fp8} FP8 layers)"
        logger(f"FP8: on (fp8ops, {recipe}): all {n_fp8} linear layers {runs}{later}")
    unused = _delayed_only_flags_set(args) if config.recipe == "current" else []
    if unused:
        logger(f"FP8 note: --fp8_recipe current scales each tensor from its own amax at each call; "
               f"{', '.join(unused)} apply to delayed scaling only")
    return model, info


def _delayed_only_flags_set(args) -> list[str]:
    """The delayed-scaling flags args sets away from their defaults (current scaling reads none)."""
    defaults = _defaults()
    return [f"--{k}" for k in ("fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo")
            if getattr(args, k, defaults[k]) != defaults[k]]


def run_summary(model, info) -> str:
    """The FP8 line for the end of a run: what the layers ran by then, not what
    prepare_model converted. Under policy "auto" a converted layer whose shape
    FP8 does not speed up runs BF16 from its first forward (or after the trial
    in the loop), so "48 FP8 layers" at the start can mean none ran FP8; this
    line says so. Other backends: info["summary"] unchanged."""
    if info.get("backend") != "fp8ops":
        return info["summary"]
    # the extension may be absent on the other backends' paths: imported here
    from .linear import Fp8LinearBase  # noqa: PLC0415
    from .report import RUNS_BF16_POLICY, RUNS_FP8, RUNS_NOT_YET, RUNS_PLAIN, RUNS_TRIAL, runs_now  # noqa: PLC0415

    runs = [runs_now(m) for m in model.modules() if isinstance(m, Fp8LinearBase)]
    parts = [f"{runs.count(RUNS_FP8)} of {len(runs)} converted layers ran FP8"]
    if runs.count(RUNS_BF16_POLICY):
        parts.append(f"{runs.count(RUNS_BF16_POLICY)} ran BF16: policy auto found FP8 not faster for them "
                     "here (fp8ops.report(model) says why; --fp8_policy always forces FP8)")
    if runs.count(RUNS_TRIAL):
        parts.append(f"{runs.count(RUNS_TRIAL)} still in policy auto's trial")
    if runs.count(RUNS_NOT_YET):
        parts.append(f"{runs.count(RUNS_NOT_YET)} never ran FP8")
    if runs.count(RUNS_PLAIN):
        parts.append(f"{runs.count(RUNS_PLAIN)} run nn.Linear's computation: their weights' dtype "
                     "or device (fp8ops.report(model) says why)")
    kept = sum(type(m) is nn.Linear for m in model.modules())
    if kept:
        parts.append(f"{kept} not converted")
    return f"fp8ops ({'; '.join(parts)})"


@contextlib.contextmanager
def _quiet_convert():
    fp8ops_log = logging.getLogger("fp8ops")
    drop = lambda record: record.levelno > logging.WARNING  # noqa: E731 -- keep errors only
    fp8ops_log.addFilter(drop)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="fp8ops:")
            yield
    finally:
        fp8ops_log.removeFilter(drop)


def _report_rows(model):
    import fp8ops

    report = getattr(fp8ops, "report", None)
    if report is None:
        return None
    try:
        return report(model, print_table=False)
    except Exception:  # a report problem must not stop training; fall back to counting modules
        return None


def _why_no_fp8(fp8ops, bf16_reasons):
    """The one reason to print when fp8ops converted nothing: the environment's, else the layers'."""
    why_unavailable = getattr(fp8ops, "why_unavailable", None)
    if why_unavailable is not None:
        why = why_unavailable()
        if why:
            return why
    supported_here = getattr(fp8ops, "fp8_supported_here", None)
    if supported_here is not None:
        ok, why = supported_here()
        if not ok:
            return why
    if bf16_reasons:
        return max(bf16_reasons, key=bf16_reasons.get)
    return "no eligible nn.Linear layers"


# ------------------------------------------------------------------------------------------------
# torchao and Transformer Engine. Each returns None on success (info filled in), else the reason
# it cannot run here; prepare_model then falls back.

def _gpu_reason(model):
    """None when the model sits on a CUDA GPU that can run FP8 (sm_89+), else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "the model is not on a CUDA device"
    cap = torch.cuda.get_device_capability(param.device)
    if cap < (8, 9):
        name = torch.cuda.get_device_name(param.device)
        return f"{name} is sm_{cap[0]}{cap[1]}; FP8 needs sm_89 or newer (Ada, Hopper, Blackwell)"
    return None


def _dims_ok(module):
    return (module.in_features % _FP8_DIM_MULTIPLE == 0
            and module.out_features % _FP8_DIM_MULTIPLE == 0)


def _eligible(module_filter_fn):
    """The combined filter: an nn.Linear with FP8-able dims that the user's filter accepts."""
    def fn(module, fqn):
        if not isinstance(module, nn.Linear) or not _dims_ok(module):
            return False
        return module_filter_fn is None or bool(module_filter_fn(module, fqn))
    return fn


def _prepare_torchao(model, args, logger, module_filter_fn, info):
    try:
        from torchao.float8 import (CastConfig, Float8LinearConfig,
                                    convert_to_float8_training)
    except ImportError:
        return "torchao not installed: pip install torchao, or use --fp8_backend fp8ops"
    except Exception as e:  # e.g. torch/torchao version skew (ao#2919)
        return f"torchao failed to import ({type(e).__name__}: {e})"
    reason = _gpu_reason(model)
    if reason is not None:
        return reason

    fmt = args.fp8_format
    kwargs = {}
    if fmt == "e4m3":
        if "target_dtype" not in getattr(CastConfig, "__dataclass_fields__", {}):
            logger("FP8: this torchao cannot set gradient dtypes; using hybrid")
            fmt = "hybrid"
        else:
            kwargs["cast_config_grad_output"] = CastConfig(target_dtype=torch.float8_e4m3fn)
    if args.fp8_recipe == "delayed":
        logger("FP8: torchao scales from each tensor's current amax (it removed delayed scaling);"
               " --fp8_recipe delayed, --fp8_margin, --fp8_interval and --fp8_amax_* do not apply")
    if getattr(args, "fsdp_fp8_all_gather", False):
        # (a training script's flag, e.g. the example's: torchao's own FP8 all-gather for FSDP2)
        if "enable_fsdp_float8_all_gather" in getattr(Float8LinearConfig, "__dataclass_fields__", {}):
            kwargs["enable_fsdp_float8_all_gather"] = True
        else:
            logger("FP8: this torchao has no FSDP2 FP8 all-gather; --fsdp_fp8_all_gather does not apply")

    n_before = sum(type(m) is nn.Linear for m in model.modules())
    model_filter = _eligible(module_filter_fn)
    # (it swaps in place and returns the model: a new object where the model is one nn.Linear)
    converted = convert_to_float8_training(model, config=Float8LinearConfig(**kwargs),
                                           module_filter_fn=model_filter)
    if converted is not None and converted is not model:
        info["model"] = model = converted
    n_fp8 = n_before - sum(type(m) is nn.Linear for m in model.modules())
    if n_fp8 == 0:
        return ("no linear layer is eligible (in/out features multiples of 16, accepted by "
                "module_filter_fn)")
    info.update(backend="torchao", fp8_layers=n_fp8,
                summary=f"torchao ({n_fp8} FP8 layers, current scaling, {fmt})")
    logger(f"FP8: on (torchao, current tensorwise scaling, {fmt}): {n_fp8} of {n_before} linear"
           f" layers run FP8; torchao is fast only under torch.compile (--compile)")
    return None


def _prepare_te(model, args, logger, module_filter_fn, info):
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common import recipe as te_recipe
    except ImportError:
        return ("Transformer Engine not installed: pip install --no-build-isolation "
                "transformer_engine[pytorch], or use --fp8_backend fp8ops")
    except Exception as e:  # TE's import also fails on cuDNN / ABI problems (TE#1853, TE#611)
        return f"Transformer Engine failed to import ({type(e).__name__}: {e})"
    reason = _gpu_reason(model)
    if reason is not None:
        return reason
    check = getattr(te, "is_fp8_available", None)
    if check is not None:
        ok, why = check(return_reason=True)
        if not ok:
            return f"Transformer Engine says FP8 is unavailable: {why}"

    fmt = args.fp8_format
    te_format = te_recipe.Format.HYBRID if fmt == "hybrid" else te_recipe.Format.E4M3
    if args.fp8_recipe == "current" and hasattr(te_recipe, "Float8CurrentScaling"):
        recipe = te_recipe.Float8CurrentScaling(fp8_format=te_format)
        desc = f"current scaling, {fmt}"
    else:
        if args.fp8_recipe == "current":
            logger("FP8: this Transformer Engine has no current scaling; using delayed scaling")
        kwargs = dict(margin=args.fp8_margin, fp8_format=te_format,
                      amax_history_len=args.fp8_amax_history_len,
                      amax_compute_algo=args.fp8_amax_compute_algo)
        # TE removed `interval` in 2025 (TE PR #1607); pass it only where it still exists.
        if "interval" in getattr(te_recipe.DelayedScaling, "__dataclass_fields__", {}):
            kwargs["interval"] = args.fp8_interval
        elif args.fp8_interval != 1:
            logger("FP8: this Transformer Engine updates scales every step; --fp8_interval ignored")
        recipe = te_recipe.DelayedScaling(**kwargs)
        desc = f"delayed scaling, {fmt}, history {args.fp8_amax_history_len}"

    eligible = _eligible(module_filter_fn)
    swaps = [(fqn, m) for fqn, m in model.named_modules()
             if type(m) is nn.Linear and eligible(m, fqn)]
    # te.Linear makes its own parameters: a weight tied to another (a GPT's lm_head and its token
    # embedding) would come apart and the two train separately. Such a layer stays as it is.
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)

    def tied_to(fqn, m):
        own = {f"{fqn}.{n}" if fqn else n for n in ("weight", "bias")}
        return [n for p in (m.weight, m.bias) if p is not None for n in owners[id(p)] if n not in own]
    tied = {fqn: others for fqn, m in swaps if (others := tied_to(fqn, m))}
    for fqn, others in tied.items():
        logger(f"FP8: {fqn} stays an nn.Linear (not FP8): its parameters are tied to {', '.join(others)}, "
               "and te.Linear, which makes its own, would untie them")
    swaps = [(fqn, m) for fqn, m in swaps if fqn not in tied]
    if not swaps:
        return ("no linear layer is eligible (in/out features multiples of 16, accepted by "
                "module_filter_fn" + (", parameters not tied to others: " + ", ".join(tied) if tied else "") + ")")
    for fqn, old in swaps:
        new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                        params_dtype=old.weight.dtype, device=old.weight.device)
        with torch.no_grad():
            new.weight.copy_(old.weight)
            if old.bias is not None:
                new.bias.copy_(old.bias)
        if not fqn:  # the model itself is a single nn.Linear: prepare_model returns the new one
            info["model"] = new
            continue
        parent_name, _, child = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child, new)

    # te.autocast replaced te.fp8_autocast (deprecated) in TE 2.x.
    if hasattr(te, "autocast"):
        def autocast():
            return te.autocast(enabled=True, recipe=recipe)
    else:
        def autocast():
            return te.fp8_autocast(enabled=True, fp8_recipe=recipe)

    n_fp8 = len(swaps)
    info.update(backend="te", fp8_layers=n_fp8, autocast=autocast,
                summary=f"te ({n_fp8} FP8 layers, {desc})")
    logger(f"FP8: on (Transformer Engine, {desc}): {n_fp8} of {info['linear_layers']} linear"
           " layers swapped for te.Linear; build the optimizer after this call")
    return None
