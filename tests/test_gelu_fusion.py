"""The fused GELU: conversion moves a tanh-GELU module into the Fp8Linear that
consumes it (gelu_fusion.py): that linear casts gelu(h) from h (linear_fwd
with gelu_input), and the linear that produced h applies the GELU's gradient in
its gradient cast (linear_bwd with gelu_input).

CPU tests run the C reference kernels; the CUDA parametrisations run the
cast kernels on the device."""
import collections
import copy
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops import Fp8Config, ops
from fp8ops._reference import sqnr
from fp8ops.gelu_fusion import fuse_gelu
from fp8ops.linear import Fp8Linear

from conftest import (FP8_DEVICES, assert_compiled_matches_eager, assert_steps_match_eager, convert_as_on_fp8_gpu,
                      requires_fp8, train_steps)

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2


class MLP(nn.Module):
    """GPT-2's MLP: c_proj(gelu(c_fc(x)))."""

    def __init__(self, d=32, approximate="tanh"):
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU(approximate=approximate)
        self.c_proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.drop(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        return x + self.mlp(self.ln(x))


def _gelu_calls(monkeypatch):
    """Records which linear_fwd calls fused a GELU and which linear_bwd calls its gradient."""
    seen = []
    fwd, bwd = ops._linear_fwd_raw, ops._linear_bwd_raw
    monkeypatch.setattr(ops, "_linear_fwd_raw", lambda *a: (seen.append(("fwd", a[15])), fwd(*a))[1])
    monkeypatch.setattr(ops, "_linear_bwd_raw", lambda *a: (seen.append(("bwd", a[8].numel() > 0)), bwd(*a))[1])
    return seen


# ------------------------------------------------------------------ conversion

def test_convert_fuses_gpt2_mlp_gelu(monkeypatch):
    model = nn.Sequential(Block(), Block())
    keys = list(model.state_dict())
    convert_as_on_fp8_gpu(model, monkeypatch)
    for blk in model:
        assert isinstance(blk.mlp.gelu, nn.Identity)
        assert blk.mlp.c_proj.fp8_gelu_input and not blk.mlp.c_fc.fp8_gelu_input
        assert blk.mlp.c_fc.fp8_gelu_output and not blk.mlp.c_proj.fp8_gelu_output
    assert list(model.state_dict()) == keys
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert reasons["0.mlp.c_proj"] == "converted; GELU 0.mlp.gelu fused into its input cast"
    assert reasons["0.mlp.c_fc"].startswith("converted; GELU 0.mlp.gelu's gradient fused into its gradient cast")
    assert "gelu_tanh(x) (fused)" in repr(model[0].mlp.c_proj)
    assert "output feeds a fused GELU" in repr(model[0].mlp.c_fc)


def test_fuse_gelu_off_keeps_the_gelu(monkeypatch):
    model = convert_as_on_fp8_gpu(Block(), monkeypatch, fuse_gelu=False)
    assert type(model.mlp.gelu) is nn.GELU and not model.mlp.c_proj.fp8_gelu_input
    assert not model.mlp.c_fc.fp8_gelu_output


class GeluTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.gelu, self.b = nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32)

    def forward(self, x):
        return self.b(self.gelu(self.a(x))) + self.gelu(x).sum()


class GeluAlsoResidual(GeluTwice):
    def forward(self, x):
        g = self.gelu(self.a(x))
        return self.b(g) + g.mean()


class GeluFunctional(GeluTwice):
    def forward(self, x):
        return self.b(F.gelu(self.a(x), approximate="tanh"))


class GeluBranching(GeluTwice):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent: torch.fx cannot read it
            x = -x
        return self.b(self.gelu(self.a(x)))


class LinearTwice(GeluTwice):
    def forward(self, x):
        return self.b(self.gelu(self.a(x))) + self.b(self.a(x))


class TrainOnlyDropout(GeluTwice):
    def forward(self, x):
        g = self.gelu(self.a(x))
        if self.training:  # traced in both modes: routed differently, so left alone
            g = F.dropout(g, 0.0)
        return self.b(g)


class GeluInputChangedInPlace(GeluTwice):
    def forward(self, x):
        h = self.a(x)
        g = self.gelu(h)
        h.mul_(0.5)  # fused, the consumer would apply the GELU to the changed h
        return self.b(g)


