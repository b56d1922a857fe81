"""Scaling rules a mutation review found no test for (CPU reference kernels): the default
format's gradient dtype, the margin on the gradient's scale, amax_compute_algo="most_recent"
on a layer, two forwards before one backward under current scaling, what a saved scaling
state restores (step count, primed or not), nested optimizers over part of a model, and the
SQNR helper every numerics test relies on."""
import torch
import torch.nn as nn

import fp8ops
from fp8ops._reference import sqnr
from fp8ops.config import Fp8Config
from fp8ops.linear import Fp8Linear

X, W, G = 0, 1, 2


def _layer(**cfg) -> Fp8Linear:
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, config=Fp8Config(**cfg))
    lin.fp8_on_cpu = True
    return lin


def test_sqnr_is_in_decibels_of_amplitude():
    x = torch.randn(1000, dtype=torch.float64)
    assert abs(sqnr(x, x * 1.1) - 20.0) < 1e-9
    assert abs(sqnr(x, x * (1 + 1e-3)) - 60.0) < 1e-6


def test_hybrid_is_e4m3_forward_e5m2_gradients():
    assert Fp8Config().dtypes() == (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)
    assert Fp8Linear(32, 16).fp8_max.tolist()[:3] == [448.0, 448.0, 57344.0]


def test_gradient_scale_uses_e5m2_range_and_the_margin():
    """Current scaling (and delayed scaling's first step): the gradient's scale is
    57344 / amax(g) / 2**margin, as the input's is 448 / amax(x) / 2**margin."""
    for recipe in ("current", "delayed"):
        for margin in (0, 2):
            lin = _layer(recipe=recipe, margin=margin, amax_history_len=4)
            x = torch.randn(16, 32)
            g = torch.randn(16, 16) * 3
            lin(x).backward(g)
            expect = (torch.tensor(57344.0) / g.abs().max()) / 2.0 ** margin
            assert lin.fp8_scale[G].item() == expect.item(), (recipe, margin)


def test_most_recent_scales_from_the_last_step_only():
    """amax_compute_algo="most_recent": after a step with 10x larger inputs, the next update
    scales from the last step's amax, not the history's max (what "max" would keep)."""
    scales = {}
    for algo in ("most_recent", "max"):
        lin = _layer(amax_compute_algo=algo, amax_history_len=4)
        opt = torch.optim.SGD(lin.parameters(), lr=0.0)
        torch.manual_seed(1)
        x = torch.randn(16, 32)
        for xi in (x * 10, x):
            lin(xi).sum().backward()
            opt.step()
            opt.zero_grad()
        scales[algo] = lin.fp8_scale[X].item()
    amax = x.abs().max()
    assert scales["most_recent"] == (torch.tensor(448.0) / amax).item()
    assert scales["max"] == (torch.tensor(448.0) / (amax * 10)).item()


def test_current_scaling_two_forwards_before_one_backward():
    """Each forward keeps its own input scale for its backward: two calls with inputs 100x
    apart, then one backward, give the weight gradient of the two calls done one by one."""
    torch.manual_seed(2)
    a, b = torch.randn(16, 32), torch.randn(16, 32) * 100
    lin = _layer(recipe="current")
    (lin(a).sum() + lin(b).sum()).backward()
    together = lin.weight.grad.clone()
    lin.weight.grad = None
    lin(a).sum().backward()
    lin(b).sum().backward()
    torch.testing.assert_close(together, lin.weight.grad, rtol=0, atol=0)


def test_a_loaded_state_keeps_the_step_count_and_primed_flag():
    """load_scaling_state_dict restores the step count (the update interval's phase: the next
    updates match the source's bit for bit) and whether delayed scaling was primed (a state
    saved before the first update casts the next step with current scales)."""
    torch.manual_seed(3)
    xs = [torch.randn(16, 32) for _ in range(4)]

    def model():
        torch.manual_seed(0)
        lin = Fp8Linear.from_linear(nn.Linear(32, 16), Fp8Config(interval=2, amax_history_len=4))
        lin.fp8_on_cpu = True
        return nn.Sequential(lin)

    def step(m, opt, x):
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()

    src = model()
    opt = torch.optim.SGD(src.parameters(), lr=0.0)
    step(src, opt, xs[0])
    state = fp8ops.scaling_state_dict(src)
    dst = model()
    fp8ops.load_scaling_state_dict(dst, state)
    assert dst[0].fp8_step == src[0].fp8_step == 1
    dst_opt = torch.optim.SGD(dst.parameters(), lr=0.0)
    for x in xs[1:]:
        step(src, opt, x)
        step(dst, dst_opt, x)
        assert torch.equal(src[0].fp8_scale, dst[0].fp8_scale)
    # saved after a cast, before any update: not primed
    fresh = model()
    fresh(xs[0] * 7).sum().backward()
    state = fp8ops.scaling_state_dict(fresh)
    again = model()
    fp8ops.load_scaling_state_dict(again, state)
    assert again[0]._fp8_delayed_ready is False
    again(xs[1]).sum().backward()
    assert again[0].fp8_scale[X].item() == (torch.tensor(448.0) / xs[1].abs().max()).item()


def test_nested_optimizers_over_part_of_the_model_update_every_layer_once_per_step():
    """An outer optimizer that steps an inner one over some of the parameters (SAM-like): the
    layers only the outer one owns are updated every step, the inner's once per step too."""
    torch.manual_seed(4)
    layers = [Fp8Linear.from_linear(nn.Linear(32, 32), Fp8Config(amax_history_len=4)) for _ in range(2)]
    for lin in layers:
        lin.fp8_on_cpu = True
    model = nn.Sequential(*layers)

    class Outer(torch.optim.SGD):
        def __init__(self, params, inner):
            super().__init__(params, lr=0.0)
            self.inner = inner

        def step(self, closure=None):
            self.inner.step()
            return super().step(closure)

    inner = torch.optim.SGD(layers[0].parameters(), lr=0.0)
    outer = Outer(model.parameters(), inner)
    for _ in range(3):
        model(torch.randn(16, 32)).sum().backward()
        outer.step()
        outer.zero_grad()
    assert [lin.fp8_step for lin in layers] == [3, 3]


def test_an_optimizer_step_that_raised_does_not_stop_the_updates():
    """A step that raises after the pre-step hook (no post-step hook then) leaves that
    optimizer's step open; its next step still updates every layer, once."""
    lin = _layer(amax_history_len=4)
    calls = {"n": 0}

    class Flaky(torch.optim.SGD):
        def step(self, closure=None):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("out of memory (simulated)")
            return super().step(closure)

    opt = Flaky(lin.parameters(), lr=0.0)
    for _ in range(3):
        lin(torch.randn(16, 32)).sum().backward()
        try:
            opt.step()
        except RuntimeError:
            pass
        opt.zero_grad()
    assert lin.fp8_step == 2
