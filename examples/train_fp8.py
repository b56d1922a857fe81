"""Train a GPT-2 with FP8 linear layers: the fp8ops workflow from start to finish.

It shows the three lines a training script adds (`add_fp8_args`, `prepare_model`, and saving
`fp8ops.scaling_state_dict` next to the model), together with everything a real run needs: a
byte-level GPT-2 on a corpus that needs no download, checkpoints (latest, periodic, best) with
`--resume`, TensorBoard, a progress bar, periodic evaluation, Ctrl-C (or SIGTERM) that saves, and a
metrics.json for comparing FP8 with BF16.

    python examples/train_fp8.py --use_fp8                          # GPU: GPT-2 124M in FP8
    python examples/train_fp8.py --out_dir runs/bf16                # the same run in BF16
    python examples/plot_curves.py runs/train_fp8/metrics.json runs/bf16/metrics.json
    python examples/train_fp8.py --model tiny --steps 50            # CPU smoke test
    python examples/train_fp8.py --resume auto --use_fp8            # continue; BF16 ckpt -> FP8 is fine
    torchrun --nproc_per_node=2 examples/train_fp8.py --use_fp8 --ddp   # data parallel (or --fsdp)

Without a GPU that can run FP8 (sm_89+), or without the fp8ops extension, it still trains: in BF16
on the GPU, in FP32 on the CPU, and says once why FP8 is off. `tensorboard --logdir <out_dir>/tb`
shows loss, lr, tokens/s and each FP8 layer's amax and scale.
"""

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import shlex
import signal
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

try:
    import fp8ops
except ImportError:  # run from a source checkout that was not pip-installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import fp8ops
from fp8ops.training import add_fp8_args, portable_state_dict, prepare_model, run_summary

from gpt2 import ARCHS, GPT, LM_HEAD_FILTER, PRESETS, GPTConfig

try:
    from tqdm import tqdm
except ImportError:
    tqdm = None

CORPUS_MAX_BYTES = 8 << 20


# ------------------------------------------------------------------------------------------------
# arguments

