"""Numerical guards, end to end: NaN and +inf injected into activations or
gradients in the middle of training never turn an FP8 scale into 0, inf or
NaN; each NaN/inf amax is counted per tensor (Fp8Linear.fp8_overflow_count
[x, w, g], report's "overflows" and "overflow_x/w/g") and visible in TensorBoard (the example's per-layer amax);
training goes on with finite losses and the scales adapt again.

The model is a small MLP whose three linears are Fp8Linear. On CPU the FP8
path runs through the C reference kernels (`fp8_on_cpu = True`); the same
tests run on CUDA on an FP8 GPU (gpu/fp8 markers).

How the training loop treats a poisoned step (both are what real loops do):
  "skip": like torch.amp.GradScaler, optimizer.step() is skipped when any
          gradient is non-finite. The optimizer hook then does not run, the
          NaN/inf amax stays in the history's current row and is counted at
          the next optimizer step.
  "zero": non-finite gradients are zeroed and the step runs (the parameters
          keep their values up to weight decay); the hook counts the overflow
          in the same step.

Checked after every step, for every layer: scale and scale_inv finite and > 0;
when the optimizer stepped, the new history/scale/scale_inv are bit-identical
to fp8ops._reference.amax_update_ref applied to the state just before the step,
and each tensor's overflow counter grew by one exactly when that state's
current row held a NaN/inf amax for it; when it did not step, nothing changed.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops import Fp8Config, ops
from fp8ops._reference import amax_update_ref
from fp8ops.linear import G, W, X, Fp8Linear

from conftest import FP8_DEVICES, requires_fp8

FLT_MAX = torch.finfo(torch.float32).max
NAN, INF = float("nan"), float("inf")
STEPS, AT, H = 20, 8, 4           # 20 steps, poison at step 8, amax history of 4 steps
LAYERS = ("up", "down", "head")
ROOT = Path(__file__).resolve().parent.parent

# which (layer, column) sees the non-finite amax, per injection
# the injections whose step has a NaN loss (a non-finite input reaches the output)
NAN_LOSS = {"act_nan", "act_inf"}

AFFECTED = {
    # a NaN input propagates through every layer, and its NaN loss into every gradient
    "act_nan": {(n, c) for n in LAYERS for c in (X, G)},
    # +inf becomes NaN in up's input cast (e4m3fn has no inf; finite values saturate):
    # from there on as a NaN input, as nn.Linear's inf output would go on; up's input amax is inf
    "act_inf": {(n, c) for n in LAYERS for c in (X, G)},
    # a NaN / +inf in the gradient reaching up's output: up's grad_output amax
    "grad_nan": {("up", G)},
    "grad_inf": {("up", G)},
}


def _poison(t: torch.Tensor, value: float) -> torch.Tensor:
    t = t.clone()
    t.view(-1)[0] = value
    return t


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)
        self.head = nn.Linear(32, 16)
        self.grad_poison = None          # written into the gradient reaching up's output

    def forward(self, x):
        h = self.up(x)
        if self.grad_poison is not None and h.requires_grad:
            v = self.grad_poison
            h.register_hook(lambda g: _poison(g, v))
        return self.head(self.down(torch.relu(h)))


def fp8_mlp(config: Fp8Config, device="cpu") -> MLP:
    # policy "always": on a GPU, "auto" would (rightly) run these tiny layers in BF16
    config = dataclasses.replace(config, policy="always")
    torch.manual_seed(0)
    model = MLP().to(device)
    for name in LAYERS:
        new = Fp8Linear.from_linear(getattr(model, name), config)
        new.fp8_on_cpu = device == "cpu"
        setattr(model, name, new)
    return model


def make_opt(name, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def layers(model) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


def assert_scales_ok(model, where: str):
    for n, m in layers(model).items():
        for buf in ("fp8_scale", "fp8_scale_inv"):
            t = getattr(m, buf).detach().float().cpu()
            assert torch.isfinite(t).all() and (t > 0).all(), f"{where}: {n}.{buf} = {t.tolist()}"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.detach().cpu().view(torch.int32), b.detach().cpu().view(torch.int32))


def train(model, opt_name, inject=None, mode="skip", device="cpu", steps=STEPS, at=AT, check_reference=True):
    """Train `steps` steps on a teacher task, poisoning step `at`; check the
    guards after every step; return one record per step."""
    opt = make_opt(opt_name, model)
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(32, 16, generator=gen) / 4
    lay = layers(model)
    records = []
    for step in range(steps):
        x = torch.randn(32, 32, generator=gen)
        target = torch.tanh(x @ teacher).to(device)     # from the clean input
        x = x.to(device)
        model.grad_poison = None
        if step == at and inject:
            kind, value = inject.split("_")
            value = NAN if value == "nan" else INF
            if kind == "act":
                x = _poison(x, value)
            else:
                model.grad_poison = value
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        grads_finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        before = {n: (m.fp8_amax_history.clone(), m.fp8_scale.clone(), m.fp8_scale_inv.clone(),
                      m.fp8_overflow_count.clone()) for n, m in lay.items()}
        stepped = True
        if not grads_finite:
            if mode == "skip":
                stepped = False
            else:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.zero_()
        if stepped:
            opt.step()
        where = f"step {step} ({inject}, {mode}, {opt_name})"
        assert_scales_ok(model, where)
        for n, m in lay.items():
            h, s, si, count = before[n]
            if not stepped:
                assert _same_bits(m.fp8_scale, s) and torch.equal(m.fp8_overflow_count, count), where
                continue
            # delayed: +1 for each tensor whose amax this step (row 0) was NaN/inf;
            # current scaling counts in the casts themselves, never in the step
            overflow = (~torch.isfinite(h[0])).long() if m.fp8_config.recipe == "delayed" else 0
            assert torch.equal(m.fp8_overflow_count, count + overflow), f"{where}: {n} overflow count"
            if check_reference and m.fp8_config.recipe == "delayed":
                cfg = m.fp8_config
                rh, rs, rsi = amax_update_ref(h, s, si, m.fp8_max, cfg.margin, cfg.amax_compute_algo)
                assert _same_bits(m.fp8_amax_history, rh), f"{where}: {n} history"
                assert _same_bits(m.fp8_scale, rs), f"{where}: {n} scale {m.fp8_scale.tolist()} vs {rs.tolist()}"
                assert _same_bits(m.fp8_scale_inv, rsi), f"{where}: {n} scale_inv"
        records.append({"loss": loss.item(), "stepped": stepped, "grads_finite": grads_finite,
                        "scale": {n: m.fp8_scale.detach().cpu().clone() for n, m in lay.items()},
                        "overflow": {n: int(m.fp8_overflow_count.sum()) for n, m in lay.items()}})
    return records


def _check_recovery(model, records, inject, mode):
    # the poisoned step: a NaN or inf input -> NaN loss; everything else stays finite
    for i, r in enumerate(records):
        if i == AT and inject in NAN_LOSS:
            assert math.isnan(r["loss"])
        else:
            assert math.isfinite(r["loss"]), f"step {i}: loss {r['loss']}"
    # non-finite gradients exactly at the injection's step
    assert [i for i, r in enumerate(records) if not r["grads_finite"]] == [AT]
    # counted once per affected tensor (the NaN stays in the history H steps, counted once)
    counts = {n: m.fp8_overflow_count.tolist() for n, m in layers(model).items()}
    assert counts == {n: [int((n, c) in AFFECTED[inject]) for c in (X, W, G)] for n in LAYERS}, counts
    rows = {r["name"]: r for r in fp8ops.report(model, print_table=False)}
    assert {n: [rows[n][f"overflow_{t}"] for t in "xwg"] for n in LAYERS} == counts
    assert {n: rows[n]["overflows"] for n in LAYERS} == {n: sum(c) for n, c in counts.items()}
    # the update that met the overflow kept the scale; the bad amax stays in the history
    # (the record of that step) but holds no later scale (the step-by-step values are
    # amax_update_ref's, checked in train), so the scale adapts again
    ov = next(i for i, r in enumerate(records) if i >= AT and r["stepped"])
    assert records[ov]["overflow"] != records[ov - 1]["overflow"]
    for n, col in AFFECTED[inject]:
        frozen = records[ov - 1]["scale"][n][col]
        assert records[ov]["scale"][n][col] == frozen, f"{n}[{col}] step {ov}: the scale must be kept"
        assert records[-1]["scale"][n][col] != frozen, f"{n}[{col}]: the scale never adapted again"
    # and it learns: the last steps' loss is below the first steps'
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < first, (first, last)


# ---------------------------------------------------------------------- CPU

@pytest.mark.parametrize("mode", ["skip", "zero"])
@pytest.mark.parametrize("inject", list(AFFECTED))
@pytest.mark.parametrize("opt_name", ["sgd", "adamw"])
def test_injection_mid_training_recovers(opt_name, inject, mode):
    model = fp8_mlp(Fp8Config(amax_history_len=H))
    records = train(model, opt_name, inject, mode)
    _check_recovery(model, records, inject, mode)


def test_clean_run_counts_no_overflow():
    model = fp8_mlp(Fp8Config(amax_history_len=H))
    records = train(model, "adamw", None)
    assert all(r["grads_finite"] and math.isfinite(r["loss"]) for r in records)
    assert all(r["overflows"] == 0 for r in fp8ops.report(model, print_table=False))


def test_report_table_shows_overflows(capsys):
    model = fp8_mlp(Fp8Config(amax_history_len=H))
    train(model, "sgd", "act_nan", "zero", steps=AT + 2)
    capsys.readouterr()
    rows = fp8ops.report(model)                          # prints the table
    # the NaN input reaches every layer's input and (NaN loss) every gradient
    assert [(r["name"], r["overflow_x"], r["overflow_w"], r["overflow_g"]) for r in rows] == [(n, 1, 0, 1) for n in LAYERS]
    table = capsys.readouterr().out.strip()
    header = table.splitlines()[1]
    col = header.index("ovf")
    for line in table.splitlines()[3:]:
        assert line[col:col + 3].strip() == "2", line


def test_report_amax_shows_the_overflowing_step():
    """Right after the update that met it, report's amax of that step is the NaN/inf."""
    model = fp8_mlp(Fp8Config(amax_history_len=H))
    train(model, "sgd", "act_inf", "zero", steps=AT + 1)
    row = {r["name"]: r for r in fp8ops.report(model, print_table=False)}["up"]
    assert row["amax_x"] == INF
    assert math.isfinite(row["scale_x"]) and row["scale_x"] > 0


