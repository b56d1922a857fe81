"""A converted model keeps behaving as the nn.Linear model it was: what convert keeps (hooks,
attributes, modes, a module shared by two parents), copies, a model built on the meta device,
dtype changes, wrong inputs, double backward, arguments, wrapped models (torch.compile, a
parent) in report and the scaling state, and a frozen weight updated through .data. All on the
CPU reference kernels (conftest.convert_as_on_fp8_gpu)."""
import copy
import dataclasses
import functools
import io
import pickle
import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8ops
from fp8ops import Fp8Config, policy
from fp8ops._reference import FP8_MAX, sqnr
from fp8ops.linear import X, Fp8Linear, Fp8LinearBase

from conftest import FP8_DEVICES, convert_as_on_fp8_gpu, requires_fp8


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))


def _train(model, steps=3, seed=1, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randn(16, 32, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_convert_keeps_hooks_attributes_and_mode(monkeypatch):
    model = _mlp()
    lin = model[0]
    called = []
    lin.register_forward_pre_hook(lambda m, args, kwargs: called.append("pre") or None, with_kwargs=True)
    lin.register_forward_hook(lambda m, args, kwargs, out: called.append("fwd") or None, with_kwargs=True)
    lin.register_full_backward_hook(lambda m, gin, gout: called.append("bwd") or None)
    lin.NANOGPT_SCALE_INIT = 1
    model[2].eval()
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert model[0] is lin and isinstance(lin, Fp8Linear)      # the same object, converted in place
    model(torch.randn(16, 32)).sum().backward()
    assert called == ["pre", "fwd", "bwd"]
    assert lin.NANOGPT_SCALE_INIT == 1 and not model[2].training and model[0].training


def test_forward_replaced_on_the_instance_stays_with_the_reason(monkeypatch):
    """accelerate's hooks set a forward on the module object that calls the class's original
    one: converted, the layer would keep running BF16 while reported FP8."""
    model = _mlp()
    lin = model[0]

    def wrapped(module, *args, **kwargs):
        return module._old_forward(*args, **kwargs)

    lin._old_forward = lin.forward
    lin.forward = functools.partial(wrapped, lin)
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert type(model[0]) is nn.Linear and isinstance(model[2], Fp8Linear)
    rows = {r["name"]: r for r in fp8ops.report(model, print_table=False)}
    assert rows["0"]["backend"] == "bf16" and "forward replaced on the module object" in rows["0"]["reason"]


def test_shared_linear_stays_one_converted_module(monkeypatch):
    model = nn.Module()
    model.a = nn.Linear(32, 32)
    model.b = model.a
    convert_as_on_fp8_gpu(model, monkeypatch)
    assert model.a is model.b and isinstance(model.a, Fp8Linear)
    rows = {r["name"]: r for r in fp8ops.report(model, print_table=False)}
    assert rows["a"]["backend"] == "fp8ops"


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_copy_updates_its_scales_after_its_optimizer_steps(monkeypatch, how):
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(model)
    if how == "deepcopy":
        twin = copy.deepcopy(model)
    elif how == "pickle":
        twin = pickle.loads(pickle.dumps(model))
    else:
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        twin = torch.load(buf, weights_only=False)
    # (a copy casts with current scales until its own first update: it may be stepped by no
    # optimizer, as an EMA teacher is)
    assert twin[0].fp8_step == 3 and not twin[0]._fp8_delayed_ready
    before = twin[0].fp8_scale.clone()
    g = torch.Generator().manual_seed(5)
    opt = torch.optim.SGD(twin.parameters(), lr=0.0)
    for _ in range(3):   # inputs 100x larger: the input scale must follow them down
        twin(torch.randn(16, 32, generator=g) * 100).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert twin[0].fp8_step == 6 and twin[0]._fp8_delayed_ready
    assert twin[0].fp8_scale[X] < before[X] / 10
    assert model[0].fp8_step == 3                                  # the original is its own


def test_meta_device_model_gets_fresh_scaling_state(monkeypatch):
    with torch.device("meta"):
        model = _mlp()
    convert_as_on_fp8_gpu(model, monkeypatch)
    # before to_empty: the report and the scaling state say there is none yet (no crash)
    assert [r["runs"] for r in fp8ops.report(model, print_table=False)] == ["not yet", "not yet"]
    assert "on the meta device" in fp8ops.report(model, print_table=False)[0]["reason"]
    assert fp8ops.scaling_state_dict(model) == {}
    model.to_empty(device="cpu")
    ref = _mlp()
    model.load_state_dict(ref.state_dict())
    for m in (model[0], model[2]):
        assert m.fp8_max.tolist() == [FP8_MAX[dt] for dt in m.fp8_dtypes]
        assert m.fp8_scale.tolist() == [1.0, 1.0, 1.0] and m.fp8_scale_inv.tolist() == [1.0, 1.0, 1.0]
        assert not m.fp8_amax_history.any() and not m.fp8_overflow_count.any()
        assert m.fp8_step == 0 and not m._fp8_delayed_ready
    x = torch.randn(16, 32)
    for _ in range(3):
        assert sqnr(model(x), ref(x)) >= 25
        fp8ops.step(model)


def test_wrong_input_width_names_in_features(monkeypatch):
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    with pytest.raises(ValueError, match=r"last dimension must be 32 \(in_features\), found input shape \(16, 64\)"):
        model(torch.randn(16, 64))
    assert not model[0].fp8_amax_history.any()                     # nothing recorded from it


def test_float64_model_runs_as_nn_linear(monkeypatch):
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch).to(torch.float64)
    ref = _mlp().to(torch.float64)
    x = torch.randn(16, 32, dtype=torch.float64)
    y = model(x)
    assert y.dtype == torch.float64 and torch.equal(y, ref(x))


def test_double_backward_raises_instead_of_a_zero_gradient(monkeypatch):
    """A second derivative through FP8 casts is not computed: differentiating a gradient taken
    with create_graph=True through an FP8 layer raises, saying so. torch's once_differentiable
    raised only at a .backward(): torch.autograd.grad (allow_unused=True) gave None, and jvp /
    hvp zeros, for the FP8 layers' share, silently. The legacy-batched backward of
    vectorize=True raises clearly too (it raised torch's 'Batching rule not implemented for
    aten::detach'); vectorize=False runs."""
    import torch.autograd.functional as AF
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    x = torch.randn(16, 32, requires_grad=True)
    refused = "second derivative through FP8 casts is not computed"
    (g,) = torch.autograd.grad(model(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=refused):
        torch.autograd.grad(g.square().sum(), x, allow_unused=True)
    with pytest.raises(RuntimeError, match=refused):
        g.square().sum().backward()
    with pytest.raises(RuntimeError, match=refused):
        AF.jvp(model, x.detach(), torch.ones(16, 32))
    with pytest.raises(RuntimeError, match=refused):
        AF.hvp(lambda t: model(t).square().sum(), x.detach(), torch.ones(16, 32))
    with pytest.raises(RuntimeError, match="vectorize=False"):
        AF.jacobian(model, x.detach()[:1], vectorize=True)
    jac = AF.jacobian(model, x.detach()[:1], vectorize=False)
    assert jac.shape == (1, 32, 1, 32) and jac.abs().sum() > 0


def test_second_order_that_does_not_pass_an_fp8_layer_runs(monkeypatch):
    """create_graph=True where the second derivative is taken only through a BF16 head (a
    Hutchinson Hessian of the head's weight, as AdaHessian or Sophia take it): the FP8 layers'
    first-order gradients are those of a plain backward, and the head's Hessian-vector product
    that of the same model without the FP8 layers' graph."""
    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 8))
    model = convert_as_on_fp8_gpu(build(), monkeypatch)
    head = model[4]
    model[4] = nn.Linear(32, 8)
    model[4].load_state_dict(head.state_dict())  # (the head in BF16's place: nn.Linear)
    x, v = torch.randn(16, 32), torch.randn(8, 32)
    model(x).square().mean().backward(create_graph=True)
    (hv,) = torch.autograd.grad(model[4].weight.grad, model[4].weight, v)
    fp8_grads = [p.grad.detach().clone() for p in model[:3].parameters()]
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(fp8_grads, model[:3].parameters()))
    h = model[:4](x).detach()  # (the head's input, as the FP8 layers computed it)
    w = model[4].weight.detach().requires_grad_()
    loss = torch.nn.functional.linear(h, w, model[4].bias.detach()).square().mean()
    (gw,) = torch.autograd.grad(loss, w, create_graph=True)
    (want,) = torch.autograd.grad(gw, w, v)
    torch.testing.assert_close(hv, want)


def test_frozen_weight_updated_through_data_is_cast_afresh(monkeypatch):
    """An EMA teacher: frozen weights written through .data, which no version counter sees."""
    teacher = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    plain = _mlp()
    for p in teacher.parameters():
        p.requires_grad_(False)
    x = torch.randn(16, 32)
    for it in range(3):
        with torch.no_grad():
            assert sqnr(teacher(x), plain(x)) >= 20, it   # a stale cached cast: about -7 dB
            for pt, pp in zip(teacher.parameters(), plain.parameters()):
                new = torch.randn_like(pt) * 0.2
                pt.data.copy_(new)
                pp.data.copy_(new)


def test_bad_arguments_raise_naming_them(monkeypatch):
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    with pytest.raises(TypeError, match="config must be an fp8ops.Fp8Config, found dict"):
        fp8ops.convert(_mlp(), config={"recipe": "current"})
    with pytest.raises(TypeError, match="module_filter_fn must be a callable"):
        fp8ops.convert(_mlp(), module_filter_fn=["0"])
    with pytest.raises(ValueError, match="fuse_gelu must be True or False, found 'false'"):
        Fp8Config(fuse_gelu="false")
    with pytest.raises(ValueError, match="interval must be an int >= 1, found True"):
        Fp8Config(interval=True)
    with pytest.raises(TypeError, match="must be a plain nn.Linear"):
        Fp8Linear.from_linear(nn.Bilinear(4, 4, 4), Fp8Config())


