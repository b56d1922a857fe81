"""Benchmark a full GPT training step: tokens/s and peak memory, BF16 vs fp8ops vs torchao.

Model: examples/gpt2.py (nanoGPT-style GPT, tied lm_head kept out of FP8 but in the *_lmhead
variants), vocab 50304.
  small  GPT-2 124M: d768, L12, H12, T1024, batch 8   (8192 tokens/step)
  1b     ~1B GPT:    d2048, L16, H16, T2048, batch 4  (8192 tokens/step)
Every variant: fp32 master weights, torch.autocast(bf16), fused AdamW, the same init and data;
a step is forward + loss + backward + optimizer.step() + zero_grad(set_to_none=True). fp8ops scales
update through its optimizer post-step hook (one amax_update per layer per step), as in training.
Variants:
  bf16              eager                          fp8ops           fp8ops.convert (delayed, hybrid)
  bf16_compiled     torch.compile                  fp8ops_compiled  fp8ops.convert + torch.compile
  torchao_compiled  torchao.float8 tensorwise + torch.compile     (torchao: the same, eager)
torch.compile is applied per transformer block by default (--compile-scope blocks, as torchtitan
does: one graph reused by every block, so compile time does not grow with depth), and to the loss
(the logits' FP32 cross-entropy) as a function of its own, as torchtitan does too (its compile
components: model and loss). --eager-loss leaves the loss eager, as every run before the
thirty-seventh session did (in GPT-2 small that eager loss took ~22 ms of each step, fp8ops' ~72 ms
and BF16's ~87 ms alike). --compile-scope model compiles the whole model, the loss inside its graph.
fp8ops_lmhead(_compiled): fp8ops with the tied lm_head converted too (in place, so it stays tied);
in GPT-2 small its GEMMs are about a third of the linears' FLOPs.
The targets compare fp8ops and fp8ops_compiled (lm_head in BF16, as torchtitan keeps its output
layer); the *_lmhead rows are for reading beside them.

Targets: fp8ops >= 1.30x BF16 tokens/s on 1b and >= 1.15x on small (eager vs eager and compiled
vs compiled), with peak memory below BF16's.

    python benchmarks/bench_train.py                                   # both models, all variants
    python benchmarks/bench_train.py --models small --variants bf16,fp8ops --steps 30

Napkin math: FLOPs per token = 6 * params (non-embedding + lm_head) + 12 * L * d * T (attention,
nanoGPT's count; causal masking is not discounted). small: 6*124M + 12*12*768*1024 = 0.86 GFLOP
-> 7.0 TFLOP per 8192-token step; 1b: 6*0.91B + 12*16*2048*2048 = 6.3 GFLOP -> 52 TFLOP/step.
In the 1b model the linear layers are ~80 % of the FLOPs, so with ~1.6x faster linears the step
can gain ~1.3x (Amdahl); in GPT-2 small attention, layernorm, the 50304-wide lm_head + loss (kept
BF16) and the optimizer are a larger share, and the 768-wide GEMMs gain little, hence ~1.1-1.15x.
Memory: fp8ops saves x8^T (FP8) instead of x (BF16) for wgrad, so activations shrink.

Timing: warm-up steps (compile happens there), then N timed steps back to back between two CUDA
events (tokens/s = tokens / elapsed) plus per-step events (median step ms). Peak memory =
torch.cuda.max_memory_allocated over the timed steps (stats reset after warm-up).
--repeats R runs every variant R times, each from a fresh build, in alternating order
(A B C, C B A, A B C, ...; torchao always last, see below), so a drift of the GPU's speed over
the run (clocks, power) does not favour the variants that run first. Each ratio is taken
within one repeat (both sides from the same pass); the targets use the median ratio.
Validation (once, in the warm-up): every variant's first loss (same init, same batch) within 1 %
of BF16 eager's and its last warm-up loss within 3 %; all losses finite.
"""
import argparse
import contextlib
import gc
import math
import statistics
import sys
from pathlib import Path

import torch

from bench_common import (cat_grads_fused, gelu_grads_fused, graph_breaks, graphs_compiled, inductor_cache_hits,  # noqa: E402
                          residual_adds_fused, start, table, write_json)