def _train_fp8_module():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_fp8  # noqa: PLC0415
    finally:
        sys.path.remove(str(ROOT / "examples"))
    return train_fp8


def _logged_scalars(tmp_path, model, step):
    """What examples/train_fp8.py writes to TensorBoard for the FP8 layers."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415
    from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415

    train_fp8 = _train_fp8_module()
    writer = SummaryWriter(log_dir=str(tmp_path))
    train_fp8.log_fp8_state(writer, model, {"backend": "fp8ops"}, step)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_shows_the_overflowing_amax(tmp_path):
    model = fp8_mlp(Fp8Config(amax_history_len=H))
    train(model, "sgd", "act_inf", "zero", steps=AT + 1)
    scalars = _logged_scalars(tmp_path, model, AT + 1)
    assert scalars["fp8_amax/up/x"] == [INF]
    assert all(math.isfinite(v[0]) and v[0] > 0 for k, v in scalars.items() if k.startswith("fp8_scale/"))


def test_tensorboard_shows_a_gradient_filling_little_of_its_range(tmp_path):
    """After the gradients fall 10^4-fold, the example's TensorBoard shows each layer's dy
    filling ~1e-4 of its FP8 range under delayed scaling, x and w all of theirs."""
    model = fp8_mlp(Fp8Config())
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    for k in range(6):
        (model(x) * (1.0 if k < 3 else 1e-4)).sum().backward()
        opt.step()
        opt.zero_grad()
    scalars = _logged_scalars(tmp_path, model, 6)
    for name in LAYERS:
        assert scalars[f"fp8_range/{name}/x"] == [pytest.approx(1.0)]
        assert 0.5e-4 < scalars[f"fp8_range/{name}/g"][0] < 2e-4, scalars[f"fp8_range/{name}/g"]


def test_tensorboard_logs_overflow_count(tmp_path):
    model = fp8_mlp(Fp8Config(amax_history_len=H))
    train(model, "sgd", "act_nan", "zero", steps=AT + 3)
    scalars = _logged_scalars(tmp_path, model, AT + 3)
    # the NaN input: each layer's x and g amax, counted once each
    assert any("overflow" in tag and vals == [2.0] for tag, vals in scalars.items()), sorted(scalars)


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("where", ["input", "grad_output"])
def test_an_infinite_value_makes_the_loss_scaler_skip_as_with_nn_linear(where, recipe, device):
    """torch.amp.GradScaler skips a step whose gradients are not finite and lowers its scale.
    The casts saturate finite values beyond the scale's range, but an infinite one stays
    non-finite (NaN in e4m3fn, inf in e5m2), so it reaches the loss or the gradients as in
    nn.Linear. (Saturated, an inf gave a finite loss and finite gradients: the scaler took
    the step and lowered nothing.) Bias-free layers, as in Llama: a bias gradient, summed
    from dy in high precision, would show an inf in dy by itself."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False)).to(device)
    fp8 = copy.deepcopy(plain)
    for i in (0, 1):
        fp8[i] = Fp8Linear.from_linear(fp8[i], Fp8Config(policy="always", recipe=recipe))
        fp8[i].fp8_on_cpu = device == "cpu"

    def poison(t):
        t = t.clone()
        t[0, 0] = INF
        return t

    got = {}
    for name, model in (("nn.Linear", plain), ("fp8ops", fp8)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16)
        g = torch.Generator().manual_seed(1)
        for step in range(4):
            x = torch.randn(32, 32, generator=g).to(device)
            bad = step == 2
            if bad and where == "input":
                x = poison(x)
            h = model[0](x)
            if bad and where == "grad_output":
                h.register_hook(poison)
            scaler.scale(model[1](h).float().square().mean()).backward()
            before, scale = [p.detach().clone() for p in model.parameters()], scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            stepped = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
            got.setdefault(name, []).append((stepped, scaler.get_scale() < scale))
    assert got["fp8ops"] == got["nn.Linear"] == [(True, False), (True, False), (False, True), (True, False)], got
    for layer in fp8:
        assert torch.isfinite(layer.fp8_scale).all() and (layer.fp8_scale > 0).all()