def _filtered(monkeypatch):
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.Linear(32, 8))
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    return fp8ops.convert(model, config=Fp8Config(policy="always"), module_filter_fn=lambda m, n: n != "2")


@pytest.mark.parametrize("wrap", ["compile", "parent"])
def test_report_of_a_wrapped_model_keeps_the_reasons(monkeypatch, wrap):
    model = _filtered(monkeypatch)
    if wrap == "compile":
        outer, prefix = torch.compile(model), "_orig_mod."
    else:
        outer, prefix = nn.ModuleDict({"body": model}), "body."
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(outer, print_table=False)}
    assert reasons[prefix + "2"] == "excluded by module_filter_fn"
    assert "multiples of 16" in reasons[prefix + "3"]


def test_scaling_state_is_keyed_by_the_model_not_its_wrapper(monkeypatch):
    model = _filtered(monkeypatch)
    for m in model.modules():
        if isinstance(m, Fp8Linear):
            m.fp8_on_cpu = True
    _train(model)
    state = fp8ops.scaling_state_dict(torch.compile(model))
    assert list(state) == ["0"]
    fresh = _filtered(monkeypatch)
    assert fp8ops.load_scaling_state_dict(fresh, state, strict=True) == []
    assert torch.equal(fresh[0].fp8_scale, model[0].fp8_scale)
    # a state an older fp8ops saved under the wrapper's names still loads
    fresh = _filtered(monkeypatch)
    assert fp8ops.load_scaling_state_dict(fresh, {"_orig_mod.0": state["0"]}) == []
    assert torch.equal(fresh[0].fp8_scale, model[0].fp8_scale)


def test_scaling_state_of_another_format_is_not_loaded(monkeypatch):
    src = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=4)
    _train(src)
    state = fp8ops.scaling_state_dict(src)
    dst = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=4, fp8_format="e4m3")
    assert fp8ops.load_scaling_state_dict(dst, state) == ["0", "2"]
    assert dst[0].fp8_scale.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(KeyError, match="another amax history length, recipe, FP8 format or layer shape"):
        fp8ops.load_scaling_state_dict(dst, state, strict=True)


def test_scaling_state_of_another_shape_is_not_loaded(monkeypatch):
    """A state saved from a layer of another shape under the same name (a probe: the loaded
    input scale saturated a wider layer's inputs, 0.2 dB against F.linear) is skipped, and
    strict refuses it; a state saved before the shape was recorded still loads."""
    src = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(src)
    state = fp8ops.scaling_state_dict(src)
    assert state["0"]["shape"] == (32, 64) and state["2"]["shape"] == (64, 32)
    wide = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32)), monkeypatch)
    assert fp8ops.load_scaling_state_dict(wide, state) == ["0", "2"]
    assert wide[0].fp8_scale.tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(KeyError, match=r"no compatible state for \['0', '2'\].*layer shape"):
        fp8ops.load_scaling_state_dict(wide, state, strict=True)
    old = {name: {k: v for k, v in s.items() if k != "shape"} for name, s in state.items()}
    dst = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    assert fp8ops.load_scaling_state_dict(dst, old, strict=True) == []
    assert torch.equal(dst[0].fp8_scale, src[0].fp8_scale)
    with pytest.raises(ValueError, match=r"0's saved state shape is \(32,\), not \(in_features, out_features\)"):
        fp8ops.load_scaling_state_dict(dst, {**state, "0": {**state["0"], "shape": (32,)}})


def test_scaling_state_into_a_meta_model_raises_before_the_weights_give_it_storage(monkeypatch):
    """On a model built on the meta device the copy stored nothing and the assign=True weight
    load (or to_empty) then started the scaling afresh, while the load had returned [] (a
    probe): it raises now, saying to load the weights first; that order restores the state."""
    src = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(src)
    state, weights = fp8ops.scaling_state_dict(src), src.state_dict()
    with torch.device("meta"):
        dst = _mlp()
    convert_as_on_fp8_gpu(dst, monkeypatch)
    with pytest.raises(ValueError, match="0 is on the meta device.*Load the weights.*first.*Nothing was loaded"):
        fp8ops.load_scaling_state_dict(dst, state, strict=True)
    dst.load_state_dict(weights, assign=True)
    assert fp8ops.load_scaling_state_dict(dst, state, strict=True) == []
    assert dst[0].fp8_step == src[0].fp8_step == 3 and torch.equal(dst[0].fp8_scale, src[0].fp8_scale)


def test_policy_verdicts_are_saved_and_restored_on_the_same_gpu(monkeypatch):
    """policy "auto"'s settled verdicts travel with the scaling state (through torch.save with
    weights_only): a resume on the same GPU and torch runs each shape as the run before, with
    no trial steps again (a pending one is dropped); on another GPU, or into a layer whose policy
    or setup differs, nothing is restored and the layer measures again."""
    from fp8ops import policy_ranks  # noqa: PLC0415
    gpu = ["NVIDIA H200"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu[0])
    key = (1024, torch.bfloat16)

    def converted(policy="auto", **cfg):
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, **cfg)
        for m in (model[0], model[2]):
            m.fp8_config = dataclasses.replace(m.fp8_config, policy=policy)
        return model

    src = converted()
    _train(src)
    policy_ranks.settled(src[0], key, False, 0.8, "trial: 1.00 vs 0.90 ms per step")
    policy_ranks.settled(src[2], key, True, 1.4)
    buf = io.BytesIO()
    torch.save(fp8ops.scaling_state_dict(src), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert state["0"]["policy"]["gpu"] == "NVIDIA H200"
    dst = converted()
    dst[0]._fp8_pending[key] = policy.Timing(1.0, 2.0, 1.5, 1.0, 0.2, 0.4)  # (a trial under way)
    assert fp8ops.load_scaling_state_dict(dst, state, strict=True) == []
    assert dst[0].fp8_policy == {key: (False, 0.8)} and dst[2].fp8_policy == {key: (True, 1.4)}
    assert dst[0].fp8_policy_why[key] == "trial: 1.00 vs 0.90 ms per step; restored"
    assert dst[2].fp8_policy_why[key] == "restored from the saved scaling state" and key not in dst[0]._fp8_pending
    # the all-BF16 layer rests from the next step, as it did before the save (its updates cost host time)
    assert dst[0]._fp8_rest_due and not dst[2]._fp8_rest_due
    rows = {r["name"]: r for r in fp8ops.report(dst, print_table=False)}
    assert "restored" in rows["0"]["reason"]
    # saved again and restored again: the note does not grow
    again = converted()
    fp8ops.load_scaling_state_dict(again, fp8ops.scaling_state_dict(dst))
    assert again[0].fp8_policy_why[key] == "trial: 1.00 vs 0.90 ms per step; restored"
    # verdicts of another form (a newer fp8ops', a hand-made one) are measured again; the rest
    # loads (they raised part-way through the load, after earlier layers had loaded)
    for bad in ([(1024, "bf16", False, 0.8, None)], [(1024, "bfloat16")], "x"):
        odd = {**state, "2": {**state["2"], "policy": {**state["2"]["policy"], "verdicts": bad}}}
        dst = converted()
        assert fp8ops.load_scaling_state_dict(dst, odd, strict=True) == []
        assert dst[0].fp8_policy == {key: (False, 0.8)} and dst[2].fp8_policy == {}
        assert torch.equal(dst[2].fp8_scale, src[2].fp8_scale)
    # measured elsewhere, or for another setup or policy: measured again
    for gpu[0], cfg, pol in (("NVIDIA H100 80GB HBM3", {}, "auto"), ("NVIDIA H200", {"fast_accum": False}, "auto"),
                             ("NVIDIA H200", {}, "always")):
        dst = converted(pol, **cfg)
        assert fp8ops.load_scaling_state_dict(dst, state, strict=True) == []
        assert dst[0].fp8_policy == {} and dst[2].fp8_policy == {}
        assert torch.equal(dst[0].fp8_scale, src[0].fp8_scale)  # (the scales load all the same)


def test_assign_load_into_a_meta_model_gives_the_scaling_state_storage(monkeypatch):
    """PyTorch's meta-device recipe: build on meta, convert, load_state_dict(assign=True). The
    scaling buffers (in no state dict) get storage on the weights' device and fresh values, and
    the model trains as one built with to_empty() and loaded."""
    sd = _mlp().state_dict()
    runs = []
    for assign in (False, True):
        with torch.device("meta"):
            model = _mlp()
        convert_as_on_fp8_gpu(model, monkeypatch)
        if assign:
            model.load_state_dict(sd, assign=True)
        else:
            model.to_empty(device="cpu").load_state_dict(sd)
        assert all(b.device.type == "cpu" for b in model.buffers())
        assert model[0].fp8_scale.tolist() == [1.0, 1.0, 1.0] and model[0].fp8_max[0] == FP8_MAX[torch.float8_e4m3fn]
        _train(model)
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("remake", ["assign_load", "to_empty", "move"])
def test_a_first_call_under_inference_mode_after_the_buffers_were_remade(monkeypatch, remake):
    """A move or a meta model's load leaves the scale_inv buffer unpadded, and the next call
    pads it. When that call ran under inference_mode (a validation before training), the new
    buffer was an inference tensor: that call and every training call after it raised
    "Inference tensors do not track version counter"."""
    sd = _mlp().state_dict()
    if remake == "move":
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
        for m in (model[0], model[2]):
            m.fp8_scale_inv = m.fp8_scale_inv.contiguous()  # (what .cuda() does to the strided buffer)
    else:
        with torch.device("meta"):
            model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
        if remake == "assign_load":
            with torch.inference_mode():
                model.load_state_dict(sd, assign=True)
        else:
            model.to_empty(device="cpu").load_state_dict(sd)
    assert model[0].fp8_scale_inv.stride() == (1,)
    with torch.inference_mode():
        model(torch.randn(16, 32))
    assert not any(b.is_inference() for b in model.buffers())
    _train(model)
    assert model[0]._fp8_delayed_ready and model[0].fp8_step == 3


def test_compiled_optimizer_steps_run_the_scale_updates(monkeypatch):
    """The scale updates hang on global optimizer hooks: under torch.compile(opt.step) dynamo
    traced them and failed (an AssertionError naming an optimizer attribute), for any
    optimizer in the process once a layer was converted. They run as eager code."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    plain = _mlp(seed=2)
    for m, n in ((plain, 0), (model, 3)):
        opt = torch.optim.SGD(m.parameters(), lr=torch.tensor(0.01))
        step = torch.compile(opt.step, backend="eager")
        for _ in range(3):
            m(torch.randn(16, 32)).square().mean().backward()
            step()
            opt.zero_grad()
    assert model[0].fp8_step == 3 and model[0]._fp8_delayed_ready and model[0].fp8_scale[X] != 1.0


@pytest.mark.parametrize("fails", ["filter", "state"])
def test_a_convert_that_raises_leaves_every_layer_as_it_was(monkeypatch, fails):
    """A module_filter_fn that raises part-way, or a layer whose scaling state cannot be made:
    the layers converted before it were left converted with no decisions stored, and the
    failing one half-made (an Fp8Linear whose forward raised KeyError). Now nothing is."""
    from fp8ops.linear import Fp8Linear as L  # noqa: PLC0415
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 32))
    before = {n: (type(m), set(m.__dict__), set(m._buffers)) for n, m in model.named_modules()}
    filt = None
    if fails == "filter":
        def filt(mod, fqn):
            if fqn == "3":
                raise RuntimeError("a filter's own bug")
            return True
    else:
        init = L._init_fp8_state
        made = []

        def failing_init(self, config):
            made.append(self)
            init(self, config)
            if len(made) == 2:
                raise MemoryError("no room for the scaling state")
        monkeypatch.setattr(L, "_init_fp8_state", failing_init)
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    with pytest.raises((RuntimeError, MemoryError)):
        fp8ops.convert(model, config=Fp8Config(policy="always"), module_filter_fn=filt)
    assert {n: (type(m), set(m.__dict__), set(m._buffers)) for n, m in model.named_modules()} == before
    x = torch.randn(16, 32)
    assert torch.equal(model(x), nn.Sequential(*[copy.deepcopy(m) for m in model])(x))
    assert fp8ops.report(model, print_table=False)[0]["runs"] == "BF16"


def test_config_takes_numpy_numbers_as_python_ones():
    np = pytest.importorskip("numpy")
    cfg = Fp8Config(interval=np.int64(2), amax_history_len=np.int32(16), margin=np.float32(1.0))
    assert cfg == Fp8Config(interval=2, amax_history_len=16, margin=1.0) and type(cfg.interval) is int
    assert "np." not in cfg.short_str()
    with pytest.raises(ValueError, match=r"amax_history_len must be an int in \[1, 1048576\]"):
        Fp8Config(amax_history_len=10 ** 12)


def test_a_weight_load_restarts_scaling_but_keeps_the_step_and_the_counts(monkeypatch):
    """load_state_dict of other weights restarts the scaling (current scales first), while the
    step count (the phase of `interval`) and the run's NaN/inf counts go on."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, interval=2)
    _train(model, steps=3)
    lin = model[0]
    with torch.no_grad():
        lin.fp8_overflow_count[X] = 2  # (as two NaN amaxes of its input would have counted)
    lin.load_state_dict(_mlp(seed=1)[0].state_dict())
    assert lin.fp8_step == 3 and lin.fp8_overflow_count.tolist() == [2, 0, 0]
    assert not lin.fp8_amax_history.any() and lin.fp8_scale.tolist() == [1.0, 1.0, 1.0]
    assert not lin._fp8_delayed_ready


def test_a_scaling_state_loaded_before_the_weights_is_kept(monkeypatch):
    """A resume that restores the scaling state first and the weights after it (the order the
    README does not ask for) continues bit for bit as the uninterrupted run, as the other order
    does; a weight load after the next optimizer step restarts the scaling again."""
    xs = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    def make():
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model, opt, batch):
        outs = []
        for x in batch:
            y = model(x)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        return outs

    model, opt = make()
    ref = train(model, opt, xs)
    model, opt = make()
    train(model, opt, xs[:3])
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(),
                           "fp8": fp8ops.scaling_state_dict(model)})
    for scaling_first in (False, True):
        ck = copy.deepcopy(saved)  # (the optimizer's load keeps its step tensors: a copy per resume)
        resumed, opt = make()
        if scaling_first:
            assert fp8ops.load_scaling_state_dict(resumed, ck["fp8"]) == []
            resumed.load_state_dict(ck["model"])
        else:
            resumed.load_state_dict(ck["model"])
            assert fp8ops.load_scaling_state_dict(resumed, ck["fp8"]) == []
        opt.load_state_dict(ck["opt"])
        assert all(torch.equal(a, b) for a, b in zip(ref[3:], train(resumed, opt, xs[3:]))), scaling_first
    resumed.load_state_dict(ck["model"])  # (stepped since the scaling load: a restart)
    assert not resumed[0].fp8_amax_history.any()
    fresh, _ = make()
    fp8ops.load_scaling_state_dict(fresh, saved["fp8"])
    fresh(xs[0])  # (a cast: the loaded state is in use, and a weight load restarts it)
    fresh.load_state_dict(saved["model"])
    assert not fresh[0].fp8_amax_history.any() and fresh[0].fp8_step == saved["fp8"]["0"]["step"]