MODELS = {
    "small": dict(cfg=dict(n_layer=12, n_head=12, n_embd=768, block_size=1024), batch=8),
    "1b": dict(cfg=dict(n_layer=16, n_head=16, n_embd=2048, block_size=2048), batch=4),
    # the 1b shape with Llama-style blocks (examples/gpt2.py: RMSNorm, SwiGLU, no biases); no target
    "llama1b": dict(cfg=dict(n_layer=16, n_head=16, n_embd=2048, block_size=2048, arch="llama"), batch=4),
    # four blocks of a 7B Llama's width (d4096, SwiGLU hidden 11008): the 4096-wide norms; no target
    "llama4096": dict(cfg=dict(n_layer=4, n_head=32, n_embd=4096, block_size=2048, arch="llama"), batch=4),
}
VOCAB = 50304
# fp8ops_unfused(_compiled): fp8ops with Fp8Config(fuse_gelu=False, fuse_layernorm=False, fuse_swiglu=False), the
# GELUs, norms and SwiGLUs left to torch (what the fusions save); fp8ops_lnunfused_compiled: the norms alone left to
# torch, where inductor can fuse them with the residual adds around them; fp8ops_noresadd_compiled: fp8ops compiled
# with residual_pass off (the residual adds left apart from the norms' ops, as before the thirty-eighth session)
VARIANTS = ("bf16", "bf16_compiled", "fp8ops", "fp8ops_compiled", "fp8ops_unfused", "fp8ops_unfused_compiled",
            "fp8ops_lnunfused_compiled", "fp8ops_noresadd_compiled", "fp8ops_lmhead",
            "fp8ops_lmhead_compiled", "torchao_compiled", "torchao")
DEFAULT_VARIANTS = "bf16,bf16_compiled,fp8ops,fp8ops_compiled,torchao_compiled"
TARGETS = {"small": 1.15, "1b": 1.30}
DEVICE = "cuda"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


# ------------------------------------------------------------------------------------------------
# helpers


# ------------------------------------------------------------------------------------------------

def import_gpt():
    """examples/gpt2.py's GPT, GPTConfig, the lm_head filter and the loss (the model the example
    trains)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    import gpt2
    filt = getattr(gpt2, "LM_HEAD_FILTER", None) or (lambda mod, fqn: fqn.split(".")[-1] != "lm_head")
    return gpt2.GPT, gpt2.GPTConfig, filt, gpt2.cross_entropy_loss


def flops_per_token(model, cfg) -> float:
    """nanoGPT's estimate: 6 * non-embedding params (wte counts: it is the tied lm_head) + attention."""
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    return 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def build(variant: str, GPT, GPTConfig, lm_filter, loss_fn, mcfg: dict, args, fp8ops, example):
    """(model, its call: (idx, targets) -> (logits, loss), optimizer, config, note). example: a
    (idx, targets) batch of the training shape."""
    torch.manual_seed(0)
    cfg = GPTConfig(**mcfg, vocab_size=VOCAB, dropout=0.0)
    model = GPT(cfg).to(DEVICE)  # fp32 master weights
    note = ""
    from fp8ops import residual_pass  # noqa: PLC0415
    residual_pass.ENABLED = variant != "fp8ops_noresadd_compiled"  # (this variant's graphs only)
    if variant.startswith("fp8ops"):
        fuse = not variant.startswith("fp8ops_unfused")
        fuse_ln = fuse and not variant.startswith("fp8ops_lnunfused")
        fp8ops.convert(model, config=fp8ops.Fp8Config(policy=args.fp8_policy, recipe=args.fp8_recipe,
                                                      fuse_gelu=fuse, fuse_layernorm=fuse_ln, fuse_swiglu=fuse),
                       module_filter_fn=None if "_lmhead" in variant else lm_filter)  # (converted in place: tied still)
        n_fp8 = sum(type(m).__name__ == "Fp8Linear" for m in model.modules())
        n_lin = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
        note = f"{n_fp8}/{n_lin} linears Fp8Linear (policy {args.fp8_policy})"
        if n_fp8 == 0:
            raise RuntimeError(f"fp8ops.convert converted no layer: {getattr(model, '_fp8ops_decisions', {})}")
        if variant.endswith("compiled") and args.fp8_policy == "auto":
            # compiled code cannot measure: settle each layer's verdict eagerly first
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                fp8ops.tune_policy(model, *example)
    elif variant.startswith("torchao"):
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model, module_filter_fn=lm_filter)
        n_fp8 = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        note = f"{n_fp8} linears Float8Linear (tensorwise)"
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95),
                            fused=DEVICE == "cuda")
    call = model  # (model(idx, tgt) -> (logits, loss): GPT.forward computes the loss)
    if variant.endswith("compiled"):
        if args.compile_scope == "model":
            call = torch.compile(model)  # (the loss in the model's graph)
        else:
            for blk in model.transformer.h:
                blk.compile()
            if not args.eager_loss:
                compiled_loss = torch.compile(loss_fn)

                def call(idx, tgt):
                    logits, _ = model(idx)
                    return logits, compiled_loss(logits, tgt)
    return model, call, opt, cfg, note