class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """torch-style help with defaults, except where there is none to show (None, an off switch)
    or the help names its own (a default that depends on the device or another flag)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Train a byte-level GPT-2 with FP8 linear layers (fp8ops, torchao or TE).",
        formatter_class=_HelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=list(PRESETS), default=None,
                   help="size preset: tiny (d128 L2, CPU smoke tests), small (GPT-2 124M), "
                        "1b (d2048 L16), llama1b (1b's shape, Llama-style blocks). Default: small "
                        "on CUDA, tiny on CPU")
    m.add_argument("--arch", choices=ARCHS, default=None,
                   help="block style: gpt2 (LayerNorm, tanh-GELU MLP, biases) or llama (RMSNorm, "
                        "SwiGLU MLP, no biases). Default: the preset's")
    m.add_argument("--n_layer", type=int, help="override the preset's number of blocks")
    m.add_argument("--n_head", type=int, help="override the preset's attention heads")
    m.add_argument("--n_embd", type=int, help="override the preset's width")
    m.add_argument("--block_size", type=int, help="override the preset's context length")
    m.add_argument("--dropout", type=float, default=None, help="dropout probability (default: 0.0)")

    d = p.add_argument_group("data")
    d.add_argument("--data", metavar="FILE",
                   help="plain-text file to train on (bytes are tokens, vocab 256). Default: the "
                        "source of this Python's standard library (its top-level *.py files in "
                        "sorted order, about 5 MB), already on every machine: no download")
    d.add_argument("--batch_size", type=int, default=16, help="sequences per micro-batch")
    d.add_argument("--grad_accum", type=int, default=1, help="micro-batches per optimizer step")

    o = p.add_argument_group("optimization")
    o.add_argument("--steps", type=int, default=2000, help="optimizer steps in total")
    o.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (AdamW)")
    o.add_argument("--min_lr", type=float, default=None, help="final lr of the cosine (default lr/10)")
    o.add_argument("--warmup_steps", type=int, default=None,
                   help="linear warm-up steps (default: min(100, steps/10))")
    o.add_argument("--weight_decay", type=float, default=0.1, help="AdamW weight decay of the weight matrices "
                   "(biases and norm gains: none)")
    o.add_argument("--grad_clip", type=float, default=1.0, help="max grad norm; 0 disables")
    o.add_argument("--seed", type=int, default=1337, help="random seed: initial weights, batches, dropout")

    r = p.add_argument_group("run")
    r.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    r.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="autocast dtype around the model; auto: bf16 on CUDA, fp32 on CPU")
    r.add_argument("--compile", action="store_true", help="torch.compile the model")
    r.add_argument("--deterministic", action="store_true",
                   help="repeatable runs: deterministic torch algorithms, cuBLAS workspace config, "
                        "and the math attention kernel (slower; for comparing runs step by step)")
    r.add_argument("--out_dir", default="runs/train_fp8",
                   help="checkpoints, TensorBoard logs and metrics.json go here")
    r.add_argument("--resume", metavar="PATH|auto",
                   help="continue from a checkpoint; auto = <out_dir>/ckpt_latest.pt if present")
    r.add_argument("--eval_every", type=int, default=200, help="evaluate every N steps")
    r.add_argument("--eval_iters", type=int, default=20,
                   help="validation batches (each a global batch of the step) per evaluation")
    r.add_argument("--save_every", type=int, default=1000,
                   help="write ckpt_step{N}.pt (and ckpt_latest.pt) every N steps")
    r.add_argument("--log_every", type=int, default=10,
                   help="log loss, lr, tokens/s and FP8 amax/scale every N steps")
    r.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="write TensorBoard logs to <out_dir>/tb")
    r.add_argument("--max_time_min", type=float, default=None,
                   help="stop (and save) after this many minutes of wall time")
    r.add_argument("--ddp", action="store_true",
                   help="data parallel under torchrun (DistributedDataParallel): each rank trains "
                        "on --batch_size sequences of every global micro-batch of batch_size x ranks")
    r.add_argument("--fsdp", action="store_true",
                   help="like --ddp, with FSDP2 (fully_shard of each block, then the root): "
                        "parameters, gradients and optimizer state sharded across the ranks")
    r.add_argument("--fsdp_fp8_all_gather", action="store_true",
                   help="with --fsdp: all-gather the FP8 layers' weights in FP8 (1 byte per element) "
                        "instead of the master weights (fp8ops.enable_fsdp_fp8_all_gather; under "
                        "--fp8_backend torchao, torchao's enable_fsdp_float8_all_gather)")
    add_fp8_args(p)
    args = p.parse_args(argv)
    if args.ddp and args.fsdp:
        p.error("--ddp and --fsdp are exclusive")
    if args.fsdp_fp8_all_gather and not args.fsdp:
        p.error("--fsdp_fp8_all_gather needs --fsdp")
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_iters",
                 "save_every", "log_every", "n_layer", "n_head", "n_embd", "block_size"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1 (got {getattr(args, name)})")
    if args.data and not Path(args.data).is_file():
        what = "is a directory" if Path(args.data).is_dir() else \
            ("is not a regular file" if Path(args.data).exists() else "no such file")
        p.error(f"--data {args.data}: {what} (a plain-text file to train on; leave it out for the "
                "embedded default corpus)")
    for name, ok, want in (("lr", args.lr > 0 and math.isfinite(args.lr), "a positive number"),
                           ("min_lr", args.min_lr is None or (args.min_lr >= 0 and math.isfinite(args.min_lr)),
                            "a number >= 0"),
                           ("warmup_steps", args.warmup_steps is None or args.warmup_steps >= 0, "at least 0"),
                           ("dropout", 0 <= args.dropout < 1 if args.dropout is not None else True, "in [0, 1)"),
                           ("weight_decay", args.weight_decay >= 0, "at least 0"),
                           ("grad_clip", args.grad_clip >= 0, "at least 0 (0 disables)"),
                           ("max_time_min", args.max_time_min is None or args.max_time_min > 0, "positive")):
        if not ok:
            p.error(f"--{name} must be {want} (got {getattr(args, name)})")
    if args.min_lr is not None and args.min_lr > args.lr:
        p.error(f"--min_lr {args.min_lr} must be at most --lr {args.lr} (the schedule decays from --lr "
                "to --min_lr)")
    if args.warmup_steps is not None and args.warmup_steps > args.steps:
        p.error(f"--warmup_steps {args.warmup_steps} must be at most --steps {args.steps} (a warm-up "
                "longer than the run never reaches --lr)")
    if args.n_embd is not None and args.n_head is not None and args.n_embd % args.n_head:
        p.error(f"--n_embd {args.n_embd} must be a multiple of --n_head {args.n_head}")
    if Path(args.out_dir).exists() and not Path(args.out_dir).is_dir():
        p.error(f"--out_dir {args.out_dir}: a file is there; name a directory")
    if args.resume and args.resume != "auto" and not Path(args.resume).is_file():
        p.error(f"--resume {args.resume}: no such file (a ckpt_*.pt this script wrote, or auto)")
    return args


# ------------------------------------------------------------------------------------------------
# data: bytes are tokens

def default_corpus():
    """(bytes, description) of the built-in corpus: this Python's standard-library source.

    Sorted top-level *.py files of the stdlib, so the corpus is the same on every run of the same
    Python. Should a distribution strip the .py files, torch's own Python source (installed with
    the torch this runs on) stands in.
    """
    for root, pattern in ((Path(sysconfig.get_paths()["stdlib"]), "*.py"),
                          (Path(torch.__file__).parent, "**/*.py")):
        chunks, total = [], 0
        for f in sorted(root.glob(pattern)):
            data = f.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= CORPUS_MAX_BYTES:
                break
        if total >= 1 << 20:
            what = ("Python %s standard library" % sysconfig.get_python_version()
                    if pattern == "*.py" else "torch %s Python source" % torch.__version__)
            return b"\n".join(chunks), f"{what} ({len(chunks)} files, {root})"
    raise SystemExit("no default corpus found (no .py files in the stdlib or torch): use --data FILE")


def load_data(args, device, block_size):
    """Train and validation token tensors (uint8, on `device`) and a description of the corpus."""
    if args.data:
        raw = Path(args.data).read_bytes()
        desc = args.data
    else:
        raw, desc = default_corpus()
    need = 10 * (block_size + 2)  # (10 % of it validates: more than block_size + 1 bytes)
    if len(raw) < need:
        where = f"--data {desc}" if args.data else f"the default corpus ({desc})"
        raise SystemExit(f"{where}: {len(raw):,} bytes; with a context of {block_size} (--block_size) "
                         f"it needs at least {need:,} (10 % of it is the validation split): use a larger "
                         f"file or a smaller --block_size")
    tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    n_train = int(0.9 * len(tokens))
    train, val = tokens[:n_train], tokens[n_train:]
    # The whole corpus lives on the device: a batch is then one gather, with no host transfer.
    size = f"{len(tokens) / 1e6:.1f} MB" if len(tokens) >= 100_000 else f"{len(tokens):,} bytes"
    return train.to(device), val.to(device), f"{desc}: {size}, 90/10 split"


def get_batch(data, batch_size, block_size, generator):
    # windows of block_size + 1 bytes: starts 0 .. len - block_size - 1, the last byte a target too
    ix = torch.randint(len(data) - block_size, (batch_size, 1), generator=generator,
                       device=data.device)
    chunk = data[ix + torch.arange(block_size + 1, device=data.device)].long()
    return chunk[:, :-1], chunk[:, 1:]


# ------------------------------------------------------------------------------------------------
# checkpoints

def save_atomic(obj, path, json_text=False):
    """Write to a temporary file, then rename: an interrupted save never corrupts the old file."""
    tmp = path.with_name(path.name + ".tmp")
    if json_text:
        tmp.write_text(json.dumps(_json_safe(obj), indent=1, allow_nan=False))
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def _json_safe(obj):
    """obj with NaN and inf as null: JSON has no such numbers (json.dumps would write NaN, which
    strict parsers refuse)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


# the flags that make up a run's recipe: a resume that changes one of them says so
RECIPE_FLAGS = ("steps", "lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip", "batch_size",
                "grad_accum", "data", "seed", "dtype", "use_fp8", "fp8_backend", "fp8_fallback", "fp8_recipe",
                "fp8_format", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
                "fp8_amax_compute_algo", "fp8_policy")
# model-shape flags: a resume takes the checkpoint's shape
SHAPE_FLAGS = ("model", "arch", "n_layer", "n_head", "n_embd", "block_size", "dropout")