def test_report_says_a_layer_whose_weight_moved_runs_nn_linear(monkeypatch, capsys):
    """After model.double() every call of a converted layer runs nn.Linear's computation:
    report, its headline and the example's run summary say so rather than FP8, whatever the
    layer ran before."""
    from fp8ops.report import RUNS_PLAIN  # noqa: PLC0415
    from fp8ops.training import run_summary  # noqa: PLC0415
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(model, steps=2)
    assert {r["runs"] for r in fp8ops.report(model, print_table=False)} == {"FP8"}
    model.double()
    model(torch.randn(16, 32, dtype=torch.float64)).sum().backward()
    rows = fp8ops.report(model)
    assert all(r["runs"] == RUNS_PLAIN for r in rows)
    assert "its weight is float64, not float32, bfloat16 or float16" in rows[0]["reason"]
    assert "0 running FP8; 2 running nn.Linear's computation" in capsys.readouterr().out
    assert "0 of 2 converted layers ran FP8; 2 run nn.Linear's computation" in run_summary(
        model, {"backend": "fp8ops", "summary": ""})
    model.float()
    assert {r["runs"] for r in fp8ops.report(model, print_table=False)} == {"FP8"}
    # a GPU-trained model moved to the CPU (here: the CPU no longer stands in for the GPU), once
    # called there (before, a weight resting on the CPU may be an offload's, which casts on the GPU)
    _train(model, steps=1)
    for m in (model[0], model[2]):
        m.fp8_on_cpu = False
    assert {r["runs"] for r in fp8ops.report(model, print_table=False)} == {"FP8"}
    model(torch.randn(16, 32))
    rows = fp8ops.report(model, print_table=False)
    assert [r["runs"] for r in rows] == [RUNS_PLAIN] * 2, rows
    assert "its weight is on the CPU, where its calls fell back, and FP8 runs on a CUDA GPU" in rows[0]["reason"]


def test_report_of_a_layer_replaced_after_conversion_says_so(monkeypatch):
    """A converted layer replaced by a plain nn.Linear under the same name (HF's
    resize_token_embeddings makes a new lm_head) used to be listed as BF16 with the old
    decision's reason, "converted"."""
    model = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16)), monkeypatch)
    model[1] = nn.Linear(32, 16)
    rows = {r["name"]: r for r in fp8ops.report(model, print_table=False)}
    assert rows["0"]["reason"] == "converted" and rows["0"]["backend"] == "fp8ops"
    assert rows["1"]["backend"] == "bf16" and rows["1"]["runs"] == "BF16"
    assert rows["1"]["reason"] == "replaced after conversion by a plain layer; call fp8ops.convert(model) again"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.jit.script is deprecated in torch 2.11)
def test_convert_of_a_model_without_linear_layers_says_so(monkeypatch):
    """A model with no linear layer (or a TorchScript module, whose layers are compiled code)
    was returned unconverted without a word; report(None) raised an AttributeError."""
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    with pytest.warns(UserWarning, match=r"no nn.Linear \(or transformers Conv1D\) layer; nothing was converted$"):
        fp8ops.convert(nn.Sequential(nn.ReLU(), nn.LayerNorm(16)))
    scripted = torch.jit.script(nn.Sequential(nn.Linear(16, 16)))
    with pytest.warns(UserWarning, match=r"nothing was converted \(a TorchScript module's layers .* before "
                                         r"torch.jit.script\)"):
        fp8ops.convert(scripted)
    with pytest.raises(TypeError, match="report: model must be an nn.Module, found NoneType"):
        fp8ops.report(None)


def test_report_reads_the_running_amax_until_the_first_update_under_an_interval(monkeypatch):
    """Under interval > 1 the first steps roll nothing: the report shows row 0's running
    maxima (the casts' amaxes so far), not the zeros of a history row no update has written."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, interval=3)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    opt = _train(model, steps=1)
    row = fp8ops.report(model, print_table=False)[0]
    assert row["amax_x"] == pytest.approx(float(x.abs().max()), rel=1e-6) and row["amax_w"] > 0
    _train(model, steps=2, opt=opt)  # (the third step's update rolls the history)
    assert fp8ops.report(model, print_table=False)[0]["amax_x"] > 0


def test_report_shows_no_amax_where_a_one_row_history_kept_none(monkeypatch, capsys):
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=1)
    _train(model, steps=1)
    rows = fp8ops.report(model)
    assert rows[0]["amax_x"] is None and rows[0]["scale_x"] != 1.0
    assert "-/-/-" in capsys.readouterr().out
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=2)
    _train(model, steps=1)
    assert fp8ops.report(model, print_table=False)[0]["amax_x"] > 0


def _train_then_shrink_grads(model, fall=1e-4, big_steps=3, small_steps=3):
    """Steps whose gradients then fall 1/fall-fold (the loss scaled down), the weights unchanged."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    for k in range(big_steps + small_steps):
        (model(x) * (1.0 if k < big_steps else fall)).sum().backward()
        opt.step()
        opt.zero_grad()


