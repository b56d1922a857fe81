"""torch.compile and the order of forwards and backwards (README, "Limitations").

Compiled code saves what a backward reads with torch's version check, and a second
compiled forward of the same layers may run before the first one's backward: two calls
summed into one loss (siamese pairs, R-Drop, DPO's chosen and rejected run apart), a
no_grad forward in between (a metric), pipeline schedules (several micro-batches'
forwards, then their backwards). Until the thirty-third session a layer's compiled
backward wrote the amax history, which its forward writes too, and those orders raised
"modified by an inplace operation"; now it folds dy's amax into fp8_grad_amax, which the
optimizer step folds into the history (linear._scaled_grad_output, scaling.fold_grad_amax).
These tests train the same steps eager and compiled, and compare them step by step."""
import contextlib
import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import fp8ops
from fp8ops._reference import sqnr
from fp8ops.linear import G, W, X, Fp8Linear

from conftest import FP8_DEVICES, convert_as_on_fp8_gpu, requires_fp8

# compiled against eager: inductor computes the LayerNorm and the loss otherwise than eager
# code, to rounding; on the CPU reference kernels that moves no FP8 step, on CUDA (inductor's
# own kernels) a few, each a whole FP8 step of the values downstream
GRAD_DB = {"cpu": 30, "cuda": 20}
STATE_RTOL = {"cpu": 1e-3, "cuda": 1e-2}


def _model(monkeypatch, recipe, device="cpu"):
    torch.manual_seed(0)
    base = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    if device == "cpu":
        return convert_as_on_fp8_gpu(base, monkeypatch, recipe=recipe)
    return fp8ops.convert(base.to(device), config=fp8ops.Fp8Config(policy="always", recipe=recipe))


def _state(model):
    return [(m.fp8_amax_history.clone(), m.fp8_scale.clone()) for m in model.modules() if isinstance(m, Fp8Linear)]


def _overflows(model):
    return [m.fp8_overflow_count.clone() for m in model.modules() if isinstance(m, Fp8Linear)]


def _assert_states_match(s1, s2, recipe, step, rtol=1e-3):
    """Every layer's amax history and scales alike. Under current scaling compiled code
    keeps dy's amax of the step's calls as their max and sets dy's scale from it
    (scaling.fold_grad_amax), where eager code keeps the last call's: there the dy column
    is left out (each cast's own scale is the same: the gradients check it)."""
    cols = slice(None) if recipe == "delayed" else slice(0, 2)
    for (h1, sc1), (h2, sc2) in zip(s1, s2):
        assert torch.allclose(h1[:, cols], h2[:, cols], rtol=rtol), f"step {step}"
        assert torch.allclose(sc1[cols], sc2[cols], rtol=rtol), f"step {step}"


def _pair_loss(fn, x1, x2):
    return fn(x1).square().mean() + 7 * fn(x2).square().mean()