def resume_differences(args, saved: dict, model_config: dict) -> list[str]:
    """One line per recipe flag of this invocation that differs from the checkpoint's run, and
    per model-shape flag given that differs from the checkpoint's model (model_config: what
    it was built with), which the resume keeps."""
    lines = []
    for name in RECIPE_FLAGS:
        if name in saved and getattr(args, name) != saved[name]:
            if name == "seed":  # (the resume keeps the run's seed: _main sets it back)
                lines.append(f"--seed {args.seed} ignored: the run keeps its seed, {saved[name]} (its random "
                             "state and validation batches continue)")
            else:
                lines.append(f"--{name} {getattr(args, name)} (the checkpoint's run: {saved[name]})")
    for name in SHAPE_FLAGS:
        given = getattr(args, name)
        if given is None:
            continue
        # (a preset names several fields: it differs where any of them not given by its own flag does)
        want = ({k: v for k, v in {"arch": GPTConfig.arch, **PRESETS[given]}.items() if getattr(args, k) is None}
                if name == "model" else {name: given})
        if any(k in model_config and model_config[k] != v for k, v in want.items()):
            lines.append(f"--{name} {given} ignored: the model keeps the checkpoint's shape")
    return lines


def continue_command(argv, world: int = 1) -> str:
    """This invocation's flags with --resume auto: continuing it keeps its recipe (and, under
    torchrun, its number of ranks, which sets the global batch)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a == "--resume":
            skip = True
            continue
        if a.startswith("--resume="):
            continue
        out.append(shlex.quote(a))
    launch = f"torchrun --nproc_per_node={world}" if world > 1 else "python"
    # (the script's path from where it was run: the command works from that directory)
    return f"{launch} {shlex.quote(os.path.relpath(__file__))} " + " ".join(out + ["--resume", "auto"])


def find_resume(args):
    if not args.resume:
        return None
    if args.resume == "auto":
        path = Path(args.out_dir) / "ckpt_latest.pt"
        if not path.exists():
            print(f"resume: no {path} yet, starting a new run")
            return None
        return path
    path = Path(args.resume)
    if not path.exists():
        raise SystemExit(f"--resume {path}: no such file")
    return path


def lr_at(step, args):
    """Linear warm-up, then cosine decay to min_lr at the last step."""
    warmup = args.warmup_steps if args.warmup_steps is not None else min(100, args.steps // 10)
    min_lr = args.min_lr if args.min_lr is not None else args.lr / 10
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - min_lr)


def make_optimizer(model, args, device):
    # Decay matrices, not biases or LayerNorm gains (GPT-2/nanoGPT practice).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95),
                             fused=device.type == "cuda")


# ------------------------------------------------------------------------------------------------
# Ctrl-C or SIGTERM: the first one stops at the end of the current step and saves; a second one aborts.

class StopOnInterrupt:
    """Ctrl-C (SIGINT), or SIGTERM (`timeout`, a scheduler's preemption: SLURM and Kubernetes
    send it before killing), stops the run after the current step with a checkpoint. A second
    Ctrl-C goes to the handler that was there before (abort without saving); SIGTERM stays
    caught until the final save is written, since automation may send it twice (torchrun passes
    its own SIGTERM on to workers a job-wide signal already reached): the hard stop is the
    scheduler's SIGKILL."""

    SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}

    def __init__(self, log):
        self.requested = None  # the signal's name, once one came
        self.code = 0          # the exit status it asks for
        self.log = log
        self.previous = {sig: signal.signal(sig, self._handler) for sig in self.SIGNALS}

    def _handler(self, signum, frame):
        if self.requested is None:
            self.requested = self.SIGNALS[signum]
            self.code = 128 + signum  # (the shell's exit status for a process ended by that signal)
            self.log(f"{self.requested}: saving a checkpoint after this step"
                     + (" (Ctrl-C again to abort without saving)" if signum == signal.SIGINT else ""))
        if signum == signal.SIGINT:
            signal.signal(signum, self.previous[signum])

    def restore(self, *signals):
        """Put the handlers that were there before back (those of `signals`, or all)."""
        for sig in signals or tuple(self.previous):
            signal.signal(sig, self.previous[sig])


# ------------------------------------------------------------------------------------------------