def test_report_shows_the_range_a_shrunken_gradient_fills_and_says_why(monkeypatch, capsys):
    """Delayed scaling keeps the largest amax of its history: after the gradients fall 10^4-fold
    the scale still fits the old ones, and the report shows the gradient filling ~1e-4 of E5M2's
    range (no note: a cast loses nothing measurable there); after a 10^7-fold fall, ~1e-7, past
    2^-20, with a note naming the lowest layer and what follows a falling gradient. x and w,
    unchanged, fill all of theirs. Current scaling, and a history the large amaxes have left,
    fill the whole range again, and no note is printed."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train_then_shrink_grads(model)
    rows = fp8ops.report(model)
    out = capsys.readouterr().out
    for r in rows:
        assert r["range_x"] == pytest.approx(1.0) and r["range_w"] == pytest.approx(1.0)
        assert 0.5e-4 < r["range_g"] < 2e-4, r["range_g"]
    assert "range x/w/g" in out and "filled under" not in out
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train_then_shrink_grads(model, fall=1e-7)
    rows = fp8ops.report(model)
    out = capsys.readouterr().out
    assert all(0.5e-7 < r["range_g"] < 2e-7 for r in rows), [r["range_g"] for r in rows]
    assert "output gradients (dy) of 2 layer(s) filled under 2^-20" in out and 'recipe="current"' in out
    for cfg in ({"recipe": "current"}, {"amax_history_len": 2}):
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, **cfg)
        _train_then_shrink_grads(model, fall=1e-7)
        rows = fp8ops.report(model)
        assert all(r["range_g"] > 0.5 for r in rows), (cfg, [r["range_g"] for r in rows])
        assert "filled under" not in capsys.readouterr().out


def test_report_notes_inputs_an_outlier_batch_left_filling_little_of_their_range(monkeypatch, capsys):
    """One batch of inputs 10^4 times the others: delayed scaling keeps its amax as the history's
    maximum, and the next steps' inputs fill ~1e-4 of E4M3's range, where heavy-tailed data has
    lost 7 dB or more (benchmarks/dev/stale_scale_sqnr.py --fmt e4m3): a note says so for the
    first layer, whose inputs they are (its weight and the later layers fill theirs). Under
    current scaling the next step fills the range again and no note is printed."""
    for recipe, noted in (("delayed", True), ("current", False)):
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, recipe=recipe)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        g = torch.Generator().manual_seed(1)
        for k in range(4):
            model(torch.randn(16, 32, generator=g) * (1e4 if k == 1 else 1.0)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        rows = fp8ops.report(model)
        out = capsys.readouterr().out
        assert ("note: the inputs (x) of 1 layer(s) filled under 2^-8" in out) is noted, out
        assert "weights (w)" not in out and "output gradients (dy)" not in out
        if noted:
            assert 0.3e-4 < rows[0]["range_x"] < 3e-4 and rows[1]["range_x"] > 2.0 ** -8
            assert rows[0]["formats"] == "e4m3/e4m3/e5m2"


def test_report_range_reads_the_margin_and_waits_for_the_first_update(monkeypatch, capsys):
    """range_x/w/g: 1 is as full as the margin allows (a margin alone fires no note), and
    before delayed scaling's first update, when each cast used its own scale while row 0 took
    the running maximum, there is no range to show; a current-scaled layer with a margin
    prints no note about a history it does not have."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, margin=9)
    _train(model, steps=1)  # (one step: its amaxes are the history's maximum)
    rows = fp8ops.report(model)
    assert all(r[k] == pytest.approx(1.0) for r in rows for k in ("range_x", "range_w", "range_g")), rows
    assert "filled under" not in capsys.readouterr().out
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    x = torch.randn(16, 32)
    for k in (1.0, 10.0):  # two micro-batches, no optimizer step: no update yet
        (model(x * k)).sum().backward()
    rows = fp8ops.report(model)
    assert rows[0]["amax_x"] > 0 and rows[0]["range_x"] is None
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, recipe="current", margin=9)
    _train_then_shrink_grads(model)
    rows = fp8ops.report(model)
    assert not any(r["scale_from_history_max"] for r in rows)
    assert "filled under" not in capsys.readouterr().out


def test_no_grad_calls_reuse_a_training_cast_but_never_store_one(monkeypatch):
    """The weight-cast cache: a call under no_grad reuses the cast a training call of the same
    step stored (reentrant checkpointing's first forward), and stores none itself."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    opt = _train(model, steps=1)  # (the cast is cached in layers a live optimizer's step has updated)
    seen = []
    raw = fp8ops.ops._linear_fwd_raw
    monkeypatch.setattr(fp8ops.ops, "_linear_fwd_raw", lambda *a: seen.append(a[1].dtype) or raw(*a))
    x = torch.randn(16, 32)
    with torch.no_grad():
        model(x)
    assert model[0]._w_cache is None and seen == [torch.float32, torch.float32]   # cast in the call
    model(x).sum().backward()
    assert model[0]._w_cache is not None
    seen.clear()
    with torch.no_grad():
        model(x)
    assert seen == [torch.float8_e4m3fn, torch.float8_e4m3fn]                      # the stored casts
    del opt


def test_a_cast_without_the_transpose_is_not_reused_where_one_is_needed(monkeypatch):
    """A call that needed no input gradient cached the weight cast without its transpose; a
    later call of the step that needs the input gradient must make it, not read an empty one."""
    model = convert_as_on_fp8_gpu(nn.Sequential(nn.Linear(32, 32)), monkeypatch)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    model(torch.randn(16, 32)).sum().backward()
    opt.step()  # (the cast is cached in layers an optimizer step has updated)
    ref = copy.deepcopy(model)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.0)
    opt_ref.step()  # (the copy's first update: it casts as the original then)
    x = torch.randn(16, 32)
    model(x).sum().backward()                       # x needs no gradient: no transpose made
    assert model[0]._w_cache[2] is None
    xg = x.clone().requires_grad_()
    model(xg).sum().backward()
    xr = x.clone().requires_grad_()
    ref(xr).sum().backward()
    assert torch.equal(xg.grad, xr.grad)


def test_layers_sharing_a_weight_keep_their_creation_order(monkeypatch):
    """Two Fp8Linears that share one weight Parameter take the same place in the optimizer's
    parameters; the step's amax all-reduce concatenates layers in that order, so every rank
    must break the tie alike: by creation, not by the WeakSet's order (its own per process)."""
    import fp8ops.scaling as scaling

    class Ordered(list):  # a stand-in for the WeakSet that iterates in the order given
        add = list.append

    a = Fp8Linear(16, 16, bias=False, config=Fp8Config())
    b = Fp8Linear(16, 16, bias=False, config=Fp8Config())
    b.weight = a.weight
    opt = torch.optim.SGD([a.weight], lr=0.1)
    for order in ([a, b], [b, a]):
        monkeypatch.setattr(scaling, "_LAYERS", Ordered(order))
        assert scaling._layers_of(opt) == [a, b]
    c = copy.deepcopy(a)   # a copy keeps its original's place, and comes right after it
    c.weight = a.weight
    monkeypatch.setattr(scaling, "_LAYERS", Ordered([c, b, a]))
    assert scaling._layers_of(opt) == [a, c, b]
    # a model one rank built and pickled to the others (unpickled in another order) orders alike
    a2, b2 = pickle.loads(pickle.dumps([b, a]))[::-1]
    b2.weight = a2.weight
    monkeypatch.setattr(scaling, "_LAYERS", Ordered([b2, a2]))
    assert scaling._layers_of(torch.optim.SGD([a2.weight], lr=0.1)) == [a2, b2]


def test_a_layer_made_in_another_thread_while_the_step_lists_the_layers(monkeypatch):
    """A thread that makes an Fp8Linear (convert, or an EMA / checkpoint thread's deepcopy) while
    the optimizer step lists the live layers: the step used to raise "Set changed size during
    iteration" after the weights had moved, its scale update lost. The other thread's layer is
    made here exactly in the middle of the listing; it waits for the listing, then is tracked."""
    import threading
    import weakref

    import fp8ops.scaling as scaling

    made = []

    class Interleaved(weakref.WeakSet):  # a WeakSet whose listing lets another thread in halfway
        def __iter__(self):
            items = super().__iter__()
            yield next(items)
            t = threading.Thread(target=lambda: made.append(Fp8Linear(16, 16, config=Fp8Config())))
            t.start()
            t.join(0.5)   # (with the lock it waits for the listing to end: the join times out)
            made.append(t)
            yield from items

    a = Fp8Linear(16, 16, bias=False, config=Fp8Config())
    b = Fp8Linear(16, 16, bias=False, config=Fp8Config())
    live = Interleaved([a, b])
    monkeypatch.setattr(scaling, "_LAYERS", live)
    opt = torch.optim.SGD([a.weight, b.weight], lr=0.1)
    (a.weight.sum() + b.weight.sum()).backward()
    opt.step()                                   # the step's hook lists the layers
    made[0].join()
    assert a.fp8_step == b.fp8_step == 1         # both layers' scale update ran
    assert any(isinstance(m, Fp8Linear) and m in live for m in made)  # the new layer is tracked