def _train(model, fn, order, device, steps=6):
    """`steps` optimizer steps, each running `order` (_order) on two fresh inputs of
    different range; per step the losses, parameter gradients, scaling state and counts."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(1)
    out = []
    for _ in range(steps):
        losses = _order(fn, torch.randn(32, 32, device=device), 5 * torch.randn(32, 32, device=device), order)
        out.append((losses, [p.grad.clone() for p in model.parameters()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[-1] += (_state(model), _overflows(model))
    return out


def _assert_runs_match(runs, recipe, device):
    for i, ((l1, g1, s1, o1), (l2, g2, s2, o2)) in enumerate(zip(*runs)):
        for a, b in zip(l1, l2):
            assert torch.allclose(a, b, rtol=1e-2), f"step {i}"
        for a, b in zip(g1, g2):
            assert sqnr(a, b) >= GRAD_DB[device], f"step {i}"
        _assert_states_match(s1, s2, recipe, i, STATE_RTOL[device])
        assert all(torch.equal(a, b) for a, b in zip(o1, o2)), f"step {i}"


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_two_forwards_in_one_compiled_call_train_like_eager(monkeypatch, recipe):
    """Two inputs of different range through one model per step, both forwards and the loss
    in one compiled function: the losses, the parameter gradients and every layer's amax
    history and scales follow eager's two calls over four steps. (A concatenated batch, one
    forward, is the other way; it casts both inputs with one scale, so it is not compared
    with two eager calls here.)"""
    base = _model(monkeypatch, recipe)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        def loss_of(x1, x2, model=model):
            return _pair_loss(model, x1, x2)
        if compiled:
            loss_of = torch.compile(loss_of)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        torch._dynamo.reset()
        torch.manual_seed(1)
        steps = []
        for _ in range(4):
            loss = loss_of(torch.randn(32, 32), 5 * torch.randn(32, 32))
            loss.backward()
            steps.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
            opt.step()
            opt.zero_grad(set_to_none=True)
            steps[-1] += (_state(model),)
        runs.append(steps)
    for i, ((l1, g1, s1), (l2, g2, s2)) in enumerate(zip(*runs)):
        assert torch.allclose(l1, l2, rtol=1e-2), f"step {i}"
        for a, b in zip(g1, g2):
            assert sqnr(a, b) >= 30, f"step {i}"
        _assert_states_match(s1, s2, recipe, i)  # (row 0 of the dy column: the max over both calls)


def _order(fn, x1, x2, order):
    """One step's forwards and backwards in `order`; returns the losses."""
    if order == "summed":  # two calls, one loss
        loss = _pair_loss(fn, x1, x2)
        loss.backward()
        return [loss.detach()]
    if order == "no_grad between":  # an evaluation's forward between a forward and its backward
        loss = fn(x1).square().mean()
        with torch.no_grad():
            fn(x2)
        loss.backward()
        return [loss.detach()]
    if order == "summed, tensor weight":
        # (the weight as a tensor: under compiled autograd a Python number in the loss fails
        # torch 2.11's inductor on CUDA, for plain nn.Linear as well: an int passed to .item())
        loss = fn(x1).square().mean() + torch.tensor(7.0, device=x1.device) * fn(x2).square().mean()
        loss.backward()
        return [loss.detach()]
    if order == "one call":
        loss = fn(x1).square().mean()
        loss.backward()
        return [loss.detach()]
    # "pipeline": both micro-batches' forwards, then both backwards (GPipe's order; the
    # weight a tensor for the reason above)
    l1, l2 = fn(x1).square().mean(), torch.tensor(7.0, device=x1.device) * fn(x2).square().mean()
    l1.backward()
    l2.backward()
    return [l1.detach(), l2.detach()]


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("order", ["summed", "no_grad between", "pipeline"])
def test_a_second_compiled_call_before_the_backward_trains_like_eager(monkeypatch, device, recipe, order):
    """Compiled calls of the same layers in the orders eager code runs: a second forward
    (with or without grad) before the first one's backward, which raised torch's "modified
    by an inplace operation" before. Six steps, each with an optimizer step: the first on
    current scales (delayed scaling's first step), the rest delayed scaling's with its
    fused LayerNorm and GELU (the GELU's gradient in c_fc's cast, inductor's pass); losses,
    parameter gradients, every layer's amax history, scales and NaN/inf counts follow
    eager's (under delayed scaling the dy column too: the max of both calls' amaxes)."""
    base = _model(monkeypatch, recipe, device)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        fn = torch.compile(model) if compiled else model
        torch._dynamo.reset()
        runs.append(_train(model, fn, order, device))
    _assert_runs_match(runs, recipe, device)


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("order", ["one call", "summed, tensor weight", "no_grad between", "pipeline"])
@pytest.mark.parametrize("forward", ["compiled", "eager"])
def test_compiled_autograd_trains_like_eager(monkeypatch, device, recipe, order, forward):
    """Compiled autograd (torch._dynamo.compiled_autograd._enable(torch.compile) around the
    forwards and the backward, as torchtitan's --compile.enable_compiled_autograd sets it)
    over compiled forwards: the first backward failed in torch (an IndexError in
    call_aot_bwd_prologue) while the compiled backward read the scales it held on its
    autograd context; they are saved with save_for_backward now (linear._keep_scales). Over
    compiled and eager forwards, in the orders above, it trains as eager code without it
    does, scaling state included (and dy's amaxes reach every layer's history, which
    _assert_runs_match leaves out under the current recipe), and the backward ran compiled
    autograd's graph. (torch._dynamo.reset() before entering: inside, it switches compiled
    autograd off.)"""
    from torch._dynamo.utils import counters  # noqa: PLC0415
    base = _model(monkeypatch, recipe, device)
    runs = []
    for under_ca in (False, True):
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model) if under_ca and forward == "compiled" else model
        with torch._dynamo.compiled_autograd._enable(torch.compile) if under_ca else contextlib.nullcontext():
            runs.append(_train(model, fn, order, device, steps=4))
    assert counters["compiled_autograd"]["captures"] >= 1
    _assert_runs_match(runs, recipe, device)
    for step in runs[1]:
        assert all(h[:, G].abs().sum() > 0 for h, _ in step[2])


