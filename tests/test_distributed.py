"""Distributed training (CPU, gloo, 2 processes): DDP and FSDP2 (fully_shard), with and
without activation checkpointing, against the single-process run of the same global batch.

One spawn of 2 ranks runs every scenario (process start-up dominates the run time on a small
CPU box); the single-process references run in the pytest process. What is checked:

* losses and (all-reduced) gradients match the single-process run of the same global batch,
  whose micro-batches are the ranks' slices, to fp32 summation order (the FP8 casts are
  bit-identical: delayed scaling's first step casts each slice with its own current scale on
  either side, and after that every rank casts with the single-process scales);
* after every step the scales are identical on every rank and equal to the single-process ones
  (g: single / world_size, see _assert_scales; exactly after the first step, to fp32 rounding of
  the updated weights after that);
* delayed scaling issues ONE all_reduce per optimizer step for all layers, none in forward or
  backward;
* current scaling under FSDP2 gives the weight the single-process (unsharded) scale;
* with fp8ops.enable_fsdp_fp8_all_gather the weights travel as FP8 (1 byte per element), the
  runs still match the single process (also under torch.compile, aot_eager) and checkpoints
  hold the plain FSDP2 run's tensors;
* a state_dict load under FSDP2 is seen by the next forward (no stale weight cast);
* policy="auto" verdicts agree across ranks at the optimizer step, also where ranks meet
  different shapes (no collective in forward).

Then examples/train_fp8.py under torchrun: --ddp for 3 steps, then --fsdp resumed from its
checkpoint, follow the single-process run's losses, and the checkpoints load into a plain GPT.
"""
import datetime
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fp8ops
from fp8ops import Fp8Config
from fp8ops.linear import G, W, Fp8Linear
from fp8ops.scaling import exclude_from_ddp_broadcast

ROOT = Path(__file__).resolve().parent.parent
WORLD = 2

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch without FSDP2
    fully_shard = None

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="torch.distributed with the gloo backend is not available"),
    pytest.mark.skipif(not fp8ops.is_available(), reason=f"fp8ops C core not loaded: {fp8ops.why_unavailable()}"),
]
requires_fsdp2 = pytest.mark.skipif(fully_shard is None, reason="torch.distributed.fsdp.fully_shard not available")

# ------------------------------------------------------------------------------ model and data

D, HID, OUT = 32, 64, 16
BATCH, ACCUM, STEPS = 16, 2, 3          # global micro-batch rows, micro-batches per step, steps


