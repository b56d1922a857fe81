"""Fp8Linear, convert_to_fp8_training, report, fallbacks and checkpoints.

CPU tests run the FP8 path through the C reference kernels (fp8_on_cpu), so
the whole forward/backward logic is checked everywhere; GPU tests check SQNR
against BF16 and the real speed path on the device."""
import copy

import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops import Fp8Config
from fp8ops._reference import sqnr
from fp8ops.linear import Fp8Linear

from conftest import FP8_DEVICES, requires_fp8


class MLP(nn.Module):
    def __init__(self, d=32, h=64, odd=False):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.head = nn.Linear(d, 10 if odd else 16, bias=False)

    def forward(self, x):
        return self.head(self.down(torch.relu(self.up(x))))


def _fp8_on_cpu(model, config=None):
    """Convert regardless of this machine (tests the FP8 logic on CPU kernels)."""
    for name, m in list(model.named_modules()):
        for cname, c in list(m.named_children()):
            if type(c) is nn.Linear and c.in_features % 16 == 0 and c.out_features % 16 == 0:
                new = Fp8Linear.from_linear(c, config or Fp8Config())
                new.fp8_on_cpu = True
                setattr(m, cname, new)
    return model


# ------------------------------------------------------------- numerics (CPU)

@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_fp8_linear_cpu_close_to_fp32(recipe, fmt):
    torch.manual_seed(0)
    ref = nn.Linear(64, 32)
    lin = Fp8Linear.from_linear(copy.deepcopy(ref), Fp8Config(recipe=recipe, fp8_format=fmt))
    lin.fp8_on_cpu = True
    x = torch.randn(48, 64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    y, y_ref = lin(x), ref(x2)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    print(f"sqnr y {sqnr(y_ref, y):.1f} dx {sqnr(x2.grad, x.grad):.1f} dw {sqnr(ref.weight.grad, lin.weight.grad):.1f}")
    assert sqnr(y_ref, y) >= 25
    assert sqnr(x2.grad, x.grad) >= 18
    assert sqnr(ref.weight.grad, lin.weight.grad) >= 18
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)


def test_delayed_scaling_updates_after_optimizer_step():
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, config=Fp8Config(amax_history_len=4))
    lin.fp8_on_cpu = True
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(16, 32) * 3
    lin(x).sum().backward()
    amax_x = x.abs().max().item()
    assert lin.fp8_amax_history[0, 0].item() == amax_x          # recorded this step
    opt.step()                                                    # global post-step hook
    assert lin.fp8_step == 1
    assert lin.fp8_amax_history[-1, 0].item() == amax_x           # rolled to the end
    assert lin.fp8_amax_history[0].abs().sum() == 0               # slot cleared
    assert lin.fp8_scale[0].item() == pytest.approx(448.0 / amax_x)


@pytest.mark.parametrize("interval", [1, 2])
def test_delayed_scaling_casts_with_current_scales_until_its_first_update(interval):
    """Before its first scale update a delayed layer has no history: each cast uses its own
    tensor's current scale, while row 0 keeps collecting the maximum for that update. (With
    interval > 1 it waits one update more, for the growth rule: scaling._unprimed.)"""
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, config=Fp8Config(amax_history_len=4, interval=interval))
    lin.fp8_on_cpu = True
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    x_small, x_big = torch.randn(16, 32), torch.randn(16, 32) * 5
    a_small, a_big = x_small.abs().max().item(), x_big.abs().max().item()
    for step in range(interval if interval == 1 else 2 * interval):
        lin(x_small).sum().backward()
        assert lin.fp8_scale[0].item() == pytest.approx(448.0 / a_small)      # its own scale
        lin(x_big).sum().backward()
        assert lin.fp8_scale[0].item() == pytest.approx(448.0 / a_big)
        assert lin.fp8_amax_history[0, 0].item() == max(a_small, a_big)   # (interval 2: not rolled yet)
        opt.step()
    # the first update (interval 1; else the second): the scale of the history's maximum, kept
    # by the next casts
    assert lin.fp8_scale[0].item() == pytest.approx(448.0 / a_big)
    lin(x_small).sum().backward()
    assert lin.fp8_scale[0].item() == pytest.approx(448.0 / a_big)
    assert lin.fp8_overflow_count.sum() == 0