class _SwiGLU(nn.Module):
    def forward(self, x):
        a, b = torch.chunk(x, 2, -1)
        return b * nn.functional.silu(a)


class _Checkpointed(nn.Module):
    """LayerNorm -> Linear -> GELU -> Linear, its MLP under activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 64)
        self.act, self.proj = nn.GELU(approximate="tanh"), nn.Linear(64, 32)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda h: self.proj(self.act(self.fc(self.ln(h)))), x,
                                                 use_reentrant=False)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("kind", ["e5m2", "swiglu", "checkpointed"])
def test_compiled_autograd_trains_the_other_paths_like_eager(monkeypatch, recipe, kind):
    """The other autograd paths under compiled autograd over compiled forwards (CPU
    reference kernels): the all-E5M2 format's emulated GEMMs, the fused SwiGLU input and
    activation checkpointing inside the compiled model train as eager code does, dy's
    amaxes reaching every layer."""
    from torch._dynamo.utils import counters  # noqa: PLC0415
    torch.manual_seed(0)
    if kind == "swiglu":
        plain = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 128), _SwiGLU(), nn.Linear(64, 32))
    elif kind == "checkpointed":
        plain = _Checkpointed()
    else:
        plain = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    base = convert_as_on_fp8_gpu(plain, monkeypatch, recipe=recipe,
                                 **({"fp8_format": "e5m2"} if kind == "e5m2" else {}))
    # (delayed scaling: the SwiGLU fused into c_proj's input cast; the current recipe fuses nothing)
    assert kind != "swiglu" or base[3].fp8_swiglu_input == (recipe == "delayed")
    runs = []
    for under_ca in (False, True):
        model = copy.deepcopy(base)
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model) if under_ca else model
        with torch._dynamo.compiled_autograd._enable(torch.compile) if under_ca else contextlib.nullcontext():
            runs.append(_train(model, fn, "one call", "cpu", steps=4))
    assert counters["compiled_autograd"]["captures"] >= 1
    _assert_runs_match(runs, recipe, "cpu")
    for step in runs[1]:
        assert len(step[2]) == 2 and all(h[:, G].abs().sum() > 0 for h, _ in step[2])


@pytest.mark.gpu
@pytest.mark.fp8
@requires_fp8
@pytest.mark.parametrize("order", ["one call", "pipeline"])
def test_cuda_graphs_compiled_trains_like_eager(order):
    """mode="reduce-overhead" (CUDA graphs, whose trees copy inputs that are not static
    into their own memory before a replay): the compiled backward's dy amax reaches the
    layer's own fp8_grad_amax (a buffer: a static input) and the history, as eager's."""
    base = _model(None, "delayed", "cuda")
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        fn = torch.compile(model, mode="reduce-overhead") if compiled else model
        torch._dynamo.reset()
        runs.append(_train(model, fn, order, "cuda"))
    _assert_runs_match(runs, "delayed", "cuda")


def test_a_scaling_state_saved_between_backward_and_step_holds_dy_amax(monkeypatch):
    """scaling_state_dict folds what compiled backwards left in fp8_grad_amax into the
    history first: a checkpoint taken before the optimizer step holds dy's amax in row 0,
    as eager code's does, and the buffer is 0 afterwards."""
    base = _model(monkeypatch, "delayed")
    rows = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        fn = torch.compile(model) if compiled else model
        torch._dynamo.reset()
        torch.manual_seed(1)
        fn(torch.randn(32, 32)).square().mean().backward()
        if compiled:
            assert all(m.fp8_amax_history[0, 2] == 0 and m.fp8_grad_amax.item() > 0
                       for m in model.modules() if isinstance(m, Fp8Linear))
        state = fp8ops.scaling_state_dict(model)
        rows.append(torch.stack([s["amax_history"][0] for s in state.values()]))
        assert all(m.fp8_grad_amax.item() == 0 for m in model.modules() if isinstance(m, Fp8Linear))
    assert bool((rows[0][:, 2] > 0).all()) and torch.allclose(rows[0], rows[1], rtol=1e-3)


