"""Scaling rules a mutation review found no test for (CPU reference kernels): the default
format's gradient dtype, the margin on the gradient's scale, amax_compute_algo="most_recent"
on a layer, two forwards before one backward under current scaling, what a saved scaling
state restores (step count, primed or not), nested optimizers over part of a model, and the
SQNR helper every numerics test relies on."""
import gc
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops._reference import sqnr
from fp8ops.config import Fp8Config
from fp8ops.linear import Fp8Linear

from conftest import FP8_DEVICES

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


def test_a_loaded_state_keeps_the_overflow_counts():
    """The NaN/inf counts are the run's, cumulative (report, the example's TensorBoard): a
    resume goes on from them; a state saved without them (an older fp8ops) keeps zeros."""
    src = nn.Sequential(_layer())
    opt = torch.optim.SGD(src.parameters(), lr=0.0)
    for step in range(3):
        x = torch.randn(16, 32)
        if step == 2:
            x[0, 0] = float("inf")
        src(x).sum().backward()
        opt.step()
    state = fp8ops.scaling_state_dict(src)
    assert state["0"]["overflow_count"].tolist() == [1, 0, 0]
    dst = nn.Sequential(_layer())
    fp8ops.load_scaling_state_dict(dst, state, strict=True)
    assert dst[0].fp8_overflow_count.tolist() == [1, 0, 0]
    del state["0"]["overflow_count"]
    old = nn.Sequential(_layer())
    fp8ops.load_scaling_state_dict(old, state, strict=True)
    assert old[0].fp8_overflow_count.tolist() == [0, 0, 0]


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


def _zero_init_mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    nn.init.zeros_(m[2].weight)  # a zero-initialised output projection (ReZero, adaLN-Zero, ...)
    nn.init.zeros_(m[2].bias)
    return m