# ----------------------------------------------------------- current scaling

@pytest.mark.parametrize("inject", list(AFFECTED))
def test_current_scaling_keeps_scales_finite(inject):
    model = fp8_mlp(Fp8Config(recipe="current"))
    records = train(model, "adamw", inject, "skip")
    for i, r in enumerate(records):
        assert math.isfinite(r["loss"]) or (i == AT and inject in NAN_LOSS)
    assert sum(r["loss"] for r in records[-3:]) < sum(r["loss"] for r in records[:3])


@pytest.mark.parametrize("inject", ["act_nan", "grad_inf"])
def test_current_scaling_counts_overflow(inject):
    model = fp8_mlp(Fp8Config(recipe="current"))
    train(model, "adamw", inject, "zero", steps=AT + 2)
    # current scaling counts casts that met a NaN/inf amax: a NaN activation
    # poisons x's cast and, through the loss, the gradient's cast of that step
    assert model.up.fp8_overflow_count.tolist() == ([1, 0, 1] if inject == "act_nan" else [0, 0, 1])


# ------------------------------------------------------------ scale rules

def _layer_after_one_call(config, x):
    lin = Fp8Linear(32, 16, config=config)
    lin.fp8_on_cpu = True
    y = lin(x)
    return lin, y


def test_nan_in_an_older_row_holds_no_scale():
    """A NaN already in the history (the record of an overflowed step, or restored from a
    saved scaling state) does not hold the scale: the max skips it (under algo max it would
    otherwise freeze the scale until it rolls out, amax_history_len steps), and it is not
    counted again."""
    lin = Fp8Linear(32, 16, config=Fp8Config(amax_history_len=H))
    lin.fp8_on_cpu = True
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)

    def step(amax):
        opt.zero_grad()
        lin(torch.full((16, 32), amax)).sum().backward()
        opt.step()
        assert_scales_ok(nn.Sequential(lin), f"amax {amax}")
        return lin.fp8_scale[X].item()

    assert [step(1.0) for _ in range(H)][-1] == 448.0
    with torch.no_grad():
        lin.fp8_amax_history[2, X] = NAN
    # the history's max without the NaN (2.0, this step's) gives the new scale at once
    assert [step(2.0) for _ in range(3)] == [224.0, 224.0, 224.0]
    assert int(lin.fp8_overflow_count.sum()) == 0       # counted when it happens (row 0), not again


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_tiny_amax_scale_clamped_to_flt_max(recipe):
    x = torch.full((16, 32), 1e-40)                      # fp32 subnormal: 448 / 1e-40 overflows
    lin, y = _layer_after_one_call(Fp8Config(recipe=recipe, amax_history_len=H), x)
    assert lin.fp8_scale[X].item() == FLT_MAX
    assert lin.fp8_scale_inv[X].item() == (1.0 / torch.tensor(FLT_MAX)).item() > 0
    assert torch.isfinite(y).all()
    ref = F.linear(x, lin.weight, lin.bias)
    torch.testing.assert_close(y, ref, rtol=1e-2, atol=1e-2)
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    y.sum().backward()
    opt.step()
    assert_scales_ok(nn.Sequential(lin), "after the update")
    assert lin.fp8_scale[X].item() == FLT_MAX