class GeluInputChangedByInplaceModule(GeluTwice):
    def __init__(self):
        super().__init__()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.a(x)
        g = self.gelu(h)
        r = self.relu(h)  # (in place on h: fused, the consumer would apply the GELU to relu(h))
        return self.b(g) + r.sum()


class GeluInputChangedByInplaceFunction(GeluTwice):
    def forward(self, x):
        h = self.a(x)
        g = self.gelu(h)
        F.relu(h, inplace=True)
        torch.relu_(h)
        return self.b(g)


class GeluUnderNoGrad(GeluTwice):
    def forward(self, x):  # a stop-gradient activation: fused, a gradient would pass through it
        with torch.no_grad():
            g = self.gelu(self.a(x))
        return self.b(g)


class GeluAlsoInAnotherMethod(GeluTwice):
    def hidden(self, x):  # fused, the GELU would be an identity here
        return self.gelu(self.a(x))

    def forward(self, x):
        return self.b(self.gelu(self.a(x)))


class GeluStored(GeluTwice):
    def forward(self, x):
        g = self.gelu(self.a(x))
        self.last_act = g  # (an activation statistic, a loss term): a use fx does not see
        return self.b(g)


class GeluAppended(GeluTwice):
    def __init__(self):
        super().__init__()
        self.acts = []  # filled in place: the attribute stays the same list object

    def forward(self, x):
        g = self.gelu(self.a(x))
        self.acts.append(g)
        return self.b(g)


class GeluDeque(GeluTwice):
    def __init__(self):
        super().__init__()
        self.acts = collections.deque(maxlen=4)

    def forward(self, x):
        g = self.gelu(self.a(x))
        self.acts.append(g)
        return self.b(g)


class RefusesUpdate(dict):
    """Like transformers' ModelOutput: its own update and item assignment refuse."""

    def update(self, *a, **k):
        raise RuntimeError("refused")

    def __setitem__(self, k, v):
        raise RuntimeError("refused")


class GeluBesideContainers(MLP):
    """Containers the forward does not touch, or fills with no tensor: left exactly as they
    were, and the GELU fused."""

    def __init__(self):
        super().__init__()
        self.out = RefusesUpdate(last=1)
        self.stats = {"n": [1, 2]}
        self.seen = {3}
        self.calls = collections.OrderedDict(calls=0)
        self.output = OrderedRefuses(last=1)

    def forward(self, x):
        self.calls["n"] = 1          # not a tensor: no store that blocks the fusion
        self.output["n"] = 1
        return super().forward(x)


class OrderedRefuses(collections.OrderedDict):
    """transformers' ModelOutput: an OrderedDict whose own update refuses."""

    def update(self, *a, **k):
        raise RuntimeError("refused")


class GeluWithConstantAndAux(GeluTwice):
    def forward(self, x):
        self.aux_loss = x.pow(2).mean()  # stored, but not the GELU's output or its producer's
        return self.b(self.gelu(self.a(x))) * torch.tensor(0.5)  # (fx stores the constant itself)


class ProducerStored(GeluTwice):
    def forward(self, x):
        h = self.a(x)
        self.h = h  # a later loss on it would add a gradient c_fc's fused backward does not expect
        return self.b(self.gelu(h))


def test_stores_block_only_the_fusions_they_touch(monkeypatch):
    torch.manual_seed(0)
    model = convert_as_on_fp8_gpu(GeluWithConstantAndAux(), monkeypatch)
    assert model.b.fp8_gelu_input and model.a.fp8_gelu_output
    assert "_tensor_constant0" not in model.__dict__ and "aux_loss" not in model.__dict__   # reads leave none
    model = convert_as_on_fp8_gpu(ProducerStored(), monkeypatch)
    assert model.b.fp8_gelu_input and not model.a.fp8_gelu_output
    x = torch.randn(16, 32)
    model(x)
    assert type(model.h) is torch.Tensor


@pytest.mark.parametrize("cls", [GeluTwice, GeluAlsoResidual, GeluFunctional, GeluBranching, LinearTwice,
                                 TrainOnlyDropout, GeluStored, GeluAppended, GeluDeque, GeluInputChangedInPlace,
                                 GeluInputChangedByInplaceModule, GeluInputChangedByInplaceFunction,
                                 GeluUnderNoGrad, GeluAlsoInAnotherMethod])