def test_fp8_config_assigned_after_conversion_keeps_what_conversion_built(monkeypatch):
    """A config assigned to a converted layer may change what each call reads (policy, margin,
    ...), not what the conversion built from it (FP8 dtypes, history rows, fusions): those ran
    as before while repr and the report showed the new config. Refused, naming the fields."""
    layer = convert_as_on_fp8_gpu(nn.Linear(32, 32), monkeypatch, amax_history_len=16)
    cfg = layer.fp8_config
    for change, field in ((dict(fp8_format="e5m2"), "fp8_format"), (dict(amax_history_len=4), "amax_history_len"),
                          (dict(recipe="current"), "recipe"), (dict(fuse_gelu=False), "fuse_gelu")):
        with pytest.raises(ValueError, match=rf"fp8_config: {field} .* cannot change after conversion.*"
                                             r"fp8ops\.convert"):
            layer.fp8_config = dataclasses.replace(cfg, **change)
        assert layer.fp8_config is cfg
    with pytest.raises(TypeError, match="must be an fp8ops.Fp8Config, found dict"):
        layer.fp8_config = {"policy": "always"}
    layer.fp8_config = new = dataclasses.replace(cfg, policy="auto", margin=1, interval=2, fast_accum=False)
    assert layer.fp8_config is new and "m1/i2" in repr(layer)
    assert layer.fp8_dtypes == (torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e5m2)
    # a layer on current scaling keeps one history row: delayed with one row is the same state
    cur = convert_as_on_fp8_gpu(nn.Linear(32, 32), monkeypatch, recipe="current")
    cur.fp8_config = dataclasses.replace(cur.fp8_config, recipe="delayed", amax_history_len=1)
    assert cur.fp8_amax_history.shape == (1, 3)


def test_a_shared_module_refused_by_the_filter_under_any_name_stays_linear(monkeypatch):
    """One nn.Linear under two parents is one layer: module_filter_fn is asked under each name,
    and a refusal under any of them keeps it nn.Linear (it used to be asked under the first
    name only, and converted), the reason naming both."""
    shared = nn.Linear(32, 32)
    net = nn.ModuleDict({"enc": nn.Sequential(shared), "dec": nn.Sequential(shared)})
    asked = []

    def keep_dec_plain(mod, fqn):
        asked.append(fqn)
        return fqn != "dec.0"
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    fp8ops.convert(net, config=Fp8Config(policy="always"), module_filter_fn=keep_dec_plain)
    assert asked == ["enc.0", "dec.0"]
    assert type(net["enc"][0]) is nn.Linear and net["enc"][0] is net["dec"][0]
    reasons = fp8ops.conversion.decisions_of(net)
    assert reasons["enc.0"] == reasons["dec.0"] == (
        "bf16", "excluded by module_filter_fn (as 'dec.0'; the same module is also 'enc.0')")
    # accepted under both names: converted once, the same module under both
    net2 = nn.ModuleDict({"enc": nn.Sequential(shared), "dec": nn.Sequential(shared)})
    fp8ops.convert(net2, config=Fp8Config(policy="always"), module_filter_fn=lambda mod, fqn: True)
    assert isinstance(net2["dec"][0], Fp8Linear) and net2["enc"][0] is net2["dec"][0]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (torch.distributed.optim's torch.jit use)
def test_zero_redundancy_optimizer_before_its_inner_optimizer_exists():
    """ZeroRedundancyOptimizer(overlap_with_ddp=True) makes its inner optimizer after DDP's
    first iterations: the step pre-hook must not fail on one without it."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    import fp8ops.scaling as scaling
    zero = object.__new__(ZeroRedundancyOptimizer)   # no inner optimizer yet
    scaling._before_optimizer_step(zero, (), {})


def test_subclasses_and_float64_linears_stay_with_their_reason(monkeypatch):
    """nn.MultiheadAttention's out_proj (a subclass of nn.Linear) and a float64 linear are not
    converted (from_linear would not make them what they are); convert goes on and the report
    names why."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 2, batch_first=True)
            self.wide = nn.Linear(32, 32).double()
            self.fc = nn.Linear(32, 32)
    model = convert_as_on_fp8_gpu(Model(), monkeypatch)
    assert type(model.attn.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    assert type(model.wide) is nn.Linear and type(model.fc).__name__ == "Fp8Linear"
    reasons = {r["name"]: r["reason"] for r in fp8ops.report(model, print_table=False)}
    assert "is a subclass of nn.Linear" in reasons["attn.out_proj"]
    assert "weight dtype torch.float64" in reasons["wide"]


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_a_layer_settled_bf16_after_casting_rests(device, monkeypatch):
    """Policy "auto" settled BF16 for every shape a layer met after the layer had cast (its
    trial's FP8 steps): at the next optimizer step it rests as if never cast (history 0,
    scales 1, its step count kept), and no update reaches it in the steps after (each cost
    34 us of host time on an H200 host). A layer that casts again starts from current
    scales: its next forward is bit for bit that of a fresh conversion of the same weights."""
    import dataclasses  # noqa: PLC0415

    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    from fp8ops import policy, scaling  # noqa: PLC0415

    model = convert_as_on_fp8_gpu(_mlp().to(device), monkeypatch, device, amax_history_len=4)
    layer = model[2]
    layer.fp8_config = dataclasses.replace(layer.fp8_config, policy="auto")
    key = (16, torch.float32)  # (rows bucket, compute dtype) of _train's batches
    layer.fp8_policy[key] = (True, 1.5)
    jobs = []
    fast_job = scaling._fast_job

    def counted_job(m, *args):  # (the CUDA layers' update: a job of the many-layer launch)
        job = fast_job(m, *args)
        if job is not None:
            jobs.append(m)
        return job
    monkeypatch.setattr(scaling, "_fast_job", counted_job)

    class Updates(TorchDispatchMode):  # (the CPU layers' update: one op per layer)
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.fp8ops.amax_update.default and args[0] is layer.fp8_amax_history:
                jobs.append(layer)
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train(steps):
        for _ in range(steps):
            model(torch.randn(16, 32, generator=g).to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad()

    with Updates():
        train(3)  # FP8: the layer casts and is updated
        assert jobs.count(layer) == 3 and not layer._fp8_pristine
        assert layer.fp8_amax_history.abs().sum() > 0
        # a new verdict, BF16 (as a trial's would be; here by the two timings)
        del layer.fp8_policy[key]
        monkeypatch.setattr(policy, "measure", lambda *a: policy.Timing(1.0, 2.0, 1.0, 2.0, 0.1, 0.2))
        if device == "cpu":  # (the CPU path does not ask the policy: asked here, then the plain path)
            monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no driver)
            assert not layer._fp8_pays(16, torch.float32)
            layer.fp8_on_cpu = False
        train(1)  # BF16, then the step at which it rests
        assert layer.fp8_policy[key][0] is False
        assert layer._fp8_pristine and layer.fp8_step == 4
        assert layer.fp8_amax_history.abs().sum() == 0 and layer.fp8_scale.tolist() == [1.0, 1.0, 1.0]
        assert layer.fp8_scale_inv.tolist()[:3] == [1.0, 1.0, 1.0]
        n = jobs.count(layer)
        train(3)
        assert jobs.count(layer) == n and layer.fp8_step == 7  # skipped, still counting steps
    # cast again (a shape FP8 wins): as a fresh conversion of the same weights would
    layer.fp8_policy[key] = (True, 1.5)
    layer.__dict__["_fp8_bf16_key"] = None  # (the BF16 shortcut of the last call: what settled() clears)
    layer.fp8_on_cpu = device == "cpu"
    fresh = convert_as_on_fp8_gpu(nn.Sequential(copy.deepcopy(layer_as_linear(layer))), monkeypatch, device)
    h = torch.randn(16, 64, generator=g).to(device)
    torch.testing.assert_close(layer(h), fresh(h), rtol=0, atol=0)
    assert layer._fp8_cast_since_update


def layer_as_linear(layer):
    """An nn.Linear with a converted layer's parameters."""
    lin = nn.Linear(layer.in_features, layer.out_features, device=layer.weight.device)
    with torch.no_grad():
        lin.weight.copy_(layer.weight)
        lin.bias.copy_(layer.bias)
    return lin


def test_a_layer_that_never_cast_skips_its_scale_update_and_ends_as_if_updated(monkeypatch):
    """update_scales skips a layer with no cast yet (what policy "auto" leaves in BF16): its
    history is all 0 and its scales 1, which the update would keep. Shown on two copies of one
    model, one with the skip and one with it forced off: no amax_update reaches the idle layer
    in the first, and after both cast again for 3 steps their scaling state is the same, bit
    for bit. A loaded state is not skipped."""
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    class Updates(TorchDispatchMode):
        def __init__(self, history):
            super().__init__()
            self.history, self.n = history, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.fp8ops.amax_update.default and args[0] is self.history:
                self.n += 1
            return func(*args, **(kwargs or {}))

    runs, idle_updates = [], []
    for force in (False, True):
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=4)
        layer = model[2]
        assert layer._fp8_pristine
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        g = torch.Generator().manual_seed(1)
        with Updates(layer.fp8_amax_history) as seen:
            for _ in range(3):  # layer 2 idle: only layer 0 runs FP8
                if force:
                    layer.__dict__["_fp8_pristine"] = False  # the update for every layer, as before the skip
                model[0](torch.randn(16, 32, generator=g)).square().mean().backward()
                opt.step()  # (its hook updates the scales)
                opt.zero_grad()
        idle_updates.append(seen.n)
        assert layer.fp8_step == 3
        assert layer.fp8_amax_history.abs().sum() == 0 and layer.fp8_scale.tolist() == [1.0, 1.0, 1.0]
        _train(model, steps=3, opt=opt)
        assert not layer._fp8_pristine
        runs.append([m.fp8_amax_history.clone() for m in (model[0], layer)] + [layer.fp8_scale.clone()])
    assert idle_updates == [0, 3]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    # a loaded state (history not 0) is never skipped
    fresh = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=4)
    fp8ops.load_scaling_state_dict(fresh, fp8ops.scaling_state_dict(model))
    assert not fresh[2]._fp8_pristine


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float64])
def test_a_model_built_under_another_default_dtype_trains(monkeypatch, default):
    """torch.set_default_dtype(bf16) before building the model: the scaling state stays
    fp32 (the C ops take nothing else), and the layer trains."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        model = convert_as_on_fp8_gpu(_mlp().float(), monkeypatch)   # the scaling state made here
    finally:
        torch.set_default_dtype(old)
    _train(model, steps=2)
    bufs = dict(model[0].named_buffers())
    assert all(bufs[n].dtype == torch.float32 for n in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv",
                                                         "fp8_max")), {n: b.dtype for n, b in bufs.items()}
    assert model[0].fp8_step == 2 and model[0].fp8_scale[X] != 1


def test_fast_weights_at_a_freed_weights_address_are_cast_afresh(monkeypatch):
    """functional_call with new weight tensors each call (MAML-style fast weights): a new
    tensor may land on the freed memory of the last one, with version 0 as well; the
    cached cast of the old one must not be used for it."""
    from torch.func import functional_call
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    x = torch.randn(16, 32)
    w = {k: v.detach().clone() for k, v in model.named_parameters()}
    for i in range(6):
        params = {k: v.clone().requires_grad_(True) for k, v in w.items()}
        y = functional_call(model, params, (x,))
        fresh = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
        assert torch.equal(y, functional_call(fresh, params, (x,))), i
        w = {k: v * 1.5 for k, v in w.items()}
        del params, y


@pytest.mark.parametrize("x", [torch.ones(16, 32, dtype=torch.int64), torch.ones(16, 32, dtype=torch.bool),
                               torch.randn(16, 32, dtype=torch.complex64), torch.randn(16, 32).to(torch.float8_e4m3fn),
                               torch.randn(16, 32, dtype=torch.float64), [[1.0] * 32] * 16],
                         ids=["int64", "bool", "complex64", "float8", "float64", "list"])
def test_an_input_nn_linear_refuses_is_refused_alike(monkeypatch, x):
    """What nn.Linear does with an input of another dtype (or no tensor) is what the
    converted layer does: torch's own error, not a silent FP8 computation."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    with pytest.raises((RuntimeError, TypeError)) as ref:
        _mlp()(x)
    with pytest.raises(type(ref.value), match=str(ref.value).split(",")[0][:40].replace("(", r"\(").replace(")", r"\)")):
        model(x)
    assert not model[0].fp8_amax_history.any()


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16)])
def test_an_input_of_another_float_dtype_than_the_weight_is_refused_alike(monkeypatch, x_dtype, w_dtype):
    """Outside autocast nn.Linear refuses an input whose dtype is not its weight's. The FP8
    path ran it (fp16 out of an fp32 model), and the same call then raised wherever the layer
    fell back (an odd batch's row count, policy auto's BF16 verdict, a machine without FP8):
    a run that trained for hours could stop at its first odd evaluation batch."""
    model = convert_as_on_fp8_gpu(_mlp().to(w_dtype), monkeypatch)
    x = torch.randn(16, 32).to(x_dtype)
    with pytest.raises(RuntimeError) as ref:
        _mlp().to(w_dtype)(x)
    with pytest.raises(RuntimeError, match=re.escape(str(ref.value)[:40])):
        model(x)
    assert not model[0].fp8_amax_history.any()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # under autocast both run
        assert torch.isfinite(model(x)).all()