def test_zero_input_keeps_scale():
    lin, _ = _layer_after_one_call(Fp8Config(amax_history_len=H), torch.randn(16, 32))
    before = lin.fp8_scale[X].item()
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    for _ in range(H + 1):                               # only zeros in the whole history
        opt.zero_grad()
        lin(torch.zeros(16, 32)).sum().backward()
        opt.step()
    assert lin.fp8_scale[X].item() == before and int(lin.fp8_overflow_count.sum()) == 0


def test_a_margin_that_flushes_every_value_is_refused():
    """Fp8Config(margin=20) was taken and cast every value to 0 (99 % output error, no word):
    E4M3 spans 2**17.8 from its largest value to its smallest subnormal, E5M2 2**31.8."""
    assert Fp8Config(margin=16).margin == 16 and Fp8Config(margin=30, fp8_format="e5m2").margin == 30
    for margin, fmt in ((17, "hybrid"), (20, "e4m3"), (31, "e5m2")):
        with pytest.raises(ValueError, match=f"margin must be below .* for fp8_format '{fmt}' .* found {margin}"):
            Fp8Config(margin=margin, fp8_format=fmt)


@pytest.mark.parametrize("margin", [0, 1, 2, 3])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_margin_applied(margin, recipe):
    torch.manual_seed(0)
    x = torch.randn(16, 32) * 5
    lin, _ = _layer_after_one_call(Fp8Config(recipe=recipe, margin=margin, amax_history_len=H), x)
    amax_x = x.abs().max()
    expect = (torch.tensor(448.0) / amax_x) / 2.0 ** margin
    assert lin.fp8_scale[X].item() == expect.item()
    amax_w = lin.weight.detach().abs().max()
    assert lin.fp8_scale[W].item() == ((torch.tensor(448.0) / amax_w) / 2.0 ** margin).item()
    if recipe == "delayed":
        opt = torch.optim.SGD(lin.parameters(), lr=0.0)
        x2 = torch.randn(16, 32)
        lin(x2).sum().backward()
        opt.step()
        hist_max = torch.maximum(amax_x, x2.abs().max())
        assert lin.fp8_scale[X].item() == ((torch.tensor(448.0) / hist_max) / 2.0 ** margin).item()