def test_gelu_not_fused_where_unsafe(cls, monkeypatch):
    torch.manual_seed(0)
    model = cls()
    ref = copy.deepcopy(model)
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert not model.b.fp8_gelu_input and not model.a.fp8_gelu_output
    assert type(model.gelu) is nn.GELU
    x = torch.randn(16, 32)
    x = -x.abs() if cls is GeluBranching else x
    with torch.no_grad():  # (the in-place cases: the original itself refuses a backward)
        torch.testing.assert_close(model(x), ref(x), rtol=0.1, atol=0.1)  # FP8, but the same function
    if cls is GeluStored:  # what it stores is the GELU's output (not a tracing Proxy, not its input)
        assert type(model.last_act) is torch.Tensor and model.last_act.min() >= -0.1701
    if cls in (GeluAppended, GeluDeque):  # the reads left no Proxy; the forward appended the GELU's output
        assert len(model.acts) == 1 and type(model.acts[0]) is torch.Tensor and model.acts[0].min() >= -0.1701


def test_untouched_containers_stay_and_do_not_block_fusion(monkeypatch):
    model = GeluBesideContainers()
    out, stats, seen = model.out, model.stats, model.seen
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert model.c_proj.fp8_gelu_input
    assert model.out is out and dict(out) == {"last": 1}
    assert model.stats is stats and stats == {"n": [1, 2]} and model.seen is seen and seen == {3}
    assert list(model.calls.items()) == [("calls", 0)]   # an OrderedDict keeps working (its order)
    assert list(model.output.items()) == [("last", 1)]


def test_gelu_not_fused_erf_shared_or_hooked(monkeypatch):
    erf = convert_as_on_fp8_gpu(MLP(approximate="none"), monkeypatch)
    assert type(erf.gelu) is nn.GELU and not erf.c_proj.fp8_gelu_input
    shared = MLP()
    holder = nn.ModuleList([shared, nn.ModuleDict({"g": shared.gelu})])
    convert_as_on_fp8_gpu(holder, monkeypatch)
    assert type(shared.gelu) is nn.GELU and not shared.c_proj.fp8_gelu_input
    hooked = MLP()
    hooked.c_proj.register_forward_pre_hook(lambda m, a: None)  # would see h instead of gelu(h)
    convert_as_on_fp8_gpu(hooked, monkeypatch)
    assert type(hooked.gelu) is nn.GELU and not hooked.c_proj.fp8_gelu_input


class _Wrapped(nn.Module):
    """A linear inside a module of the user's (as HF wraps its projections)."""

    def __init__(self, i, o):
        super().__init__()
        self.linear = nn.Linear(i, o)

    def forward(self, x):
        return self.linear(x)


class WrappedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = _Wrapped(32, 64), nn.GELU(approximate="tanh"), _Wrapped(64, 32)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


def test_a_hook_on_a_wrapper_keeps_what_it_sees(monkeypatch):
    """A hook on a module that wraps a linear sees and keeps what that wrapper computes: a
    forward hook that keeps c_fc's output for an activation penalty (its gradient then
    reaches c_fc's backward beside the GELU's), a pre-hook that probes c_proj's input. The
    wrapper is read as one opaque call (nothing inside it is fused with anything outside),
    and convert runs no hook (it once ran them on torch.fx's stand-ins)."""
    torch.manual_seed(0)
    base = WrappedMLP()
    x = torch.randn(16, 32)
    ref = copy.deepcopy(base)
    model = copy.deepcopy(base)
    kept, seen = [], []
    model.c_fc.register_forward_hook(lambda m, a, out: kept.append(out))
    model.c_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert kept == [] and seen == []
    assert type(model.gelu) is nn.GELU
    assert not model.c_fc.linear.fp8_gelu_output and not model.c_proj.linear.fp8_gelu_input
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    for _ in range(3):  # (past delayed scaling's first step, where a fusion would run)
        kept.clear(), seen.clear()
        y = model(x)
        (y.square().mean() + 0.05 * kept[0].square().sum()).backward()
        opt.step()
        opt.zero_grad()
    h = ref.c_fc(x)
    torch.testing.assert_close(seen[0], F.gelu(kept[0], approximate="tanh"), rtol=0, atol=0)
    (ref.c_proj(F.gelu(h, approximate="tanh")).square().mean() + 0.05 * h.square().sum()).backward()
    y = model(x)
    (y.square().mean() + 0.05 * kept[-1].square().sum()).backward()
    assert sqnr(ref.c_fc.linear.weight.grad, model.c_fc.linear.weight.grad) > 18