def _train_zero_init_beside_fp32(fp8, steps: int, device="cpu"):
    """Trains the zero-initialised MLP converted (fp8) beside its FP32 twin, each step from
    the same weights, so only that step's gradients differ; asserts from step 1 on that the
    first layer's weight gradient and the output are as close to FP32's as a primed step's
    (without the wait for an amax: -1.8 dB at step 1, the first layer's gradient cast with
    scale 1.0; without the wait while they grow, steps 2-4: the gradient 6.5, 11.4, 14.1 dB,
    ~15 after, the output 7.7, 15.5, 23.3 dB, 34-39 with it). Yields after each step's
    optimizer step."""
    ref = _zero_init_mlp().to(device)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_f = torch.optim.AdamW(fp8.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        x, t = torch.randn(32, 64, generator=g).to(device), torch.randn(32, 64, generator=g).to(device)
        with torch.no_grad():
            for pf, pr in zip(fp8.parameters(), ref.parameters()):
                pf.copy_(pr)
        ys = []
        for m, opt in ((ref, opt_r), (fp8, opt_f)):
            opt.zero_grad()
            ys.append(m(x))
            (ys[-1] - t).square().mean().backward()
        if step >= 1:
            assert sqnr(ref[0].weight.grad, fp8[0].weight.grad) >= 13, step
            assert sqnr(ys[0], ys[1]) >= 30, step
        opt_r.step()
        opt_f.step()
        yield step


@pytest.mark.parametrize("history", [1024, 1])
@pytest.mark.parametrize("device", FP8_DEVICES)
def test_a_tensor_with_no_amax_yet_stays_on_current_scaling(device, history, monkeypatch):
    """Step 1 of a model whose last projection starts at 0: that layer's weight amax and the
    first layer's gradient amax are exactly 0, so the first update has no scale for them
    (they would keep the fresh state's 1.0). Both layers stay on current scaling, and while
    those amaxes grow (AdamW moves the zero weight by ~lr per step, and the gradient before it
    grows with it) they go on doing so: cast with the step before's amax, the growing tensors
    saturated (the first layer's weight gradient 7.2 and 4.7 dB at steps 2 and 3 in a probe).
    Every step's gradients and outputs are then as close to FP32's as a primed step's; delayed
    scaling follows. (A one-row history keeps no step before in it: the layer keeps that.)"""
    from conftest import convert_as_on_fp8_gpu
    from fp8ops import scaling
    fp8 = convert_as_on_fp8_gpu(_zero_init_mlp().to(device), monkeypatch, device, amax_history_len=history)
    first, last = fp8[0], fp8[2]
    for step in _train_zero_init_beside_fp32(fp8, scaling._GROWING_UPDATES + 2, device):
        ready = (first._fp8_delayed_ready, last._fp8_delayed_ready)
        if step <= 1:
            assert ready == (False, False), (step, ready)
    assert ready == (True, True)
    assert first.fp8_scale[G] > 1e3  # (its gradient's scale came from its amaxes)


@pytest.mark.parametrize("interval", [2, 3])
def test_a_zero_initialised_weight_waits_under_an_update_interval(interval, monkeypatch):
    """With interval > 1 the first update reads the max over several steps, which the zero
    weight has left by then: the wait for an amax never started, and the layers turned to
    delayed scaling with the first steps' amaxes while the weight grew (a review's probe: the
    output 7.7 and 5.5 dB against FP32 at steps 2 and 3 with interval 2, the first layer's
    weight gradient 6.5 and 4.5 dB). Every layer now waits one update and the growth rule
    judges it at the next: every step stays as close to FP32 as a primed one, and delayed
    scaling follows."""
    from conftest import convert_as_on_fp8_gpu
    fp8 = convert_as_on_fp8_gpu(_zero_init_mlp(), monkeypatch, interval=interval)
    first, last = fp8[0], fp8[2]
    for step in _train_zero_init_beside_fp32(fp8, 8 * interval):
        if step < 2 * interval - 1:  # (the first update waits in any case)
            assert (first._fp8_delayed_ready, last._fp8_delayed_ready) == (False, False), step
    assert (first._fp8_delayed_ready, last._fp8_delayed_ready) == (True, True)


def test_a_layer_under_an_update_interval_turns_to_delayed_scaling_at_its_second_update(monkeypatch):
    """What the wait costs a layer whose amaxes do not grow: one update more on current
    scales, then delayed scaling."""
    from conftest import convert_as_on_fp8_gpu
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32)), monkeypatch, interval=2)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    x = torch.randn(16, 32)
    ready = []
    for _ in range(4):
        m(x).sum().backward()
        opt.step()
        ready.append(m[0]._fp8_delayed_ready)
    assert ready == [False, False, False, True]


def test_a_resume_while_waiting_goes_on_waiting(monkeypatch, tmp_path):
    """A scaling state saved while the zero-initialised model's layers wait on current scales
    (their amaxes still growing) keeps the wait: loaded into a fresh conversion, the run goes
    on as the uninterrupted one, bit for bit (a review: the resumed layers turned to delayed
    scaling at once, 15.5 dB outputs at the next step)."""
    from conftest import convert_as_on_fp8_gpu
    runs = []
    for resume in (False, True):
        fp8 = convert_as_on_fp8_gpu(_zero_init_mlp(), monkeypatch)
        opt = torch.optim.AdamW(fp8.parameters(), lr=1e-3)
        g, outs = torch.Generator().manual_seed(1), []
        for step in range(6):
            if resume and step == 2:
                assert not fp8[2]._fp8_delayed_ready  # (waiting)
                torch.save({"w": fp8.state_dict(), "o": opt.state_dict(), "s": fp8ops.scaling_state_dict(fp8)},
                           tmp_path / "ck.pt")
                ck = torch.load(tmp_path / "ck.pt", weights_only=True)
                fp8 = convert_as_on_fp8_gpu(_zero_init_mlp(), monkeypatch)
                fp8.load_state_dict(ck["w"])
                opt = torch.optim.AdamW(fp8.parameters(), lr=1e-3)
                opt.load_state_dict(ck["o"])
                assert fp8ops.load_scaling_state_dict(fp8, ck["s"], strict=True) == []
            x, t = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
            y = fp8(x)
            (y - t).square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append((y.detach(), fp8[0]._fp8_delayed_ready, fp8[2]._fp8_delayed_ready))
        runs.append(outs)
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:], i