def model_grads(m, fn, batch, autocast: bool = True, slices: int = 1) -> tuple:
    """(loss, {parameter name: gradient}) of one forward + backward of fn (m's call) on batch,
    under BF16 autocast unless autocast=False, the batch's rows in up to `slices` slices (the
    loss is a mean over tokens, every row of the same length: the batch's gradient is the sum of
    the slices', each weighted by its share of the rows; an FP32 pass of the 1B model fits an
    80 GB GPU in 4); m's gradients are cleared first and stay set."""
    idx, tgt = batch
    rows = idx.shape[0]
    size = -(-rows // max(1, slices))
    m.zero_grad(set_to_none=True)
    loss = 0.0
    for i, t in zip(idx.split(size), tgt.split(size)):
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            _, part = fn(i, t)
        share = i.shape[0] / rows
        (part * share).backward()
        loss += float(part.detach()) * share
    return loss, {n.replace("_orig_mod.", ""): p.grad for n, p in m.named_parameters() if p.grad is not None}


def grads_to_cpu(grads: dict) -> dict:
    """fp32 copies on the CPU (three gradient sets of the 1B model would hold 12 GB of GPU
    memory; a copy, never a view: the model's next backward may write its .grad in place)."""
    return {n: g.detach().to("cpu", torch.float32, copy=True) for n, g in grads.items()}


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise); a NaN or inf anywhere reads -inf (all error), never inf."""
    if not (math.isfinite(signal) and math.isfinite(noise)):
        return -math.inf
    if noise == 0:
        return math.inf
    return 10 * math.log10(signal / noise) if signal > 0 else -math.inf


def squared_errors(grads: dict, ref: dict) -> dict:
    """{name: (sum of ref's squares, sum of (ref - grads)'s squares)} per parameter of ref; a
    parameter missing from grads counts as all error."""
    out = {}
    for n, g_ref in ref.items():
        g = grads.get(n)
        s_n = float(g_ref.float().square().sum())
        out[n] = (s_n, float((g_ref.float() - g.float()).square().sum()) if g is not None else s_n)
    return out


def terms_sqnr(terms: dict) -> tuple:
    """(SQNR as one vector, [(SQNR, name) per parameter]) in dB of squared_errors' terms."""
    overall = sqnr_db(sum(s for s, _ in terms.values()), sum(e for _, e in terms.values()))
    return overall, [(sqnr_db(s, e), n) for n, (s, e) in terms.items() if not s == 0]


def grad_sqnr(grads: dict, ref: dict) -> tuple:
    """(SQNR of grads against ref as one vector, [(SQNR, name) per parameter]) in dB."""
    return terms_sqnr(squared_errors(grads, ref))


def reference_model(model, GPT, cfg):
    """A plain copy of the model with its current weights."""
    ref = GPT(cfg).to(DEVICE)
    ref.load_state_dict({k.replace("_orig_mod.", ""): v for k, v in model.state_dict().items()})
    return ref


SETTLED_MIN_SQNR_DB = 10.0  # FP8 against BF16 gradients of a whole model: 29-36 dB where BF16 is sound
# FP8's SQNR against FP32 below BF16's, whole model: 10-20 dB in the seven 1B runs where BF16's was
# 46-49 dB, 4-20 dB in all ten (H100, H200), 21-23 dB for a small GPT on the CPU; over the parameters
# where BF16's is >= 35 dB, 14-16 dB (dev/settled_check_fp32.py; benchmarks/RESULTS.md §5,
# twenty-first session)
SETTLED_MAX_DEFICIT_DB = 25.0