def test_torch_func_transforms_take_the_plain_path(monkeypatch):
    """torch.func.grad over a converted model (per-sample gradients): the layers run
    the nn.Linear computation, counted as fallback calls, with nn.Linear's gradients."""
    from torch.func import functional_call, grad
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    ref = _mlp()
    x = torch.randn(16, 32)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(m):
        return lambda p: functional_call(m, p, (x,)).square().mean()

    got, want = grad(loss(model))(params), grad(loss(ref))(params)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert model[0].fp8_fallback_calls == 1 and not model[0].fp8_amax_history.any()
    # compiled alike (compiled code once ran the FP8 autograd function inside the transform,
    # whose gradients came back all zero), and vmap over the batch
    torch._dynamo.reset()
    got = torch.compile(grad(loss(model)))(params)
    for k in want:
        torch.testing.assert_close(got[k], want[k])
        assert got[k].abs().sum() > 0
    rows = torch.randn(4, 16, 32)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(torch.vmap(model))(rows), torch.vmap(ref)(rows))
    assert not model[0].fp8_amax_history.any()


def test_converting_again_with_another_config_warns_that_it_is_kept(monkeypatch):
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        convert_as_on_fp8_gpu(model, monkeypatch)                       # the same config: silent
    with pytest.warns(UserWarning, match=r"2 layer\(s\) \(0, 2\) were already converted with another config"):
        convert_as_on_fp8_gpu(model, monkeypatch, recipe="current")
    assert model[0].fp8_config.recipe == "delayed"
    assert "keeps its config delayed" in fp8ops.report(model, print_table=False)[0]["reason"]


def test_a_strict_scaling_state_load_checks_everything_before_loading_anything(monkeypatch):
    src = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(src)
    state = fp8ops.scaling_state_dict(src)
    dst = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    with pytest.raises(KeyError, match=r"layers this model does not have: \['extra'\]. Nothing was loaded"):
        fp8ops.load_scaling_state_dict(dst, {**state, "extra": state["0"]}, strict=True)
    bad = {"0": state["0"], "2": {**state["2"], "scale": torch.ones(5)}}
    with pytest.raises(ValueError, match=r"2's saved scale has shape \(5,\), expected \(3,\)"):
        fp8ops.load_scaling_state_dict(dst, bad)
    assert dst[0].fp8_scale.tolist() == [1.0, 1.0, 1.0] and dst[0].fp8_step == 0    # "0" was not loaded either
    assert fp8ops.load_scaling_state_dict(dst, {**state, "extra": state["0"]}) == []  # not strict: what fits
    assert torch.equal(dst[2].fp8_scale, src[2].fp8_scale)


@pytest.mark.parametrize("entry, match", [
    (dict(scale=torch.tensor([float("nan"), 1.0, 1.0])), r"holds the scales \[nan, 1.0, 1.0\]: each must be finite and > 0"),
    (dict(scale=torch.tensor([0.0, 1.0, 1.0])), r"each must be finite and > 0"),
    (dict(scale=torch.tensor([-2.0, 1.0, 1.0])), r"each must be finite and > 0"),
    (dict(scale_inv=torch.tensor([7.0, 7.0, 7.0])), r"each must be 1 / scale"),
    (dict(step="three"), r"step is 'three': an int >= 0"),
    (dict(step=-1), r"step is -1: an int >= 0"),
    (dict(primed="False"), r"primed is 'False': a bool"),
    (dict(overflow_count=torch.tensor([-1, 0, 0])), r"overflow_count is \[-1, 0, 0\]: counts >= 0"),
    (dict(amax_history=[[0.0] * 3]), r"amax_history is list , not a floating-point tensor"),
    ("a tensor", r"is a str, not a dict"),
    # a denormal scale, whose scale_inv is inf (allclose(inf, inf) held): NaN outputs, NaN weights
    (dict(scale=torch.tensor([1e-45, 1.0, 1.0])), r"with a finite 1 / scale"),
    # a negative amax gave scales near 0, whose inverses' product overflowed: NaN outputs
    (dict(amax_history=torch.full((1024, 3), -1e30)), r"holds a negative amax \(-1.0\d*e\+30\)"),
    (dict(config=5), r"config is 5, not a string"),
    (dict(scale=torch.ones(3, device="meta")), r"scale is on the meta device"),
])
def test_a_scaling_state_that_would_poison_the_casts_is_refused(monkeypatch, entry, match):
    """A saved scale that is NaN, 0 or negative (its casts give NaN, and the gradient's would
    stay NaN), a scale_inv that is not its inverse (outputs off by its ratio), and entries
    that are not scaling_state_dict's are refused naming the layer, before anything loads."""
    src = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(src)
    state = fp8ops.scaling_state_dict(src)
    if isinstance(entry, dict) and "scale" in entry and not entry["scale"].is_meta:
        entry = {**entry, "scale_inv": 1.0 / entry["scale"]}
    dst = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    bad = {"0": state["0"], "2": {**state["2"], **entry} if isinstance(entry, dict) else entry}
    with pytest.raises(ValueError, match="load_scaling_state_dict: 2's saved state .*" + match):
        fp8ops.load_scaling_state_dict(dst, bad)
    assert dst[0].fp8_scale.tolist() == [1.0, 1.0, 1.0] and dst[0].fp8_step == 0    # "0" was not loaded either
    state["2"]["step"] = torch.tensor(state["2"]["step"])  # (a 0-d integer tensor is a step too)
    assert fp8ops.load_scaling_state_dict(dst, state) == [] and isinstance(dst[2].fp8_step, int)


def test_the_scaling_state_functions_refuse_what_is_not_a_model_or_a_state(monkeypatch):
    """None, a list, or a dict keyed by ints raised a bare AttributeError."""
    m = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    with pytest.raises(TypeError, match="scaling_state_dict: model must be an nn.Module .* found NoneType"):
        fp8ops.scaling_state_dict(None)
    with pytest.raises(TypeError, match="load_scaling_state_dict: model must be an nn.Module"):
        fp8ops.load_scaling_state_dict(None, {})
    for state, found in ((None, "NoneType"), ([], "list"), ({0: {}}, r"dict with the key 0 \(int\)")):
        with pytest.raises(TypeError, match="state must be what fp8ops.scaling_state_dict returned .* found " + found):
            fp8ops.load_scaling_state_dict(m, state)