def test_a_tensor_that_stays_zero_turns_to_delayed_scaling_after_a_few_updates(monkeypatch):
    """A layer whose gradient is always 0 (its output never reaches the loss) waits a few
    updates for an amax, then turns to delayed scaling: no read of its history every step."""
    from conftest import convert_as_on_fp8_gpu
    from fp8ops import scaling
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), monkeypatch)
    # (a small step: m[1]'s input, which m[0] makes, grows by under 25 % a step, so m[1] does
    # not wait for that; see test_a_tensor_with_no_amax_yet_stays_on_current_scaling)
    opt = torch.optim.SGD(m.parameters(), lr=1e-4)
    x = torch.randn(16, 32)
    ready = []
    for _ in range(scaling._PRIMING_UPDATES + 1):
        h = m[0](x)
        (m[1](h).sum() * 0 + h.sum()).backward()  # m[1]'s output gradient is 0
        opt.step()
        opt.zero_grad()
        ready.append((m[0]._fp8_delayed_ready, m[1]._fp8_delayed_ready))
    assert ready[0] == (True, False)
    assert [r[1] for r in ready] == [False] * (scaling._PRIMING_UPDATES - 1) + [True, True]


def test_fp8ops_step_leaves_the_layers_a_torch_optimizer_steps(monkeypatch):
    """fp8ops.step after a torch optimizer's step (whose hook updates the scales) updated
    them twice per step: fp8_step doubled, every other history row a zero roll (half the
    window), `interval` counted twice. It leaves those layers out, says so once, and still
    updates the layers no torch optimizer steps."""
    from conftest import convert_as_on_fp8_gpu
    from fp8ops import scaling
    monkeypatch.setattr(scaling, "_warned_step", False)
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), monkeypatch)
    opt = torch.optim.SGD(m[0].parameters(), lr=0.01)  # m[1]: stepped by hand (a custom optimizer)
    for k in range(3):
        m(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            fp8ops.step(m)
        assert len(seen) == (k == 0) and (k or "1 of the model's FP8 layers are stepped by a torch.optim" in
                                          str(seen[0].message))
        opt.zero_grad()
    assert m[0].fp8_step == 3 and m[1].fp8_step == 3
    assert m[0].fp8_amax_history[-3:, 0].gt(0).all()  # (three steps' amaxes, no zero rolls between them)
    # steps where no optimizer hook fires (ZeroRedundancyOptimizer's overlap_with_ddp): updated by hand again
    for _ in range(2):
        m(torch.randn(16, 32)).square().mean().backward()
        fp8ops.step(m)
    assert m[0].fp8_step == 5 and m[1].fp8_step == 5
    with pytest.raises(TypeError, match="fp8ops.step: model must be an nn.Module"):
        fp8ops.step(None)


def test_a_layer_whose_bias_alone_an_optimizer_steps_goes_with_its_step(monkeypatch):
    """BitFit, or a LoRA model with bias="all": the weight is frozen and the optimizer holds
    the bias. The optimizer's step updates that layer's scales (it matched layers by their
    weight only, so the layer stayed on current scaling for good); a layer of which it holds
    nothing is left alone (fp8ops.step is for those)."""
    from conftest import convert_as_on_fp8_gpu
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)), monkeypatch)
    for layer in m:
        layer.weight.requires_grad_(False)
    m[1].bias.requires_grad_(False)
    opt = torch.optim.SGD([m[0].bias], lr=0.01)
    for _ in range(3):
        m(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert (m[0].fp8_step, m[1].fp8_step) == (3, 0)
    fp8ops.step(m)
    assert (m[0].fp8_step, m[1].fp8_step) == (3, 1)


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("weight_first", [True, False])
def test_a_layer_split_between_two_optimizers_is_updated_once_per_step(weight_first, device, monkeypatch):
    """Muon steps the weights, AdamW the biases (Muon takes 2-D parameters only): both steps
    updated each layer's scales, so fp8_step doubled and every other history row was an update
    with nothing cast (half the window, `interval` counted twice). Once per step now, in either
    order, with the weights frozen or not; when one of the two stops stepping, the other takes
    the layer over."""
    from conftest import convert_as_on_fp8_gpu
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32)).to(device), monkeypatch,
                              device)
    layers = (m[0], m[2])
    opt_w = torch.optim.Muon([layer.weight for layer in layers], lr=0.01)
    opt_b = torch.optim.AdamW([layer.bias for layer in layers], lr=0.01)

    def train(opts, steps):
        for _ in range(steps):
            m(torch.randn(16, 32, device=device)).square().mean().backward()
            for o in opts:
                o.step()
            m.zero_grad()
        return [layer.fp8_step for layer in layers]

    opts = (opt_w, opt_b) if weight_first else (opt_b, opt_w)
    assert train(opts, 3) == [3, 3]
    for layer in layers:
        layer.weight.requires_grad_(False)
    assert train(opts, 3) == [6, 6]  # (frozen, still held by Muon)
    for layer in layers:
        layer.weight.requires_grad_(True)
    assert train(opts, 3) == [9, 9]
    for layer in layers:
        assert layer.fp8_amax_history[-9:].gt(0).all()  # (nine steps' amaxes, no zero rolls between them)
    assert train((opt_b,), 2) == [11, 11]  # (the weights' optimizer stopped)
    # (then the biases': the weights' optimizer, back after steps it missed, takes the layer over
    # one step later, since the other's update may have been this step's)
    assert train((opt_w,), 2) == [12, 12]