def test_a_layer_pickled_before_the_compiled_amax_slot_trains_compiled(monkeypatch):
    """A whole model pickled by an fp8ops from before fp8_grad_amax and the fp8_config property
    (simulated: the buffer removed, the config under its old key, before pickling) gets the
    buffer back and its config under the property when unpickled, and trains compiled."""
    import pickle  # noqa: PLC0415

    model = _model(monkeypatch, "delayed")
    configs = []
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            del m._buffers["fp8_grad_amax"]
            m._non_persistent_buffers_set.discard("fp8_grad_amax")
            configs.append(m.fp8_config)
            m.__dict__["fp8_config"] = m.__dict__.pop("_fp8_config")
    twin = pickle.loads(pickle.dumps(model))
    layers = [m for m in twin.modules() if isinstance(m, Fp8Linear)]
    assert [m.fp8_config for m in layers] == configs and all("fp8_config" not in m.__dict__ for m in layers)
    assert all(m.fp8_grad_amax.shape == (1,) and m.fp8_grad_amax.item() == 0 for m in layers)
    assert "fp8_grad_amax" not in twin.state_dict()
    fn = torch.compile(twin)
    torch._dynamo.reset()
    for _ in range(2):
        fn(torch.randn(32, 32)).square().mean().backward()
        fp8ops.step(twin)
    assert all(bool((m.fp8_amax_history[-2:, 2] > 0).all()) for m in layers)