def test_fuse_gelu_logs_untraceable_parent(caplog):
    model = GeluBranching()
    model.b = Fp8Linear.from_linear(model.b, Fp8Config())
    with caplog.at_level(logging.DEBUG, logger="fp8ops"):
        assert fuse_gelu(model) == []
    assert "torch.fx cannot read GeluBranching.forward" in caplog.text


# ------------------------------------------------------------------ numerics

@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_mlp_trains_like_unfused(device, dtype, monkeypatch):
    """Three optimizer steps (the first casts with current scales and runs the GELU
    unfused, the next two fused): the fused model's losses, outputs and gradients
    match the same FP8 model with its GELU left alone, to FP8 rounding."""
    torch.manual_seed(0)
    base = Block(64).to(device)
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, fuse_gelu=False)
    assert fused.mlp.c_proj.fp8_gelu_input and not plain.mlp.c_proj.fp8_gelu_input
    seen = _gelu_calls(monkeypatch)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, plain)]
    x = torch.randn(4, 32, 64, device=device)
    for step in range(3):
        outs = []
        for m, opt in zip((fused, plain), opts):
            with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
                y = m(x)
            (y.float() ** 2).mean().backward()
            outs.append((y.detach().float(), {n: p.grad.clone() for n, p in m.named_parameters()}))
            opt.step()
            opt.zero_grad()
        (y_f, g_f), (y_p, g_p) = outs
        assert sqnr(y_p, y_f) >= 35, step
        for n in g_p:
            assert sqnr(g_p[n], g_f[n]) >= 25, (step, n, sqnr(g_p[n], g_f[n]))
    # steps 2 and 3 of the fused model ran c_proj's forward and c_fc's gradient cast fused
    assert sum(1 for kind, on in seen if kind == "fwd" and on) == 2
    assert sum(1 for kind, on in seen if kind == "bwd" and on) == 2


def test_fused_mlp_compiles(monkeypatch):
    """torch.compile(fullgraph=True) of a fused MLP: compiled code fuses the GELU into
    c_proj's cast, and inductor's pass (gelu_grad_pass.py) its gradient into c_fc's
    gradient cast; outputs and gradients match eager's, to FP8 rounding."""
    torch.manual_seed(0)
    base = MLP()
    assert_compiled_matches_eager(base, monkeypatch, (48, 32))


def _train_compiled_and_eager(base, monkeypatch, device, steps=4, module_filter_fn=None):
    """`steps` steps of base converted, eager and torch.compile(fullgraph=True)d, under bf16
    autocast on CUDA: per run, per step (output, input gradient, parameter gradients), and
    how many linear_bwd calls the GELU pass changed while compiling, and how many GELU
    gradients it put back as pointwise code. Inductor's caches off: a cached graph would not
    run the pass again."""
    from fp8ops import gelu_grad_pass  # noqa: PLC0415
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    runs, fused, decomposed = [], 0, 0
    for compiled in (False, True):
        model = fp8ops.convert(copy.deepcopy(base).to(device), config=Fp8Config(policy="always"),
                               module_filter_fn=module_filter_fn)
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.fp8_on_cpu = device == "cpu"
        fn = torch.compile(model, fullgraph=True) if compiled else model
        torch._dynamo.reset()
        before = gelu_grad_pass.FUSED[0], gelu_grad_pass.DECOMPOSED[0]
        runs.append(train_steps(model, fn, device, steps))
        fused, decomposed = gelu_grad_pass.FUSED[0] - before[0], gelu_grad_pass.DECOMPOSED[0] - before[1]
    return runs, fused, decomposed


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_compiled_code_fuses_the_gelu_gradient_into_the_producer(device, monkeypatch):
    """Under torch.compile the GELU's gradient moves into c_fc's gradient cast as in eager
    code: inductor's pass rewrites one linear_bwd per MLP in the delayed-scaling graph's
    backward, and from step 2 on (delayed scaling, the fused paths on both sides) every
    output and gradient is eager's, bit for bit on the CPU. Without the pass the GELU's
    gradient comes from torch's kernel instead of the cast's own formula: c_fc's bias
    gradient (summed from that gradient, not from its FP8 cast) then differs in its last
    bits, which the comparison sees."""
    from fp8ops import gelu_grad_pass
    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block())
    (eager, compiled), fused, decomposed = _train_compiled_and_eager(base, monkeypatch, device)
    assert (fused, decomposed) == (2, 0)
    assert_steps_match_eager(eager, compiled, device)
    if device == "cpu":
        monkeypatch.setattr(gelu_grad_pass, "fuse_gelu_grads", lambda graph: 0)
        (eager, unfused), _, _ = _train_compiled_and_eager(base, monkeypatch, device)
        names = [n for n, _ in base.named_parameters()]
        _, _, g1 = eager[3]
        _, _, g2 = unfused[3]
        biases = [i for i, n in enumerate(names) if n.endswith("c_fc.bias")]
        assert not any(torch.equal(g1[i], g2[i]) for i in biases)
        assert all(sqnr(g1[i], g2[i]) >= 100 for i, n in enumerate(names) if "c_fc" in n)