@pytest.mark.parametrize("step_first", [True, False])
def test_a_custom_weight_optimizer_with_fp8ops_step_and_a_bias_optimizer(step_first, monkeypatch):
    """The weight stepped by a custom optimizer (fp8ops.step after it), the bias by AdamW:
    with fp8ops.step before AdamW's step, the first step updated the scales twice."""
    from conftest import convert_as_on_fp8_gpu
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32)), monkeypatch)
    opt_b = torch.optim.AdamW([m[0].bias], lr=0.01)

    def custom_step():
        with torch.no_grad():
            m[0].weight -= 0.01 * m[0].weight.grad
        fp8ops.step(m)

    for _ in range(3):
        m(torch.randn(16, 32)).square().mean().backward()
        for step in ((custom_step, opt_b.step) if step_first else (opt_b.step, custom_step)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (fp8ops.step's note that a torch optimizer updated it)
                step()
        m.zero_grad()
    assert m[0].fp8_step == 3 and m[0].fp8_amax_history[-3:].gt(0).all()


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_a_gradient_that_arrives_after_the_priming_wait_is_not_flushed(device, monkeypatch):
    """A frozen part whose weights the optimizer holds (fastai's freeze/unfreeze), or a loss
    term switched on later: no gradient reaches it during the priming updates, which then end
    with dy's scale still the fresh 1.0. The first gradient after the unfreeze was cast with
    it and flushed (dW at 0.7-12 dB against FP32 instead of ~20); it is cast with its own
    current scale instead, and delayed scaling takes over after that step. A saved state
    keeps the rule."""
    from conftest import convert_as_on_fp8_gpu
    from fp8ops import scaling

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                             nn.Linear(256, 10)).to(device)
    ref, fp = build(), convert_as_on_fp8_gpu(build(), monkeypatch, device)
    backbone = [p for m in (ref, fp) for i in (0, 2) for p in m[i].parameters()]
    for p in backbone:
        p.requires_grad_(False)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, fp)]
    g = torch.Generator().manual_seed(1)
    unfreeze = scaling._PRIMING_UPDATES + 2
    for step in range(unfreeze + 2):
        if step == unfreeze:
            for p in backbone:
                p.requires_grad_(True)
            saved = fp8ops.scaling_state_dict(fp)
        x, t = torch.randn(512, 64, generator=g).to(device), torch.randint(0, 10, (512,), generator=g).to(device)
        with torch.no_grad():  # the same weights in both: this step's gradients compare
            for pf, pr in zip(fp.parameters(), ref.parameters()):
                pf.copy_(pr)
        for m in (ref, fp):
            F.cross_entropy(m(x), t).backward()
        if step >= unfreeze:
            assert fp[0]._fp8_delayed_ready and sqnr(ref[0].weight.grad, fp[0].weight.grad) > 15, step
        for o in opts:
            o.step()
            o.zero_grad()
        # (set when the wait ends, at the last priming update; cleared by the update after the unfreeze)
        assert ("_fp8_grad_unset" in fp[0].__dict__) == (scaling._PRIMING_UPDATES - 1 <= step < unfreeze), step
        assert "_fp8_grad_unset" not in fp[4].__dict__  # (the head had its gradient from the start)
    fresh = convert_as_on_fp8_gpu(build(), monkeypatch, device)
    fp8ops.load_scaling_state_dict(fresh, saved)
    assert "_fp8_grad_unset" in fresh[0].__dict__ and "_fp8_grad_unset" not in fresh[4].__dict__


