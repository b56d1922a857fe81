"""policy="auto": the verdict from the two timings (policy.py) and, where they
disagree, the decision from the host's lead in the caller's loop (host_lead.py)."""
import json
import time
import types

import pytest
import torch

import fp8ops
from fp8ops import Fp8Config, host_lead, policy
from fp8ops.linear import Fp8Linear

from conftest import requires_fp8

T = policy.Timing


def gpu_only(extra_host_ms: float = 0.05) -> policy.Timing:
    """FP8 1.5x faster on the GPU, 2x slower alone (host-bound), extra_host_ms more host time per call"""
    return T(1.0, 2.0, 1.5, 1.0, 0.2, 0.2 + extra_host_ms)


def test_verdict_where_both_timings_agree_and_where_they_do_not():
    assert policy.verdict(T(1.5, 1.0, 1.5, 1.0, 0.1, 0.1)) == (True, 1.5)    # faster both ways
    assert policy.verdict(T(0.8, 1.0, 0.8, 1.0, 0.1, 0.1)) == (False, 0.8)   # slower both ways
    assert policy.verdict(T(1.02, 1.0, 1.02, 1.0, 0.1, 0.1)) == (False, 1.02)  # within noise: BF16
    wins, speedup = policy.verdict(gpu_only())
    assert wins is None and speedup == pytest.approx(1.5)                     # the caller's loop decides
    assert gpu_only(0.3).extra_host_ms == pytest.approx(0.3)
    assert T(1, 1, 1, 1, 0.5, 0.2).extra_host_ms == 0.0                       # FP8 saving host time costs none


def test_choose_charges_each_fp8_layer_to_every_later_point():
    # three layers at points 0, 1, 2; a 1 ms lead everywhere; each costs 0.4 ms of host time
    leads = [1.0] * 6
    got = host_lead.choose(leads, [("a", 0, gpu_only(0.4)), ("b", 1, gpu_only(0.4)), ("c", 2, gpu_only(0.4))])
    # a: room 1.0; b: 1.0 - 0.4 = 0.6; c: 0.6 - 0.4 = 0.2 < 0.4 + margin
    assert [got[k][0] for k in "abc"] == [True, True, False]
    assert "host lead 0.200 ms" in got["c"][1] and "0.400 ms per call" in got["c"][1]


def test_choose_looks_only_after_the_layer_and_needs_a_later_point():
    leads = [0.0, 0.0, 5.0, 5.0]          # no lead early in the step (e.g. right after a sync), 5 ms later
    got = host_lead.choose(leads, [("early", 0, gpu_only()), ("late", 2, gpu_only()), ("last", 3, gpu_only())])
    assert got["early"][0] is False       # point 1 has no lead to hide its extra host time in
    assert got["late"][0] is True         # its own point does not count, point 3 has 5 ms
    assert got["last"][0] is False and "no later point" in got["last"][1]


def test_choose_order_is_call_order_and_gpu_loss_stays_bf16():
    leads = [1.0] * 4
    slower_on_gpu = T(1.0, 0.9, 1.0, 1.1, 0.2, 0.1)   # faster alone (cheaper host), slower on the GPU
    got = host_lead.choose(leads, [("second", 1, gpu_only(0.6)), ("first", 0, gpu_only(0.6)),
                                   ("gpu_loses", 2, slower_on_gpu)])
    assert (got["first"][0], got["second"][0], got["gpu_loses"][0]) == (True, False, False)