def test_weight_cast_cached_across_microbatches():
    lin = Fp8Linear(32, 16)
    lin.fp8_on_cpu = True
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(torch.randn(48, 32)).sum().backward()
    opt.step()  # (the cast is cached in layers an optimizer step has updated: not in the first step)
    calls = []
    orig = fp8ops.ops._linear_fwd_raw
    # linear_fwd casts the weight when it is passed in high precision (args[1])
    fp8ops.linear.ops._linear_fwd_raw = lambda *a: (calls.append(a[1].dtype), orig(*a))[1]
    try:
        for _ in range(3):                       # three micro-batches, one step
            lin(torch.randn(48, 32)).sum().backward()
        n_weight_casts = calls.count(torch.float32)
        opt.step()
        lin(torch.randn(48, 32)).sum().backward()
        n_after = calls.count(torch.float32)
    finally:
        fp8ops.linear.ops._linear_fwd_raw = orig
    assert len(calls) == 4
    assert n_weight_casts == 1 and n_after == 2


def test_nan_gradient_keeps_scales_and_counts_overflow():
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, config=Fp8Config(amax_history_len=2))
    lin.fp8_on_cpu = True
    opt = torch.optim.SGD(lin.parameters(), lr=0.0)
    lin(torch.randn(16, 32)).sum().backward()
    opt.step()
    scales = lin.fp8_scale.clone()
    y = lin(torch.randn(16, 32))
    (y * torch.tensor(float("nan"))).sum().backward()            # poisoned gradient
    opt.step()
    assert torch.isfinite(lin.fp8_scale).all() and (lin.fp8_scale > 0).all()
    assert lin.fp8_scale[2] == scales[2]                          # grad scale kept
    assert lin.fp8_overflow_count.tolist() == [0, 0, 1]          # the gradient's amax, once
    row = [r for r in fp8ops.report(nn.Sequential(lin), print_table=False)][0]
    assert row["overflows"] == 1 and row["overflow_g"] == 1
    for _ in range(3):                                            # recovers with clean data
        lin.zero_grad()
        lin(torch.randn(16, 32)).sum().backward()
        opt.step()
    assert torch.isfinite(lin.fp8_scale).all()


# ------------------------------------------------------ convert and fallback

def test_convert_falls_back_on_this_machine_when_no_fp8():
    ok, reason = fp8ops.fp8_supported_here()
    if ok:
        pytest.skip("FP8 runs here; the fallback test is for machines without it")
    model = MLP()
    before = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="FP8 is OFF"):
        out = fp8ops.convert(model)
    assert out is model
    assert not any(isinstance(m, Fp8Linear) for m in model.modules())
    rows = fp8ops.report(model, print_table=False)
    assert [r["backend"] for r in rows] == ["bf16"] * 3
    assert all(r["reason"] == reason for r in rows)
    x = torch.randn(4, 32)
    assert torch.equal(model(x), before(x))          # trains exactly like the plain model


def test_convert_per_layer_decisions(monkeypatch):
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    model = MLP(odd=True)
    fp8ops.convert(model, module_filter_fn=lambda m, fqn: fqn != "down")
    assert isinstance(model.up, Fp8Linear)
    assert type(model.down) is nn.Linear and type(model.head) is nn.Linear
    rows = {r["name"]: r for r in fp8ops.report(model, print_table=False)}
    assert rows["up"]["backend"] == "fp8ops"
    assert rows["down"]["reason"] == "excluded by module_filter_fn"
    assert "multiples of 16" in rows["head"]["reason"]
    root = fp8ops.convert(nn.Linear(32, 32))
    assert isinstance(root, Fp8Linear)


def test_state_dict_is_the_bf16_models():
    torch.manual_seed(0)
    plain = MLP().to(torch.bfloat16)
    conv = _fp8_on_cpu(copy.deepcopy(plain))
    sd_p, sd_c = plain.state_dict(), conv.state_dict()
    assert list(sd_p) == list(sd_c)
    for k in sd_p:
        assert sd_p[k].shape == sd_c[k].shape and sd_p[k].dtype == sd_c[k].dtype