def test_a_loss_term_weighted_by_zero_then_switched_on_is_not_flushed(monkeypatch):
    """A loss weighted by 0 for the first steps: the weights have gradients (all zero), which
    cleared the waiting flag at once; the first real gradient was then cast with dy's fresh
    scale 1.0 (16.5 dB against FP32). The flag waits for a dy with an amax > 0. A NaN gradient
    of a waiting layer is counted once (it was counted by its cast and by the update)."""
    from conftest import convert_as_on_fp8_gpu
    from fp8ops import scaling

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    ref, fp = build(), convert_as_on_fp8_gpu(build(), monkeypatch)
    opts = [torch.optim.SGD(m.parameters(), lr=1e-2) for m in (ref, fp)]
    g = torch.Generator().manual_seed(1)
    on = scaling._PRIMING_UPDATES + 2
    for step in range(on + 2):
        x, t = torch.randn(512, 64, generator=g), torch.randint(0, 10, (512,), generator=g)
        with torch.no_grad():
            for pf, pr in zip(fp.parameters(), ref.parameters()):
                pf.copy_(pr)
        for m in (ref, fp):
            (F.cross_entropy(m(x), t) * (1.0 if step >= on else 0.0)).backward()
        if step >= on:
            assert sqnr(ref[0].weight.grad, fp[0].weight.grad) > 18, step
        for o in opts:
            o.step()
            o.zero_grad()
        assert ("_fp8_grad_unset" in fp[0].__dict__) == (scaling._PRIMING_UPDATES - 1 <= step < on), step
    # a waiting layer's NaN gradient: counted once
    for m in (fp[0], fp[2]):
        m.__dict__["_fp8_grad_unset"] = True
    before = fp[0].fp8_overflow_count.tolist()
    (fp(torch.randn(16, 64)).sum() * float("nan")).backward()
    opts[1].step()
    assert fp[0].fp8_overflow_count.tolist() == [before[0], before[1], before[2] + 1]


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_a_layer_no_optimizer_steps_counts_its_nan_amaxes(device, monkeypatch):
    """A frozen layer (a LoRA base) gets no scale update: it casts with current scales for
    good, so its casts count their NaN/inf amaxes; a stepped layer's first update then
    counts nothing more for that step (once per cast, not twice)."""
    from conftest import convert_as_on_fp8_gpu
    m = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32)).to(device), monkeypatch, device)
    m[0].weight.requires_grad_(False)
    m[0].bias.requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.01)
    for step in range(3):
        x = torch.randn(16, 32, device=device)
        if step == 2:  # (the last: a NaN gradient would make the next step's weight NaN)
            x[0, 0] = float("nan")
        m(x).sum().backward()
        opt.step()
        opt.zero_grad()
    frozen, stepped = m[0], m[1]
    assert frozen.fp8_step == 0 and not frozen._fp8_delayed_ready
    assert frozen.fp8_overflow_count.tolist() == [1, 0, 0]  # x at step 2 (no backward reaches it)
    # the stepped layer, delayed by step 2: its NaN input counted once, by that step's update
    assert stepped.fp8_overflow_count.tolist() == [1, 0, 0]
    # a NaN in the first step of a stepped layer (current scales then): counted by the cast only
    fresh = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32)).to(device), monkeypatch, device)
    opt = torch.optim.SGD(fresh.parameters(), lr=0.0)
    x = torch.randn(16, 32, device=device)
    x[3, 3] = float("inf")
    fresh(x).sum().backward()
    opt.step()
    assert fresh[0].fp8_overflow_count.tolist() == [1, 0, 0]