@pytest.mark.parametrize("amax,margin", [(3e38, 40.0), (3e30, 63.0), (3e38, 63.0)])
def test_amax_update_underflow_keeps_previous_scale(amax, margin):
    """fp8_max / amax / 2**margin rounding to 0 keeps the previous scale (never 0)."""
    h, s, si, fm = torch.tensor([[amax]]), torch.tensor([2.0]), torch.ones(1), torch.tensor([448.0])
    ops.amax_update(h, s, si, fm, margin, "max")
    assert s.item() == 2.0 and si.item() == 0.5


def test_huge_finite_amax_with_margin_keeps_scale_usable():
    x = torch.randn(16, 32)
    x[0, 0] = 3e38                                        # finite
    lin, y = _layer_after_one_call(Fp8Config(margin=10, amax_history_len=H), x)
    assert_scales_ok(nn.Sequential(lin), "after the first call")
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("amax,margin", [(3e38, 10.0), (3e38, 20.0), (1e30, 40.0)])
def test_amax_update_scale_inv_stays_finite(amax, margin):
    h, s, si, fm = torch.tensor([[amax]]), torch.ones(1), torch.ones(1), torch.tensor([448.0])
    ops.amax_update(h, s, si, fm, margin, "max")
    assert s.item() > 0 and math.isfinite(si.item())