def test_checkpoint_roundtrip_bf16_fp8_bf16(tmp_path):
    """BF16 checkpoint -> converted model -> train -> save -> plain BF16 model: bit-exact weights."""
    torch.manual_seed(0)
    plain = MLP()
    torch.save(plain.state_dict(), tmp_path / "bf16.pt")
    conv = _fp8_on_cpu(MLP())
    conv.load_state_dict(torch.load(tmp_path / "bf16.pt"))
    for k, v in plain.state_dict().items():
        assert torch.equal(conv.state_dict()[k], v)
    opt = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        conv(torch.randn(16, 32)).square().mean().backward()
        opt.step()
    torch.save(conv.state_dict(), tmp_path / "fp8.pt")
    torch.save(fp8ops.scaling_state_dict(conv), tmp_path / "scaling.pt")
    back = MLP()
    back.load_state_dict(torch.load(tmp_path / "fp8.pt"))
    for k, v in conv.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    again = _fp8_on_cpu(MLP())
    again.load_state_dict(torch.load(tmp_path / "fp8.pt"))
    assert fp8ops.load_scaling_state_dict(again, torch.load(tmp_path / "scaling.pt")) == []
    assert torch.equal(again.up.fp8_scale, conv.up.fp8_scale)
    assert torch.equal(again.up.fp8_amax_history, conv.up.fp8_amax_history)


def test_config_validation():
    with pytest.raises(ValueError, match="recipe must be one of"):
        Fp8Config(recipe="fast")
    with pytest.raises(ValueError, match="fp8_format must be one of"):
        Fp8Config(fp8_format="e4m2")
    with pytest.raises(ValueError, match="interval must be"):
        Fp8Config(interval=0)
    assert Fp8Config().short_str() == "delayed/hybrid/h1024/max"


# ------------------------------------------------------------------ GPU-only