def test_a_scaling_state_that_names_no_layer_of_the_model_is_refused(monkeypatch):
    """A probe's finding: the model's state_dict(), or a whole checkpoint, passed by mistake
    loaded nothing and said nothing (strict=False), so a resume restarted every layer's
    scaling. A state that names none of the model's FP8 layers now raises, saying what it
    looks like; an empty one (what a model without FP8 layers saves) still loads nothing, and
    one that names some layers loads those."""
    m = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(m)
    before = [t.clone() for t in (m[0].fp8_scale, m[0].fp8_amax_history)]
    for wrong, said in ((m.state_dict(), "its values are tensors, as in a model state_dict"),
                        ({"model": m.state_dict(), "step": 3}, "names an FP8 layer of this model")):
        with pytest.raises(ValueError, match="none of the state's .* keys .*" + said + ".*Nothing was loaded"):
            fp8ops.load_scaling_state_dict(m, wrong)
    assert torch.equal(m[0].fp8_scale, before[0]) and torch.equal(m[0].fp8_amax_history, before[1])
    names = [n for n, x in m.named_modules() if isinstance(x, Fp8LinearBase)]
    assert fp8ops.load_scaling_state_dict(m, {}) == names
    state = fp8ops.scaling_state_dict(m)
    del state[names[0]]
    assert fp8ops.load_scaling_state_dict(m, state) == names[:1]


def test_a_scaling_state_loads_across_activation_checkpointing_wrappers(monkeypatch):
    """A review's finding: torch's apply_activation_checkpointing puts its wrapper inside the
    module paths (0._checkpoint_wrapped_module), and a state saved under it restored, into the
    same model without it, only the layers outside the wrappers, with no word. Each path is
    matched without the wrappers' own names now, both ways."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: PLC0415
        apply_activation_checkpointing)
    plain = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    wrapped = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, Fp8LinearBase))
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_modules())
    _train(wrapped)
    assert fp8ops.load_scaling_state_dict(plain, fp8ops.scaling_state_dict(wrapped), strict=True) == []
    assert torch.equal(plain[0].fp8_scale, wrapped[0]._checkpoint_wrapped_module.fp8_scale)
    assert plain[2].fp8_step == 3
    fresh = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    apply_activation_checkpointing(fresh, check_fn=lambda m: isinstance(m, Fp8LinearBase))
    assert fp8ops.load_scaling_state_dict(fresh, fp8ops.scaling_state_dict(plain), strict=True) == []
    assert fresh[2]._checkpoint_wrapped_module.fp8_step == 3


def test_loading_weights_into_a_trained_model_scales_them_as_a_fresh_conversion(monkeypatch):
    """load_state_dict into a converted model that has trained (the best checkpoint, a
    rollback): the old weights' scales would saturate or waste the new weights' range
    for up to amax_history_len steps; the layer starts its scaling afresh instead, and a
    scaling state loaded after that is restored (a resume)."""
    trained = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(trained)
    other = _mlp(seed=5)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(8)                                                   # other weights, 8x larger
    sd = other.state_dict()
    trained.load_state_dict(sd)
    fresh = convert_as_on_fp8_gpu(copy.deepcopy(other), monkeypatch)
    x = torch.randn(16, 32)
    assert torch.equal(trained(x), fresh(x))
    # (the step count goes on: the phase of `interval`)
    assert trained[0].fp8_step == 3 and torch.equal(trained[0].fp8_scale, fresh[0].fp8_scale)
    state = fp8ops.scaling_state_dict(fresh)
    _train(fresh)
    fp8ops.load_scaling_state_dict(fresh, fp8ops.scaling_state_dict(trained))   # resume: after the weights
    assert torch.equal(fresh[0].fp8_amax_history, trained[0].fp8_amax_history) and state


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_an_optimizer_step_between_forward_and_backward_raises(monkeypatch, recipe):
    """The FP8 tensors saved in forward pair with the scales of that forward; an update in
    between would give wrong gradients silently (the kernels write the scales through raw
    pointers). nn.Linear raises there (its weight changed); so does Fp8Linear."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, recipe=recipe)
    opt = _train(model, steps=2)
    x = torch.randn(16, 32)
    loss = model(x).square().mean()
    opt.step()
    with pytest.raises(RuntimeError, match="scales changed between its forward and this backward"):
        loss.backward()
    model(x).square().mean().backward()                                 # the usual order still works
    opt.step()
    assert model[0].fp8_step == 4


class _Sam(torch.optim.Optimizer):
    """SAM as its users write it: an optimizer whose step runs a base optimizer's step."""

    def __init__(self, params, base_cls, **kw):
        super().__init__(params, dict(rho=0.05, **kw))
        self.base_optimizer = base_cls(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def step(self, closure):
        with torch.enable_grad():
            closure()
        self.base_optimizer.step()


def test_an_optimizer_stepping_an_inner_one_updates_the_scales_once_per_step(monkeypatch):
    """Both step hooks fire (the inner optimizer's and the outer's): the scales follow the
    one optimizer step, not two (which halved the amax window and doubled DDP's all-reduces)."""
    runs = {}
    for kind in ("sgd", "sam"):
        model = convert_as_on_fp8_gpu(_mlp(), monkeypatch, amax_history_len=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.01) if kind == "sgd" else \
            _Sam(model.parameters(), torch.optim.SGD, lr=0.01)
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(16, 32, generator=g)

            def closure():
                loss = model(x).square().mean()
                loss.backward()
                return loss
            closure() if kind == "sgd" else None
            opt.step() if kind == "sgd" else opt.step(closure)
            opt.zero_grad()
        runs[kind] = model[0]
    assert runs["sam"].fp8_step == runs["sgd"].fp8_step == 3
    assert torch.equal(runs["sam"].fp8_amax_history[:, X].ne(0), runs["sgd"].fp8_amax_history[:, X].ne(0))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_compiled_activation_checkpointing_keeps_the_layers_in_the_graph(monkeypatch, recipe):
    """torch.compile of blocks under activation checkpointing: no graph break (a module
    attribute written in forward was one, at every checkpointed layer), delayed scaling
    starts after the first step as in eager, and the results are eager's bits."""
    from torch.utils.checkpoint import checkpoint
    import torch._dynamo.utils as dynamo_utils

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

        def inner(self, x):
            return self.fc2(F.relu(self.fc1(x)))

        def forward(self, x):
            return x + checkpoint(self.inner, x, use_reentrant=False)

    torch.manual_seed(0)
    base = nn.Sequential(Block(), Block(), nn.Linear(32, 16))
    models = {k: convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, recipe=recipe) for k in ("eager", "compiled")}
    torch._dynamo.reset()
    dynamo_utils.counters.clear()
    calls = {"eager": models["eager"], "compiled": torch.compile(models["compiled"], backend="aot_eager")}
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in models.items()}
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(32, 32, generator=g)
        for k in calls:
            calls[k](x).square().mean().backward()
            opts[k].step()
            opts[k].zero_grad()
    assert not dynamo_utils.counters["graph_break"], dict(dynamo_utils.counters["graph_break"])
    for (_, e), (_, c) in zip(models["eager"].named_modules(), models["compiled"].named_modules()):
        if isinstance(e, Fp8Linear):
            assert c._fp8_delayed_ready == e._fp8_delayed_ready == (recipe == "delayed")
            assert torch.equal(c.fp8_amax_history, e.fp8_amax_history) and torch.equal(c.weight, e.weight)


def test_report_counts_the_calls_that_fell_back(monkeypatch):
    """A converted layer whose every call fell back (here: an empty input, which never
    reaches FP8) says so in its reason."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    model(torch.randn(0, 32))
    row = fp8ops.report(model, print_table=False)[0]
    assert row["runs"] == "not yet" and "1 calls ran nn.Linear's computation" in row["reason"]


def test_a_converted_layer_takes_nn_linears_keyword(monkeypatch):
    """nn.Linear's forward names its argument `input`: layer(input=x) keeps working."""
    model = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    x = torch.randn(16, 32)
    assert torch.equal(model[0](input=x), model[0](x))


def test_an_unstepped_copy_updated_through_data_is_cast_afresh(monkeypatch):
    """An EMA teacher made by deepcopy of a trained student: its weights still require grad,
    no optimizer steps it, and .data writes move neither version nor storage."""
    student = convert_as_on_fp8_gpu(_mlp(), monkeypatch)
    _train(student, steps=2)
    teacher = copy.deepcopy(student)
    x = torch.randn(16, 32)
    for it in range(3):
        y = teacher(x).detach()  # grad mode on, as a teacher's forward often is
        with torch.no_grad():
            ref = F.linear(torch.relu(F.linear(x, teacher[0].weight, teacher[0].bias)), teacher[2].weight,
                           teacher[2].bias)
            assert sqnr(ref, y) >= 20, it
            for pt, ps in zip(teacher.parameters(), student.parameters()):
                pt.data.mul_(0.5).add_(ps.data * 0.5 + 0.1)  # (a stale cast: about 0 dB)


def test_a_conv1d_weight_cast_is_reused_by_the_steps_micro_batches(monkeypatch):
    """Fp8Conv1D computes with a fresh transpose view of its Parameter each call: the
    step's cached cast must still be found (keyed on the Parameter)."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    model = convert_as_on_fp8_gpu(nn.Sequential(Conv1D(64, 32)), monkeypatch)
    layer = model[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    casts = []
    real = Fp8LinearBase._weight_fp8

    def spy(self, *a, **k):
        out = real(self, *a, **k)
        casts.append(out[1] is None)  # w8t None: cast in this call
        return out

    monkeypatch.setattr(Fp8LinearBase, "_weight_fp8", spy)
    for _ in range(3):
        for _ in range(4):
            layer(torch.randn(16, 32, requires_grad=True)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    # step 1 (no update yet): every micro-batch casts; then once per step
    assert casts == [True] * 4 + [True, False, False, False] * 2


@requires_fp8
@pytest.mark.gpu
def test_scale_update_of_buffers_sharing_memory_takes_the_checked_op():
    """The many-layer CUDA update (one launch for all layers) trusts the pointers it is given: a
    layer whose scale_inv a user made its scale (one word written twice) was updated in a race.
    Such a layer now takes the checked op, which refuses it by name."""
    from fp8ops import scaling  # noqa: PLC0415
    model = fp8ops.convert(nn.Sequential(nn.Linear(32, 32)).cuda(), config=Fp8Config(policy="always"))
    layer = model[0]
    model(torch.randn(16, 32, device="cuda")).square().mean().backward()
    assert scaling._fast_job(layer) is not None
    layer.fp8_scale_inv = layer.fp8_scale
    assert scaling._fast_job(layer) is None
    with pytest.raises(RuntimeError, match=r"scale, scale_inv and amax_history must be three tensors of their own"):
        fp8ops.step(model)


def _copying_saved_tensor_hooks():
    """What torch.autograd.graph.save_on_cpu does on a GPU: each saved tensor packed as a copy
    (on the CPU box save_on_cpu keeps a CPU tensor as it is)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