def test_timings_cache_round_trip_and_old_files(tmp_path, monkeypatch):
    path = tmp_path / "policy.json"
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(path))
    monkeypatch.setattr(policy, "_timings", None)
    policy._load()["k"] = T(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    policy._save()
    monkeypatch.setattr(policy, "_timings", None)
    assert policy.cached("k") == T(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    # a cache an older fp8ops wrote ((wins, speedup) per key) is not an error: it is re-measured
    path.write_text(json.dumps({"v2|x": [True, 1.2]}))
    monkeypatch.setattr(policy, "_timings", None)
    assert policy.cached("v2|x") is None


# ------------------------------------------------- host_lead's rounds, on CPU with stand-in CUDA events


@pytest.fixture
def fake_cuda(monkeypatch):
    """CUDA events on the CPU: an event completes `lag` ms after it is recorded,
    except the first one after a synchronize (the drained GPU runs it at once)."""
    state = {"lag": 0.0, "drained": False}

    class Event:
        def __init__(self, enable_timing=True):
            self.t = None

        def record(self, stream=None):
            lag = 0.0 if state["drained"] else state["lag"]
            state["drained"] = False
            self.t = time.perf_counter() * 1e3 + lag

        def elapsed_time(self, end):
            return end.t - self.t

    def synchronize(device=None):
        state["drained"] = True

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(host_lead, "_rounds", {})
    return state


def _layer():
    return types.SimpleNamespace(weight=types.SimpleNamespace(device=torch.device("cuda", 0)))


def _forward(layer, t, key=(64, torch.bfloat16)):
    """One forward of a pending layer: its decision, else a BF16 output whose backward is a sample point."""
    got = host_lead.decision(layer, key, t)
    if got is None:
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        host_lead.watch(layer, key, y)
        return y
    return got


@pytest.mark.parametrize("lag, fp8", [(2.0, True), (0.0, False)])
def test_round_decides_on_the_third_call(fake_cuda, lag, fp8):
    fake_cuda["lag"] = lag           # 2 ms: the GPU runs behind the host (GPU-bound); 0: host-bound
    layer, t = _layer(), gpu_only(0.2)
    for _ in range(2):               # call 1: the anchor; call 2: drain, time zero, sampling
        y = _forward(layer, t)
        assert isinstance(y, torch.Tensor)
        y.sum().backward()           # the backward's sample point
    wins, why = _forward(layer, t)
    assert wins is fp8 and "host lead" in why
    r = host_lead._rounds[0]
    assert not r.pending and r.anchor is None and not r.sampling


def test_round_shares_the_lead_between_layers_in_call_order(fake_cuda):
    fake_cuda["lag"] = 1.0           # 1 ms of lead everywhere; each layer would spend 0.6 ms of it
    a, b, t = _layer(), _layer(), gpu_only(0.6)
    for _ in range(2):
        ys = [_forward(a, t), _forward(b, t)]
        sum(y.sum() for y in ys).backward()
    got_a = _forward(a, t)           # the anchor's third call ends the round
    got_b = _forward(b, t)
    assert got_a[0] is True and got_b[0] is False
    assert "host lead 0.4" in got_b[1]   # what a left of the lead


def test_a_stale_anchor_does_not_block_the_others(fake_cuda, monkeypatch):
    monkeypatch.setattr(host_lead, "STALE_CALLS", 3)
    fake_cuda["lag"] = 2.0
    gone, kept, t = _layer(), _layer(), gpu_only(0.2)
    _forward(gone, t)                # the anchor, never called again (a model that was dropped)
    got = None
    for i in range(10):
        got = _forward(kept, t)
        if not isinstance(got, torch.Tensor):
            break
        got.sum().backward()
    assert got is not None and got[0] is True, got
    assert i == 5                    # calls 0-2 wait, 3 finds the anchor stale and takes over, 4 samples, 5 decides


# ----------------------------------------------------------------------------------------- GPU


@pytest.fixture
def fresh_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(tmp_path / "policy.json"))
    monkeypatch.setattr(policy, "_timings", None)
    monkeypatch.setattr(host_lead, "_rounds", {})


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_measure_times_both_ways(fresh_policy):
    layer = Fp8Linear(1024, 1024, device="cuda", config=Fp8Config(policy="auto"))
    t = policy.measure(layer, 2048, torch.bfloat16)
    assert all(v > 0 for v in t), t
    # pure GPU time cannot exceed the loop's own pace by more than noise; the
    # host's enqueue time neither
    for gpu, host, alone in ((t.gpu_bf16, t.host_bf16, t.alone_bf16), (t.gpu_fp8, t.host_fp8, t.alone_fp8)):
        assert gpu <= 1.5 * alone and host <= 1.5 * alone, t
    assert policy.cached(policy.key(layer.weight.device, 2048, 1024, 1024, torch.bfloat16, True)) == t
    # the sleep kernel's calibration: GPU clocks are 0.5-3 GHz (a timed first launch once made it 50 MHz)
    assert 5e5 < policy._cycles_per_ms() < 3e6


def _loop(layer, steps: int, gpu_bound: bool):
    """fwd + bwd of one layer; gpu_bound: 2 ms of GPU work between them (the host runs ahead);
    else a sync after each step (the host never does)"""
    x = torch.randn(64, 128, device="cuda", requires_grad=True)
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        if gpu_bound:
            torch.cuda._sleep(int(2.0 * policy._cycles_per_ms()))
        y.float().sum().backward()
        if not gpu_bound:
            torch.cuda.synchronize()
    torch.cuda.synchronize()


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("gpu_bound", [True, False])
def test_host_lead_decides_a_layer_fp8_wins_on_the_gpu_only(fresh_policy, monkeypatch, gpu_bound):
    """Call 1 measures (mocked: FP8 faster on the GPU only), call 2 drains the GPU and
    starts sampling, call 3 decides: FP8 where the host runs ahead, BF16 where it does not."""
    monkeypatch.setattr(policy, "measure", lambda layer, M, cdtype: gpu_only(0.2))
    layer = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(128, 256)).cuda(),
                           config=Fp8Config(policy="auto"))[0]
    _loop(layer, 2, gpu_bound)
    assert layer.fp8_fallback_calls == 2 and not layer.fp8_policy     # BF16 while measuring the lead
    assert layer.fp8_amax_history.abs().sum() == 0
    _loop(layer, 3, gpu_bound)
    wins, speedup = layer.fp8_policy[(64, torch.bfloat16)]
    why = layer.fp8_policy_why[(64, torch.bfloat16)]
    assert wins is gpu_bound and speedup == pytest.approx(1.5 if gpu_bound else 0.5), why
    assert "host lead" in why and "no later point" not in why
    assert layer.fp8_fallback_calls == (2 if gpu_bound else 5)
    assert bool(layer.fp8_amax_history[0].abs().sum() > 0) is gpu_bound   # it really ran FP8 (or not)
    assert not layer._fp8_pending and not host_lead._rounds[torch.cuda.current_device()].pending
    reason = fp8ops.report(torch.nn.Sequential(layer), print_table=False)[0]["reason"]
    assert ("M=64: FP8 (" if gpu_bound else "M=64: BF16 (") in reason and "host lead" in reason