@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_linear_cuda_sqnr_vs_bf16(recipe, master):
    torch.manual_seed(0)
    ref = nn.Linear(1024, 512).cuda().to(master)
    model = fp8ops.convert(nn.Sequential(copy.deepcopy(ref)), config=Fp8Config(recipe=recipe))
    assert isinstance(model[0], Fp8Linear)
    x = torch.randn(4, 256, 1024, device="cuda")
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, y_ref = model(xa), ref(xb)
    g = torch.randn_like(y_ref)
    y.backward(g)
    y_ref.backward(g)
    assert y.dtype == torch.bfloat16
    assert sqnr(y_ref.float(), y.float()) >= 25
    assert sqnr(xb.grad, xa.grad) >= 20
    assert sqnr(ref.weight.grad.float(), model[0].weight.grad.float()) >= 20
    assert model[0].weight.grad.dtype == master


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_fp8_linear_cuda_compile_and_graph():
    torch.manual_seed(0)
    model = fp8ops.convert(MLP(256, 512).cuda())
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = model(x)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True)(x)
    torch.testing.assert_close(compiled.float(), eager.float(), rtol=0.05, atol=0.05)


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_compile_reduce_overhead_trains_like_eager():
    """torch.compile(mode="reduce-overhead"): CUDA graphs recorded by inductor
    replay the FP8 forward and backward while the optimizer hook updates the
    scales between steps; the losses follow eager fp8ops' and the scales move."""
    torch.manual_seed(0)
    base = MLP(256, 512).cuda()
    models = {mode: fp8ops.convert(copy.deepcopy(base), config=Fp8Config(policy="always"))
              for mode in ("eager", "graphs")}
    calls = {"eager": models["eager"], "graphs": torch.compile(models["graphs"], mode="reduce-overhead")}
    opts = {mode: torch.optim.SGD(m.parameters(), lr=0.5) for mode, m in models.items()}
    x, target = torch.randn(64, 256, device="cuda"), torch.randn(64, 16, device="cuda")
    losses = {mode: [] for mode in models}
    torch._dynamo.reset()
    for _ in range(6):
        for mode, fn in calls.items():
            torch.compiler.cudagraph_mark_step_begin()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = (fn(x).float() - target).square().mean()
            loss.backward()
            opts[mode].step()
            opts[mode].zero_grad(set_to_none=True)
            losses[mode].append(loss.item())
    assert losses["graphs"] == pytest.approx(losses["eager"], rel=0.02), losses
    assert losses["graphs"][-1] < losses["graphs"][0]
    up_e, up_g = models["eager"].up, models["graphs"].up
    assert up_g.fp8_step == up_e.fp8_step == 6
    torch.testing.assert_close(up_g.fp8_scale, up_e.fp8_scale, rtol=0.02, atol=0)
    torch.testing.assert_close(up_g.fp8_amax_history, up_e.fp8_amax_history, rtol=0.02, atol=0)
    assert up_g.fp8_amax_history.gt(0).any(1).sum() >= 5   # the steps' amaxes were recorded


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_fp8_linear_cuda_graph_capture_fwd_bwd():
    """A full Fp8Linear forward + backward captured in a CUDA graph and replayed
    gives the eager result (scales fixed between replays, as inside one step)."""
    torch.manual_seed(0)
    model = fp8ops.convert(MLP(256, 512).cuda(), config=Fp8Config(policy="always"))
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    params = [x] + list(model.parameters())

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = model(x)
        y.float().square().mean().backward()
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up: cuBLASLt handles and algorithms, first-step scales, weight cast
            for p in params:
                p.grad = None
            fwd_bwd()
    torch.cuda.current_stream().wait_stream(s)
    for p in params:
        p.grad = None
    eager_y = fwd_bwd().detach().clone()
    eager_grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fwd_bwd()
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y.float(), eager_y.float(), rtol=0, atol=0)
    for p, ref in zip(params, eager_grads):
        torch.testing.assert_close(p.grad, ref, rtol=1e-6, atol=1e-6)


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_ops_from_two_threads_on_two_streams():
    """Casts and GEMMs issued concurrently from two threads, each on its own
    stream, give the single-threaded results (cuBLASLt cache and handles are
    shared and locked in C)."""
    import threading

    torch.manual_seed(0)
    e4 = torch.float8_e4m3fn
    xs = [torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(2)]
    w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([2.0], device="cuda")

    def work(x):
        x8, _, _ = fp8ops.ops.cast(x, s, e4, True)
        w8, _, _ = fp8ops.ops.cast(w, s, e4, False)
        return fp8ops.ops.gemm(x8, w8, s, s, None, torch.bfloat16)

    expected = [work(x) for x in xs]
    torch.cuda.synchronize()
    results = [None, None]
    errors = []

    def run(i):
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for _ in range(50):
                    results[i] = work(xs[i])
            stream.synchronize()
        except Exception as e:  # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for got, ref in zip(results, expected):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_fp8_linear_compiled_fwd_bwd_matches_eager_cpu(recipe):
    """torch.compile(fullgraph=True) of converted layers, forward and backward,
    through the fused ops' fake kernels and their in-place amax folding: the
    same outputs, gradients and scaling state as eager (CPU reference kernels)."""
    torch.manual_seed(0)
    base = MLP(32, 64)
    runs = []
    for compiled in (False, True):
        model = _fp8_on_cpu(copy.deepcopy(base), Fp8Config(recipe=recipe))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        fn = torch.compile(model, fullgraph=True) if compiled else model
        torch._dynamo.reset()
        torch.manual_seed(1)
        outs = []
        for _ in range(3):
            x = torch.randn(48, 32)
            y = fn(x)
            y.square().mean().backward()
            opt.step()
            opt.zero_grad()
            outs.append(y.detach())
        runs.append((outs, [p.detach().clone() for p in model.parameters()],
                     [(m.fp8_amax_history.clone(), m.fp8_scale.clone()) for m in model.modules()
                      if isinstance(m, Fp8Linear)]))
    (o1, p1, s1), (o2, p2, s2) = runs
    for a, b in zip(o1, o2):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(p1, p2):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for (h1, sc1), (h2, sc2) in zip(s1, s2):
        assert torch.equal(h1, h2) and torch.equal(sc1, sc2)


def test_scale_inv_entries_stay_16_byte_aligned():
    """The GEMMs read scale_inv entries through pointers cuBLASLt wants 16-byte
    aligned: the buffer is padded (stride 4), and re-padded when something
    (.to(), a load) makes it contiguous again, values kept."""
    lin = Fp8Linear(32, 16)
    lin.fp8_on_cpu = True
    x = torch.randn(16, 32)
    lin(x).sum().backward()
    assert lin.fp8_scale_inv.stride() == (4,)
    before = lin.fp8_scale_inv.clone()
    lin.fp8_scale_inv = lin.fp8_scale_inv.contiguous()      # what .cuda() does to a strided buffer
    with torch.no_grad():
        lin(x)                                               # (first step: x's current scale again)
    si = lin.fp8_scale_inv
    assert si.stride() == (4,) and torch.equal(si, before)
    assert all(si[i:i + 1].data_ptr() % 16 == 0 for i in range(3))