def set_deterministic() -> None:
    """Make two runs of the same command give the same losses (on one GPU, bit for
    bit): the flash / memory-efficient attention backward kernels accumulate with
    atomics, so attention takes the math path; torch's ops use their
    deterministic variants (a warning where one has none); cuBLAS gets a fixed
    workspace. fp8ops' own kernels are deterministic (amax is a max)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    for kernel in ("flash", "mem_efficient", "cudnn"):
        fn = getattr(torch.backends.cuda, f"enable_{kernel}_sdp", None)
        if fn is not None:
            fn(False)
    print("deterministic: on (math attention, deterministic algorithms)")


class _ToLog(logging.Handler):
    """fp8ops' log records through this run's printer (tqdm-safe), attached during the
    training loop only; `target` is set per run."""
    target = print

    def emit(self, record):
        self.target(record.getMessage())


_FP8OPS_LOG = _ToLog()


def main(argv=None):
    try:
        return _main(argv)
    except KeyboardInterrupt:
        # (the training loop handles its own Ctrl-C: it saves; this is one during start-up,
        # e.g. while the corpus loads or the model compiles, or during the final save)
        print("\ninterrupted (Ctrl-C) outside the training steps; checkpoints, if any, are as the last "
              "complete save left them", file=sys.stderr)
        return 130


def _main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    out_dir = Path(args.out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if not os.access(out_dir, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise SystemExit(f"--out_dir {out_dir}: cannot write there ({e.strerror or e}); name a directory "
                         "this user can create or write") from None

    # --- device and precision ---------------------------------------------------------------------
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device: --device cuda, but no CUDA GPU is visible: falling back to the CPU")
        device = torch.device("cpu")
    elif args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    device, dinfo = init_distributed(args, device)   # --ddp/--fsdp: this rank's GPU; others stay quiet
    dtype = args.dtype if args.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    if dtype == "bf16":
        def amp():
            return torch.autocast(device.type, dtype=torch.bfloat16)
    else:
        amp = contextlib.nullcontext
    if args.deterministic:
        set_deterministic()
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")
        where = f"cuda ({torch.cuda.get_device_name(device)})"
    else:
        where = "cpu" + (" (no CUDA GPU found)" if args.device == "auto" else "")
    print(f"device: {where}, {dtype} autocast" if dtype == "bf16" else f"device: {where}, fp32")

    # --- model: build, load the checkpoint (plain model), then convert to FP8 ----------------------
    resume_path = find_resume(args)
    if resume_path is None and (out_dir / "ckpt_latest.pt").exists():
        print(f"note: {out_dir} holds an earlier run; its checkpoints will be overwritten "
              "(--resume auto continues it instead)")
    ckpt = None
    if resume_path is not None:
        # Our own checkpoint holds only tensors, numbers and strings: weights_only loading works.
        try:
            ckpt = torch.load(resume_path, map_location="cpu", weights_only=True)
            cfg = GPTConfig(**ckpt["model_config"])
            ckpt["step"], ckpt["model"]  # noqa: B018 -- what a resume reads first
        except Exception as e:  # noqa: BLE001 -- any unreadable file gets the same answer
            raise SystemExit(f"--resume {resume_path}: not readable as a checkpoint of this script "
                             f"(truncated or damaged, or another program's: {type(e).__name__}: "
                             f"{str(e)[:200].rstrip()}); resume from another of its out_dir's "
                             f"checkpoints (ckpt_step*.pt, ckpt_best.pt) with --resume PATH") from None
        saved_backend = ckpt.get("fp8_backend", "bf16")
        saved_dtype = (ckpt.get("args") or {}).get("dtype")  # (bf16, fp32, or auto: the device's)
        trained_with = (f"trained with {saved_backend} FP8" if saved_backend != "bf16" else "trained without FP8"
                        + (f", in {saved_dtype.upper()}" if saved_dtype in ("bf16", "fp32") else ""))
        print(f"resume: {resume_path} (step {ckpt['step']}, {trained_with}); model shape from the checkpoint")
        for line in resume_differences(args, ckpt.get("args") or {}, ckpt["model_config"]):
            print(f"resume: {line}")
        if "seed" in (ckpt.get("args") or {}):
            # (the evaluation's batches and the fallback reseed derive from it: the run's own)
            args.seed = ckpt["args"]["seed"]
        saved_world = ckpt.get("world_size")  # (not in checkpoints before the twenty-eighth session)
        if saved_world is not None and saved_world != dinfo.world:
            print(f"resume: {dinfo.world} rank(s) (the checkpoint's run: {saved_world}): the global batch, "
                  f"--batch_size x --grad_accum x ranks sequences per step, changes with it")
    else:
        preset = args.model or ("small" if device.type == "cuda" else "tiny")
        try:
            cfg = GPTConfig.preset(preset, n_layer=args.n_layer, n_head=args.n_head,
                                   n_embd=args.n_embd, block_size=args.block_size,
                                   dropout=args.dropout, arch=args.arch)
        except ValueError as e:  # (e.g. a width the heads do not divide)
            raise SystemExit(f"model flags (--model {preset}): {e}") from None
    # The same seed gives FP8 and BF16 runs identical initial weights, so their curves compare.
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    if ckpt is not None:
        # Before conversion: checkpoints always hold the plain model's state_dict, which is what
        # lets a BF16 checkpoint continue in FP8 and the other way round.
        model.load_state_dict(ckpt["model"])
    model.to(device)
    kind = "Llama-style" if cfg.arch == "llama" else "GPT-2"
    print(f"model: {kind} {cfg.n_layer} layers, {cfg.n_head} heads, d{cfg.n_embd}, context "
          f"{cfg.block_size}, {model.num_params() / 1e6:.1f}M parameters")

    model, fp8_info = prepare_model(model, args, logger=print, module_filter_fn=LM_HEAD_FILTER,
                                    precision=dtype.upper())
    if args.deterministic and fp8_info["backend"] == "fp8ops" and args.fp8_policy == "auto":
        print("deterministic: note: --fp8_policy auto times each layer shape on this GPU and may settle a "
              "layer FP8 in one run and BF16 in another; for runs that repeat bit for bit add --fp8_policy always")
    if args.fsdp_fp8_all_gather and fp8_info["backend"] not in ("fp8ops", "torchao"):
        print("note: --fsdp_fp8_all_gather does not apply: FP8 is off (it gathers the FP8 weights of fp8ops "
              "or torchao)")
    # --ddp: DDP(model); --fsdp: model sharded in place (before the optimizer: it holds the shards)
    # (--fsdp_fp8_all_gather under torchao: prepare_model turned on torchao's own FP8 all-gather)
    wrapped = wrap_distributed(model, dinfo, device,
                               fp8_all_gather=args.fsdp_fp8_all_gather and fp8_info["backend"] == "fp8ops")
    optimizer = make_optimizer(model, args, device)
    if ckpt is not None:
        load_optimizer_state(model, optimizer, ckpt["optimizer"], dinfo)
    load_scaling_state(model, ckpt, fp8_info)

    # --- data ---------------------------------------------------------------------------------------
    train_data, val_data, data_desc = load_data(args, device, cfg.block_size)
    print(f"data: {data_desc}")
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)

    def rank_batches(data, generator, n_micro):
        # Every rank draws the same global batch (batch_size x ranks x n_micro sequences) and
        # takes its n_micro micro-batches from it: blocks micro x ranks + rank. The data depends
        # on the global batch only, whatever the number of ranks, and one rank with
        # --grad_accum N runs the micro-batches that N ranks with --grad_accum 1 run side by side.
        x, y = get_batch(data, args.batch_size * dinfo.world * n_micro, cfg.block_size, generator)
        blocks = [slice(i * args.batch_size, (i + 1) * args.batch_size)
                  for i in range(dinfo.rank, dinfo.world * n_micro, dinfo.world)]
        return [(x[b], y[b]) for b in blocks]

    train_model = wrapped
    if args.compile:
        if fp8_info.get("backend") == "fp8ops" and fp8_info["config"].policy == "auto":
            # compiled code cannot time anything: settle each FP8 layer's policy verdict eagerly
            # first, on a batch of the training shape (its own generator: the data stays the same)
            g = torch.Generator(device=device)
            g.manual_seed(args.seed + 2)
            (x, y), = rank_batches(train_data, g, 1)
            with amp(), fp8_info["autocast"]():
                fp8ops.tune_policy(wrapped, x, y)
        train_model = torch.compile(wrapped)
    start_step, best_val = 0, float("inf")
    metrics = {"steps": [], "train_loss": [], "val_steps": [], "val_loss": [],
               "tokens_per_s_steps": [], "tokens_per_s": []}
    if ckpt is not None:
        start_step, best_val = ckpt["step"], ckpt["best_val_loss"]
        metrics.update(ckpt.get("metrics") or {})
        restore_rng(ckpt, gen, device, args.seed + start_step)
    del ckpt  # the optimizer copied its state; free the checkpoint's copy

    # --- logging ----------------------------------------------------------------------------------
    # (nothing to train: the finished run's TensorBoard events stay as they are)
    writer = make_writer(args, out_dir, start_step) if dinfo.main and start_step < args.steps else None
    tokens_per_step = args.batch_size * args.grad_accum * cfg.block_size * dinfo.world
    interactive = sys.stderr.isatty()
    bar = None
    if tqdm is not None and start_step < args.steps and dinfo.main:
        bar = tqdm(total=args.steps, initial=start_step, unit="step", dynamic_ncols=True,
                   mininterval=1 if interactive else 30)

    def log(msg):
        (bar.write if bar is not None else print)(msg)

    def flush_losses():
        """Move the per-step loss tensors into metrics (one device sync for all of them), and
        note the first step whose loss is not finite (every rank reads the same means)."""
        if pending:
            steps = [s for s, _ in pending]
            losses = all_ranks_mean(torch.stack([l for _, l in pending]), dinfo).tolist()
            metrics["steps"] += steps
            metrics["train_loss"] += losses
            pending.clear()
            if not bad:
                bad.extend([(s, l) for s, l in zip(steps, losses) if not math.isfinite(l)][:1])

    def diverged_message():
        s, l = bad[0]
        last = (f"step {last_saved} (ckpt_latest.pt)" if last_saved else f"the resumed step {start_step}"
                if start_step else "none from this run")
        return (f"the training loss is {l} at step {s}: training diverged; nothing is saved from there "
                f"on (last checkpoint: {last}). Lower --lr, keep --grad_clip on, or lengthen --warmup_steps")

    def checkpoint(step, *names) -> bool:
        """Save once, then copy: serializing a large model twice costs more than a file copy.
        Nothing is saved once a loss was not finite (the weights may hold NaN/inf): False."""
        flush_losses()
        if bad:
            return False
        # The plain model's full state dict and the single-process optimizer format, whatever
        # --ddp/--fsdp (under --fsdp every rank takes part in gathering them to rank 0).
        model_sd, optim_sd = full_state_dicts(model, optimizer, dinfo)
        if not dinfo.main:
            return True
        sd = getattr(fp8ops, "scaling_state_dict", None)
        save_atomic({
            "model": model_sd,
            "optimizer": optim_sd,
            "step": step,
            "best_val_loss": best_val,
            "args": vars(args),
            "model_config": dataclasses.asdict(cfg),
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                    "data": gen.get_state()},
            "fp8_backend": fp8_info["backend"],
            "world_size": dinfo.world,  # (with the batch flags: the global batch a resume keeps)
            # Scaling state (amax histories, scales) is kept out of model.state_dict() on purpose:
            # the model keys stay the BF16 model's. It rides along under its own key.
            "fp8_scaling": (sd(model) or None) if sd and fp8_info["backend"] == "fp8ops" else None,
            "metrics": metrics,
        }, out_dir / names[0])
        for name in names[1:]:
            tmp = out_dir / (name + ".tmp")
            shutil.copyfile(out_dir / names[0], tmp)
            os.replace(tmp, out_dir / name)
        written.update(names)
        return True

    def write_metrics(step, save=True):
        flush_losses()
        # This run's windows after the first (which holds warm-up and any compilation); the
        # median too, which a later window with a recompilation in it does not move.
        steady = run_tok_s[1:] or run_tok_s
        summary = dict(metrics, label=fp8_info["summary"], backend=fp8_info["backend"],
                       fp8_ran=run_summary(model, fp8_info),  # what ran by now (policy auto may pick BF16)
                       device=where, dtype=dtype, model_config=dataclasses.asdict(cfg),
                       tokens_per_step=tokens_per_step, last_step=step,
                       world_size=dinfo.world, parallel=dinfo.mode,
                       mean_tokens_per_s=sum(steady) / len(steady) if steady else None,
                       median_tokens_per_s=statistics.median(steady) if steady else None,
                       final_val_loss=metrics["val_loss"][-1] if metrics["val_loss"] else None,
                       final_train_loss=final_train_loss(metrics))
        if dinfo.main and save:
            save_atomic(summary, out_dir / "metrics.json", json_text=True)
        return summary

    @torch.no_grad()
    def evaluate():
        # The same validation batches at every evaluation and in every run: curves compare.
        g = torch.Generator(device=device)
        g.manual_seed(args.seed + 1)
        model.eval()
        total = torch.zeros((), device=device)
        for _ in range(args.eval_iters):
            # a step's worth of sequences (the global batch): the same tokens for any number of ranks
            batches = rank_batches(val_data, g, args.grad_accum)
            for x, y in batches:
                with amp(), fp8_info["autocast"]():
                    total += train_model(x, y)[1] / len(batches)
        model.train()
        return all_ranks_mean(total / args.eval_iters, dinfo).item()

    # --- train --------------------------------------------------------------------------------------
    if start_step >= args.steps:
        print(f"the checkpoint is at step {start_step}, already >= --steps {args.steps}: "
              "nothing to train (raise --steps to continue)")
    else:
        log(f"training steps {start_step}..{args.steps}: {tokens_per_step:,} tokens per step; "  # (above the bar)
            f"writing to {out_dir}")
    stopper = StopOnInterrupt(log)
    step, stop_reason, diverged = start_step, None, None
    pending = []                     # (step, loss tensor): read back at log steps, not every step
    bad = []                         # (step, loss) of the first loss that was not finite
    written = set()                  # the checkpoint files this run wrote
    tb_from = len(metrics["steps"])  # metrics' first step not yet in TensorBoard's train/loss
    run_tok_s = []                   # tokens/s of this run's log windows
    window_t0, window_steps = time.perf_counter(), 0
    last_saved = None
    best_saved = None                # the step ckpt_best.pt holds, if this run wrote it
    model.train()
    # fp8ops says when policy auto's trial settles (its first steps run the undecided layers in
    # BF16 and FP8 in turns): through the same printer as the step lines, for this loop only
    fp8_log = logging.getLogger("fp8ops")
    fp8_log_saved = fp8_log.level, fp8_log.propagate
    if dinfo.main:
        _FP8OPS_LOG.target = log
        fp8_log.addHandler(_FP8OPS_LOG)
        fp8_log.setLevel(logging.INFO)
        fp8_log.propagate = False  # a root handler the user set up would print it twice
    try:
        while step < args.steps:
            if stopper.requested:
                stop_reason = f"interrupted ({stopper.requested})"
            elif args.max_time_min is not None and time.time() - t_start > 60 * args.max_time_min:
                stop_reason = f"--max_time_min {args.max_time_min} reached"
            if dinfo.world > 1:
                # the ranks stop together, deciding at log steps (one small collective there)
                stop_reason = agreed_stop(stop_reason, step % args.log_every == 0, dinfo, device)
            if stop_reason:
                break
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro, (x, y) in enumerate(rank_batches(train_data, gen, args.grad_accum)):
                with grad_sync(wrapped, dinfo, last=micro == args.grad_accum - 1):
                    with amp(), fp8_info["autocast"]():
                        _, loss = train_model(x, y)
                    (loss / args.grad_accum).backward()
                loss_sum += loss.detach()
            grad_norm = None
            if args.grad_clip > 0:
                grad_norm = clip_grad_norm(model, args.grad_clip, dinfo)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window_steps += 1
            pending.append((step, loss_sum / args.grad_accum))
            if bar is not None:
                bar.update(1)

            if step % args.log_every == 0 or step == args.steps:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                tok_s = window_steps * tokens_per_step / (time.perf_counter() - window_t0)
                flush_losses()
                loss_now = metrics["train_loss"][-1]
                if bad:  # (every rank has the same means: all stop here together)
                    diverged = diverged_message()
                    break
                metrics["tokens_per_s_steps"].append(step)
                metrics["tokens_per_s"].append(tok_s)
                run_tok_s.append(tok_s)
                if bar is not None:
                    bar.set_postfix(loss=f"{loss_now:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
                elif dinfo.main:  # (no tqdm: the step line the bar would show)
                    log(f"step {step}: train loss {loss_now:.4f}, {tok_s:,.0f} tokens/s")
                if writer is not None:
                    # every step's loss, as metrics.json has them (the bar shows the last)
                    for s_, l_ in zip(metrics["steps"][tb_from:], metrics["train_loss"][tb_from:]):
                        writer.add_scalar("train/loss", l_, s_)
                    tb_from = len(metrics["steps"])
                    writer.add_scalar("lr", lr, step)
                    writer.add_scalar("tokens_per_s", tok_s, step)
                    if grad_norm is not None:
                        writer.add_scalar("train/grad_norm", float(grad_norm), step)
                    log_fp8_state(writer, model, fp8_info, step)
                window_t0, window_steps = time.perf_counter(), 0

            # Evaluation and checkpoints are kept out of the tokens/s windows.
            paused = time.perf_counter()
            if step % args.eval_every == 0 or step == args.steps:
                val = evaluate()
                flush_losses()
                metrics["val_steps"].append(step)
                metrics["val_loss"].append(val)
                if writer is not None:
                    writer.add_scalar("val/loss", val, step)
                    writer.flush()
                best = val < best_val
                if best:
                    # (set before the save: ckpt_best.pt holds its own val loss, which a resume
                    # from it must beat before it overwrites the file)
                    prev, best_val = best_val, val
                    if checkpoint(step, "ckpt_best.pt"):
                        best_saved = step
                    else:
                        best_val = prev
                log(f"step {step}: train loss {final_train_loss(metrics):.4f} (mean of the last "
                    f"{train_loss_window(metrics)} steps), val loss {val:.4f}{' (best)' if best else ''}, "
                    f"lr {lr:.2e}")
                write_metrics(step)
            if step % args.save_every == 0 and checkpoint(step, "ckpt_latest.pt", f"ckpt_step{step}.pt"):
                last_saved = step
            if bad:  # (a loss read back by the evaluation's or the checkpoint's flush)
                diverged = diverged_message()
                break
            window_t0 += time.perf_counter() - paused
    except KeyboardInterrupt:
        # The second Ctrl-C: the step may be half applied, so nothing is saved.
        if bar is not None:
            bar.close()
        print(f"\naborted during step {step + 1}; last checkpoint: "
              f"{'step %d (ckpt_latest.pt)' % last_saved if last_saved else 'none from this run'}"
              + (f"; best: step {best_saved} (ckpt_best.pt)" if best_saved else ""))
        stopper.restore()
        return 130
    except BaseException:
        stopper.restore()
        raise
    finally:
        stopper.restore(signal.SIGINT)  # (SIGTERM stays caught through the final save below)
        fp8_log.removeHandler(_FP8OPS_LOG)
        fp8_log.setLevel(fp8_log_saved[0])
        fp8_log.propagate = fp8_log_saved[1]
    if bar is not None:
        bar.close()

    # --- wrap up --------------------------------------------------------------------------------------
    # (a resume with nothing to train leaves the finished run's checkpoint and metrics.json as they
    # are: rewritten, they would carry this invocation's flags, e.g. BF16 without --use_fp8)
    trained = step > start_step
    try:
        if trained and last_saved != step and not diverged:
            checkpoint(step, "ckpt_latest.pt")
        summary = write_metrics(step, save=trained)
    finally:
        stopper.restore()
    if writer is not None:
        # the steps after the last log step (a stop between two, or the divergence's window)
        for s_, l_ in zip(metrics["steps"][tb_from:], metrics["train_loss"][tb_from:]):
            writer.add_scalar("train/loss", l_, s_)
        writer.close()

    minutes = (time.time() - t_start) / 60
    if diverged:
        print(f"stopped at step {step} of {args.steps}: {diverged}")
        return 1
    if stop_reason:
        print(f"stopped at step {step} of {args.steps}: {stop_reason}")
    print(f"\nsummary ({minutes:.1f} min)")
    ftl, fvl = summary["final_train_loss"], summary["final_val_loss"]
    print(f"  steps           {start_step} -> {step}")
    print(f"  train loss      {ftl:.4f} (mean of the last {train_loss_window(metrics)} steps)"
          if ftl is not None
          else "  train loss      -")
    print(f"  val loss        {fvl:.4f} (best {best_val:.4f})" if fvl is not None
          else "  val loss        -")
    if summary["median_tokens_per_s"]:
        print(f"  tokens/s        {summary['median_tokens_per_s']:,.0f} (median of the log windows after the "
              "first; without warm-up, evaluation and checkpoint time)")
    print(f"  FP8             {summary['fp8_ran']}")
    # (a new run stopped before its first step wrote nothing: no paths to files that are not
    # its own, which may be an earlier run's in the same directory)
    ours = trained or start_step > 0
    # (this run's files: others in the directory may be an earlier run's)
    saved = sorted(written)
    print(f"  checkpoints     {out_dir}/ {', '.join(saved)}" if saved else "  checkpoints     none from this run")
    if trained:
        print(f"  continue with   {continue_command(sys.argv[1:] if argv is None else argv, dinfo.world)}")
    elif start_step > 0:
        print(f"  continue with   the same command with --steps above {start_step}")
    if writer is not None and trained:
        print(f"  TensorBoard     tensorboard --logdir {out_dir / 'tb'}")
    if ours and (out_dir / "metrics.json").exists():
        print(f"  metrics         {out_dir / 'metrics.json'} (compare runs: examples/plot_curves.py)")
    report = getattr(fp8ops, "report", None)
    if report is not None and fp8_info["backend"] in ("fp8ops", "bf16"):
        # (the fp8ops layers' table: torchao's and Transformer Engine's layers are not its own,
        # the FP8 line above says what they ran)
        print()
        report(model)
    return stopper.code if stopper.requested and stop_reason == f"interrupted ({stopper.requested})" else 0


TRAIN_LOSS_WINDOW = 10  # (the train loss the logs and the summary give: a mean of the last steps)


def train_loss_window(metrics) -> int:
    """How many steps final_train_loss averages."""
    return min(TRAIN_LOSS_WINDOW, len(metrics["train_loss"]))


def final_train_loss(metrics):
    """Mean of the last TRAIN_LOSS_WINDOW recorded train losses."""
    recent = metrics["train_loss"][-TRAIN_LOSS_WINDOW:]
    return sum(recent) / len(recent) if recent else None


def load_scaling_state(model, ckpt, fp8_info):
    """Restore amax histories and scales when both the checkpoint and this run use fp8ops FP8."""
    if ckpt is None:
        return
    saved = ckpt.get("fp8_scaling")
    running_fp8ops = fp8_info["backend"] == "fp8ops"
    if not saved:
        if running_fp8ops:
            print("resume: the checkpoint has no FP8 scaling state (a BF16 run?): "
                  "scales start fresh from the first steps' amax")
        return
    if not running_fp8ops:
        print(f"resume: the checkpoint's FP8 scaling state is not used ({fp8_info['summary']})")
        return
    load = getattr(fp8ops, "load_scaling_state_dict", None)
    if load is None:
        print("resume: this fp8ops cannot load FP8 scaling state; scales start fresh")
        return
    try:
        skipped = load(model, saved) or []
    except (KeyError, ValueError, RuntimeError) as e:
        print(f"resume: the checkpoint's FP8 scaling state does not fit this run ({e}); "
              "scales start fresh")
        return
    if skipped:
        # e.g. a different --fp8_amax_history_len, or layers that ran BF16 in the saved run
        print(f"resume: FP8 scaling state restored except for {len(skipped)} layers, which start "
              f"fresh: {', '.join(skipped[:4])}{' ...' if len(skipped) > 4 else ''}")
    else:
        print("resume: FP8 scaling state restored (amax histories and scales)")


def restore_rng(ckpt, gen, device, fallback_seed):
    rng = ckpt.get("rng") or {}
    try:
        torch.set_rng_state(rng["torch"])
        if device.type == "cuda" and rng.get("cuda") is not None:
            torch.cuda.set_rng_state(rng["cuda"], device)
        gen.set_state(rng["data"])
    except (KeyError, RuntimeError, TypeError):
        # e.g. saved on the CPU, resumed on the GPU: the generators differ in kind.
        gen.manual_seed(fallback_seed)
        print("resume: RNG state not restorable on this device; data order reseeded")


def make_writer(args, out_dir, start_step):
    if not args.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard: not installed (pip install tensorboard); logging to metrics.json only")
        return None
    # purge_step hides events an earlier run in this directory wrote from this step on, so a
    # resumed (or restarted) run does not draw over stale curves. A resumed run's checkpoint step
    # itself keeps its events (its losses and evaluation came before that checkpoint): from the
    # step after it.
    return SummaryWriter(log_dir=str(out_dir / "tb"), purge_step=start_step + 1 if start_step else 0)


def log_fp8_state(writer, model, fp8_info, step):
    """Per-layer amax, scale and range used (the share of the FP8 range the latest amax fills at
    the scale now set: a falling fp8_range/<layer>/g shows a gradient that shrank below its
    delayed scale's history maximum) of the FP8 layers, from fp8ops.report."""
    report = getattr(fp8ops, "report", None)
    if report is None or fp8_info["backend"] != "fp8ops":
        return
    for row in report(model, print_table=False):
        if row.get("backend") != "fp8ops":
            continue
        for kind in ("amax", "scale", "range"):
            for t in ("x", "w", "g"):
                value = row.get(f"{kind}_{t}")
                if value is not None:
                    writer.add_scalar(f"fp8_{kind}/{row['name']}/{t}", value, step)
        # amaxes that were NaN/inf (scale kept): cumulative, so none is lost between log steps
        writer.add_scalar(f"fp8_overflows/{row['name']}", row.get("overflows", 0), step)


# ------------------------------------------------------------------------------------------------
# Data parallel under torchrun: --ddp (DistributedDataParallel) or --fsdp (FSDP2 fully_shard).
#
#     torchrun --nproc_per_node=2 examples/train_fp8.py --use_fp8 --ddp
#
# Every rank builds the same model (same seed) and draws the same global batch of
# batch_size x ranks x grad_accum sequences per step, training on its own micro-batches of it:
# 1 GPU with --batch_size 16 and 2 GPUs with --batch_size 8 see the same tokens, and so do 1 GPU
# with --batch_size 8 --grad_accum 2 and 2 GPUs with --batch_size 8, micro-batch for micro-batch
# (with --deterministic that pair trains bit for bit alike: see benchmarks/dist_check.sh). fp8ops
# all-reduces the amaxes, so after the first step every rank casts with the same scales. Rank 0 alone prints, writes TensorBoard, metrics.json and the
# checkpoints, which are those of a single-process run (the plain model's full state dict, the
# optimizer state keyed by position): any run resumes from any other, with or without --ddp/--fsdp.

@dataclasses.dataclass
class DistInfo:
    mode: str = None    # None (one process), "ddp" or "fsdp"
    rank: int = 0
    world: int = 1

    @property
    def main(self):
        return self.rank == 0


def init_distributed(args, device):
    """(device, DistInfo). Under --ddp/--fsdp join the process group torchrun describes (NCCL on
    CUDA, gloo on the CPU) and take the GPU of this rank's LOCAL_RANK; without torchrun, run as
    a single rank. The other ranks' stdout goes to /dev/null: only rank 0 logs."""
    mode = "ddp" if args.ddp else "fsdp" if args.fsdp else None
    if mode is None:
        return device, DistInfo()
    import atexit

    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group(backend, device_id=device)
        else:
            dist.init_process_group(backend)
    else:
        print(f"--{mode}: not started by torchrun, running as a single rank")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    atexit.register(leave_process_group)   # also on an exception; a no-op once done
    info = DistInfo(mode, dist.get_rank(), dist.get_world_size())
    if not info.main:
        sys.stdout = open(os.devnull, "w")
    print(f"distributed: --{mode}, {info.world} ranks ({backend}); rank 0 logs and saves")
    return device, info


def leave_process_group():
    """Once every rank is done (rank 0 may still be writing its files when the others finish),
    leave the process group. True if this process was in one."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return True


def wrap_distributed(model, dinfo, device, fp8_all_gather=False):
    """The module to run: DDP(model), or (--fsdp) the model itself, sharded in place: each
    transformer block, then the root (embeddings, final LayerNorm and the tied lm_head);
    fp8_all_gather: FSDP2 gathers the FP8 layers' weights in FP8.
    `model` stays the module that checkpoints and reports read."""
    if dinfo.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # fp8ops.convert lists its scaling buffers in model._ddp_params_and_buffers_to_ignore:
        # DDP must not overwrite the amaxes each rank records (they are all-reduced at the step)
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if dinfo.mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dinfo.world,))
        if fp8_all_gather:
            names = fp8ops.enable_fsdp_fp8_all_gather(model)
            if dinfo.rank == 0:
                print(f"fsdp: {len(names)} FP8 layers all-gather their weights in FP8")
        for block in model.transformer.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def _param_names(model, optimizer):
    """The optimizer's parameters by name, in the order of its state_dict's integer keys."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def full_state_dicts(model, optimizer, dinfo):
    """(model, optimizer) state dicts as a single-process run saves them. Under --fsdp they are
    gathered to rank 0, on the CPU (the other ranks get empty dicts); DCP keys the optimizer
    state by parameter name, which is mapped back to the single-process integer keys."""
    if dinfo.mode != "fsdp":
        return portable_state_dict(model), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(model, options=options)
    model_sd = {k: v for k, v in model_sd.items() if not k.endswith("._extra_state")}
    optim_sd = get_optimizer_state_dict(model, optimizer, options=options)
    if not optim_sd:
        return model_sd, optim_sd
    index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
    return model_sd, {
        "state": {index[k]: v for k, v in optim_sd["state"].items()},
        "param_groups": [dict(g, params=[index[k] for k in g["params"]]) for g in optim_sd["param_groups"]],
    }


def load_optimizer_state(model, optimizer, state, dinfo):
    """Load a single-process-format optimizer state (what every run saves). Under --fsdp, every
    rank passes the full state to DCP, which keeps this rank's shards."""
    if dinfo.mode != "fsdp":
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = _param_names(model, optimizer)
    state = {"state": {names[i]: v for i, v in state["state"].items()},
             "param_groups": [dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def grad_sync(wrapped, dinfo, last):
    """Reduce gradients once per optimizer step, at its last micro-batch (--grad_accum)."""
    if dinfo.mode == "ddp" and not last:
        return wrapped.no_sync()
    if dinfo.mode == "fsdp":
        wrapped.set_requires_gradient_sync(last)
    return contextlib.nullcontext()


def clip_grad_norm(model, max_norm, dinfo):
    """torch.nn.utils.clip_grad_norm_ (L2, the same clip factor), with the squares summed in
    float64 so that the norm does not depend on how the gradients are split: under --fsdp each
    rank sums its shards and one all-reduce adds the ranks' sums. In fp32 another summation order
    moves the norm by an ulp, and one ulp of the clip factor is enough for a sharded run to drift
    away from the single-process run it otherwise repeats exactly. Returns the norm (fp32)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    # per-tensor norms accumulated in float64 by one multi-tensor kernel (not a launch or two per
    # parameter); their squares summed in float64
    sq = torch.stack(torch._foreach_norm(local, 2, dtype=torch.float64)).square().sum()
    if dinfo.mode == "fsdp" and dinfo.world > 1:
        import torch.distributed as dist

        dist.all_reduce(sq)   # the shards partition every parameter: the sum of the ranks' sums
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(torch.float32)
    torch._foreach_mul_(local, coef)
    return norm.to(torch.float32)


def all_ranks_mean(t, dinfo):
    """The mean of t over the ranks (the global batch's loss); t itself in a single process."""
    if dinfo.world == 1:
        return t
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t / dinfo.world


def agreed_stop(reason, check_now, dinfo, device):
    """Ranks stop at the same step: at check points, all stop when one wants to."""
    if not check_now:
        return None
    import torch.distributed as dist

    flag = torch.tensor([float(reason is not None)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return (reason or "another rank stopped") if flag.item() else None


if __name__ == "__main__":
    code = main()
    if leave_process_group():
        # A C++ thread of the process group that takes the GIL once the interpreter is
        # finalizing aborts the process ("terminate called without an active exception": seen
        # once in CI, on rank 1 of a finished 2-rank gloo --fsdp run; not reproduced in 140 runs
        # here). Everything is saved and closed: leave without finalizing.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)