class _FrozenMiddle(nn.Module):
    """up (trains) -> mid (frozen: its input still needs the gradient) -> head (trains); a hook
    may put NaN into the gradient reaching mid's output."""

    def __init__(self):
        super().__init__()
        self.up, self.mid, self.head = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 16)
        self.poison = None

    def forward(self, x):
        h = self.mid(torch.relu(self.up(x)))
        if self.poison is not None and h.requires_grad:
            value = self.poison

            def hook(g):
                g = g.clone()
                g.view(-1)[0] = value
                return g
            h.register_hook(hook)
        return self.head(torch.relu(h))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_a_frozen_layer_records_dy_amax_and_nan_counts_compiled_as_eager(monkeypatch, recipe):
    """A layer no optimizer steps (frozen weight and bias, its input's gradient still needed: a
    LoRA base) stays on current scaling; its compiled backward's dy amax and NaN/inf count reach
    its buffers at the other layers' optimizer step (scaling.update_scales folds every live
    layer), as eager code records them per cast. A NaN in its dy at step 1."""
    torch.manual_seed(0)
    base = convert_as_on_fp8_gpu(_FrozenMiddle(), monkeypatch, recipe=recipe)
    for p in base.mid.parameters():
        p.requires_grad_(False)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        fn = torch.compile(model) if compiled else model
        torch._dynamo.reset()
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
        torch.manual_seed(1)
        for step in range(4):
            model.poison = float("nan") if step == 1 else None
            fn(torch.randn(32, 32) * (1 + 3 * step)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        runs.append((model.mid.fp8_amax_history.clone(), model.mid.fp8_overflow_count.clone(),
                     model.mid.fp8_grad_amax.clone()))
    (h1, o1, _), (h2, o2, ga2) = runs
    assert torch.equal(o1, o2) and o1[G] >= 1  # (dy's NaN counted: one call per step, so once either way)
    assert ga2.item() == 0  # (folded at the last step)
    if recipe == "delayed":  # (under the current recipe the step's max, eager's last: one call, the same)
        assert torch.allclose(h1[0, G:], h2[0, G:], rtol=1e-3, equal_nan=True) and bool(h1[0, G].isnan())


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_the_step_sets_the_current_recipes_dy_scale_from_the_compiled_amax(monkeypatch, device):
    """scaling.fold_grad_amax under the current recipe, layer by layer: dy's scale from the
    step's compiled dy amax (fp8_max / amax; a zero, NaN or inf amax keeps the scale, and a
    NaN/inf is counted), its scale_inv 1 / scale, that amax in row 0 of the history where it is
    not 0, fp8_grad_amax zeroed. On CUDA one launch
    serves all layers (amax_update_many), on the CPU the checked op runs per layer."""
    from fp8ops import scaling  # noqa: PLC0415
    from fp8ops import linear as fp8_linear  # noqa: PLC0415

    base = nn.Sequential(*[nn.Linear(32, 32) for _ in range(5)])
    if device == "cpu":
        model = convert_as_on_fp8_gpu(base, monkeypatch, recipe="current")
    else:
        model = fp8ops.convert(base.to(device), config=fp8ops.Fp8Config(policy="always", recipe="current"))
    layers = list(model)
    amaxes = [0.0, 3.5, float("nan"), float("inf"), 0.25]
    held = [0.0, 0.0, 0.0, 1.0, 1.0]  # row 0's dy amax before the fold
    for m, a, r0 in zip(layers, amaxes, held):
        m.fp8_grad_amax.fill_(a)
        m.fp8_amax_history[0, G] = r0
        m.fp8_scale[G] = 2.0
        m.fp8_scale_inv[G] = 0.5
    versions = [m.fp8_scale_inv._version for m in layers]
    monkeypatch.setattr(fp8_linear, "_TRACES", [1])
    scaling.fold_grad_amax(layers)
    for m, a, r0, v in zip(layers, amaxes, held, versions):
        fmax = float(m.fp8_max[G])
        ok = a == a and a not in (0.0, float("inf"))
        want = torch.tensor(fmax, dtype=torch.float32) / torch.tensor(a, dtype=torch.float32) if ok else torch.tensor(2.0)
        assert float(m.fp8_scale[G]) == float(want), (a, float(m.fp8_scale[G]))
        assert float(m.fp8_scale_inv[G]) == float(1 / want), a
        assert int(m.fp8_overflow_count[G]) == (0 if a == a and a != float("inf") else 1), a
        row0 = float(m.fp8_amax_history[0, G])
        assert (row0 != row0) if a != a else row0 == (a if a != 0 else r0), (a, row0)
        assert float(m.fp8_grad_amax) == 0.0
        # (no version counter moves: an eager backward still to come, which sets dy's scale itself under
        # current scaling, is not refused when the report or a saved state folds before it)
        assert m.fp8_scale_inv._version == v
        assert float(m.fp8_scale[X]) == 1.0 and float(m.fp8_scale[W]) == 1.0  # (x's and w's: untouched)


def test_a_fold_refused_by_one_layer_counts_nothing_twice(monkeypatch):
    """A layer whose buffers the checked op refuses (a user's float64 fp8_grad_amax) makes the
    step's fold raise; the layers before it are folded whole or not at all, so the next fold
    counts no NaN twice and leaves no amax behind."""
    from fp8ops import scaling  # noqa: PLC0415
    from fp8ops import linear as fp8_linear  # noqa: PLC0415

    model = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)),
                                  monkeypatch, recipe="current")
    first, bad, delayed = model
    delayed.fp8_config = fp8ops.Fp8Config(policy="always", recipe="delayed", amax_history_len=1)
    first.fp8_grad_amax.fill_(float("nan"))
    delayed.fp8_grad_amax.fill_(float("inf"))
    bad._buffers["fp8_grad_amax"] = torch.zeros(1, dtype=torch.float64)
    monkeypatch.setattr(fp8_linear, "_TRACES", [1])
    # (the amaxes set by hand: no record of compiled writes, so every layer is read, as after a
    # CUDA graph captured one)
    monkeypatch.setattr(scaling, "_written_grad_amaxes", lambda: None)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="float32"):
            scaling.fold_grad_amax([first, delayed, bad])
    assert int(first.fp8_overflow_count[G]) == 1 and float(first.fp8_grad_amax) == 0.0
    assert bool(first.fp8_amax_history[0, G].isnan())
    # (the delayed layer after it in the batch: not folded yet, and not counted either)
    assert int(delayed.fp8_overflow_count[G]) == 0 and float(delayed.fp8_grad_amax) == float("inf")


# The record of undeclared amax writes (csrc/amax_writes.c) answers "every slot" for good once a
# CUDA graph captured such a write, as test_cuda_graphs_compiled_trains_like_eager's do: its
# tests run in a process of their own.
_RECORD_PRELUDE = """
import torch, torch.nn as nn
import fp8ops, fp8ops.conversion
from fp8ops import _loader, scaling
from fp8ops.linear import G
take = _loader._C.take_amax_writes
assert take() == set(), "the record starts empty"
def convert(model, recipe):  # (conftest.convert_as_on_fp8_gpu: the CPU reference kernels)
    fp8ops.conversion.fp8_supported_here = lambda device=None: (True, "ok")
    fp8ops.convert(model, config=fp8ops.Fp8Config(policy="always", recipe=recipe))
    for m in model.modules():
        m.fp8_on_cpu = True
    return model
"""