def test_bf16_verdict_fast_path_only_for_the_same_input_kind():
    """After policy "auto" sends a call to BF16 it records the input's (shape,
    dtype, device, autocast); a repeat of exactly that call takes the plain
    F.linear path at once, anything else goes through the full checks."""
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, bias=True)
    lin.fp8_on_cpu = True
    x = torch.randn(48, 32)
    lin._fp8_bf16_key = (x.shape, x.dtype, x.device, None)   # what the policy branch stores
    y = lin(x)
    assert torch.equal(y, torch.nn.functional.linear(x, lin.weight, lin.bias))
    assert lin.fp8_fallback_calls == 1 and lin.fp8_step == 0
    assert lin.fp8_amax_history.abs().sum() == 0                 # nothing cast, nothing recorded
    y2 = lin(torch.randn(32, 32))                                # another shape: the FP8 path
    assert lin.fp8_fallback_calls == 1 and lin.fp8_amax_history[0, 0] > 0
    assert y2.shape == (32, 16)


def test_module_moves_keep_fp32_scaling_state_and_drop_caches():
    """.half() / .to(bf16) must not cast the scaling state (a large scale would
    become inf in fp16); any .to() drops the cached weight cast; a state load
    drops it too (it was made with the old weight scale)."""
    lin = Fp8Linear(32, 16)
    lin.fp8_on_cpu = True
    lin(torch.randn(16, 32)).sum().backward()
    fp8ops.step(lin)                                      # (cached only after a step)
    with torch.no_grad():
        lin.fp8_scale.fill_(1e6)                          # > fp16 max
        lin.fp8_scale_inv.fill_(1e-6)
    before = lin.fp8_scale.clone()
    lin.half()
    assert lin.weight.dtype == torch.float16
    for name in ("fp8_amax_history", "fp8_scale", "fp8_scale_inv", "fp8_max"):
        assert getattr(lin, name).dtype == torch.float32, name
    assert torch.equal(lin.fp8_scale, before) and lin._w_cache is None
    lin.float()
    lin(torch.randn(16, 32))                              # caches the weight cast again
    assert lin._w_cache is not None
    state = fp8ops.scaling_state_dict(torch.nn.Sequential(lin))
    fp8ops.load_scaling_state_dict(torch.nn.Sequential(lin), state)
    assert lin._w_cache is None


def test_views_follow_a_buffer_whose_data_is_swapped():
    """FSDP2 moves buffers by assigning .data: the amaxes must land in the new memory."""
    lin = Fp8Linear(32, 16)
    lin.fp8_on_cpu = True
    lin(torch.randn(16, 32))
    lin.fp8_amax_history.data = lin.fp8_amax_history.data.clone().zero_()
    x = torch.full((16, 32), 3.0)
    lin(x)
    assert lin.fp8_amax_history[0, 0].item() == 3.0


def test_parametrized_weight():
    import torch.nn.utils.parametrize as P

    class Scale(nn.Module):
        def forward(self, w):
            return w * 2

    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, config=Fp8Config(policy="always"))
    lin.fp8_on_cpu = True
    with torch.no_grad():
        lin.bias.fill_(5.0)
    P.register_parametrization(lin, "weight", Scale())
    P.register_parametrization(lin, "bias", Scale())
    x = torch.randn(16, 32)
    y = lin(x)
    ref = torch.nn.functional.linear(x, lin.weight, lin.bias)   # weight and bias doubled
    assert sqnr(ref, y) >= 25
    y.sum().backward()
    assert lin.parametrizations.bias.original.grad is not None


def test_tune_policy_changes_no_scaling_state_cpu():
    """tune_policy's one forward only settles the policy: the result is the plain
    one, and no history, scale, weight cast or counter moves."""
    torch.manual_seed(0)
    model = _fp8_on_cpu(MLP(32, 64), Fp8Config(policy="auto"))
    x = torch.randn(16, 32)
    # (on the CPU no layer reaches a measurement: said, as compiled code would run them FP8)
    with pytest.warns(UserWarning, match=r"tune_policy: 3 of 3 FP8 layers \(up, down, head\) settled no verdict"):
        assert fp8ops.tune_policy(model, x) == {"up": {}, "down": {}, "head": {}}
    for _, m in model.named_modules():
        if isinstance(m, Fp8Linear):
            assert m.fp8_amax_history.abs().sum() == 0 and m.fp8_fallback_calls == 0
            assert m._w_cache is None and torch.equal(m.fp8_scale, torch.ones(3))
    import fp8ops.linear as linear_mod
    assert linear_mod._POLICY_ONLY is False                       # reset after the call
    model(x)                                                      # now the FP8 path
    assert model.up.fp8_amax_history[0, 0] > 0