# ---------------------------------------------------------------------- GPU

@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("mode", ["skip", "zero"])
@pytest.mark.parametrize("inject", list(AFFECTED))
def test_injection_mid_training_recovers_cuda(inject, mode):
    model = fp8_mlp(Fp8Config(amax_history_len=H), device="cuda")
    records = train(model, "adamw", inject, mode, device="cuda")
    _check_recovery(model, records, inject, mode)


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("inject", list(AFFECTED))
def test_current_scaling_keeps_scales_finite_cuda(inject):
    model = fp8_mlp(Fp8Config(recipe="current"), device="cuda")
    records = train(model, "adamw", inject, "skip", device="cuda")
    assert all(math.isfinite(r["loss"]) or (i == AT and inject in NAN_LOSS) for i, r in enumerate(records))


def test_a_negative_or_conjugate_bit_view_is_refused_naming_the_argument():
    """A tensor with torch's negative bit (torch._neg_view, the .imag of a conjugated complex
    tensor) as an argument the op writes made torch's fallback free tensors still in use after
    amax_update (a () op), and the process abort (a probe's finding). Refused before any op
    runs, the argument named; the buffers are left as they were."""
    hist, scale = torch.tensor([[4.0], [0.0]]), torch.ones(1)
    for scale_inv in (torch._neg_view(torch.ones(1)), torch.tensor([2j]).conj().imag):
        with pytest.raises(ValueError, match=r"fp8ops::amax_update: scale_inv is a negative- or conjugate-bit "
                                             r"view .*resolve_neg\(\)"):
            ops.amax_update(hist, scale, scale_inv, torch.tensor([448.0]))
        assert torch.equal(hist, torch.tensor([[4.0], [0.0]])) and torch.equal(scale, torch.ones(1))
    x = torch.randn(16, 16)
    with pytest.raises(ValueError, match=r"fp8ops::cast_accumulate: x, amax are a negative- or conjugate-bit"):
        torch.ops.fp8ops.cast_accumulate(torch._neg_view(x), torch.ones(1), torch._neg_view(torch.zeros(1)),
                                         torch.float8_e4m3fn, False)
    with pytest.raises(ValueError, match=r"fp8ops::cast: scale is a negative"):
        torch.ops.fp8ops.cast(x, torch._neg_view(torch.ones(1)), torch.float8_e4m3fn, False)
    # (resolved, the same values run)
    ops.amax_update(hist, scale, torch._neg_view(torch.ones(1)).resolve_neg(), torch.tensor([448.0]))
    assert scale.item() == 448.0 / 4.0
