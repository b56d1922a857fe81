"""Fp8Config: the FP8 training recipe (Transformer Engine's meanings)."""
from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

RECIPES = ("delayed", "current")
FORMATS = ("hybrid", "e4m3", "e5m2")
AMAX_ALGOS = ("max", "most_recent")
POLICIES = ("auto", "always")
MAX_HISTORY = 1 << 20  # amax_history_len's bound: a million steps, longer than any run's window


@dataclass(frozen=True)
class Fp8Config:
    """How fp8ops scales and casts.

    Args:
        recipe: "delayed" (cast with a scale from past amaxes; one read and one
            write per cast) or "current" (per-tensor dynamic scaling from this
            tensor's amax; one extra read). Default "delayed".
        fp8_format: "hybrid" (E4M3 activations and weights, E5M2 output
            gradients; default), "e4m3" (all E4M3) or "e5m2" (all E5M2: for
            studying its numerics, not for speed -- no tensor core multiplies
            E5M2 by E5M2, so its GEMMs run on the FP8 values widened to BF16,
            exactly, and policy "auto" keeps it FP8; see emulated.py).
        margin: scale = fp8_max / amax / 2**margin, above -64 and below 16.8
            (30.8 for "e5m2": past that nearly every value casts to 0). Default 0.
        interval: update scales every `interval` optimizer steps. Default 1.
        amax_history_len: steps of amax history (delayed). Default 1024.
        amax_compute_algo: "max" over the history or "most_recent". Default "max".
        policy: "auto" (a layer runs FP8 only where FP8 is faster than BF16 on
            this GPU: fwd + bwd + the per-step scale update of its shape, timed
            once alone and once GPU-bound, cached; FP8 where both say at least
            1.3x, BF16 where both say under 1.03x, and otherwise a trial of
            25 steps of your own loop, in blocks of BF16 and FP8, decides, see
            loop_trial.py) or "always".
            Default "auto".
        fast_accum: Hopper fast accumulation in the forward GEMM (the gradient
            GEMMs always keep full-precision accumulation). Default True.
        fuse_gelu: move each tanh-GELU module whose output only feeds one
            converted linear (GPT-2's MLP: c_proj(gelu(c_fc(x)))) into the
            linears around it: c_proj applies it in its input cast, c_fc its
            gradient in its gradient cast, and the GELU's own forward and
            backward passes no longer run. The module becomes nn.Identity;
            state_dict keys do not change (see gelu_fusion.py). Default True.
        fuse_layernorm: move each nn.LayerNorm or nn.RMSNorm whose output
            only feeds one converted linear (GPT-2's ln_1 -> c_attn, ln_2 ->
            c_fc) into that linear, which normalizes inside its input cast:
            the norm's output is never written. The norm module keeps its
            parameters (see layernorm_fusion.py). Default True.
        fuse_swiglu: move each SwiGLU activation module (fp8ops.SwiGLU, or a
            module whose forward is exactly chunk -> silu -> mul) whose output
            only feeds one converted linear (Llama's MLP with gate and up in
            one projection: c_proj(swiglu(c_fc(x)))) into that linear, which
            computes silu(gate) * up inside its input cast and the SwiGLU's
            gradient in one pass. The module becomes nn.Identity; state_dict
            keys do not change (see swiglu_fusion.py). Default True.
    """

    recipe: str = "delayed"
    fp8_format: str = "hybrid"
    margin: int = 0
    interval: int = 1
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    policy: str = "auto"
    fast_accum: bool = True
    fuse_gelu: bool = True
    fuse_layernorm: bool = True
    fuse_swiglu: bool = True

    def __post_init__(self):
        def need(cond, what):
            if not cond:
                raise ValueError(f"Fp8Config: {what}")

        need(self.recipe in RECIPES, f"recipe must be one of {RECIPES}, found {self.recipe!r}")
        need(self.fp8_format in FORMATS, f"fp8_format must be one of {FORMATS}, found {self.fp8_format!r}")
        need(self.amax_compute_algo in AMAX_ALGOS,
             f"amax_compute_algo must be one of {AMAX_ALGOS}, found {self.amax_compute_algo!r}")
        need(self.policy in POLICIES, f"policy must be one of {POLICIES}, found {self.policy!r}")
        def is_int(v):  # (numpy's integers too: numbers.Integral)
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        need(is_int(self.interval) and self.interval >= 1, f"interval must be an int >= 1, found {self.interval!r}")
        need(is_int(self.amax_history_len) and 1 <= self.amax_history_len <= MAX_HISTORY,
             f"amax_history_len must be an int in [1, {MAX_HISTORY}] (steps of history; each layer keeps 12 "
             f"bytes per step), found {self.amax_history_len!r}")
        need(isinstance(self.margin, numbers.Real) and not isinstance(self.margin, bool)
             and abs(self.margin) < 64, f"margin must be a number in (-64, 64), found {self.margin!r}")
        # the cast maps the amax to fp8_max / 2**margin, and values below amax * 2**(margin - span)
        # to 0: past span, every value, the amax too (E4M3: 448 down to its smallest subnormal
        # 2**-9 is 2**17.8; E5M2: 57344 down to 2**-16, 2**31.8)
        span = 31.8 if self.fp8_format == "e5m2" else 17.8
        need(self.margin < span - 1,
             f"margin must be below {span - 1:g} for fp8_format {self.fp8_format!r} (at margin m the amax is cast "
             f"to fp8_max / 2**m and every value below amax * 2**(m - {span:g}) to 0: at {self.margin!r} nearly every "
             f"value, or every one, becomes 0), found {self.margin!r}; margins are usually 0 to 2")
        # plain Python numbers from here on (a numpy scalar would print as np.int64(2) in short_str)
        for name in ("interval", "amax_history_len"):
            object.__setattr__(self, name, int(getattr(self, name)))
        if not isinstance(self.margin, (int, float)):
            object.__setattr__(self, "margin", int(self.margin) if is_int(self.margin) else float(self.margin))
        for flag in ("fast_accum", "fuse_gelu", "fuse_layernorm", "fuse_swiglu"):
            v = getattr(self, flag)
            need(isinstance(v, bool), f"{flag} must be True or False, found {v!r}")

    def dtypes(self) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
        """(input, weight, grad_output) FP8 dtypes."""
        e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
        return {"hybrid": (e4, e4, e5), "e4m3": (e4, e4, e4), "e5m2": (e5, e5, e5)}[self.fp8_format]

    @property
    def gemm_emulated(self) -> bool:
        """True when no FP8 tensor core runs this format's GEMMs (all E5M2)."""
        return self.fp8_format == "e5m2"

    def fuses(self, what: str) -> bool:
        """Does a layer with this config take the fusion `what` ("gelu", "swiglu", "layernorm")?
        Its flag on, and delayed scaling with FP8 GEMMs: the fused casts run only on delayed
        scaling's steady path (current scaling's amax pass comes first; emulated GEMMs take BF16)."""
        return self.recipe == "delayed" and not self.gemm_emulated and getattr(self, "fuse_" + what)

    def short_str(self) -> str:
        s = f"{self.recipe}/{self.fp8_format}"
        if self.recipe == "delayed":
            s += f"/h{self.amax_history_len}/{self.amax_compute_algo}"
        if self.margin:
            s += f"/m{self.margin}"
        if self.interval != 1:
            s += f"/i{self.interval}"
        return s