def test_policy_measuring_layer_runs_fp8_inside_tune_policy_cpu(monkeypatch):
    """policy.measure's throwaway layer is created inside tune_policy's forward:
    it must time the FP8 path, not the plain one (it once timed BF16 against
    BF16 there, and every layer of a compiled model got a BF16 verdict)."""
    import fp8ops.linear as linear_mod
    torch.manual_seed(0)
    lin = Fp8Linear(32, 16, config=Fp8Config(policy="auto"))
    lin.fp8_on_cpu = True
    lin.fp8_policy_measuring = True
    monkeypatch.setattr(linear_mod, "_POLICY_ONLY", True)
    x = torch.randn(16, 32, requires_grad=True)
    lin(x).sum().backward()
    assert lin.fp8_amax_history[0, 0] > 0 and lin.fp8_amax_history[0, 2] > 0  # x and dy were cast
    assert lin.fp8_fallback_calls == 0


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_tune_policy_then_compile_follows_the_verdicts(monkeypatch):
    """A compiled layer cannot measure; after tune_policy it follows the verdicts
    measured eagerly: the layer FP8 loses on runs BF16 (casts nothing)."""
    import fp8ops.policy as policy
    torch.manual_seed(0)
    model = fp8ops.convert(MLP(256, 512).cuda(), config=Fp8Config(policy="auto"))
    # up: FP8 slower both ways; down: faster on the GPU, slower alone -> tune_policy settles it GPU-bound
    slower, gpu_only = policy.Timing(1.0, 1.25, 1.0, 1.25, 0.1, 0.1), policy.Timing(1.0, 2.0, 1.0, 0.8, 0.1, 0.5)
    monkeypatch.setattr(policy, "measure", lambda layer, M, cdtype: gpu_only if layer.out_features != 512 else slower)
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        verdicts = fp8ops.tune_policy(model, x)
    assert verdicts["up"] == {(64, torch.bfloat16): (False, 0.8)}
    assert verdicts["down"] == {(64, torch.bfloat16): (True, 1.25)}
    assert all(m.fp8_amax_history.abs().sum() == 0 for m in model.modules() if isinstance(m, Fp8Linear))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        compiled(x).float().sum().backward()
    assert model.up.fp8_amax_history.abs().sum() == 0          # BF16 by its verdict
    assert model.down.fp8_amax_history[0].abs().sum() > 0      # FP8


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_tune_policy_times_the_fp8_path(monkeypatch, tmp_path):
    """tune_policy's own measurement (no timing mocked, an empty cache): the FP8
    side of each timing runs fp8ops' FP8 forward, while the model's layers
    themselves only compute the plain result."""
    import fp8ops.ops as ops_mod
    import fp8ops.policy as policy
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(tmp_path / "policy.json"))
    monkeypatch.setattr(policy, "_timings", None)
    calls = []
    real = ops_mod._linear_fwd_raw
    monkeypatch.setattr(ops_mod, "_linear_fwd_raw", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(0)
    model = fp8ops.convert(MLP(256, 512).cuda(), config=Fp8Config(policy="auto"))
    x = torch.randn(64, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fp8ops.tune_policy(model, x)
    assert torch.Size([64, 256]) in calls and torch.Size([64, 512]) in calls   # up's and down's shapes
    assert all(m.fp8_amax_history.abs().sum() == 0 for m in model.modules() if isinstance(m, Fp8Linear))
    timings = [t for k, t in policy._load().items() if "64x256->512" in k]
    assert len(timings) == 1                                                   # measured and cached


class _Block(nn.Module):
    """A residual MLP block, one of a stack compiled block by block."""

    def __init__(self, d=32):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.ln(x))))


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_blocks_compiled_one_by_one_share_their_graphs(device, monkeypatch):
    """torch.compile of each block on its own (blk.compile(), as torchtitan does): the blocks
    share their graphs (one for delayed scaling's first step, one after), so a stack deeper
    than dynamo's recompile limit stays compiled. Every layer turns to delayed scaling after
    its first update (compiled code sets no flag: update_scales finds its casts in the
    histories): the first five blocks' after step 0, the other five, first called at step 2
    through the graphs the first ones made, after step 2, and all again after a weight load.
    Once every layer is settled, an update reads no history (no sync per step). The results
    match eager. (On CUDA: the real kernels, and the histories read back from the GPU.)"""
    from torch._dynamo.utils import counters

    from fp8ops import scaling
    torch.manual_seed(0)
    base = nn.Sequential(*[_Block() for _ in range(10)], nn.Linear(32, 16))  # a tail never called
    read = []  # per update: how many layers' histories it read
    row0_written = scaling._row0_written
    monkeypatch.setattr(scaling, "_row0_written", lambda layers: read.append(len(layers)) or row0_written(layers))
    cfg = torch._dynamo.config
    saved = cfg.recompile_limit, cfg.fail_on_recompile_limit_hit
    cfg.recompile_limit = 8  # torch's default, whatever an earlier test set
    cfg.fail_on_recompile_limit_hit = True  # (a block past the limit would run eager, silently)
    try:
        runs = []
        for compiled in (False, True):
            # (policy "always": "auto" would time these tiny CUDA layers and choose BF16)
            model = _fp8_on_cpu(copy.deepcopy(base).to(device), Fp8Config(policy="always"))
            for m in model.modules():
                if isinstance(m, Fp8Linear):
                    m.fp8_on_cpu = device == "cpu"
            blocks, tail = model[:10], model[10]
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            torch._dynamo.reset()
            counters.clear()
            if compiled:
                for blk in blocks:
                    blk.compile()
            layers = [m for m in blocks.modules() if isinstance(m, Fp8Linear)]
            torch.manual_seed(1)
            outs, ready = [], []
            for step in range(6):
                if step == 4:
                    model.load_state_dict(model.state_dict())  # new weights: each layer restarts its scaling
                    assert not any(m._fp8_delayed_ready for m in layers)
                read.clear()
                # (an input that needs no gradient would give the first block graphs of its own)
                y = blocks[:5 if step < 2 else 10](torch.randn(48, 32, device=device, requires_grad=True))
                y.square().mean().backward()
                opt.step()
                opt.zero_grad()
                outs.append(y.detach())
                ready.append(sum(m._fp8_delayed_ready for m in layers))
            assert ready == [10, 10, 20, 20, 20, 20], ready
            assert not tail._fp8_delayed_ready
            if compiled:
                assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
                assert read == [], read  # (step 5: every layer settled or unchanged, the tail too)
            runs.append((outs, [m.fp8_scale.clone() for m in layers]))
    finally:
        cfg.recompile_limit, cfg.fail_on_recompile_limit_hit = saved
    (o1, s1), (o2, s2) = runs
    for a, b in zip(o1, o2):
        assert sqnr(a, b) >= 40
    for a, b in zip(s1, s2):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=0)