class Block(nn.Module):
    """Residual MLP block; `ckpt` recomputes its inner part in backward (non-reentrant)."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, HID)
        self.fc2 = nn.Linear(HID, D)
        self.ckpt = False

    def inner(self, x):
        return self.fc2(F.gelu(self.fc1(x)))

    def forward(self, x):
        return x + (checkpoint(self.inner, x, use_reentrant=False) if self.ckpt else self.inner(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, OUT)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def make_model(recipe="delayed", ckpt=False, bf16_exact=False):
    """The same initial weights in every process; every Linear runs FP8 on the CPU kernels.
    bf16_exact: initial weights rounded to values bf16 holds exactly."""
    torch.manual_seed(0)
    model = Net()
    if bf16_exact:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
    cfg = Fp8Config(recipe=recipe, amax_history_len=4)
    for m in list(model.modules()):
        for cname, c in list(m.named_children()):
            if type(c) is nn.Linear:
                new = Fp8Linear.from_linear(c, cfg)
                new.fp8_on_cpu = True
                setattr(m, cname, new)
        if isinstance(m, Block):
            m.ckpt = ckpt
    exclude_from_ddp_broadcast(model)   # what fp8ops.convert does
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    out = [[(torch.randn(BATCH, D, generator=g) * 3, torch.randn(BATCH, OUT, generator=g))
            for _ in range(ACCUM)] for _ in range(STEPS)]
    for micro in out:
        # the step's largest inputs: rank 1's rows of the first micro-batch (an amax lost
        # between micro-batches, e.g. to DDP's buffer broadcast, changes the scales)
        micro[0][0][BATCH // 2:] *= 4
    return out


def fp8_layers(model):
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def train(mode="single", recipe="delayed", ckpt=False, rank=0, world=1, ar_log=None):
    """STEPS optimizer steps of ACCUM micro-batches; each rank takes its slice of every global
    micro-batch, and the single process (world=1) takes the WORLD slices one after another, as
    micro-batches of their own. Returns per-step losses (global mean), gradients (full), scales
    (after the step) and the weight scales the forwards used."""
    model = make_model(recipe, ckpt, bf16_exact=mode.endswith("_mp"))
    wrapped = model
    if mode == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
    elif mode == "ddp_compiled":
        # DDP finds convert's list of buffers to skip through the compiled wrapper's attribute
        # lookup, under its _orig_mod names
        torch._dynamo.reset()
        wrapped = nn.parallel.DistributedDataParallel(torch.compile(model, backend="aot_eager"))
    elif mode == "ddp_parent":
        # DDP around a parent of the converted model: its broadcast_buffers copies rank 0's
        # scaling buffers before every forward (fp8ops cannot name them for it): warned
        wrapped = nn.parallel.DistributedDataParallel(nn.Sequential(model))
    elif mode in ("fsdp", "fsdp_fp8_ag", "fsdp_fp8_ag_compiled", "fsdp_mp", "fsdp_fp8_ag_mp"):
        if mode.startswith("fsdp_fp8_ag"):
            assert len(fp8ops.enable_fsdp_fp8_all_gather(model)) == len(fp8_layers(model))
        kw = {}
        if mode.endswith("_mp"):   # bf16 unsharded parameters and compute, fp32 gradient reduction
            from torch.distributed.fsdp import MixedPrecisionPolicy
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for _, m in fp8_layers(model):
            fully_shard(m, **kw)
        fully_shard(model, **kw)
        if mode.endswith("compiled"):
            # aot_eager: dynamo + AOTAutograd without a C++ toolchain; FSDP2's hooks break the
            # graph at every sharded layer, each layer object its own frame
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = 64
            wrapped = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.05)   # after wrapping: FSDP2's DTensors
    n = BATCH // WORLD
    parts = [slice(rank * n, (rank + 1) * n)] if world > 1 else [slice(r * n, (r + 1) * n) for r in range(WORLD)]
    rec = {"loss": [], "grads": [], "scales": [], "w_scale_fwd": []}
    phase = ar_log.setdefault("phase", [None]) if ar_log is not None else [None]
    for step, micro in enumerate(batches()):
        if recipe == "current":   # the full weights this step's forwards cast
            rec.setdefault("weights", []).append(
                {n: _full(m.weight.detach()).clone() for n, m in fp8_layers(model)})
        total = torch.zeros(())
        phase[0] = ("fwdbwd", step)
        for x, y in micro:
            for rows in parts:
                # .float(): the output is bf16 under the MixedPrecisionPolicy scenarios
                loss = F.mse_loss(wrapped(x[rows]).float(), y[rows]) / (ACCUM * len(parts))
                loss.backward()
                total += loss.detach()
        rec["w_scale_fwd"].append({n: m.fp8_scale[W].item() for n, m in fp8_layers(model)})
        phase[0] = ("grads", step)
        rec["grads"].append({n: _full(p.grad).clone() for n, p in model.named_parameters()})
        phase[0] = ("optstep", step)
        opt.step()
        opt.zero_grad()
        phase[0] = None
        rec["scales"].append({n: m.fp8_scale.clone() for n, m in fp8_layers(model)})
        if world > 1:
            _orig_all_reduce(total)   # not counted: the test's own bookkeeping
            total /= world
        rec["loss"].append(total.item())
    rec["steps"] = {n: m.fp8_step for n, m in fp8_layers(model)}
    if mode.endswith("compiled"):
        rec["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    rec["report"] = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    if mode.startswith("fsdp"):   # what a checkpoint of the sharded model holds (rank 0)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        rec["full_state"] = {k: (type(v).__name__, v.clone()) for k, v in sd.items()}
    return rec


_orig_all_reduce = dist.all_reduce

# --------------------------------------------------------------------------- the 2-rank worker

SCENARIOS = {   # name: (mode, recipe, activation checkpointing)
    "ddp": ("ddp", "delayed", False),
    "ddp_ckpt": ("ddp", "delayed", True),
    "ddp_compiled": ("ddp_compiled", "delayed", False),
    "ddp_compiled_current": ("ddp_compiled", "current", False),
    "ddp_parent": ("ddp_parent", "delayed", False),
    "fsdp": ("fsdp", "delayed", False),
    "fsdp_ckpt": ("fsdp", "delayed", True),
    "fsdp_current": ("fsdp", "current", False),
    # FP8 weight all-gather (fp8ops.enable_fsdp_fp8_all_gather)
    "fsdp_fp8_ag": ("fsdp_fp8_ag", "delayed", False),
    "fsdp_fp8_ag_ckpt": ("fsdp_fp8_ag", "delayed", True),
    "fsdp_fp8_ag_current": ("fsdp_fp8_ag", "current", False),
    "fsdp_fp8_ag_compiled": ("fsdp_fp8_ag_compiled", "delayed", False),
    # with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    "fsdp_mp": ("fsdp_mp", "delayed", False),
    "fsdp_fp8_ag_mp": ("fsdp_fp8_ag_mp", "delayed", False),
}


def _worker(rank, world, tmp, scenarios):
    torch.set_num_threads(1)
    # (a timeout: a collective one rank misses fails the test instead of hanging it)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    out = {}
    try:
        # count the all_reduces fp8ops issues, by phase of the training step
        ar_log = {"calls": []}

        def counting_all_reduce(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            ar_log["calls"].append((ar_log["phase"][0], caller, tensor.numel()))
            return _orig_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce
        for name in scenarios:
            if name.startswith("fsdp") and fully_shard is None:
                continue
            ar_log["calls"] = []
            ar_log["phase"] = [None]
            mode, recipe, ckpt = SCENARIOS[name]
            ag_log = _log_all_gathers()
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                out[name] = train(mode, recipe, ckpt, rank, world, ar_log)
            out[name]["warnings"] = [str(w.message) for w in said]
            out[name]["all_reduce"] = ar_log["calls"]
            out[name]["all_gather"] = ag_log()
        dist.all_reduce = _orig_all_reduce
        if fully_shard is not None:
            out["fsdp_load"] = _fsdp_load_state_dict(rank, world)
        out["policy"] = _policy_agreement(rank)
        out["zero"] = _zero_redundancy(rank)
        out["tune_groups"] = _tune_policy_by_scaling_group(rank)
        if fully_shard is not None:
            out["dtensor_guard"] = _dtensor_guard()
    finally:
        dist.all_reduce = _orig_all_reduce
        torch.save(out, f"{tmp}/rank{rank}.pt")
        _teardown()
    _leave()


def _teardown():
    """Every rank done before any tears its gloo group down. (Once, without the barrier, one
    rank of the 3-rank test aborted at exit: "terminate called without an active exception".)"""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _leave():
    """A spawned rank's last call once its work is done and saved: os._exit, as the example's
    distributed run leaves, so that no gloo thread can abort the finalizing interpreter (CI saw
    it once more with the barrier, twenty-first session: a rank ended by SIGABRT, "terminate
    called without an active exception", after saving its results). Not reached when the rank
    raised: spawn reports that as usual."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _log_all_gathers():
    """Record the dtype and bytes of every all-gather FSDP2 issues from now on; returns
    the getter (which also restores the collective)."""
    log, orig = [], dist.all_gather_into_tensor

    def logged(output, input, *args, **kwargs):
        log.append((str(input.dtype), input.numel() * input.element_size()))
        return orig(output, input, *args, **kwargs)

    dist.all_gather_into_tensor = logged

    def get():
        dist.all_gather_into_tensor = orig
        return log
    return get


def _fsdp_load_state_dict(rank, world):
    """forward, load other weights (no optimizer step), forward: the second forward must use
    the loaded weights, not the weight cast cached by the first."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    model = make_model()
    for _, m in fp8_layers(model):
        fully_shard(m)
    fully_shard(model)
    x = batches()[0][0][0]
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    with torch.no_grad():
        y0 = model(x[rows])
    set_model_state_dict(model, _other_weights(), options=StateDictOptions(full_state_dict=True))
    # The unsharded weight's version and (on CUDA, often) storage do not change across the load,
    # so the cache key alone could not see it; here (CPU) the storage usually moves, hence
    # the direct check that the load dropped the cached casts.
    dropped = all(m._w_cache is None for _, m in fp8_layers(model))
    with torch.no_grad():
        y1 = model(x[rows])
    return {"y0": y0, "y1": y1, "dropped": dropped}


def _other_weights():
    torch.manual_seed(5)
    return Net().state_dict()


def _dtensor_guard():
    """A layer called on its own while its FSDP2 parent is sharded sees a DTensor weight: a
    clear error, not an operator without a sharding strategy, eager and compiled (compiled
    code once skipped the check: "as_strided not supported with DTensor"). And the FP8
    all-gather enabled after fully_shard: a clear error at the call, not an AttributeError in
    FSDP2's lazy init at the first forward."""
    model = make_model()
    fully_shard(model)
    out = {}
    for name, fn in (("eager", model.head), ("compiled", torch.compile(model.head, backend="aot_eager"))):
        try:
            fn(torch.randn(8, D))
        except RuntimeError as e:
            out[name] = str(e)
    try:
        fp8ops.enable_fsdp_fp8_all_gather(model)
    except RuntimeError as e:
        out["enable"] = str(e)
    return out


def _policy_agreement(rank):
    """policy="auto" with ranks that meet different shapes (uneven batches): rank 0 settles
    M=16 and 32, rank 1 M=16, 48 and 64, with no collective in forward (one per new shape, as
    before, would hang here: 2 on one rank, 3 on the other). The optimizer step's exchange
    (its flag read at the next step) then gives both the same verdicts, FP8 only where every
    rank that met the shape chose it: rank 0 measures FP8 faster at M=16, rank 1 slower, so
    both run it BF16. A layer of the current recipe (no amax all-reduce at the step) exchanges
    through its own flag."""
    import fp8ops.policy as policy
    from fp8ops.scaling import update_scales
    saved = policy.measure, torch.cuda.is_current_stream_capturing, dist.all_gather_object
    faster, slower = policy.Timing(1.5, 1.0, 1.5, 1.0, 0.1, 0.1), policy.Timing(0.8, 1.0, 0.8, 1.0, 0.1, 0.1)
    policy.measure = lambda lyr, M, cdtype: slower if (rank, M) == (1, 16) else faster
    torch.cuda.is_current_stream_capturing = lambda: False      # CPU-only machines
    gathers = []

    def counting_gather(*args, **kwargs):
        gathers.append(1)
        return saved[2](*args, **kwargs)

    dist.all_gather_object = counting_gather
    out = {}
    try:
        for recipe in ("delayed", "current"):
            layer = Fp8Linear(D, HID, config=Fp8Config(policy="auto", recipe=recipe))
            local = {M: layer._fp8_pays(M, torch.bfloat16) for M in ((16, 32) if rank == 0 else (16, 48, 64))}
            per_step, verdicts = [], []
            for _ in range(3):          # the flag of step 1 is read at step 2, which gathers; step 3: none
                n = len(gathers)
                update_scales([layer])
                per_step.append(len(gathers) - n)
                verdicts.append({k[0]: v[0] for k, v in layer.fp8_policy.items()})
            out[recipe] = {"local": local, "after_step1": verdicts[0], "agreed": verdicts[1],
                           "final": verdicts[2], "gathers": per_step,
                           "why": layer.fp8_policy_why.get((16, torch.bfloat16)), "left": layer._fp8_unagreed}
        return out
    finally:
        policy.measure, torch.cuda.is_current_stream_capturing, dist.all_gather_object = saved


def _tune_policy_by_scaling_group(rank):
    """tune_policy exchanges the verdicts within each layer's scaling group, as the step does.
    It used the whole world: a model only rank 0 trains ("local") waited in a collective rank 1
    never joins, and pipeline stages of 3 and 2 layers matched verdicts by layer index (rank
    0's last layer took rank 1's, rank 1 raised IndexError)."""
    from fp8ops import policy_ranks
    key = (64, torch.bfloat16)

    def stage(n):
        torch.manual_seed(0)
        m = nn.Sequential(*[Fp8Linear.from_linear(nn.Linear(32, 32), Fp8Config(policy="auto")) for _ in range(n)])
        fp8ops.set_scaling_group(m, "local")
        return m
    calls, orig = [], dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    try:
        out = {}
        if rank == 0:  # a helper model rank 0 alone trains
            out["helper"] = fp8ops.tune_policy(stage(2), torch.randn(64, 32))
        model = stage(3 if rank == 0 else 2)  # a pipeline stage per rank
        policy_ranks.settled(model[2 if rank == 0 else 0], key, rank == 0, 1.5 if rank == 0 else 0.9)
        out["stage"] = fp8ops.tune_policy(model, torch.randn(64, 32))
        out["collectives"] = len(calls)
        return out
    finally:
        dist.all_reduce = orig


def _zero_redundancy(rank):
    """ZeroRedundancyOptimizer steps an inner optimizer holding this rank's shard of the
    parameters: the scales follow the outer one (every parameter, every rank), once per step.
    Before, the inner one's scale update ran where its shard held the layer only (a hang)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    out = {}
    for recipe in ("current", "delayed"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, 256), nn.Linear(256, D))
        model[1] = Fp8Linear.from_linear(model[1], Fp8Config(recipe=recipe, amax_history_len=4))
        model[1].fp8_on_cpu = True
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.01)
        g = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp(torch.randn(16, D, generator=g)).sum().backward()
            opt.step()
            opt.zero_grad()
        out[recipe] = {"steps": model[1].fp8_step, "scale": model[1].fp8_scale.clone()}
    return out


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    import torch.multiprocessing as mp
    # CPU (gloo) tests, also on a GPU machine: keep the workers off the GPU, where
    # FSDP2 / DDP would otherwise place buffers
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        mp.spawn(_worker, args=(WORLD, str(tmp), list(SCENARIOS)), nprocs=WORLD, join=True)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def single():
    cache = {}

    def get(recipe="delayed"):
        if recipe not in cache:
            cache[recipe] = train("single", recipe)
        return cache[recipe]
    return get


# -------------------------------------------------------------------------------- assertions

def _assert_scales(dist_scales, single_scales, world, exact):
    """x and w: the single-process scales. g: each rank's loss is the mean over its rows, so
    its output gradient is exactly world x the single-process one (DDP / FSDP2 then average
    the parameter gradients), hence its g scale is single / world, and the FP8 bits of the
    cast gradient are the same. Exact after the first step (the same weights); later the
    weights differ from the single-process ones by fp32 summation order, and an amax can
    move by an ulp."""
    for name, s in single_scales.items():
        d = dist_scales[name].clone()
        d[G] *= world
        if exact:
            assert torch.equal(d, s), f"{name}: scales {d.tolist()} (g x {world}) vs single {s.tolist()}"
        else:
            torch.testing.assert_close(d, s, rtol=1e-5, atol=0, msg=lambda m: f"{name}: {m}")


def _check_against_single(results, ref, name):
    runs = [r[name] for r in results]
    for step in range(STEPS):
        # every rank holds identical scales after the step
        for other in runs[1:]:
            for layer, s in runs[0]["scales"][step].items():
                assert torch.equal(other["scales"][step][layer], s), f"step {step} {layer}: ranks differ"
        _assert_scales(runs[0]["scales"][step], ref["scales"][step], WORLD, exact=step == 0)
        for run in runs:
            assert run["loss"][step] == pytest.approx(ref["loss"][step], rel=1e-6, abs=1e-7), f"step {step} loss"
            for pname, g in ref["grads"][step].items():
                torch.testing.assert_close(run["grads"][step][pname], g, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{name} step {step} grad {pname}: {m}")
    for run in runs:
        assert set(run["steps"].values()) == {STEPS}   # the optimizer hook found every layer


def test_ddp_matches_single_process(dist_results, single):
    _check_against_single(dist_results, single(), "ddp")


def test_ddp_activation_checkpointing_matches_single_process(dist_results, single):
    _check_against_single(dist_results, single(), "ddp_ckpt")


def test_ddp_of_a_compiled_model_matches_single_process(dist_results, single):
    """DDP(torch.compile(model)): the scaling buffers are not broadcast (else each rank loses
    the amaxes of its earlier micro-batches, and the scales move away from the single
    process's)."""
    _check_against_single(dist_results, single(), "ddp_compiled")
    assert not any("overwritten" in w for r in dist_results for w in r["ddp_compiled"]["warnings"])


def test_ddp_of_a_compiled_model_on_the_current_recipe_is_no_broadcast(dist_results, single):
    """On the current recipe a compiled forward writes the layer's scales back through its
    graph's copy, which bumps fp8_scale_inv's version counter: not DDP's broadcast, which that
    counter detects on delayed scaling. No warning (each rank warned, also with
    broadcast_buffers=False, before), and the ranks train alike, close to one process."""
    for r in dist_results:
        assert not any("overwritten" in w for w in r["ddp_compiled_current"]["warnings"]), r["ddp_compiled_current"]
    runs = [r["ddp_compiled_current"] for r in dist_results]
    assert runs[0]["loss"] == runs[1]["loss"]
    torch.testing.assert_close(torch.tensor(runs[0]["loss"]), torch.tensor(single("current")["loss"]), rtol=2e-2,
                               atol=0)


def test_ddp_broadcasting_the_scaling_buffers_is_warned(dist_results):
    for r in dist_results:
        said = [w for w in r["ddp_parent"]["warnings"] if "overwritten between two optimizer steps" in w]
        assert len(said) == 1 and "broadcast_buffers=False" in said[0], r["ddp_parent"]["warnings"]


@requires_fsdp2
def test_fsdp2_matches_single_process(dist_results, single):
    _check_against_single(dist_results, single(), "fsdp")


@requires_fsdp2
def test_fsdp2_activation_checkpointing_matches_single_process(dist_results, single):
    _check_against_single(dist_results, single(), "fsdp_ckpt")


@pytest.mark.parametrize("name", ["ddp", "ddp_ckpt", "fsdp", "fsdp_ckpt"])
def test_one_amax_all_reduce_per_step(dist_results, name):
    """One all_reduce (max) per optimizer step for all layers' amaxes, and none in forward or
    backward (delayed scaling's first step scales each cast from its own, rank-local amax)."""
    if name.startswith("fsdp") and fully_shard is None:
        pytest.skip("fully_shard not available")
    n_layers = len(fp8_layers(Net())) or 5
    for res in dist_results:
        calls = res[name]["all_reduce"]
        fp8 = [(phase, n) for phase, caller, n in calls if caller.startswith("fp8ops")]
        for step in range(STEPS):
            in_step = [c for c in calls if c[0] == ("optstep", step)]
            assert len(in_step) == 1, f"step {step}: {len(in_step)} all_reduces in optimizer.step: {in_step}"
            # (+1: policy auto's flag, policy_ranks.py)
            assert in_step[0][1] == "fp8ops.scaling" and in_step[0][2] == 3 * n_layers + 1
            fwd = [c for c in fp8 if c[0] == ("fwdbwd", step)]
            assert not fwd, f"step {step}: {fwd}"


@requires_fsdp2
@pytest.mark.parametrize("name", ["fsdp_fp8_ag", "fsdp_fp8_ag_ckpt"])
def test_fsdp2_fp8_all_gather_matches_single_process(dist_results, single, name):
    """The weights travel as FP8 cast with the layer's scale; casting shards with one scale
    gives the bits of casting the whole weight, so the run matches the single process as
    the plain FSDP2 run does."""
    _check_against_single(dist_results, single(), name)
    # per rank, one weight shard travels as 1 byte per element instead of 4 (fp32); the
    # bias stays fp32 (FSDP2 packs a module's all-gather inputs into one uint8 buffer)
    saved = {3 * m.weight.numel() // WORLD for _, m in fp8_layers(make_model())}
    for res in dist_results:
        plain = res[name.replace("_fp8_ag", "")]["all_gather"]
        fp8 = res[name]["all_gather"]
        assert plain and {d for d, _ in plain} == {"torch.float32"}, plain
        assert len(fp8) == len(plain) and {d for d, _ in fp8} == {"torch.uint8"}, fp8
        assert all(p - f in saved for (_, p), (_, f) in zip(plain, fp8)), (plain, fp8)
    for res in dist_results:   # fp8ops.report says so, for the sharded layers
        assert all("all-gathers its weight in FP8" in why for why in res[name]["report"].values())
        assert not any("all-gather" in why for why in res["fsdp"]["report"].values())
    # the checkpoint (full state dict) is plain tensors, the same as plain FSDP2's run gives
    full, ref_full = dist_results[0][name]["full_state"], dist_results[0][name.replace("_fp8_ag", "")]["full_state"]
    assert full.keys() == ref_full.keys() and full
    for k, (kind, v) in full.items():
        assert kind == "Tensor" and torch.equal(v, ref_full[k][1]), k


@requires_fsdp2
def test_fsdp2_fp8_all_gather_under_torch_compile(dist_results):
    """torch.compile (aot_eager) of the FSDP2 model with FP8 all-gather: the eager run's
    losses, gradients and scales exactly, and its all-gathers are FP8 too."""
    for res in dist_results:
        run, ref = res["fsdp_fp8_ag_compiled"], res["fsdp_fp8_ag"]
        assert run["loss"] == ref["loss"]
        for step in range(STEPS):
            for pname, g in ref["grads"][step].items():
                assert torch.equal(run["grads"][step][pname], g), f"step {step} {pname}"
            for layer, sc in ref["scales"][step].items():
                assert torch.equal(run["scales"][step][layer], sc), f"step {step} {layer}"
        assert {d for d, _ in run["all_gather"]} == {"torch.uint8"}
        assert run["graphs"] >= len(fp8_layers(make_model()))   # compiled, not run eagerly


@requires_fsdp2
def test_fsdp2_fp8_all_gather_with_mixed_precision_policy(dist_results):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32). Plain FSDP2 gathers bf16
    weights that the layers then cast to FP8; the FP8 all-gather casts the fp32 shards to FP8
    directly (one rounding instead of two). With initial weights that bf16 holds exactly, the
    two roundings agree, so the first step is bit for bit plain FSDP2's; after the fp32 update
    ~1 % of the weights' FP8 values differ by the double rounding, and this small model's FP8
    gradients move by ~10 % under such a change (as they do between plain FSDP2 with and without
    the MP policy), so the later losses agree to a few %. The weights travel as 1 byte per
    element instead of bf16's 2, and the gradients the optimizer sees are fp32, as under plain
    FSDP2."""
    saved = {m.weight.numel() // WORLD for _, m in fp8_layers(make_model())}  # 2 bytes -> 1 per element
    for res in dist_results:
        run, ref = res["fsdp_fp8_ag_mp"], res["fsdp_mp"]
        assert {d for d, _ in ref["all_gather"]} == {"torch.bfloat16"}, ref["all_gather"]
        assert {d for d, _ in run["all_gather"]} == {"torch.uint8"}, run["all_gather"]
        assert len(run["all_gather"]) == len(ref["all_gather"])
        assert all(p - f in saved for (_, p), (_, f) in zip(ref["all_gather"], run["all_gather"]))
        assert run["loss"][0] == ref["loss"][0]
        for pname, g in ref["grads"][0].items():
            assert run["grads"][0][pname].dtype == g.dtype == torch.float32, pname
            assert torch.equal(run["grads"][0][pname], g), f"step 0 grad {pname}"
        assert run["loss"] == pytest.approx(ref["loss"], rel=0.05)
        assert all("all-gathers its weight in FP8" in why for why in run["report"].values())


@requires_fsdp2
def test_fsdp2_fp8_all_gather_current_scaling(dist_results, single):
    """Current scaling with the FP8 all-gather: the shards' amaxes are max-reduced before the
    cast, so the weight scale is the unsharded weight's (step 0: exactly the single run's)."""
    ref = single("current")
    for res in dist_results:
        run = res["fsdp_fp8_ag_current"]
        assert run["w_scale_fwd"][0] == ref["w_scale_fwd"][0]
        assert run["w_scale_fwd"] == res["fsdp_current"]["w_scale_fwd"]
        assert run["loss"] == res["fsdp_current"]["loss"]


@requires_fsdp2
def test_fsdp2_current_scaling_weight_scale_is_unsharded_scale(dist_results, single):
    """Under FSDP2 the forward casts the all-gathered weight: its current scale is the one the
    unsharded single-process weight gets."""
    ref = single("current")
    for res in dist_results:
        run = res["fsdp_current"]
        # step 0: the same initial weights as the single-process run, the same scales, exactly
        assert run["w_scale_fwd"][0] == ref["w_scale_fwd"][0]
        # later steps: the weights drift from the single-process run's (current scaling of the
        # activations is per rank), so compare with the scale an unsharded layer computes for
        # the full weight FSDP2 held at that step
        for step in range(STEPS):
            for layer, w in run["weights"][step].items():
                lin = Fp8Linear(w.shape[1], w.shape[0], config=Fp8Config(recipe="current"))
                with torch.no_grad():
                    lin.weight.copy_(w)
                lin._weight_fp8(torch.float32, True, lin._fp8_views(False), False, current=True)
                assert run["w_scale_fwd"][step][layer] == lin.fp8_scale[W].item(), f"step {step} {layer}"


@requires_fsdp2
def test_fsdp2_state_dict_load_invalidates_weight_cast(dist_results):
    model = make_model()
    x = batches()[0][0][0]
    parts = [slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD) for rank in range(WORLD)]
    with torch.no_grad():   # each rank's slice on its own (first-step casts scale per call)
        y0 = [model(x[rows]) for rows in parts]
        model.load_state_dict(_other_weights())
        y1 = [model(x[rows]) for rows in parts]
    for rank, res in enumerate(dist_results):
        torch.testing.assert_close(res["fsdp_load"]["y0"], y0[rank], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(res["fsdp_load"]["y1"], y1[rank], rtol=1e-6, atol=1e-6)
        assert res["fsdp_load"]["dropped"]


@requires_fsdp2
def test_fsdp2_sharded_weight_gives_a_clear_error(dist_results):
    for res in dist_results:
        for when in ("eager", "compiled"):
            assert "Fp8Linear: the weight is a DTensor" in res["dtensor_guard"].get(when, ""), when
            assert "fully_shard" in res["dtensor_guard"][when]
        assert "is already sharded (a DTensor): call it after fp8ops.convert(model) and before fully_shard" \
            in res["dtensor_guard"].get("enable", "")


@pytest.mark.parametrize("recipe", ["current", "delayed"])
def test_zero_redundancy_optimizer_updates_scales_once_per_step_on_every_rank(dist_results, recipe):
    r0, r1 = (res["zero"][recipe] for res in dist_results)
    assert r0["steps"] == r1["steps"] == 3
    # (current scaling: each rank's input and gradient scales come from its own data)
    same = slice(None) if recipe == "delayed" else slice(W, W + 1)
    assert torch.equal(r0["scale"][same], r1["scale"][same])


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_policy_auto_verdicts_agree_across_ranks_at_the_step(dist_results, recipe):
    r0, r1 = (res["policy"][recipe] for res in dist_results)
    assert r0["local"] == {16: True, 32: True}      # each rank's own verdicts until the step
    assert r1["local"] == {16: False, 48: True, 64: True}
    assert r0["after_step1"] == r0["local"] and r1["after_step1"] == r1["local"]
    for r in (r0, r1):
        assert r["agreed"] == r["final"] == {16: False, 32: True, 48: True, 64: True}, r["agreed"]
        assert r["gathers"] == [0, 1, 0] and not r["left"]
        assert "rank(s) 1 chose BF16" in r["why"]


def test_tune_policy_exchanges_within_each_scaling_group(dist_results):
    r0, r1 = (res["tune_groups"] for res in dist_results)
    assert r0["helper"] == {"0": {}, "1": {}} and "helper" not in r1
    key = (64, torch.bfloat16)
    assert r0["stage"] == {"0": {}, "1": {}, "2": {key: (True, 1.5)}}   # its own verdict, not rank 1's
    assert r1["stage"] == {"0": {key: (False, 0.9)}, "1": {}}
    assert r0["collectives"] == r1["collectives"] == 0


# -------------------------------------------------------------------- single-process sanity

@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_activation_checkpointing_is_bitwise_neutral(recipe):
    """Recomputation re-runs forward: it must not rescale (first step: current scales), re-cast the weight with
    another scale, or change the recorded amaxes (max is idempotent)."""
    runs = {ckpt: (make_model(recipe, ckpt=ckpt), []) for ckpt in (False, True)}
    for ckpt, (model, log) in runs.items():
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for micro in batches():
            for x, y in micro:
                (F.mse_loss(model(x), y) / ACCUM).backward()
            log.append([p.grad.clone() for p in model.parameters()]
                       + [m.fp8_amax_history.clone() for _, m in fp8_layers(model)])
            opt.step()
            opt.zero_grad()
            log.append([m.fp8_scale.clone() for _, m in fp8_layers(model)])
    for a, b in zip(runs[False][1], runs[True][1]):
        for ta, tb in zip(a, b):
            assert torch.equal(ta, tb)


def test_convert_excludes_fp8_buffers_from_ddp_broadcast(monkeypatch):
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    model = fp8ops.convert(Net())
    ignored = set(model._ddp_params_and_buffers_to_ignore)
    for name, _ in fp8_layers(model):
        assert {f"{name}.fp8_amax_history", f"{name}.fp8_scale"} <= ignored
    assert not any(n.endswith(("weight", "bias")) for n in ignored)


# ------------------------------------------------------------------ examples/train_fp8.py
# A 1-block GPT on the CPU (FP8 is off without a GPU: these check the data-parallel plumbing).
# Constant lr, so that a run resumed at step 3 follows the same schedule as a straight run.

TRAIN_ARGS = ["--model", "tiny", "--device", "cpu", "--n_layer", "1", "--block_size", "32", "--eval_iters", "2",
              "--eval_every", "100", "--log_every", "1", "--lr", "1e-3", "--min_lr", "1e-3", "--warmup_steps", "0",
              "--no-tensorboard", "--use_fp8"]
HAS_TORCHRUN = shutil.which("torchrun") is not None or (Path(sys.executable).parent / "torchrun").exists()


def _train_fp8(args, out_dir, ranks=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    launcher = [sys.executable]
    if ranks:
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    cmd = [*launcher, str(ROOT / "examples" / "train_fp8.py"), *TRAIN_ARGS, "--out_dir", str(out_dir), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}"
    return p.stdout


def _plain_gpt_loads(ckpt):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from gpt2 import GPT, GPTConfig
    finally:
        sys.path.remove(str(ROOT / "examples"))
    plain = GPT(GPTConfig(**ckpt["model_config"]))
    assert set(ckpt["model"]) == set(plain.state_dict())
    assert all(type(v) is torch.Tensor for v in ckpt["model"].values())     # full tensors, no DTensor
    plain.load_state_dict(ckpt["model"])                                      # strict
    # the optimizer state is in the single-process format (integer keys)
    n = len(list(plain.parameters()))
    assert sorted(ckpt["optimizer"]["state"]) == list(range(n))
    assert sorted(i for g in ckpt["optimizer"]["param_groups"] for i in g["params"]) == list(range(n))


@pytest.mark.skipif(not HAS_TORCHRUN, reason="torchrun not installed")
@requires_fsdp2
def test_train_fp8_torchrun_ddp_then_fsdp_resume_match_single_process(tmp_path):
    """1 process with --batch_size 8 vs 2 ranks with --batch_size 4 (the same global batches):
    --ddp for steps 1-3 (checkpoint), then --fsdp resumed from it for steps 4-5. The losses
    follow the single-process run's, and both checkpoints load into a plain GPT."""
    single = tmp_path / "single"
    _train_fp8(["--batch_size", "8", "--steps", "5"], single)
    ref = json.loads((single / "metrics.json").read_text())["train_loss"]

    run = tmp_path / "dist"
    log = _train_fp8(["--batch_size", "4", "--steps", "3", "--ddp"], run, ranks=WORLD)
    assert log.count("summary (") == 1, "rank 0 alone logs"
    assert "distributed: --ddp, 2 ranks (gloo)" in log
    ckpt = torch.load(run / "ckpt_latest.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == 3
    _plain_gpt_loads(ckpt)
    got = json.loads((run / "metrics.json").read_text())
    assert got["world_size"] == WORLD and got["tokens_per_step"] == 8 * 32
    assert got["train_loss"] == pytest.approx(ref[:3], rel=1e-5)
    # its "continue with" keeps the ranks (they set the global batch); a resume on other ranks says so
    line = next(ln for ln in log.splitlines() if "continue with" in ln)
    assert f"torchrun --nproc_per_node={WORLD} " in line and line.endswith("--resume auto"), line
    single_resume = tmp_path / "one"
    shutil.copytree(run, single_resume)
    log1 = _train_fp8(["--batch_size", "4", "--steps", "4", "--resume", "auto"], single_resume)
    assert f"resume: 1 rank(s) (the checkpoint's run: {WORLD}): the global batch" in log1, log1

    log = _train_fp8(["--batch_size", "4", "--steps", "5", "--fsdp", "--resume", "auto"], run, ranks=WORLD)
    assert "resume:" in log
    ckpt5 = torch.load(run / "ckpt_latest.pt", map_location="cpu", weights_only=True)
    assert ckpt5["step"] == 5
    _plain_gpt_loads(ckpt5)
    assert not torch.equal(ckpt5["model"]["transformer.h.0.mlp.c_fc.weight"],
                           ckpt["model"]["transformer.h.0.mlp.c_fc.weight"])
    got = json.loads((run / "metrics.json").read_text())["train_loss"]
    assert got == pytest.approx(ref, rel=1e-5)        # steps 4-5: optimizer state, data and RNG resumed


@pytest.mark.skipif(not HAS_TORCHRUN, reason="torchrun not installed")
@requires_fsdp2
def test_train_fp8_two_ranks_repeat_one_rank_with_grad_accum_bit_for_bit(tmp_path):
    """What benchmarks/dist_check.sh checks on the GPUs, here with gloo: 1 process with
    --batch_size 4 --grad_accum 2 trains the micro-batches that 2 ranks with --batch_size 4 train
    side by side, so with --deterministic the losses are equal bit for bit, under --ddp and
    --fsdp (the example clips with a float64 norm, which FSDP2's sharding does not change)."""
    args = ["--batch_size", "4", "--steps", "4", "--deterministic", "--grad_clip", "0.5"]
    _train_fp8(args + ["--grad_accum", "2"], tmp_path / "single")
    ref = json.loads((tmp_path / "single" / "metrics.json").read_text())
    for mode in ("--ddp", "--fsdp"):
        out = tmp_path / mode.strip("-")
        _train_fp8(args + [mode], out, ranks=WORLD)
        got = json.loads((out / "metrics.json").read_text())
        assert got["tokens_per_step"] == ref["tokens_per_step"]
        assert got["train_loss"] == ref["train_loss"], mode


# --------------------------------------------- FP8 all-gather with uneven shards (3 ranks)

def _uneven_worker(rank, world, tmp):
    """A 48 -> 16 Fp8Linear on 3 ranks: FSDP2 shards its 16 rows 6 / 6 / 4 and pads the last
    shard. The FP8 all-gather must give the plain FSDP2 run's losses and gradients."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    out = {}
    try:
        for ag in (False, True):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(32, 48), nn.GELU(), nn.Linear(48, 16))
            for i in (0, 2):
                model[i] = Fp8Linear.from_linear(model[i], Fp8Config(amax_history_len=4))
                model[i].fp8_on_cpu = True
            if ag:
                fp8ops.enable_fsdp_fp8_all_gather(model)
            for i in (0, 2):
                fully_shard(model[i])
            fully_shard(model)
            rows = model[2].weight.to_local().shape[0]
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(1)
            rec = {"rows": rows, "loss": [], "grads": []}
            for _ in range(STEPS):
                x, y = torch.randn(16, 32, generator=g) * 3, torch.randn(16, 16, generator=g)
                F.mse_loss(model(x), y).backward()
                rec["grads"].append([_full(p.grad).clone() for p in model.parameters()])
                opt.step()
                opt.zero_grad()
                rec["loss"].append(F.mse_loss(model(x), y).item())
            out[ag] = rec
    finally:
        torch.save(out, f"{tmp}/uneven{rank}.pt")
        _teardown()
    _leave()


@requires_fsdp2
def test_fsdp2_fp8_all_gather_uneven_shards(tmp_path):
    import torch.multiprocessing as mp
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        mp.spawn(_uneven_worker, args=(3, str(tmp_path)), nprocs=3, join=True)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    res = [torch.load(tmp_path / f"uneven{r}.pt", weights_only=False) for r in range(3)]
    assert [r[True]["rows"] for r in res] == [6, 6, 4]
    for r in res:
        assert r[True]["loss"] == r[False]["loss"]
        for got, ref in zip(r[True]["grads"], r[False]["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(got, ref))


# ------------------------------- a layer some ranks do not run in a step (2 ranks)

SKIP_STEPS = 4


def _experts():
    torch.manual_seed(0)
    experts = nn.ModuleList([nn.Linear(32, 32), nn.Linear(32, 32)])
    for i in range(2):
        experts[i] = Fp8Linear.from_linear(experts[i], Fp8Config(amax_history_len=3, policy="always"))
        experts[i].fp8_on_cpu = True
    return experts


def _route(experts, rank, step):
    """Rank 1 routes no token to expert 1 at step 0 (does not call it) and gives it an empty
    batch at step 1; no rank calls it at step 2; both do at step 3."""
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank * 10 + step)) * (1 + rank + step)
    y = experts[0](x).sum()
    if step == 3 or (rank == 0 and step != 2):
        y = y + experts[1](x * 10).sum()
    elif rank == 1 and step == 1:
        y = y + experts[1](x[:0]).sum()
    y.backward()


def _skipped_layer_worker(rank, world, tmp):
    """The step-end amax all-reduce must pair up whichever layers each rank ran (before the
    fix: gloo's size mismatch, then an abort)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world)
    rec = []
    try:
        experts = _experts()
        opt = torch.optim.SGD(experts.parameters(), lr=0.0)
        for step in range(SKIP_STEPS):
            _route(experts, rank, step)
            opt.step()
            rec.append([(e.fp8_amax_history.clone(), e.fp8_scale.clone(), e._fp8_delayed_ready) for e in experts])
    finally:
        torch.save(rec, f"{tmp}/skipped{rank}.pt")
        _teardown()
    _leave()


def test_layer_skipped_on_some_ranks_keeps_one_process_histories(tmp_path):
    """2 ranks keep the amax histories (and so the scales) of one process that runs the ranks'
    batches as micro-batches, also where a layer ran on one rank or on none."""
    import torch.multiprocessing as mp
    mp.spawn(_skipped_layer_worker, args=(WORLD, str(tmp_path)), nprocs=WORLD, join=True)
    r0, r1 = (torch.load(tmp_path / f"skipped{r}.pt", weights_only=False) for r in range(WORLD))
    experts = _experts()
    opt = torch.optim.SGD(experts.parameters(), lr=0.0)
    for step in range(SKIP_STEPS):
        for rank in range(WORLD):
            _route(experts, rank, step)
        opt.step()
        for e, expert in enumerate(experts):
            for rec in (r0, r1):
                hist, scale, _ = rec[step][e]
                assert torch.equal(hist, expert.fp8_amax_history), (step, e)
                assert torch.equal(scale, expert.fp8_scale), (step, e)
    assert r0[2][1][0][1].gt(0).all() and not r0[2][1][0][-1].any()   # step 2 rolled a zero row
    # rank 1 cast nothing of expert 1 before step 3: it casts its first call with current scales
    assert r0[0][1][2] and not r1[2][1][2] and r1[3][1][2]


def _own_model(rank):
    """Each rank's own model (pipeline stages, or independent models of one launch): rank 1's
    inputs are 100x rank 0's."""
    torch.manual_seed(rank)
    m = nn.Sequential(nn.Linear(32, 32))
    m[0] = Fp8Linear.from_linear(m[0], Fp8Config(amax_history_len=4, policy="always"))
    m[0].fp8_on_cpu = True
    return m


def _train_own(m, rank, steps=3):
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    g = torch.Generator().manual_seed(7 + rank)
    for _ in range(steps):
        m(torch.randn(16, 32, generator=g) * (1 + 99 * rank)).sum().backward()
        opt.step()
        opt.zero_grad()
    return m[0].fp8_scale.clone()


def _scaling_group_worker(rank, world, tmp):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        own = [dist.new_group([r]) for r in range(world)]  # (every rank makes every group)
        m = _own_model(rank)
        assert fp8ops.set_scaling_group(m, "local") == 1
        out["local"] = _train_own(m, rank)
        m = _own_model(rank)
        fp8ops.set_scaling_group(m, own[rank])
        out["own_group"] = _train_own(m, rank)
        if rank == 0:  # a model only rank 0 steps, while rank 1 waits: no collective to join
            m = _own_model(rank)
            fp8ops.set_scaling_group(m, "local")
            out["alone"] = _train_own(m, rank)
        dist.barrier()
    finally:
        torch.save(out, f"{tmp}/group{rank}.pt")
        _teardown()
    _leave()


def test_a_scaling_group_keeps_the_amaxes_to_its_ranks(tmp_path):
    """Ranks that do not hold copies of one model (pipeline stages, several models) reduce
    their amaxes over their own group, or none: each rank's scales are those of its own data
    in one process (over every rank, rank 0's input scale would be rank 1's, 100x too small;
    a model only rank 0 steps would wait on rank 1 for good)."""
    import torch.multiprocessing as mp
    mp.spawn(_scaling_group_worker, args=(WORLD, str(tmp_path)), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"group{rank}.pt", weights_only=False)
        want = _train_own(_own_model(rank), rank)
        assert torch.equal(got["local"], want) and torch.equal(got["own_group"], want), rank
        if rank == 0:
            assert torch.equal(got["alone"], want)


def test_set_scaling_group_refuses_other_values():
    with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup or \"local\", found int"):
        fp8ops.set_scaling_group(nn.Sequential(Fp8Linear(16, 16)), 3)