def settled_check(model, call, GPT, cfg, batch) -> dict:
    """After the warm-up (policy auto settled, compiled code built): one forward + backward of
    the variant on batch against BF16 eager from the same weights. The warm-up losses cannot
    show a broken FP8 path: policy auto's trial starts with BF16 steps, and with random tokens
    the loss barely moves. Gradients are compared as one vector (SQNR, dB) and per parameter
    (the lowest); the model's own gradients are left cleared. The verdict (settled_verdict):
    "pass" where the SQNR is at least SETTLED_MIN_SQNR_DB and the loss within 2 %; "fail" where
    the loss is not. Otherwise the same model in FP32 (no autocast) arbitrates: some states of
    this benchmark's model (28 steps from random tokens, no learning-rate warm-up) have
    gradients so sensitive that BF16's own SQNR against FP32 is -7 to 17 dB (four 1B runs on
    an H100 and an H200, twenty-first session), and a comparison with BF16 validates nothing
    there. The parameters where BF16's SQNR against FP32 is still at least SETTLED_MIN_SQNR_DB
    + SETTLED_MAX_DEFICIT_DB (35 dB) are compared on their own as well ("sound" ones), so that
    a broken backward (~0 dB) cannot hide in such a state."""
    ref = reference_model(model, GPT, cfg)
    loss, grads = model_grads(model, call, batch)
    model.zero_grad(set_to_none=True)
    loss_ref, grads_ref = model_grads(ref, ref, batch)
    overall, per_param = grad_sqnr(grads, grads_ref)
    worst = min(per_param) if per_param else (math.inf, "")
    chk = {"loss": loss, "loss_bf16": loss_ref, "grad_sqnr_db": overall,
           "min_param_sqnr_db": worst[0], "min_param": worst[1]}
    chk["verdict"] = settled_verdict(chk)
    if chk["verdict"] is None:
        grads, grads_ref = grads_to_cpu(grads), grads_to_cpu(grads_ref)
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # (FP32 means FP32)
        try:
            loss32, grads32 = model_grads(ref, ref, batch, autocast=False, slices=4)
            grads32 = grads_to_cpu(grads32)
            chk.update(fp32_arbiter(squared_errors(grads, grads32), squared_errors(grads_ref, grads32)),
                       loss_fp32=loss32)
        except torch.cuda.OutOfMemoryError:
            chk["arbiter_error"] = "out of memory in the FP32 pass"  # (nothing acquits the variant)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        chk["verdict"] = settled_verdict(chk)
    ref.zero_grad(set_to_none=True)
    del ref, grads, grads_ref
    return chk


def fp32_arbiter(fp8: dict, bf16: dict) -> dict:
    """The variant's and BF16's SQNR against FP32 (their squared_errors against the FP32
    gradients), over the whole model and over the parameters where BF16's is at least
    SETTLED_MIN_SQNR_DB + SETTLED_MAX_DEFICIT_DB."""
    sound = [n for n, (s, e) in bf16.items() if s > 0 and sqnr_db(s, e) >= SETTLED_MIN_SQNR_DB + SETTLED_MAX_DEFICIT_DB]

    def total(terms, names):
        return sqnr_db(sum(terms[n][0] for n in names), sum(terms[n][1] for n in names))

    out = {"fp8_vs_fp32_db": total(fp8, list(fp8)), "bf16_vs_fp32_db": total(bf16, list(bf16)),
           "sound_params": len(sound)}
    if sound:
        out.update(sound_fp8_vs_fp32_db=total(fp8, sound), sound_bf16_vs_fp32_db=total(bf16, sound))
    return out


def settled_verdict(chk: dict):
    """settled_check's verdict from its dict: None where FP8 against BF16 misses its bound and
    the dict has no FP32 comparison yet (fp32_arbiter's keys)."""
    loss_ok = abs(chk["loss"] - chk["loss_bf16"]) <= 0.02 * abs(chk["loss_bf16"])  # (False for a NaN)
    if not loss_ok:
        return "fail"
    if chk["grad_sqnr_db"] >= SETTLED_MIN_SQNR_DB:
        return "pass"
    if "arbiter_error" in chk:
        return "fail"
    if "bf16_vs_fp32_db" not in chk:
        return None
    bound = SETTLED_MIN_SQNR_DB + SETTLED_MAX_DEFICIT_DB
    if chk["bf16_vs_fp32_db"] >= bound:  # the reference is sound: FP8 missed it
        return "fail"
    if not chk["fp8_vs_fp32_db"] >= chk["bf16_vs_fp32_db"] - SETTLED_MAX_DEFICIT_DB:
        return "fail"
    if chk.get("sound_params") and not chk["sound_fp8_vs_fp32_db"] >= chk["sound_bf16_vs_fp32_db"] - \
            SETTLED_MAX_DEFICIT_DB:
        return "fail"
    return "inconclusive"


