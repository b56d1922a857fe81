"""torch.compile and the order of forwards and backwards (README, "Limitations").

A converted layer's backward reads and writes its scaling buffers (dy's scale, the amax
history), which its forward writes too. Compiled code saves those buffers for the backward,
with torch's version check: a second compiled forward of the same layers before the first
one's backward (loss = f(x1) + f(x2) from two calls, or a no_grad forward in between) makes
that backward raise "modified by an inplace operation". Eager code runs it. What works
compiled: both forwards in one compiled call (concatenated batches, or a compiled function
that runs both), which these tests check against eager, step by step."""
import copy

import pytest
import torch
import torch.nn as nn

from fp8ops._reference import sqnr
from fp8ops.linear import Fp8Linear

from conftest import convert_as_on_fp8_gpu


def _model(monkeypatch, recipe):
    torch.manual_seed(0)
    base = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))
    return convert_as_on_fp8_gpu(base, monkeypatch, recipe=recipe)


def _state(model):
    return [(m.fp8_amax_history.clone(), m.fp8_scale.clone()) for m in model.modules() if isinstance(m, Fp8Linear)]


def _pair_loss(fn, x1, x2):
    return fn(x1).square().mean() + 7 * fn(x2).square().mean()


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_two_forwards_in_one_compiled_call_train_like_eager(monkeypatch, recipe):
    """Two inputs of different range through one model per step (a siamese pair, DPO's
    chosen and rejected), both forwards and the loss in one compiled function: the losses,
    the parameter gradients and every layer's amax history and scales follow eager's two
    calls over four steps. (A concatenated batch, one forward, is the other way; it casts
    both inputs with one scale, so it is not compared with two eager calls here.)"""
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
    # (inductor computes the LayerNorm and the loss otherwise than eager, to rounding)
    for i, ((l1, g1, s1), (l2, g2, s2)) in enumerate(zip(*runs)):
        assert torch.allclose(l1, l2, rtol=1e-2), f"step {i}"
        for a, b in zip(g1, g2):
            assert sqnr(a, b) >= 30, f"step {i}"
        for (h1, sc1), (h2, sc2) in zip(s1, s2):  # row 0 of both: the max over both inputs
            assert torch.allclose(h1, h2, rtol=1e-3) and torch.allclose(sc1, sc2, rtol=1e-3), f"step {i}"


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("between", ["training forward", "no_grad forward"])
def test_a_second_compiled_call_before_the_backward_raises(monkeypatch, recipe, between):
    """The documented limitation, pinned: eager code runs these orders, compiled code raises
    torch's version-check error in the backward (never a silent wrong result). When this
    test fails because the backward runs, turn it into a comparison with eager and drop
    the README's limitation."""
    model = _model(monkeypatch, recipe)
    x1, x2 = torch.randn(32, 32), 5 * torch.randn(32, 32)
    loss = _pair_loss(model, x1, x2)  # eager: runs
    loss.backward()
    fn = torch.compile(model)
    torch._dynamo.reset()
    y1 = fn(x1)
    if between == "training forward":
        loss = y1.square().mean() + fn(x2).square().mean()
    else:
        with torch.no_grad():
            fn(x2)
        loss = y1.square().mean()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