class _MLPSharedOutput(MLP):
    """c_fc's output also goes straight to the block's output: fuse_gelu leaves c_fc out
    (its output has another use), and in the backward graph the GELU's gradient is added
    to that other gradient before c_fc's cast."""

    def forward(self, x):
        h = self.c_fc(x)
        return self.c_proj(self.gelu(h)) + h[..., :32]


@pytest.mark.parametrize("case", ["c_fc not converted", "gradient used twice"])
def test_compiled_gelu_gradient_without_a_taker(case, monkeypatch):
    """No FP8 cast in the compiled graph can take the GELU's gradient (c_fc left as
    nn.Linear, or its gradient the sum of two): the pass fuses nothing and puts the GELU's
    gradient back as torch's pointwise code for inductor to fuse, once per MLP; compiled
    training matches eager's (to inductor's own rounding)."""
    torch.manual_seed(0)
    if case == "c_fc not converted":
        base, keep = nn.Sequential(Block(), Block()), (lambda m, fqn: not fqn.endswith("c_fc"))
    else:
        base, keep = nn.Sequential(_MLPSharedOutput(), _MLPSharedOutput()), None
    (eager, compiled), fused, decomposed = _train_compiled_and_eager(base, monkeypatch, "cpu",
                                                                     module_filter_fn=keep)
    assert (fused, decomposed) == (0, 2)
    for step in (2, 3):
        for a, b in zip([eager[step][0], eager[step][1], *eager[step][2]],
                        [compiled[step][0], compiled[step][1], *compiled[step][2]]):
            assert sqnr(a, b) >= 100, step