def _two_layers():
    torch.manual_seed(0)
    m = nn.Sequential(*(Fp8Linear.from_linear(nn.Linear(32, 32), Fp8Config(policy="always", amax_history_len=16))
                        for _ in range(2)))
    for lin in m:
        lin.fp8_on_cpu = True
    return m


def _trained_two_layers():
    m = _two_layers()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for _ in range(3):
        m(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert m[0]._fp8_delayed_ready and m[0].fp8_step == 3
    return m, opt


def _phase_two(m, opt, steps=4, after_step=None) -> list:
    """m[0] frozen, inputs 30x larger (a trained embedding before it): its output's SQNR
    against the plain layer at each step."""
    m[0].requires_grad_(False)
    dbs = []
    for _ in range(steps):
        x = 30 * torch.randn(16, 32)
        y = m[0](x)
        dbs.append(sqnr(F.linear(x, m[0].weight, m[0].bias), y.detach()))
        m[1](y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()
    return dbs


def test_a_layer_its_optimizer_steps_past_goes_back_to_current_scales():
    """A layer frozen mid-training and taken out of its optimizer's groups got no update again
    and cast with its last delayed scales for good: with inputs 30x larger after that, 1.0 dB
    output SQNR at every later step (a review's probe). Once the optimizer has stepped without
    it, it casts with current scales, as a layer no optimizer ever stepped does (the first
    step after the change still casts with the old ones), while the other layer goes on being
    updated."""
    m, opt = _trained_two_layers()
    opt.param_groups[0]["params"] = list(m[1].parameters())
    dbs = _phase_two(m, opt)
    assert dbs[0] < 10 and min(dbs[1:]) >= 25, dbs
    assert (m[0].fp8_step, m[1].fp8_step) == (3, 7) and not m[0]._fp8_delayed_ready
    assert m[1]._fp8_delayed_ready


def test_a_layer_left_by_a_freed_optimizer_keeps_its_scales_until_fp8ops_step():
    """Frozen and left out of a new optimizer, the old one freed: whether an optimizer is still
    alive differs between ranks (each frees it at its own garbage collection), so it decides
    nothing and the layer keeps its last scales (README); fp8ops.step after each step updates
    it (from its second call: the first leaves out the layers an optimizer updated since)."""
    m, opt = _trained_two_layers()
    opt = torch.optim.AdamW(m[1].parameters(), lr=1e-3)
    gc.collect()
    assert max(_phase_two(m, opt, steps=2)) < 10
    dbs = _phase_two(m, opt, after_step=lambda: fp8ops.step(m))
    assert min(dbs[2:]) >= 25, dbs


def test_a_subclass_step_calling_super_keeps_delayed_scaling():
    """An optimizer subclass whose step calls super().step(), where the parent's step is hooked
    too (the hooks run twice on one optimizer, the inner run updating): its layers keep delayed
    scaling (a review: the first form of the check above saw the outer run step past them and
    sent them back to current scales at every forward)."""
    class MyAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    torch.optim.AdamW([nn.Parameter(torch.zeros(1))])  # (AdamW.step hooked as well)
    m = _two_layers()
    opt = MyAdamW(m.parameters(), lr=1e-3)
    ready = []
    for _ in range(4):
        y = m(torch.randn(16, 32))
        ready.append(m[0]._fp8_delayed_ready)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert ready == [False, True, True, True] and m[0].fp8_step == 4


def test_an_optimizer_made_again_each_epoch_keeps_delayed_scaling():
    """A new optimizer over the same parameters at each epoch, the old one freed: no step on
    current scales after the first (a review: the first form of the check above sent every
    layer back to them at each epoch, 2 x interval steps)."""
    m = _two_layers()
    current = 0
    for _ in range(3):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        gc.collect()
        for _ in range(3):
            y = m(torch.randn(16, 32))
            current += not m[0]._fp8_delayed_ready
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert current == 1


def test_a_weight_its_optimizer_does_not_hold_is_cast_with_current_scales_after_a_step():
    """A new weight Parameter assigned after the optimizer was built (re-initialised 20x
    larger): the optimizer steps on without it, so the layer's delayed weight scale was never
    updated again (0.6 dB output SQNR for good). After the optimizer's next step the layer
    casts with current scales; the first step after the assignment still casts with the old
    scale (README)."""
    m = _two_layers()[:1]
    lin = m[0]
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    for _ in range(2):
        m(torch.randn(16, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    lin.weight = nn.Parameter(lin.weight.detach() * 20)
    dbs = []
    for _ in range(3):
        x = torch.randn(16, 32)
        y = lin(x)
        dbs.append(sqnr(F.linear(x, lin.weight, lin.bias), y.detach()))
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert dbs[0] < 10 and min(dbs[1:]) >= 25, dbs


def test_a_parametrized_weight_is_matched_through_its_original():
    """A parametrization registered after convert: the optimizer holds its original, which the
    hooks now match (the layer's scales follow that optimizer's steps, delayed scaling), and
    the hooks' scan no longer reads the parametrized attribute, which ran the
    parametrization at every step of every optimizer (spectral_norm's power iteration: a
    review saw an unrelated optimizer's steps change a model's spectral-norm state)."""
    import torch.nn.utils.parametrize as P
    calls = [0]

    class Twice(nn.Module):
        def forward(self, w):
            calls[0] += 1
            return 2 * w

    m = _two_layers()
    P.register_parametrization(m[0], "weight", Twice())
    calls[0] = 0  # (registering ran it once)
    other = nn.Linear(4, 4)
    opt_other = torch.optim.SGD(other.parameters(), lr=0.1)
    for _ in range(3):
        other(torch.randn(2, 4)).sum().backward()
        opt_other.step()
    assert calls[0] == 0
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    for step in range(4):
        x = torch.randn(16, 32)
        y = m[0](x)
        assert sqnr(F.linear(x, 2 * m[0].parametrizations.weight.original, m[0].bias), y.detach()) >= 25, step
        m[1](y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert m[0].fp8_step == m[1].fp8_step == 4 and m[0]._fp8_delayed_ready


def test_the_hooks_kept_scan_follows_what_the_optimizer_holds():
    """The hooks keep each optimizer's scan of the layers it holds (scaling._scan: one scan per
    optimizer step cost layers x optimizers with one optimizer per parameter); it is made again
    where what the optimizer holds may have changed. Each phase: the layers updated by a step."""
    from fp8ops import scaling

    def fp8(lin):
        new = Fp8Linear.from_linear(lin, Fp8Config(policy="always"))
        new.fp8_on_cpu = True
        return new

    torch.manual_seed(0)
    a, plain = fp8(nn.Linear(16, 16)), nn.Linear(16, 16)
    opt = torch.optim.SGD([*a.parameters(), *plain.parameters()], lr=0.0)

    def updated():
        before = {id(m): m.fp8_step for m in scaling.live_layers()}
        opt.step()
        return {m for m in scaling.live_layers() if m.fp8_step > before.get(id(m), 0)}

    assert updated() == {a}
    kept = opt.__dict__["_fp8ops_scan"]
    assert updated() == {a} and opt.__dict__["_fp8ops_scan"] is kept  # (nothing changed: kept)
    b = fp8(plain)                                   # converted after: its Parameters are held
    assert updated() == {a, b}
    c = fp8(nn.Linear(16, 16))
    c.weight = a.weight                              # a Parameter registered: tied to a held one
    assert updated() == {a, b, c}
    d = fp8(nn.Linear(16, 16))
    opt.add_param_group({"params": [d.weight]})      # another group
    assert updated() == {a, b, c, d}
    e = fp8(nn.Linear(16, 16))
    updated()
    e._parameters["weight"] = p = nn.Parameter(torch.randn(16, 16))  # (no registration hook: FSDP2's way)
    opt.param_groups[1]["params"][0] = p             # the group's list changed in place
    assert updated() == {a, b, c, e}
    c._parameters["weight"] = nn.Parameter(torch.randn(16, 16))  # a kept layer's weight swapped unseen:
    assert updated() == {a, b, e}                                 # checked at each step
    f = fp8(nn.Linear(16, 16))
    opt.add_param_group({"params": [f.weight]})
    assert len(updated()) == 4
    del f  # (no assert names it: pytest's rewritten asserts keep their operands alive)
    gc.collect()
    assert updated() == {a, b, e}                    # (a dead layer in the kept scan)


def test_the_kept_scan_follows_a_reordered_group_and_keeps_no_weight_alive():
    """The amax all-reduce concatenates layers in the optimizer's order: a group reordered in
    place is scanned again (a review: a key of the ids' sum kept the old order, and a scan
    made again on one rank only, after a deepcopy there, mixed the layers' amaxes across
    ranks). And a bias-only optimizer's kept scan holds no frozen weight (a review: it did)."""
    import weakref
    from fp8ops import scaling
    m = nn.Sequential(*(_two_layers()[0] for _ in range(3)))
    opt = torch.optim.SGD([p for lin in m for p in lin.parameters()], lr=0.0)
    assert scaling._layers_of(opt) == list(m)
    opt.param_groups[0]["params"].reverse()
    assert scaling._layers_of(opt) == list(m)[::-1]
    bitfit = torch.optim.SGD([lin.bias for lin in m], lr=0.0)
    assert scaling._layers_of(bitfit) == list(m)
    w = weakref.ref(m[0].weight)
    del m, opt
    gc.collect()
    assert w() is None


def test_a_pruned_layer_keeps_delayed_scaling():
    """torch.nn.utils.prune (and the old spectral_norm) keep the Parameter as weight_orig and
    set `weight` from it at each call: the hooks match weight_orig (a review: they read the
    attribute, matched no optimizer, and the layer went back to current scales for good)."""
    import torch.nn.utils.prune as prune
    m = _two_layers()
    prune.l1_unstructured(m[0], "weight", amount=0.5)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    ready = []
    for _ in range(5):
        x = torch.randn(16, 32)
        y = m[0](x)
        ready.append(m[0]._fp8_delayed_ready)
        assert sqnr(F.linear(x, m[0].weight, m[0].bias), y.detach()) >= 20  # (FP8's noise: ~25)
        m[1](y).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert ready == [False, True, True, True, True] and m[0].fp8_step == 5