def settled_check_line(chk: dict) -> str:
    """The check's result in words, for the benchmark's output."""
    text = (f"loss {chk['loss']:.4f} vs {chk['loss_bf16']:.4f}, gradients {chk['grad_sqnr_db']:.1f} dB "
            f"(lowest {chk['min_param_sqnr_db']:.1f} dB, {chk['min_param']})")
    if "bf16_vs_fp32_db" in chk:
        text += (f"; SQNR against FP32: BF16 {chk['bf16_vs_fp32_db']:.1f} dB, this variant "
                 f"{chk['fp8_vs_fp32_db']:.1f} dB")
        if chk.get("sound_params"):
            text += (f" (on the {chk['sound_params']} parameters where BF16's is >= "
                     f"{SETTLED_MIN_SQNR_DB + SETTLED_MAX_DEFICIT_DB:.0f} dB: {chk['sound_bf16_vs_fp32_db']:.1f} / "
                     f"{chk['sound_fp8_vs_fp32_db']:.1f} dB)")
    if "arbiter_error" in chk:
        text += f"; FP32 arbiter: {chk['arbiter_error']}"
    if chk["verdict"] == "inconclusive":
        text += (f"  INCONCLUSIVE: BF16's own gradients have an SQNR of {chk['bf16_vs_fp32_db']:.1f} dB against "
                 f"FP32's here, a state too sensitive to validate against; this variant's SQNR is at most "
                 f"{SETTLED_MAX_DEFICIT_DB:.0f} dB below BF16's, the loss within 2 %")
    elif chk["verdict"] == "fail":
        bound = SETTLED_MIN_SQNR_DB + SETTLED_MAX_DEFICIT_DB
        text += (f"  VALIDATION FAILED (needs >= {SETTLED_MIN_SQNR_DB:.0f} dB against BF16 and the loss within 2 %; "
                 f"where BF16's own SQNR against FP32 is under {bound:.0f} dB, this variant's at most "
                 f"{SETTLED_MAX_DEFICIT_DB:.0f} dB below BF16's, over the whole model and over the parameters "
                 f"where BF16's is >= {bound:.0f} dB)")
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default="small,1b", help=f"comma-separated subset of {tuple(MODELS)}")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated subset of {VARIANTS}")
    ap.add_argument("--batch", type=int, default=None, help="override the batch size (all models)")
    ap.add_argument("--batch-1b", type=int, default=None, help="override the 1b models' batch size (1b, llama1b)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every variant this many times, in alternating order; ratios within a repeat, "
                         "targets on their median")
    ap.add_argument("--warmup", type=int, default=28, help="warm-up steps: compile, and policy auto's trial (26 steps)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                    help="torch.compile each transformer block, or the whole model")
    ap.add_argument("--eager-loss", action="store_true",
                    help="compiled variants under --compile-scope blocks: run the loss eagerly (as every run "
                         "before the thirty-seventh session)")
    ap.add_argument("--fp8-policy", choices=("auto", "always"), default="auto",
                    help="fp8ops policy: auto = FP8 only where measured faster (the default users get)")
    ap.add_argument("--fp8-recipe", choices=("delayed", "current"), default="delayed")
    ap.add_argument("--compiled-autograd", action="store_true",
                    help="compiled variants: each step (forwards and backward) under compiled autograd, "
                         "torch._dynamo.compiled_autograd._enable(torch.compile), as torchtitan's "
                         "--compile.enable_compiled_autograd runs it")
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    args = ap.parse_args()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m!r}; choose from {tuple(MODELS)}")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {VARIANTS}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1 (got {args.repeats})")
    if args.eager_loss and args.compile_scope == "model":
        ap.error("--eager-loss goes with --compile-scope blocks: --compile-scope model compiles the loss inside the "
                 "model's graph; drop one of the two")
    if "bf16" not in variants:
        variants.insert(0, "bf16")  # the reference of the validation
    # torchao last: from 0.18 its convert patches inductor's min/max codegen for the process
    variants.sort(key=lambda v: v.startswith("torchao"))

    env = start(args.json)
    if env is None:
        return 0
    import fp8ops
    GPT, GPTConfig, lm_filter, loss_fn = import_gpt()
    notes = []
    if any(v.startswith("torchao") for v in variants):
        try:
            import torchao.float8  # noqa: F401 -- importable at all?
        except Exception as e:  # noqa: BLE001
            notes.append(f"torchao not importable ({type(e).__name__}: {e}); torchao variants skipped")
            print("note: " + notes[-1])
            variants = [v for v in variants if not v.startswith("torchao")]
    # torch's own recompile limit (8 graphs per code object: every block of a model shares one),
    # as users have it; a block past it would run eager and this row would time that, silently:
    # fail the row instead
    torch._dynamo.config.fail_on_recompile_limit_hit = True

    result = {"env": env, "args": vars(args), "notes": notes, "rows": [], "targets": [],
              "validation_failures": [], "validation_inconclusive": []}
    failures = result["validation_failures"]
    for mname in models:
        mcfg = MODELS[mname]["cfg"]
        B = args.batch or MODELS[mname]["batch"]
        if mname in ("1b", "llama1b") and args.batch_1b:
            B = args.batch_1b
        T = mcfg["block_size"]
        gen = torch.Generator(device="cpu").manual_seed(1234)
        batches = [(torch.randint(0, VOCAB, (B, T), generator=gen).to(DEVICE),
                    torch.randint(0, VOCAB, (B, T), generator=gen).to(DEVICE)) for _ in range(4)]
        ref_losses = None
        print(f"\n== {mname}: {mcfg}, batch {B}, {B * T} tokens/step", flush=True)
        plain = [v for v in variants if not v.startswith("torchao")]
        passes = [(r, (plain if r % 2 == 0 else plain[::-1]) + [v for v in variants if v not in plain])
                  for r in range(args.repeats)]
        for r, v in [(r, v) for r, order in passes for v in order]:
            if args.repeats > 1 and v == passes[r][1][0]:
                print(f"  -- repeat {r + 1} of {args.repeats}: {', '.join(passes[r][1])}", flush=True)
            row = {"model": mname, "variant": v, "repeat": r, "batch": B, "seq": T, "tokens_per_step": B * T}
            model = call = opt = None
            try:
                torch._dynamo.reset()
                gb0, ng0, gf0, ch0 = graph_breaks(), graphs_compiled(), gelu_grads_fused(), inductor_cache_hits()
                cf0, rf0 = cat_grads_fused(), residual_adds_fused()
                model, call, opt, cfg, note = build(v, GPT, GPTConfig, lm_filter, loss_fn, mcfg, args, fp8ops,
                                                    batches[0])
                row["note"] = note
                fpt = flops_per_token(model, cfg)

                compiled_autograd = args.compiled_autograd and v.endswith("compiled")
                ca0 = torch._dynamo.utils.counters["compiled_autograd"]["captures"]

                def step(i):
                    idx, tgt = batches[i % len(batches)]
                    with (torch._dynamo.compiled_autograd._enable(torch.compile) if compiled_autograd
                          else contextlib.nullcontext()):
                        with torch.autocast(DEVICE, dtype=torch.bfloat16):
                            _, loss = call(idx, tgt)
                        loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss.detach()

                # no .item() per step: policy auto's trial runs in these steps and times the loop it
                # sees, which must be the timed loop below (a sync per step changed its verdicts:
                # GPT-2 small batch 8 on an H200, trial FP8 1.02x synced, then 0.89x timed)
                losses = [float(t) for t in [step(i) for i in range(max(2, args.warmup))]]
                row["warmup_losses"] = losses
                if compiled_autograd:  # (the backward graphs compiled autograd captured: it ran)
                    row["compiled_autograd_captures"] = torch._dynamo.utils.counters["compiled_autograd"]["captures"] - ca0
                    row["note"] += (f"{'; ' if row['note'] else ''}compiled autograd, "
                                    f"{row['compiled_autograd_captures']} capture(s)")
                if v.endswith("compiled"):
                    row["graph_breaks"] = graph_breaks() - gb0
                    # (compile scope "blocks": one graph serves every block; fp8ops makes two, for
                    # delayed scaling's first step and the steps after it; the loss one more)
                    row["graphs"] = graphs_compiled() - ng0
                    row["note"] += f"{'; ' if row['note'] else ''}{row['graphs']} graph(s)"
                    # (the GELU gradients inductor's pass moved into their producers' casts, per
                    # compiled backward graph; a graph from inductor's cache is not counted, so
                    # the row counts those as well)
                    row["gelu_grads_fused"] = gelu_grads_fused() - gf0
                    # (likewise the q, k, v gradients read in place by c_attn's cast, cat_grad_pass.py)
                    row["cat_grads_fused"] = cat_grads_fused() - cf0
                    # (and the residual adds fused into the norms' ops, residual_pass.py)
                    row["residual_adds_fused"] = [a - b for a, b in zip(residual_adds_fused(), rf0)]
                    row["inductor_cache_hits"] = inductor_cache_hits() - ch0
                    if row["graph_breaks"]:
                        row["note"] += f"; {row['graph_breaks']} graph break(s)"
                # validation against BF16 eager's losses (same init, same batches)
                is_ref = v == "bf16" and ref_losses is None  # (later repeats of bf16 are checked against it too)
                if is_ref:
                    ref_losses = losses
                ok = all(math.isfinite(x) for x in losses)
                if ref_losses is not None and not is_ref:
                    # the first 4 steps: later, a loss spike of either run (seen at step 10 of BF16 1B)
                    # would compare trajectories, not numerics
                    k = min(len(losses), 4) - 1
                    ok = ok and abs(losses[0] - ref_losses[0]) <= 0.01 * abs(ref_losses[0]) \
                        and abs(losses[k] - ref_losses[k]) <= 0.03 * abs(ref_losses[k])
                row["valid"] = ok
                if not ok:
                    failures.append(f"{mname} {v}: warm-up losses {[round(x, 4) for x in losses]} vs BF16 "
                                    f"{[round(x, 4) for x in (ref_losses or [])]}")
                else:
                    print(f"  {v}: warm-up losses match BF16 ({losses[0]:.4f} -> {losses[-1]:.4f}). "
                          f"All results match. Starting benchmarks.", flush=True)
                if v.startswith("fp8ops"):
                    # converted is not running FP8: policy auto may have chosen BF16 (a fault once
                    # made it choose BF16 for every layer before torch.compile, and nothing said so)
                    from fp8ops.report import RUNS_FP8, runs_now
                    runs = [runs_now(m) for m in model.modules() if type(m).__name__ == "Fp8Linear"]
                    row["fp8_layers_ran"] = runs.count(RUNS_FP8)
                    row["note"] += f"; {runs.count(RUNS_FP8)} ran FP8"
                    if not runs.count(RUNS_FP8):
                        print(f"  WARNING: {v}: no layer runs FP8 after the warm-up: this row times BF16",
                              flush=True)
                    fb = sum(getattr(m, "fp8_fallback_calls", 0) for m in model.modules())
                    row["fp8ops_fallback_calls_warmup"] = fb
                    if fb:
                        row["note"] += f"; {fb} BF16 fallback calls in warm-up (policy)"
                    # policy auto after the warm-up: per layer shape, FP8 or BF16 and how it was decided
                    verdicts, whys = {}, set()
                    for m in model.modules():
                        whys.update(getattr(m, "fp8_policy_why", {}).values())
                        for k, (wins, speedup) in getattr(m, "fp8_policy", {}).items():
                            why = m.fp8_policy_why.get(k)
                            how = "measured" if why is None else \
                                ("loop trial" if "trial in your loop" in why else "tune_policy")
                            tag = f"{m.in_features}->{m.out_features} M={k[0]}: {'FP8' if wins else 'BF16'} " \
                                  f"({how}, {speedup:.2f}x)"
                            verdicts[tag] = verdicts.get(tag, 0) + 1
                    if verdicts:
                        row["policy_verdicts"] = verdicts
                        print("  policy auto: " + "; ".join(f"{n}x {t}" for t, n in sorted(verdicts.items())))
                    if whys:
                        # how each decision beyond the two timings was reached, per layer timing:
                        # the trial's step times (loop_trial), or tune_policy's GPU-bound verdict
                        row["policy_trials"] = sorted(whys)
                # the settled path against BF16 from the same weights
                chk = settled_check(model, call, GPT, cfg, batches[0])
                row["settled_check"] = chk
                chk_ok = chk["verdict"] != "fail"
                print(f"  {v}: after the warm-up, one step against BF16 from the same weights: "
                      + settled_check_line(chk), flush=True)
                if not chk_ok:
                    row["valid"] = False
                    failures.append(f"{mname} {v}: settled path vs BF16: {chk}")
                elif chk["verdict"] == "inconclusive":
                    row["note"] += "; settled check inconclusive"
                    result["validation_inconclusive"].append(f"{mname} {v}: {chk}")
                # timed steps
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(args.steps + 1)]
                ev[0].record()
                for i in range(args.steps):
                    step(args.warmup + i)
                    ev[i + 1].record()
                torch.cuda.synchronize()
                per_step = [ev[i].elapsed_time(ev[i + 1]) for i in range(args.steps)]
                total_ms = ev[0].elapsed_time(ev[-1])
                # (each step's time kept: a slow step moves tokens/s, the target's measure, and
                # not the median; the line below names the slowest where it stands out)
                row.update(step_ms_median=statistics.median(per_step), total_ms=total_ms,
                           step_ms=[round(t, 3) for t in per_step],
                           tokens_per_s=B * T * args.steps / (total_ms * 1e-3),
                           peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                           model_tflops=fpt * B * T * args.steps / (total_ms * 1e-3) / 1e12,
                           flops_per_token=fpt)
                print(f"  {v}: {row['tokens_per_s']:,.0f} tok/s, {row['step_ms_median']:.1f} ms/step, "
                      f"peak {row['peak_mem_gib']:.2f} GiB, {row['model_tflops']:.0f} model TFLOP/s "
                      f"({row['note']})", flush=True)
                slowest = max(range(args.steps), key=per_step.__getitem__)
                if per_step[slowest] > 1.05 * row["step_ms_median"]:
                    print(f"  {v}: slowest timed step {slowest + 1} of {args.steps}: {per_step[slowest]:.1f} ms "
                          f"({per_step[slowest] / row['step_ms_median']:.2f}x the median; all steps in the JSON)",
                          flush=True)
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e).splitlines()[0]}"
                print(f"  {v}: OUT OF MEMORY (try --batch-1b smaller): {row['error']}")
            except Exception as e:  # noqa: BLE001 -- one broken variant must not stop the others
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"  {v}: FAILED: {row['error']}")
            result["rows"].append(row)
            write_json(args.json, result)
            model = call = opt = None  # free before the next variant
            gc.collect()
            torch.cuda.empty_cache()

    # ---- ratios (within one repeat) and targets (their median)
    by = {(r["model"], r["variant"], r["repeat"]): r for r in result["rows"] if "tokens_per_s" in r}
    for r in result["rows"]:
        base = by.get((r["model"], "bf16_compiled" if r["variant"].endswith("compiled") else "bf16", r["repeat"]))
        if "tokens_per_s" in r and base:
            r["speedup_vs_bf16_same_mode"] = r["tokens_per_s"] / base["tokens_per_s"]
            r["mem_vs_bf16_same_mode"] = r["peak_mem_gib"] / base["peak_mem_gib"]
        eager = by.get((r["model"], "bf16", r["repeat"]))
        if "tokens_per_s" in r and eager:
            r["speedup_vs_bf16_eager"] = r["tokens_per_s"] / eager["tokens_per_s"]
    for mname in models:
        for fv, bv in (("fp8ops", "bf16"), ("fp8ops_compiled", "bf16_compiled")):
            pairs = [(by[(mname, fv, r)], by[(mname, bv, r)]) for r in range(args.repeats)
                     if (mname, fv, r) in by and (mname, bv, r) in by]
            if not pairs or mname not in TARGETS:
                continue
            tgt = TARGETS[mname]
            sps = [f["tokens_per_s"] / b["tokens_per_s"] for f, b in pairs]
            mems = [f["peak_mem_gib"] / b["peak_mem_gib"] for f, b in pairs]
            sp, mem = statistics.median(sps), statistics.median(mems)
            result["targets"].append({"what": f"{mname}: {fv} vs {bv} tokens/s >= {tgt}x", "value": sp,
                                      "per_repeat": sps, "verdict": "PASS" if sp >= tgt else "MISS"})
            result["targets"].append({"what": f"{mname}: {fv} peak memory < {bv}'s", "value": mem,
                                      "per_repeat": mems, "verdict": "PASS" if mem < 1 else "MISS"})
    write_json(args.json, result)

    print()
    for n in notes:
        print(f"note: {n}")
    for f in failures:
        print(f"validation failed: {f}")
    for f in result["validation_inconclusive"]:
        print(f"validation inconclusive (BF16 itself far from FP32; not a failure): {f}")
    for tg in result["targets"]:
        print(f"target: {tg['what']}: {tg['value']:.3f}"
              + (f" (median of {', '.join(f'{x:.3f}' for x in tg['per_repeat'])})" if len(tg["per_repeat"]) > 1 else "")
              + f" -> {tg['verdict']}")
    hdr = ["model", "variant", "batch", "tokens/s", "ms/step", "vs bf16 (same mode)", "vs bf16 eager",
           "peak GiB", "mem vs bf16", "model TF/s", "note"]
    rows = []
    for r in result["rows"]:
        name = r["variant"] + (f" #{r['repeat'] + 1}" if args.repeats > 1 else "")
        if "tokens_per_s" not in r:
            rows.append([r["model"], name, r["batch"], "-", "-", "-", "-", "-", "-", "-",
                         r.get("error", "")[:60]])
            continue
        rows.append([r["model"], name + ("" if r.get("valid", True) else "!"), r["batch"],
                     f"{r['tokens_per_s']:,.0f}", f"{r['step_ms_median']:.1f}",
                     f"{r['speedup_vs_bf16_same_mode']:.3f}x" if "speedup_vs_bf16_same_mode" in r else "-",
                     f"{r['speedup_vs_bf16_eager']:.3f}x" if "speedup_vs_bf16_eager" in r else "-",
                     f"{r['peak_mem_gib']:.2f}",
                     f"{r['mem_vs_bf16_same_mode']:.2f}x" if "mem_vs_bf16_same_mode" in r else "-",
                     f"{r['model_tflops']:.0f}", r.get("note", "")[:60]])
    loss_how = "eager" if args.eager_loss else "compiled"
    print(table(hdr, rows, title=(f"GPT training step (fwd+bwd+fused AdamW), fp32 master + bf16 autocast, "
                                  f"{args.steps} timed steps after {args.warmup} warm-up; compile scope "
                                  f"{args.compile_scope}, loss {loss_how}; same mode = compiled vs "
                                  f"bf16_compiled")))
    failed = bool(failures) or any("error" in r for r in result["rows"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