def test_compiled_bf16_fallback_does_not_recompile_per_call():
    """A layer that runs BF16 under torch.compile (here: CPU input) must not touch
    state that dynamo guards on: one graph for every call, not one per call."""
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    model = nn.Sequential(Fp8Linear(32, 16))                      # fp8_on_cpu False: BF16 fallback
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(model, fullgraph=True)
    for _ in range(5):
        fn(torch.randn(8, 32)).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert model[0].fp8_fallback_calls == 0                       # counted in eager calls only


@requires_fp8
@pytest.mark.gpu
def test_an_fp8_layer_out_of_memory_raises_torch_out_of_memory_error():
    """The FP8 forward's output cannot be allocated (2 TiB): torch.OutOfMemoryError, as an
    nn.Linear gives, not a plain RuntimeError; the layer trains right after."""
    model = fp8ops.convert(nn.Sequential(nn.Linear(16, 1 << 20, bias=False)).cuda().bfloat16(),
                           config=Fp8Config(policy="always"))
    x = torch.randn(1 << 20, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(torch.OutOfMemoryError, match=r"fp8ops::linear_fwd: out of memory: could not allocate"):
        model(x)
    model(x[:64]).float().square().mean().backward()
    assert model[0].weight.grad is not None and torch.isfinite(model[0].weight.grad).all()