def _in_a_process_of_its_own(code: str, tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(fp8ops.__file__).resolve().parents[1])}
    p = subprocess.run([sys.executable, "-c", _RECORD_PRELUDE + textwrap.dedent(code) + "\nprint('ok')"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-6000:]


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_the_ops_that_write_dy_amax_undeclared_record_the_slot(device, tmp_path):
    """linear_bwd_sink and linear_bwd_cat (compiled backwards' casts of dy) note the amax slot
    they write (csrc/amax_writes.c), which the step's fold reads back; linear_bwd, whose write
    is declared, notes nothing."""
    _in_a_process_of_its_own(f"""
        device = {device!r}
        e4, f32 = torch.float8_e4m3fn, torch.float32
        M, N, K = 32, 48, 16
        gy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
        w8t, x8t = torch.randn(K, N, device=device).to(e4), torch.randn(K, M, device=device).to(e4)
        one = lambda: torch.ones(1, device=device, dtype=f32)
        st = fp8ops.ops.ST
        tail = (st[torch.float8_e5m2], st[torch.bfloat16], st[f32], True, True, False)
        slots = {{}}
        for name in ("linear_bwd", "linear_bwd_sink", "linear_bwd_cat"):
            amax = torch.zeros(1, device=device, dtype=f32)
            gys = (gy,) if name != "linear_bwd_cat" else (gy[:, :16], gy[:, 16:32], gy[:, 32:])
            gelu = (torch.empty(0, device=device, dtype=torch.bfloat16),) if name != "linear_bwd_cat" else ()
            getattr(torch.ops.fp8ops, name)(*gys, w8t, x8t, one(), amax, one(), one(), one(), *gelu, *tail)
            assert amax.item() > 0
            slots[name] = amax
        got = take()
        assert got == {{slots["linear_bwd_sink"].data_ptr(), slots["linear_bwd_cat"].data_ptr()}}, got
        assert take() == set()  # (taken: forgotten)
    """, tmp_path)


@pytest.mark.gpu
@pytest.mark.fp8
@requires_fp8
def test_a_captured_undeclared_amax_write_makes_the_record_every_slot(tmp_path):
    """A replay of a CUDA graph runs no host code, so nothing would note its writes: once
    linear_bwd_sink runs inside a capture, the record answers "every slot" (None) from then on,
    and the step's fold reads every live layer, as before the record. A fold being captured
    reads every layer too."""
    _in_a_process_of_its_own("""
        e4, f32, dev = torch.float8_e4m3fn, torch.float32, "cuda"
        gy = torch.randn(32, 48, device=dev, dtype=torch.bfloat16)
        w8t, x8t = torch.randn(16, 48, device=dev).to(e4), torch.randn(16, 32, device=dev).to(e4)
        one, amax = torch.ones(1, device=dev), torch.zeros(1, device=dev)
        st = fp8ops.ops.ST
        args = (gy, w8t, x8t, one, amax, one, one, one, torch.empty(0, device=dev, dtype=torch.bfloat16),
                st[torch.float8_e5m2], st[torch.bfloat16], st[f32], True, True, False)
        torch.ops.fp8ops.linear_bwd_sink(*args)  # (warm-up: cuBLASLt's handle, outside the capture)
        # a fold captured itself (an optimizer step in a CUDA graph) reads every layer at each
        # replay, whichever wrote: it neither trusts nor takes the record while capturing
        step_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step_graph):
            assert scaling._written_grad_amaxes() is None
            amax.add_(0)
        assert take() == {amax.data_ptr()}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.fp8ops.linear_bwd_sink(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert take() is None and take() is None
        layer = fp8ops.convert(nn.Linear(16, 16).cuda(), config=fp8ops.Fp8Config(policy="always"))
        fp8ops.linear._TRACES[0] += 1  # (as after a compiled FP8 forward)
        fp8ops.step(layer)  # (the fold's views made: from here on a slot is read only if noted, or always)
        layer.fp8_grad_amax.fill_(3.0)  # (as a replayed compiled backward leaves it)
        fp8ops.step(layer)
        assert layer.fp8_grad_amax.item() == 0 and layer.fp8_amax_history[:, G].max().item() == 3.0
    """, tmp_path)


def test_the_step_reads_only_the_dy_amaxes_compiled_backwards_wrote(tmp_path):
    """With a compiled FP8 forward in the process, each optimizer step folds fp8_grad_amax
    into the history for the layers whose compiled backward wrote it since (the ops note
    it), not for every live layer: an eager layer's slot is not read at its steps (a value
    left in it by hand stays; before, every step read it: a few launches per step, and three
    more per layer that waits for its first update). A compiled layer's slot is read at
    each step, its amax reaching row 0 as before (delayed scaling: rolled to the last row by
    the update; current: dy's scale from it)."""
    _in_a_process_of_its_own("""
        for recipe in ("delayed", "current"):
            torch.manual_seed(0)
            eager = convert(nn.Sequential(nn.Linear(32, 32)), recipe)
            compiled = convert(nn.Sequential(nn.Linear(32, 32)), recipe)
            fn = torch.compile(compiled)
            torch._dynamo.reset()
            opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (eager, compiled)]
            for step in range(3):
                x = torch.randn(32, 32)
                eager(x).square().mean().backward()
                fn(x).square().mean().backward()
                written = compiled[0].fp8_grad_amax.item()
                assert written > 0  # (compiled backward's dy amax, not yet in the history)
                if step == 2:
                    eager[0].fp8_grad_amax.fill_(1e9)  # read by no step: no compiled backward wrote it
                for opt in opts:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                assert compiled[0].fp8_grad_amax.item() == 0 and scaling._WRITTEN == set()  # folded
                if recipe == "delayed":
                    assert compiled[0].fp8_amax_history[-1, G].item() == written
                else:
                    assert abs(compiled[0].fp8_scale[G].item() / (57344.0 / written) - 1) < 1e-6
            assert eager[0].fp8_grad_amax.item() == 1e9
            assert eager[0].fp8_amax_history.max().item() < 1e9 and eager[0].fp8_scale[G].item() > 1e-3
    """, tmp_path)


def test_a_fold_that_raises_forgets_no_recorded_slot(tmp_path):
    """The record keeps a slot until a fold has folded it: where a later layer's buffers make
    the fold raise, the next fold still reads the slots the failed one had reached (and the
    refusing layer raises again), so no compiled dy amax is lost or folded a step late."""
    _in_a_process_of_its_own("""
        model = convert(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)), "current")
        first, bad, delayed = model
        delayed.fp8_config = fp8ops.Fp8Config(policy="always", recipe="delayed", amax_history_len=1)
        fp8ops.linear._TRACES[0] += 1  # (as after a compiled FP8 forward)
        scaling.fold_grad_amax([first, delayed])  # (an earlier step: the fold's views made)
        e4, f32, st = torch.float8_e4m3fn, torch.float32, fp8ops.ops.ST
        # a compiled backward's cast of dy writes delayed's slot (and notes it)
        torch.ops.fp8ops.linear_bwd_sink(torch.full((16, 16), 7.0), torch.ones(16, 16).to(e4),
                                         torch.ones(16, 16).to(e4), torch.ones(1), delayed.fp8_grad_amax,
                                         torch.ones(1), torch.ones(1), torch.ones(1), torch.empty(0),
                                         st[torch.float8_e5m2], st[f32], st[f32], True, True, False)
        assert delayed.fp8_grad_amax.item() == 7.0
        bad._buffers["fp8_grad_amax"] = torch.zeros(1, dtype=torch.float64)  # refused by the checked op
        for _ in range(2):
            try:
                scaling.fold_grad_amax([first, delayed, bad])
                raise AssertionError("the fold did not raise")
            except RuntimeError as e:
                assert "float32" in str(e), e
        assert delayed.fp8_grad_amax.item() == 7.0  # (not folded, and still recorded)
        bad._buffers["fp8_grad_amax"] = torch.zeros(1)
        scaling.fold_grad_amax([first, delayed, bad], every_live=True)
        assert delayed.fp8_grad_amax.item() == 0.0 and delayed.fp8_amax_history[0, G].item() == 7.0
        assert scaling._WRITTEN == set()  # (and the refused buffer's slot, no live layer's now, forgotten)
    """, tmp_path)