def test_compiled_gelu_gradient_leaves_a_users_own_inductor_pass(monkeypatch, caplog):
    """A post_grad_custom_post_pass of the user's own stays in place (and runs): the GELU's
    gradient then runs as an op of its own, which a warning says once, and training matches
    eager."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from fp8ops import gelu_grad_pass
    graphs = []

    class Theirs(CustomGraphPass):
        def __call__(self, graph):
            graphs.append(graph)

        def uuid(self):
            return "theirs"

    theirs = Theirs()
    monkeypatch.setitem(gelu_grad_pass._STATE, "warned", False)
    torch.manual_seed(0)
    # (config.patch, not monkeypatch: undoing a monkeypatch deletes a config module's entry)
    with caplog.at_level(logging.WARNING, logger="fp8ops"), \
            torch._inductor.config.patch(post_grad_custom_post_pass=theirs):
        (eager, compiled), fused, decomposed = _train_compiled_and_eager(nn.Sequential(Block(), Block()),
                                                                         monkeypatch, "cpu")
        assert torch._inductor.config.post_grad_custom_post_pass is theirs
    assert (fused, decomposed) == (0, 0) and graphs
    assert sum("post_grad_custom_post_pass holds another pass" in r.message for r in caplog.records) == 1
    for step in (2, 3):
        for a, b in zip(eager[step][2], compiled[step][2]):
            assert sqnr(a, b) >= 100, step


def test_compiled_wrappers_made_after_the_pass_is_installed_pickle(monkeypatch):
    """The first trace of an Fp8Linear installs fp8ops' inductor pass in inductor's config, and
    every torch.compile wrapper made afterwards keeps that config: torch.save of such a wrapper,
    of a converted model or of any other, failed ("Can't pickle local object ...FuseGeluGrads").
    It pickles now, and the loaded wrapper runs, with fp8ops' pass in its config."""
    import io  # noqa: PLC0415
    from fp8ops import gelu_grad_pass  # noqa: PLC0415
    torch.manual_seed(0)
    model = convert_as_on_fp8_gpu(nn.Sequential(Block(), Block()), monkeypatch)
    torch._dynamo.reset()
    torch.compile(model)(torch.randn(2, 16, 32)).sum().backward()
    assert isinstance(torch._inductor.config.post_grad_custom_post_pass, gelu_grad_pass._STATE["cls"])
    for wrapper in (torch.compile(model), torch.compile(nn.Sequential(nn.Linear(32, 32)))):
        buf = io.BytesIO()
        torch.save(wrapper, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        loaded(torch.randn(2, 16, 32)).sum().backward()
    assert copy.deepcopy(torch._inductor.config.post_grad_custom_post_pass).uuid() == \
        torch._inductor.config.post_grad_custom_post_pass.uuid()


def test_current_recipe_runs_the_gelu_first(monkeypatch):
    """Current scaling needs gelu(h)'s amax before the cast: the GELU runs unfused,
    so the result is bit for bit the unfused model's."""
    torch.manual_seed(0)
    base = MLP()
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, recipe="current")
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, recipe="current", fuse_gelu=False)
    x = torch.randn(16, 32, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y2 = fused(x), plain(x2)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    y.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=0, atol=0)


def test_bf16_fallback_applies_the_gelu(monkeypatch):
    """A layer that runs BF16 (here: input on the CPU without the reference kernels)
    still computes linear(gelu(h)): the same as the model before conversion."""
    torch.manual_seed(0)
    base = MLP()
    model = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.fp8_on_cpu = False
    x = torch.randn(8, 32)
    torch.testing.assert_close(model(x), base(x), rtol=0, atol=0)
    assert model.c_proj.fp8_fallback_calls == 1


class ProducerAlsoResidual(GeluTwice):
    def forward(self, x):
        h = self.a(x)
        return self.b(self.gelu(h)) + h.mean()


def _grads_match(fused, plain, x, steps=3, min_sqnr=25):
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (fused, plain)]
    for step in range(steps):
        grads = []
        for m, opt in zip((fused, plain), opts):
            (m(x) ** 2).mean().backward()
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
            opt.step()
            opt.zero_grad()
        for n in grads[1]:
            assert sqnr(grads[1][n], grads[0][n]) >= min_sqnr, (step, n, sqnr(grads[1][n], grads[0][n]))


def test_producer_used_elsewhere_keeps_its_gradient(monkeypatch):
    """c_fc's output also feeds a residual: c_proj still fuses the GELU, but the GELU's
    gradient is applied by torch in c_proj's backward, not by c_fc."""
    torch.manual_seed(0)
    base = ProducerAlsoResidual()
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, fuse_gelu=False)
    assert fused.b.fp8_gelu_input and not fused.a.fp8_gelu_output
    _grads_match(fused, plain, torch.randn(32, 32))


def test_producer_called_alone_gets_its_own_gradient(monkeypatch):
    """c_fc called directly (no consumer takes its box) backpropagates dL/dh as a plain layer does."""
    torch.manual_seed(0)
    base = MLP()
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, fuse_gelu=False)
    x = torch.randn(16, 32)
    for m in (fused, plain):  # past the first (current-scaled) step
        m(x).sum().backward()
        fp8ops.step(m)
        m.zero_grad()
    for m in (fused, plain):
        m.c_fc(x).pow(2).sum().backward()
    torch.testing.assert_close(fused.c_fc.weight.grad, plain.c_fc.weight.grad, rtol=0, atol=0)