def _ln_gelu_mlp():
    torch.manual_seed(0)  # (LayerNorm and GELU fused by convert)
    return nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 32))


def _train_under(model, fn, hooks: bool, steps=3):
    """(outputs, the model) of `steps` SGD steps of fn (the model, or its compile), each
    forward under copying saved-tensor hooks or not."""
    opt, g, outs = torch.optim.SGD(model.parameters(), lr=0.01), torch.Generator().manual_seed(1), []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g)
        if hooks:
            with _copying_saved_tensor_hooks():
                y = fn(x)
        else:
            y = fn(x)
        y.square().mean().backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach())
    return outs, model


def test_eager_layers_under_saved_tensor_hooks_train_as_without(monkeypatch):
    """Eager Fp8Linear keeps its scaling buffers on the autograd context, not among the saved
    tensors: under hooks that copy what is saved (save_on_cpu) training is bit for bit the same,
    outputs, weights, amax histories and scales."""
    runs = [_train_under(m, m, hooks) for hooks in (False, True)
            for m in [convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch)]]
    (outs_a, a), (outs_b, b) = runs
    assert all(torch.equal(p, q) for p, q in zip(outs_a, outs_b))
    for (k, p), q in zip(a.state_dict(keep_vars=True).items(), b.state_dict(keep_vars=True).values()):
        assert torch.equal(p, q), k
    assert a[1].fp8_amax_history.abs().sum() > 0  # (FP8 ran)


def test_compiled_layers_under_saved_tensor_hooks_run_bf16_and_say_so(monkeypatch):
    """Under delayed scaling a compiled graph saves the layers' padded fp8_scale_inv (stride 4)
    for its backward; hooks that copy what is saved handed back a contiguous copy, and the
    backward failed inductor's stride check. Traced under such hooks the layers run nn.Linear's
    computation (the unconverted model's bits), with a warning naming the hooks and the
    remedies; traced without, FP8 as before."""
    model = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match=r"saved-tensor hooks .*no FP8.*run the\s+model eagerly"):
        outs, model = _train_under(model, torch.compile(model, fullgraph=True), hooks=True)
    assert all(m.fp8_amax_history.abs().sum() == 0 and m.fp8_grad_amax.abs().sum() == 0
               for m in model if isinstance(m, Fp8Linear))  # (no FP8 cast ran)
    plain = _ln_gelu_mlp()
    torch._dynamo.reset()
    want, _ = _train_under(plain, torch.compile(plain, fullgraph=True), hooks=True)
    assert all(torch.equal(got, ref) for got, ref in zip(outs, want))
    fp8 = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saved-tensor hooks")
        _train_under(fp8, torch.compile(fp8, fullgraph=True), hooks=False)
    assert fp8[1].fp8_amax_history.abs().sum() > 0


def test_compiled_autograd_under_saved_tensor_hooks_runs_bf16_and_says_so(monkeypatch):
    """Under compiled autograd a compiled graph saves the buffer its backward writes dy's
    amax into (linear._keep_scales); hooks that copy what is saved would hand it a copy, and
    dy's amax would be lost without a word. So on the current recipe too, layers traced
    there under such hooks run nn.Linear's computation, with the warning; under compiled
    autograd without hooks, FP8, dy's amaxes reaching the history."""
    def ca():  # (torch._dynamo.reset() before entering: inside, it switches compiled autograd off)
        return torch._dynamo.compiled_autograd._enable(torch.compile)
    model = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch, recipe="current")
    torch._dynamo.reset()
    with ca(), pytest.warns(UserWarning, match=r"saved-tensor hooks .*no FP8.*compiled autograd"):
        outs, model = _train_under(model, torch.compile(model, fullgraph=True), hooks=True)
    assert all(m.fp8_amax_history.abs().sum() == 0 and m.fp8_grad_amax.abs().sum() == 0
               for m in model if isinstance(m, Fp8Linear))  # (no FP8 cast ran)
    plain = _ln_gelu_mlp()
    torch._dynamo.reset()
    with ca():
        want, _ = _train_under(plain, torch.compile(plain, fullgraph=True), hooks=True)
    assert all(torch.equal(got, ref) for got, ref in zip(outs, want))  # (the unconverted model's bits)
    fp8 = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch, recipe="current")
    torch._dynamo.reset()
    with ca(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*saved-tensor hooks")
        _train_under(fp8, torch.compile(fp8, fullgraph=True), hooks=False)
    assert all(m.fp8_amax_history[:, 2].abs().sum() > 0 for m in fp8 if isinstance(m, Fp8Linear))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_a_dy_amax_written_into_a_hooks_copy_is_named_at_the_step(monkeypatch, recipe):
    """A graph traced under compiled autograd without saved-tensor hooks saves the buffer its
    backward writes dy's amax into; run later under hooks that copy (dynamo does not retrace
    when they change), the write lands in the copy. The step cannot recover that amax, but
    says so (the C record names a buffer no live layer holds) instead of losing it silently."""
    from fp8ops import scaling  # noqa: PLC0415
    monkeypatch.setattr(scaling, "_LOST_WRITE_WARNED", [False])
    model = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch, recipe=recipe)
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True)
    with torch._dynamo.compiled_autograd._enable(torch.compile):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*no live Fp8Linear")
            _train_under(model, fn, hooks=False, steps=2)
        with pytest.warns(UserWarning, match=r"dy's amax into \d+ buffer\(s\) that no live Fp8Linear holds"):
            _train_under(model, fn, hooks=True, steps=1)


def test_a_compiled_layer_freed_before_the_step_is_no_lost_dy_amax(monkeypatch):
    """A model whose compiled backward wrote its layers' dy amax slots, freed before any
    optimizer step (an evaluation copy, one variant of a benchmark after another): another
    model's next step finds those slots in the C record, held by no live layer, and says
    nothing, since the layers died (scaling.track's finalizer notes their slots)."""
    import gc  # noqa: PLC0415

    from fp8ops import scaling  # noqa: PLC0415
    monkeypatch.setattr(scaling, "_LOST_WRITE_WARNED", [False])
    gone = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch)
    torch._dynamo.reset()
    torch.compile(gone, fullgraph=True)(torch.randn(16, 32)).square().mean().backward()
    assert all(m.fp8_grad_amax.abs().sum() > 0 for m in gone if isinstance(m, Fp8Linear))  # (written)
    del gone
    gc.collect()
    other = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no live Fp8Linear")
        _train_under(other, other, hooks=False, steps=1)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_the_report_says_compiled_layers_run_fp8(monkeypatch, recipe):
    """fp8ops.report's "runs" of a compiled model that casts FP8: "FP8" on either recipe (the
    current recipe's compiled casts flag nothing, and it said "not yet"); a compiled model
    that has not run yet: "not yet"."""
    idle = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch, recipe=recipe)
    model = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch, recipe=recipe)
    torch._dynamo.reset()
    torch.compile(idle, fullgraph=True)
    _train_under(model, torch.compile(model, fullgraph=True), hooks=False, steps=2)
    assert [r["runs"] for r in fp8ops.report(model, print_table=False)] == ["FP8", "FP8"]
    assert [r["runs"] for r in fp8ops.report(idle, print_table=False)] == ["not yet", "not yet"]


def _compiled_runs(monkeypatch, wrap, **cfg):
    """(outputs, model) of the compiled converted model, called plainly and through wrap(fn, x),
    with a warning about saved-tensor hooks an error."""
    runs = []
    for wrapped in (False, True):
        model = convert_as_on_fp8_gpu(_ln_gelu_mlp(), monkeypatch, **cfg)
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*saved-tensor hooks")
            runs.append(_train_under(model, (lambda x, fn=fn: wrap(fn, x)) if wrapped else fn, hooks=False))
    return runs


def _assert_same_training(runs):
    (outs_a, a), (outs_b, b) = runs
    assert all(torch.equal(p, q) for p, q in zip(outs_a, outs_b))
    for (k, p), q in zip(a.state_dict(keep_vars=True).items(), b.state_dict(keep_vars=True).values()):
        assert torch.equal(p, q), k
    assert b[1].fp8_amax_history[:, 2].abs().sum() > 0  # (FP8 ran; dy's amaxes reached the history)


def test_the_current_recipe_keeps_fp8_under_saved_tensor_hooks_compiled(monkeypatch):
    """The current recipe's compiled graph saves clones of the scales, which copying hooks
    cannot harm: FP8 there, bit for bit as without the hooks, no warning."""
    def under_hooks(fn, x):
        with _copying_saved_tensor_hooks():
            return fn(x)
    _assert_same_training(_compiled_runs(monkeypatch, under_hooks, recipe="current"))


@pytest.mark.parametrize("offload", [False, True], ids=["checkpoint", "checkpoint_under_copying_hooks"])
def test_checkpointing_around_a_compiled_model_keeps_it_fp8(monkeypatch, offload):
    """torch.utils.checkpoint's own saved-tensor hooks (checkpoint around a compiled call, also
    inside copying hooks, whose copies then never see the checkpointed call's saved tensors)
    keep what is saved: the compiled layers run FP8, without a warning, and train bit for bit
    as the compiled model without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def checkpointed(fn, x):
        if not offload:
            return checkpoint(fn, x, use_reentrant=False)
        with _copying_saved_tensor_hooks():
            return checkpoint(fn, x, use_reentrant=False)
    _assert_same_training(_compiled_runs(monkeypatch, checkpointed))
