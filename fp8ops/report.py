"""fp8ops.report(model): what runs in FP8, what fell back to BF16, why, and the
current scales and amaxes of every FP8 layer."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from . import linear as _linear
from . import loop_trial, ops
from .conversion import decisions_of
from .conv1d import is_hf_conv1d
from .fsdp import fp8_all_gather_enabled
from .linear import G, W, X, Fp8LinearBase
from .policy import rows_label
from .scaling import fold_grad_amax


# what a layer runs now (report's "runs" column). "BF16" means "not FP8": nn.Linear's own
# computation, in whatever precision the model runs (BF16 under bf16 autocast, else FP32/FP16)
RUNS_FP8, RUNS_BF16_POLICY, RUNS_TRIAL, RUNS_NOT_YET, RUNS_BF16 = "FP8", "BF16 (policy)", "trial", "not yet", "BF16"
RUNS_PLAIN = "nn.Linear"  # converted, but with its weight's dtype now every call falls back


def cannot_run_fp8(m: Fp8LinearBase) -> str | None:
    """Why every call of m runs nn.Linear's computation now, whatever it ran before (its
    weight's dtype: model.double(); a GPU-trained model moved to the CPU and called there), or
    None. (Inputs off the GPU fall back, counted per call in fallback_calls: a layer whose
    weight is off the GPU and that has been called with an input off the GPU reads as moved.
    Not a sharded DTensor weight, nor one an offload moves to the GPU for each call: their
    inputs are on the GPU. Tests run the GPU's paths on the CPU: fp8_on_cpu.)"""
    w = m.weight
    if w.dtype not in ops.HP_DTYPES:
        return f"its weight is {str(w.dtype).replace('torch.', '')}, not float32, bfloat16 or float16"
    d = m.__dict__
    if (w.device.type not in ("cuda", "meta") and not d.get("fp8_on_cpu") and not hasattr(w, "_local_tensor")
            and d.get("_fp8_input_off_gpu")):
        return (f"its weight is on the {w.device.type.upper()}, where its calls fell back, and FP8 runs on a CUDA "
                "GPU (model.cuda() moves it back)")
    return None


def runs_now(m: Fp8LinearBase) -> str:
    """What a converted layer runs at its next call: FP8; BF16 because policy
    "auto" found FP8 not faster for every input shape it has seen; "trial"
    while policy auto's trial in the loop is deciding; "not yet" before any
    FP8 cast (never called, or every call fell back). A converted layer is not
    the same as a layer running FP8: under policy auto it can be BF16 from its
    first forward on. "nn.Linear" where its weight's dtype now sends every
    call down nn.Linear's computation (cannot_run_fp8)."""
    if cannot_run_fp8(m) is not None:
        return RUNS_PLAIN
    verdicts = [v[0] for v in m.fp8_policy.values()]
    if any(verdicts):
        return RUNS_FP8            # FP8 for at least one of its input shapes
    if verdicts:
        return RUNS_BF16_POLICY
    if m._fp8_pending:
        return RUNS_TRIAL
    if m._fp8_delayed_ready or m._fp8_cast_since_update:
        return RUNS_FP8            # policy "always", or cast without a verdict (compiled, CPU kernels)
    h = m._buffers["fp8_amax_history"]
    if _linear._TRACES[0] and not h.is_meta and bool(h.any()):
        # compiled casts flag nothing for the current recipe (update_scales looks up delayed
        # scaling's only): the amaxes they folded into the history say it (one read)
        return RUNS_FP8
    return RUNS_NOT_YET


def report(model: nn.Module, print_table: bool = True) -> list[dict]:
    """One row per linear layer: name, backend ("fp8ops" | "bf16": converted
    or not), runs (what it runs now: "FP8", "BF16 (policy)", "trial", "not yet",
    "nn.Linear" or, unconverted, "BF16"; see runs_now), reason,
    recipe, scale_x/w/g, amax_x/w/g (the latest completed step's amaxes; None
    under delayed scaling with amax_history_len=1 once a step has completed,
    since a one-row history keeps none),
    range_x/w/g (the share of the FP8 format's range the latest amax fills at the
    scale now set, amax * scale / fp8_max * 2**margin: 1 as full as the margin
    allows, below 1 unused range at the top, e.g. 0.001 ~10 binades; under
    delayed scaling with amax_compute_algo "max" it falls where the tensor shrank
    below the history's maximum, and a tensor far below it loses its smallest
    values, from ~2^-20 for an E5M2 gradient, ~2^-8 for an E4M3 input or weight
    (RANGE_LOW; above it a stale scale costs a cast little): the printed table then
    ends with range_notes' lines there. "Latest" is the last update's window: one optimizer
    step, or `interval` of them. None before delayed scaling's first update (each
    cast used its own current scale then), where amax_* is None, and for a tensor
    whose latest amax was 0 or not finite; scale_from_history_max says which rows
    the notes read, formats the FP8 formats of x/w/g, e.g. "e4m3/e4m3/e5m2"),
    overflows (amaxes that were NaN/inf, the scale kept each time: per
    optimizer step and tensor under delayed scaling, per cast under current)
    and overflow_x/w/g (the same by tensor), fallback_calls (eager calls that ran
    BF16; compiled code does not count). Prints a table
    unless print_table=False.
    Reading the scales synchronises with the GPU once."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"report: model must be an nn.Module, found {type(model).__name__}")
    fold_grad_amax([m for m in model.modules() if isinstance(m, Fp8LinearBase)])  # (compiled backwards' dy amaxes)
    decisions = decisions_of(model)
    rows = []
    for name, m in model.named_modules():
        if isinstance(m, Fp8LinearBase) and m.fp8_amax_history.is_meta:
            # a model built on the meta device: no scaling state until to_empty()
            rows.append(_row_without_state(name, "fp8ops", RUNS_NOT_YET,
                                           decisions.get(name, ("fp8ops", "converted"))[1] + "; on the meta device",
                                           m.fp8_config.short_str(), f"{m.in_features}->{m.out_features}",
                                           m.fp8_fallback_calls))
        elif isinstance(m, Fp8LinearBase):
            h = m.fp8_amax_history.detach().float().cpu()
            # the newest completed step sits in the last row after a roll; before
            # any update the running maxima are in row 0
            # has an update rolled the history? (delayed scaling: one that found a cast, so not
            # before the interval's first update, nor since a weight load or a rest reset it)
            rolled = not m._fp8_pristine if m.fp8_config.recipe == "delayed" else m.fp8_step > 0
            last = h[-1] if rolled and h.shape[0] > 1 else h[0]
            kept = h.shape[0] > 1 or not rolled or m.fp8_config.recipe != "delayed"
            s = m.fp8_scale.detach().float().cpu()
            fp8_max = m.fp8_max.detach().float().cpu()
            cfg = m.fp8_config
            delayed = cfg.recipe == "delayed"
            # the range is that of the scale now set against the amaxes shown: under delayed
            # scaling only after its first update (before it, each cast used its own current
            # scale while row 0 took the running maximum); 1 = as full as the margin allows
            shown = kept and (m._fp8_delayed_ready or not delayed)
            used = [float(last[c] * s[c] / fp8_max[c] * 2.0 ** cfg.margin) if shown and last[c] > 0 else None
                    for c in (X, W, G)]
            ovf = m.fp8_overflow_count.detach().cpu().reshape(-1)
            rows.append({
                "name": name or "<root>", "backend": "fp8ops", "runs": runs_now(m),
                "reason": decisions.get(name, ("fp8ops", "converted"))[1],
                "recipe": m.fp8_config.short_str(),
                "shape": f"{m.in_features}->{m.out_features}",
                "scale_x": float(s[X]), "scale_w": float(s[W]), "scale_g": float(s[G]),
                "amax_x": float(last[X]) if kept else None, "amax_w": float(last[W]) if kept else None,
                "amax_g": float(last[G]) if kept else None,
                "range_x": used[0], "range_w": used[1], "range_g": used[2],
                "scale_from_history_max": delayed and cfg.amax_compute_algo == "max",
                "formats": "/".join("e4m3" if d == torch.float8_e4m3fn else "e5m2" for d in cfg.dtypes()),
                "overflows": int(ovf.sum()), "overflow_x": int(ovf[X]), "overflow_w": int(ovf[W]),
                "overflow_g": int(ovf[G]), "fallback_calls": m.fp8_fallback_calls,
            })
            if fp8_all_gather_enabled(m):
                rows[-1]["reason"] += "; FSDP2 all-gathers its weight in FP8"
            if m.fp8_config.gemm_emulated:
                rows[-1]["reason"] += "; all-E5M2: GEMMs emulated in BF16 (FP8 numerics, not FP8 speed)"
            slow = [f"{rows_label(k[0])}: BF16 (FP8 {v[1]:.2f}x)" for k, v in m.fp8_policy.items()
                    if not v[0] and k not in m.fp8_policy_why]
            if slow:
                rows[-1]["reason"] += "; policy auto measured FP8 slower for " + ", ".join(slow)
            for k, why in m.fp8_policy_why.items():  # decided beyond the two timings: the loop trial, tune_policy
                rows[-1]["reason"] += f"; {rows_label(k[0])}: {'FP8' if m.fp8_policy[k][0] else 'BF16'} ({why})"
            for k in m._fp8_pending:  # not decided yet: its first steps run BF16 and FP8 in turns
                rows[-1]["reason"] += f"; {rows_label(k[0])}: {loop_trial.progress(m, k)}"
            plain = cannot_run_fp8(m)
            if plain is not None:
                rows[-1]["reason"] += f"; every call runs nn.Linear's computation now: {plain}"
            elif m.fp8_fallback_calls and not m.fp8_policy and not m._fp8_pending:
                # (policy auto's BF16 calls are counted too: its verdicts say why above)
                rows[-1]["reason"] += (f"; {m.fp8_fallback_calls} calls ran nn.Linear's computation (an input "
                                       "not on a CUDA GPU, a row count not a multiple of 16, an empty input, "
                                       "or under torch.func)")
        elif isinstance(m, nn.Linear) or is_hf_conv1d(m):
            backend, reason = decisions.get(name, ("bf16", "not converted (convert() was not called on it)"))
            if backend == "fp8ops":
                # converted, then replaced by a plain layer under the same name (e.g. HF's
                # resize_token_embeddings builds a new lm_head): the decision is the old layer's
                reason = "replaced after conversion by a plain layer; call fp8ops.convert(model) again"
                fused = [part.split(" fused into ")[0] for part in decisions[name][1].split("; ")[1:]
                         if " fused into " in part and "'s gradient" not in part]
                if fused:
                    # (the fusion moved it into the old layer: it runs nowhere now, and convert again
                    # does not bring it back)
                    reason = (f"replaced after conversion by a plain layer, which does not apply {', '.join(fused)} "
                              "that convert fused into the old one: the model no longer computes it. Rebuild the "
                              "model and convert it with Fp8Config(fuse_layernorm=False, fuse_gelu=False, "
                              "fuse_swiglu=False) before replacing layers")
            shape = f"{m.nx}->{m.nf}" if is_hf_conv1d(m) else f"{m.in_features}->{m.out_features}"
            rows.append(_row_without_state(name, "bf16", RUNS_BF16, reason, None, shape, 0))
    if print_table:
        print(format_table(rows))
    return rows


def _row_without_state(name: str, backend: str, runs: str, reason: str, recipe, shape: str,
                       fallback_calls: int) -> dict:
    """A report row with no scales or amaxes to show (a layer not converted, or on the meta device)."""
    return {"name": name or "<root>", "backend": backend, "runs": runs, "reason": reason, "recipe": recipe,
            "shape": shape, "scale_x": None, "scale_w": None, "scale_g": None, "amax_x": None, "amax_w": None,
            "amax_g": None, "range_x": None, "range_w": None, "range_g": None, "scale_from_history_max": None,
            "formats": None,
            "overflows": 0, "overflow_x": 0, "overflow_w": 0, "overflow_g": 0,
            "fallback_calls": fallback_calls}


# a tensor whose last amax filled less than this share of its format's range at the delayed
# scale its history's maximum set starts to lose its smallest values (benchmarks/dev/
# stale_scale_sqnr.py, heavy-tailed data): E5M2 keeps ~12 binades below the amax there (a cast's
# SQNR unchanged down to ~2^-18, up to 0.4 dB lower at 2^-20, 1.5 dB at 2^-22, 5 dB at 2^-24);
# E4M3, with 14 binades fewer, loses 2-7 dB at 2^-8 (Gaussian data nothing until 2^-10)
GRAD_RANGE_LOW = 2.0 ** -20
RANGE_LOW = {"e5m2": GRAD_RANGE_LOW, "e4m3": 2.0 ** -8}
_WHAT = {"x": "inputs (x)", "w": "weights (w)", "g": "output gradients (dy)"}


def range_notes(rows: list[dict]) -> list[str]:
    """A line per tensor kind (x, w, dy) for the layers whose tensor filled less than its
    format's RANGE_LOW in the latest step: their delayed scale still holds a far larger amax of
    up to amax_history_len steps ago (a falling gradient; one outlier batch of inputs), and the
    smallest values start to flush to zero."""
    lines = []
    for i, t in enumerate("xwg"):
        low = []
        for r in rows:
            fmt = (r.get("formats") or "").split("/")[i:i + 1]
            v = r.get(f"range_{t}")
            if r.get("scale_from_history_max") and v is not None and fmt and v < RANGE_LOW[fmt[0]]:
                low.append((r, RANGE_LOW[fmt[0]]))
        if not low:
            continue
        worst, limit = min(low, key=lambda rl: rl[0][f"range_{t}"])
        if t == "g":
            cause = ("the gradients shrank far below the amax history's maximum, which sets the delayed scale, "
                     "and their smallest values start to flush to zero")
        else:
            cause = ("a far larger amax of up to amax_history_len steps ago (an outlier batch, or a tensor that "
                     "shrank) is the history's maximum, which sets the delayed scale, and their smaller values "
                     "lose precision or flush to zero")
        lines.append(
            f"note: the {_WHAT[t]} of {len(low)} layer(s) filled under 2^{round(math.log2(limit))} of their FP8 "
            f"range in the last step (lowest {worst[f'range_{t}']:.2g}, {worst['name']}): {cause} until the "
            "larger amaxes leave the history. Fp8Config(recipe=\"current\") or a shorter amax_history_len "
            "follows " + ("a falling gradient" if t == "g" else "them"))
    return lines


def _f(v):
    return "-" if v is None else f"{v:.3g}"


def headline(rows: list[dict]) -> str:
    """"n of N converted, k running FP8" and, where some converted layers do
    not run FP8, how many run BF16 by the policy, wait on its trial, have not
    cast yet or run nn.Linear's computation where their weights now are."""
    conv = [r for r in rows if r["backend"] == "fp8ops"]
    line = (f"{len(conv)}/{len(rows)} linear layers converted, "
            f"{sum(r['runs'] == RUNS_FP8 for r in conv)} running FP8")
    for runs, what in ((RUNS_BF16_POLICY, "BF16 by policy auto (FP8 not faster here)"),
                       (RUNS_TRIAL, "in policy auto's trial"), (RUNS_NOT_YET, "not cast yet"),
                       (RUNS_PLAIN, "running nn.Linear's computation (weight dtype or device)")):
        n = sum(r["runs"] == runs for r in conv)
        if n:
            line += f"; {n} {what}"
    return line


def format_table(rows: list[dict]) -> str:
    lines = [f"fp8ops report: {headline(rows)}"]
    hdr = (f"{'layer':<32} {'shape':>11} {'backend':>7} {'runs':>13} {'scale x/w/g':>26} {'amax x/w/g':>26} "
           f"{'range x/w/g':>23} {'ovf':>4}  reason")
    lines += [hdr, "-" * len(hdr)]
    for r in rows:
        fp8 = r["backend"] == "fp8ops"
        scales = "/".join(_f(r[k]) for k in ("scale_x", "scale_w", "scale_g")) if fp8 else "-"
        amaxes = "/".join(_f(r[k]) for k in ("amax_x", "amax_w", "amax_g")) if fp8 else "-"
        used = "/".join(_f2(r.get(k)) for k in ("range_x", "range_w", "range_g")) if fp8 else "-"
        lines.append(f"{r['name'][:32]:<32} {r['shape']:>11} {r['backend']:>7} {r['runs']:>13} {scales:>26} "
                     f"{amaxes:>26} {used:>23} {r['overflows']:>4}  {r['reason']}")
    lines += range_notes(rows)
    return "\n".join(lines)


def _f2(v):
    return "-" if v is None else f"{v:.2g}"