def test_consumer_in_bf16_producer_in_fp8(monkeypatch):
    """Policy may run the two layers differently: c_proj's plain path passes the
    gradient of gelu(h) to c_fc, which applies the GELU's gradient itself."""
    torch.manual_seed(0)
    base = MLP()
    fused = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch)
    plain = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, fuse_gelu=False)
    for m in (fused, plain):
        m.c_proj.fp8_on_cpu = False  # CPU input without the reference kernels: the nn.Linear path
    seen = _gelu_calls(monkeypatch)
    _grads_match(fused, plain, torch.randn(32, 32))
    assert sum(1 for kind, on in seen if kind == "bwd" and on) == 2  # c_fc applied it (steps 2, 3)
    assert fused.c_proj.fp8_fallback_calls == 3


# ------------------------------------------------------------------ the ops

def _scales(device):
    s = torch.tensor([0.5], device=device)
    return s, torch.zeros(1, device=device), 1 / s


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("save_xt", [True, False])
def test_linear_fwd_gelu_input_is_linear_of_gelu(device, dtype, save_xt):
    """linear_fwd(h, gelu_input=True) == linear_fwd(gelu_tanh(h) in h's dtype), to
    tanhf's rounding: few FP8 codes differ, each by one step."""
    torch.manual_seed(0)
    M, K, N = 256, 128, 64
    h = (torch.randn(M, K, device=device) * 3).to(dtype)
    w8 = (torch.randn(N, K, device=device) * 0.1).to(E4)
    sx, amax, sx_inv = _scales(device)
    amax2 = amax.clone()
    sw_inv = torch.ones(1, device=device)
    y, x8t, _, _ = ops.linear_fwd(h, w8, sx, amax, sx_inv, sw_inv, save_xt=save_xt, gelu_input=True)
    g = F.gelu(h.float(), approximate="tanh").to(dtype)
    y_ref, x8t_ref, _, _ = ops.linear_fwd(g, w8, sx, amax2, sx_inv, sw_inv, save_xt=save_xt)
    torch.testing.assert_close(amax, amax2, rtol=1e-2, atol=0)
    assert sqnr(y_ref.float(), y.float()) >= 40
    if save_xt:
        a, b = x8t.view(torch.uint8).int(), x8t_ref.view(torch.uint8).int()
        assert (a != b).float().mean() <= 0.01
        assert (a - b).abs().max() <= 1


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("need_dw", [True, False])
def test_linear_bwd_gelu_input_casts_the_gelu_gradient(device, dtype, need_dw):
    """linear_bwd(gy, gelu_input=h) == linear_bwd(gy * gelu_tanh'(h) in gy's dtype): dx, dw,
    the bias gradient and the amax (CUDA: the fused cast with need_dw, a separate pass without)."""
    torch.manual_seed(0)
    M, N, K = 256, 128, 64
    gy = torch.randn(M, N, device=device).to(dtype)
    h = (torch.randn(M, N, device=device) * 3).to(dtype)
    w8t = (torch.randn(K, N, device=device) * 0.1).to(E4)
    x8t = torch.randn(K, M, device=device).to(E4)
    one = torch.ones(1, device=device)
    amax, amax_ref = torch.zeros(1, device=device), torch.zeros(1, device=device)
    scale = torch.tensor([64.0], device=device)
    dy = torch.ops.aten.gelu_backward(gy.float(), h.float(), approximate="tanh").to(dtype)
    out = ops.linear_bwd(gy, w8t, x8t, scale, amax, one, one, one, E5, torch.bfloat16, torch.float32,
                         need_dw=need_dw, need_db=True, gelu_input=h)
    ref = ops.linear_bwd(dy, w8t, x8t, scale, amax_ref, one, one, one, E5, torch.bfloat16, torch.float32,
                         need_dw=need_dw, need_db=True)
    torch.testing.assert_close(amax, amax_ref, rtol=1e-3, atol=0)
    torch.testing.assert_close(out[2], ref[2], rtol=1e-3, atol=1e-3)   # bias gradient
    for a, b in zip(out[:2], ref[:2]):
        if b.numel():
            assert sqnr(b.float(), a.float()) >= 35


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_linear_bwd_gelu_input_is_checked(device):
    M, N, K = 32, 16, 48
    one = torch.ones(1, device=device)
    gy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    w8t, x8t = torch.zeros(K, N, device=device, dtype=E4), torch.zeros(K, M, device=device, dtype=E4)
    args = (gy, w8t, x8t, one, torch.zeros(1, device=device), one, one, one, E5, torch.bfloat16, torch.float32)
    with pytest.raises(RuntimeError, match=r"gelu_input must be \[M, N\]"):
        ops.linear_bwd(*args, gelu_input=torch.zeros(M, K, device=device, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="gelu_input must have gy's dtype"):
        ops.linear_bwd(*args, gelu_input=torch.zeros(M, N, device=device))


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_fused_gelu_cuda_matches_cpu_reference():
    """The CUDA kernels (fast transposing path, both FP8 formats) against the C
    reference: tanhf differs by an fp32 ulp at most, so nearly every byte agrees."""
    torch.manual_seed(0)
    M, K, N = 512, 256, 128
    for dtype in (torch.bfloat16, torch.float32):
        h = (torch.randn(M, K) * 4).to(dtype)
        w8 = (torch.randn(N, K) * 0.1).to(E4)
        outs = []
        for dev in ("cpu", "cuda"):
            sx, amax, sx_inv = _scales(dev)
            y, x8t, _, _ = ops.linear_fwd(h.to(dev), w8.to(dev), sx, amax, sx_inv, torch.ones(1, device=dev),
                                          gelu_input=True)
            outs.append((y.float().cpu(), x8t.view(torch.uint8).cpu().int(), amax.cpu()))
        (y0, t0, a0), (y1, t1, a1) = outs
        assert (t0 != t1).float().mean() <= 1e-3 and (t0 - t1).abs().max() <= 1
        torch.testing.assert_close(a0, a1, rtol=1e-5, atol=0)
        assert sqnr(y0, y1) >= 40


def test_a_hook_registered_after_the_fusion_warns_what_it_sees(monkeypatch):
    """A hook on a fused linear sees other tensors than nn.Linear's would (c_proj's input is
    the GELU's input; c_fc's output gradient is the gradient of the GELU's output): say so
    when it is registered, instead of letting the hook read them silently."""
    model = convert_as_on_fp8_gpu(Block(), monkeypatch)
    mlp = model.mlp
    cases = [
        (lambda: mlp.c_proj.register_forward_pre_hook(lambda m, a: None), "GELU's input, not its output"),
        (lambda: mlp.c_proj.register_forward_hook(lambda m, a, o: None), "GELU's input, not its output"),
        (lambda: mlp.c_fc.register_forward_pre_hook(lambda m, a: None), "LayerNorm's input, not its output"),
        (lambda: mlp.c_fc.register_full_backward_pre_hook(lambda m, g: None), "gradient of the GELU after it"),
        (lambda: mlp.c_fc.register_full_backward_hook(lambda m, gi, go: None),
         r"LayerNorm's input.*; its output's gradient is the gradient of the GELU"),
    ]
    for register, pattern in cases:
        with pytest.warns(UserWarning, match=pattern):
            register()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mlp.c_proj.register_full_backward_pre_hook(lambda m, g: None)  # c_proj's output gradient is its own
        gelu_only = convert_as_on_fp8_gpu(Block(), monkeypatch, fuse_layernorm=False)
        gelu_only.mlp.c_fc.register_forward_hook(lambda m, a, o: None)  # c_fc's input and output its own
        plain = convert_as_on_fp8_gpu(Block(), monkeypatch, fuse_gelu=False, fuse_layernorm=False)
        plain.mlp.c_proj.register_forward_pre_hook(lambda m, a: None)


@pytest.mark.filterwarnings("ignore:fp8ops")
@pytest.mark.parametrize("first", [dict(fuse_gelu=False), dict(recipe="current")])
def test_convert_again_keeps_each_layers_own_fusion_choice(monkeypatch, first):
    """A model converted with fuse_gelu=False (or on current scaling, which fuses nothing), then
    converted again with the defaults: the layers keep their config, so their GELU stays apart
    (the second call used to fuse it, against the config the layer shows)."""
    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.proj = nn.Linear(64, 128), nn.GELU(approximate="tanh"), nn.Linear(128, 64)

        def forward(self, x):
            return self.proj(self.act(self.fc(x)))
    m = convert_as_on_fp8_gpu(MLP(), monkeypatch, **first)
    fp8ops.convert(m, config=fp8ops.Fp8Config(policy="always"))
    assert isinstance(m.act, nn.GELU) and not m.proj.fp8_gelu_input and not m.fc.fp8_gelu_output
