"""policy="auto": the verdict from the two timings (policy.py) and, where they
disagree, the trial of the caller's own loop, in blocks of BF16 and FP8 steps (loop_trial.py)."""
import contextlib
import json
import logging
import os
import time
import types

import pytest
import torch

import fp8ops
from fp8ops import Fp8Config, loop_trial, policy
from fp8ops.linear import Fp8Linear

from conftest import requires_fp8

T = policy.Timing
KEY = (64, torch.bfloat16)


def gpu_only() -> policy.Timing:
    """FP8 1.5x faster on the GPU, 2x slower alone (host-bound)"""
    return T(1.0, 2.0, 1.5, 1.0, 0.2, 0.4)


def test_verdict_where_both_timings_agree_and_where_they_do_not():
    assert policy.verdict(T(1.5, 1.0, 1.5, 1.0, 0.1, 0.1)) == (True, 1.5)    # faster both ways
    assert policy.verdict(T(0.8, 1.0, 0.8, 1.0, 0.1, 0.1)) == (False, 0.8)   # slower both ways
    assert policy.verdict(T(1.02, 1.0, 1.02, 1.0, 0.1, 0.1)) == (False, 1.02)  # within noise: BF16
    wins, speedup = policy.verdict(gpu_only())
    assert wins is None and speedup == pytest.approx(1.5)                     # the caller's loop decides
    assert policy.verdict(T(1.2, 1.0, 1.25, 1.0, 0.1, 0.1))[0] is None        # a small gain: a trial too
    # the speedup it reports is the timing alone's where both agree (the two differ here)
    assert policy.verdict(T(1.6, 1.0, 1.4, 1.0, 0.1, 0.1)) == (True, 1.6)
    assert policy.verdict(T(0.7, 1.0, 0.9, 1.0, 0.1, 0.1)) == (False, 0.7)
    # at the thresholds: 1.3x both ways is FP8, 1.03x both ways needs a trial
    assert policy.verdict(T(1.3, 1.0, 1.3, 1.0, 0.1, 0.1))[0] is True
    assert policy.verdict(T(1.03, 1.0, 1.03, 1.0, 0.1, 0.1))[0] is None


def test_choose_needs_a_gain_beyond_noise():
    assert loop_trial.choose([10.0, 10.2, 9.9], [9.0, 9.1, 8.8])[0] is True
    assert loop_trial.choose([10.0, 10.0, 10.0], [9.97, 9.96, 9.98])[0] is False   # 0.3 %: BF16
    assert loop_trial.choose([10.0, 10.0, 10.0], [11.0, 11.0, 11.0])[0] is False
    assert "9.000 ms with FP8 vs 10.000 ms with BF16" in loop_trial.choose([10.0] * 3, [9.0] * 3)[1]


def test_choose_leaves_out_outlier_steps():
    """An evaluation or a checkpoint save inside the trial is not a training step:
    one 40 ms step among 10 ms steps would otherwise make its side lose."""
    fp8, why = loop_trial.choose([10.0, 10.0, 10.0, 10.0], [9.0, 40.0, 9.0, 9.0])
    assert fp8 is True and "outlier steps left out: 1" in why
    assert loop_trial.choose([10.0, 40.0, 10.0, 10.0], [10.0, 10.0, 10.0, 10.0])[0] is False
    # a stall that recurs is a cost of its side, not an outlier: one step at most is left out
    assert loop_trial.choose([10.0, 10.0, 10.0, 10.0], [9.0, 40.0, 40.0, 9.0])[0] is False


@pytest.mark.parametrize("drift", [0.02, 0.1, -0.1])
@pytest.mark.parametrize("gain, fp8", [(1.0, False), (1.02, True)])
def test_schedule_cancels_a_drifting_loop(drift, gain, fp8):
    """Steps that lengthen (or shorten) by `drift` ms each over the trial -- a GPU
    warming up -- must not decide it: the schedule puts both sides at the same mean
    step. Under B F B F a drift of 0.1 ms per 10 ms step alone would cost FP8 3 %."""
    ms = {s: 10.0 + drift * s for s in range(loop_trial.DECIDE_AT)}
    b = [ms[s] for s in loop_trial.counted(False)]
    f = [ms[s] / gain for s in loop_trial.counted(True)]
    assert len(b) == len(f) == len(loop_trial.SCHEDULE)          # 2 counted steps per block, 4 blocks a side
    assert sum(loop_trial.counted(False)) == sum(loop_trial.counted(True))
    assert loop_trial.choose(b, f)[0] is fp8


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
    # nor is a file that is JSON but not fp8ops' cache, or an entry with a zero timing
    for text in ("[]", "null", "3", json.dumps({"z": [0, 1, 1, 1, 1, 1], "k": [1, 2, 3, 4, 5, 6]})):
        path.write_text(text)
        monkeypatch.setattr(policy, "_timings", None)
        assert policy.cached("z") is None and policy.cached("k") == (T(1, 2, 3, 4, 5, 6) if "k" in text else None)
    # a cache named without a folder is written to the working directory
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", "here.json")
    monkeypatch.setattr(policy, "_timings", None)
    policy._load()["k"] = T(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
    policy._save()
    assert json.loads((tmp_path / "here.json").read_text()) == {"k": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]}


def test_timings_cache_keeps_what_another_process_wrote_and_no_temporary_file(tmp_path, monkeypatch):
    """Two processes (the ranks of one run) share the file: each write merges into what is
    there now, instead of putting back the file this process read at its start. A write that
    cannot replace the file (the path is a folder) leaves no temporary file behind."""
    path = tmp_path / "policy.json"
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(path))
    monkeypatch.setattr(policy, "_timings", None)
    policy._load()                                               # this process reads: empty
    path.write_text(json.dumps({"other": [1, 1, 1, 1, 1, 1]}))  # another process writes
    policy._load()["mine"] = T(2.0, 2.0, 2.0, 2.0, 2.0, 2.0)
    policy._save()
    assert set(json.loads(path.read_text())) == {"other", "mine"}
    folder = tmp_path / "a_folder"
    folder.mkdir()
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(folder))
    policy._save()
    assert sorted(p for p in tmp_path.iterdir() if p.suffix != ".lock") == sorted([path, folder])


def test_timings_cache_names_its_temporary_file_its_own_and_reads_only_numbers(tmp_path, monkeypatch):
    """The temporary file was named by the process id alone: two containers' processes with
    one pid wrote into one file, and readers saw torn JSON (some parsed, with timings no one
    measured). Now each write has a file of its own. "~" in FP8OPS_POLICY_CACHE is the home
    folder (it made a folder named "~"), and strings or deeply nested JSON read as no entry."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", "~/c/policy.json")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(policy, "_timings", None)
    made = []
    real = policy.tempfile.mkstemp
    monkeypatch.setattr(policy.tempfile, "mkstemp", lambda **kw: made.append(real(**kw)) or made[-1])
    for _ in range(2):
        policy._load()["k"] = T(1.0, 2.0, 3.0, 4.0, 5.0, 6.0)
        policy._save()
    path = tmp_path / "c" / "policy.json"
    assert json.loads(path.read_text()) == {"k": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]} and not (tmp_path / "~").exists()
    assert len({name for _, name in made}) == 2 and {n for n in os.listdir(tmp_path / "c") if n != "policy.json.lock"} == {"policy.json"}
    assert path.stat().st_mode & 0o777 == 0o666 & ~policy._umask()  # (a plain new file's, not mkstemp's 0600)
    path.write_text(json.dumps({"s": ["1", "2", "3", "4", "5", "6"], "k": [1, 2, 3, 4, 5, 6]}))
    monkeypatch.setattr(policy, "_timings", None)
    assert policy.cached("s") is None and policy.cached("k") == T(1, 2, 3, 4, 5, 6)
    path.write_text("[" * 100000 + "]" * 100000)
    monkeypatch.setattr(policy, "_timings", None)
    assert policy.cached("k") is None


def _save_keys_slowly(path, tag, q):
    """A child process: save 6 keys of its own one by one, each read of the file slowed so that
    unlocked saves of several processes would overlap."""
    os.environ["FP8OPS_POLICY_CACHE"] = path
    policy._timings = None
    real = policy._read
    policy._read = lambda p: (real(p), time.sleep(0.02))[0]
    try:
        for i in range(6):
            policy._load()[f"{tag}-{i}"] = T(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
            policy._save()
        q.put(None)
    except BaseException as e:  # (reported to the parent, which asserts on it)
        q.put(repr(e))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_timings_cache_save_waits_for_a_held_lock_only_so_long(tmp_path, monkeypatch):
    """A lock another process holds for good (stopped, or an NFS lock daemon that never answers)
    delays a save by WAIT_S, then the save goes on unlocked: measuring never blocks training."""
    import fcntl  # noqa: PLC0415
    path = tmp_path / "policy.json"
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(path))
    monkeypatch.setattr(policy, "_timings", None)
    monkeypatch.setattr(policy._FileLock, "WAIT_S", 0.3)
    with open(str(path) + ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        policy._load()["k"] = T(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
        t0 = time.monotonic()
        policy._save()
        waited = time.monotonic() - t0
    assert 0.3 <= waited < 5 and json.loads(path.read_text()) == {"k": [1.0] * 6}


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork (POSIX)")
def test_timings_cache_saves_of_several_processes_at_once_keep_every_entry(tmp_path):
    """Each save reads the file, merges its own entries and replaces the file: two processes
    saving at once each put back a file without the other's new entries. The saves now take
    turns under a lock file beside the cache."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    path = str(tmp_path / "policy.json")
    procs = [ctx.Process(target=_save_keys_slowly, args=(path, f"p{r}", q), daemon=True) for r in range(4)]
    try:
        for pr in procs:
            pr.start()
        errors = [q.get(timeout=120) for _ in procs]
    finally:  # (a child stuck for any reason must not keep pytest from exiting)
        for pr in procs:
            pr.join(timeout=10)
            if pr.is_alive():
                pr.kill()
    assert errors == [None] * 4
    assert set(json.loads(open(path).read())) == {f"p{r}-{i}" for r in range(4) for i in range(6)}


# ------------------------------------------------ the trial's steps, on CPU with a simulated loop


class _SimLoop:
    """A training loop on two clocks: each step takes `host` ms of host time and
    `gpu` ms of GPU time, per phase (the CUDA events read the GPU clock)."""

    def __init__(self, monkeypatch, host: dict, gpu: dict):
        self.host_ms, self.gpu_ms, self.t_host, self.t_gpu = host, gpu, 0.0, 0.0
        sim = self

        class Event:
            def __init__(self, enable_timing=True):
                self.t = None

            def record(self, stream=None):
                self.t = sim.t_gpu

            def elapsed_time(self, end):
                return end.t - self.t

            def synchronize(self):
                pass

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # (the layers' cuda:0 is current)
        monkeypatch.setattr(loop_trial.time, "perf_counter", lambda: sim.t_host / 1e3)
        monkeypatch.setattr(loop_trial, "_trials", {})

    def step(self, layers, timing=None):
        """One step: each layer's forward asks for its path; returns their answers."""
        got = [loop_trial.decision(layer, KEY, timing or gpu_only()) for layer in layers]
        phase = "fp8" if got[0][0] else "bf16"
        self.t_host += self.host_ms[phase]
        self.t_gpu += self.gpu_ms[phase]
        return got


def _layer(trainable: bool = True):
    return types.SimpleNamespace(weight=types.SimpleNamespace(device=torch.device("cuda", 0),
                                                              requires_grad=trainable))


@pytest.mark.parametrize("host, gpu, fp8", [
    ({"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0}, True),    # GPU-bound: FP8's host cost hides
    ({"bf16": 10.0, "fp8": 12.0}, {"bf16": 5.0, "fp8": 4.5}, False),  # host-bound: FP8 adds to each step
    ({"bf16": 8.0, "fp8": 9.5}, {"bf16": 9.0, "fp8": 8.0}, False),    # FP8 becomes host-bound: 9.5 > 9.0
])
def test_trial_runs_blocks_of_bf16_and_fp8_and_keeps_the_faster(monkeypatch, caplog, host, gpu, fp8):
    caplog.set_level(logging.INFO, logger="fp8ops")
    sim = _SimLoop(monkeypatch, host, gpu)
    a, b = _layer(), _layer()
    paths = []
    for _ in range(loop_trial.DECIDE_AT):
        got = sim.step([a, b])
        assert got[0] == got[1] and got[0][1] is None          # both layers take the same path, undecided
        paths.append(got[0][0])
    # step 0, then blocks B F F B F B B F
    assert paths == [False] * 4 + [True] * 6 + [False] * 3 + [True] * 3 + [False] * 6 + [True] * 3
    (wins_a, why_a), (wins_b, why_b) = sim.step([a, b])
    assert wins_a is wins_b is fp8
    assert "trial in your loop" in why_a and "2 layers waited on it" in why_b
    # the decision is logged once (each rank its own; the caller then all-reduces it)
    said = [r.getMessage() for r in caplog.records if "policy auto" in r.getMessage()]
    assert said == [f"fp8ops policy auto: the trial in your loop chose {'FP8' if fp8 else 'BF16'} for 2 layers "
                    f"({why_a.split(' (2 layers')[0]})"]
    t = loop_trial._trials[0]
    assert not t.pending and not t.decided and t.anchor is None


class _Weakrefable:
    """A layer stand-in that can die (weak references)."""
    def __init__(self):
        self.weight = types.SimpleNamespace(device=torch.device("cuda", 0), requires_grad=True)


def test_a_trial_its_model_left_unfinished_does_not_count_the_next_models_steps(monkeypatch):
    """A run stopped before the trial decided (an interrupted notebook cell, a short sweep run),
    then a new model in the same process: its layers went on counting the old trial's steps,
    mixing the two models' step times (FP8 chosen where it gains nothing). The dead layers'
    entries go with them, and so does the trial they left unfinished."""
    sim = _SimLoop(monkeypatch, {"bf16": 1.0, "fp8": 1.0}, {"bf16": 10.0, "fp8": 10.0})
    old = [_Weakrefable(), _Weakrefable()]
    for _ in range(9):                      # model A: 9 optimizer steps, then deleted
        sim.step(old)
        loop_trial.note_optimizer_step()
    assert loop_trial._trials[0].by_step and loop_trial._trials[0].pending
    del old
    import gc  # noqa: PLC0415
    gc.collect()
    t = loop_trial._trials[0]
    assert not t.pending and not t.marks and not t.by_step
    sim.gpu_ms = {"bf16": 30.0, "fp8": 30.0}  # model B: FP8 gains nothing
    new = [_Weakrefable(), _Weakrefable()]
    for _ in range(loop_trial.DECIDE_AT + 2):
        got = sim.step(new)
        loop_trial.note_optimizer_step()
        if got[0][1] is not None:
            break
    assert got[0][0] is False and "30.000 ms with FP8 vs 30.000 ms with BF16" in got[0][1]


def test_the_trial_times_the_layers_gpu(monkeypatch):
    """A model on cuda:1 while cuda:0 is current: the trial's events were recorded on cuda:0's
    stream (another model's work, or an idle GPU). They are recorded with the layers' GPU
    current."""
    sim = _SimLoop(monkeypatch, {"bf16": 1.0, "fp8": 1.0}, {"bf16": 10.0, "fp8": 10.0})
    current, recorded_on = [0], []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])

    @contextlib.contextmanager
    def device(d):
        before, current[0] = current[0], torch.device(d).index
        try:
            yield
        finally:
            current[0] = before
    monkeypatch.setattr(torch.cuda, "device", device)
    record = torch.cuda.Event.record
    monkeypatch.setattr(torch.cuda.Event, "record", lambda ev, stream=None: (recorded_on.append(current[0]),
                                                                              record(ev, stream))[1])
    lyr = _Weakrefable()
    lyr.weight.device = torch.device("cuda", 1)
    for _ in range(3):
        sim.step([lyr])
        loop_trial.note_optimizer_step()
    assert recorded_on and set(recorded_on) == {1} and current[0] == 0


@pytest.mark.parametrize("calls_per_step", [1, 3, 8])
def test_trial_steps_are_optimizer_steps(monkeypatch, calls_per_step):
    """Gradient accumulation (and a layer called several times per step): the calls between
    two optimizer steps are one trial step on one path (activation checkpointing recomputes
    each on the path it took), and the optimizer step's own time falls once into every
    trial step. Per call FP8 is 5 % faster on the GPU; each optimizer step adds 3 ms. Counting
    every call as a step, 8 micro-batches put both long steps on FP8's side and chose BF16."""
    sim = _SimLoop(monkeypatch, {"bf16": 1.0, "fp8": 1.0}, {"bf16": 10.0, "fp8": 9.5})
    a, b = _layer(), _layer()
    verdict, steps = None, 0
    while verdict is None and steps < 40:
        paths = []
        for _ in range(calls_per_step):
            got = sim.step([a, b])
            paths += [g[0] for g in got]
            if got[0][1] is not None:  # decided (a layer asks no more: Fp8Linear keeps the verdict)
                assert got[1] == got[0]
                verdict = got[0][0]
                break
        if steps > 0:  # (before the first optimizer step the trial cannot know what a step is)
            assert len(set(paths)) == 1, (steps, paths)
        sim.t_host += 3.0
        sim.t_gpu += 3.0
        loop_trial.note_optimizer_step()
        steps += 1
    assert verdict is True
    # the trial's steps 0..DECIDE_AT-1, decided at the call that starts step DECIDE_AT; with
    # micro-batches the first optimizer step is spent learning what a step is (a restart)
    assert steps == loop_trial.DECIDE_AT + 1 + (1 if calls_per_step > 1 else 0), steps


def test_an_evaluation_before_training_is_no_trial_step(monkeypatch):
    """nanoGPT evaluates at iteration 0 (200 batches per split, under no_grad) before its first
    optimizer step: those forwards must not be the trial's steps (the verdict would be timed on
    forward-only steps and then hold for training). They run BF16 and mark nothing; the trial
    starts with training's first forward."""
    monkeypatch.setattr(loop_trial, "_optimizer_steps", 0)
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    a, b = _layer(), _layer()
    with torch.no_grad():
        for _ in range(400):
            assert sim.step([a, b]) == [(False, None), (False, None)]
    t = loop_trial._trials[0]
    assert t.marks == [] and t.anchor is None and len(t.pending) == 2
    assert sorted(t.eval_calls.values()) == [400, 400]
    c = _layer()
    with torch.no_grad():
        sim.step([c])
    loop_trial.forget(c)                             # (a layer moved or freed leaves nothing behind)
    assert len(t.eval_calls) == 2 and len(t.pending) == 2
    verdict, steps = None, 0
    while verdict is None and steps < 40:
        got = sim.step([a, b])
        if got[0][1] is not None:
            verdict = got[0][0]
        loop_trial.note_optimizer_step()
        steps += 1
    assert verdict is True and steps == loop_trial.DECIDE_AT + 1, steps


def test_a_loop_that_only_evaluates_gets_its_trial(monkeypatch):
    """Inference only (no optimizer, no autograd): after EVAL_ONLY_CALLS calls of a layer its
    calls are the trial's steps; a training call between evaluations restarts that count."""
    monkeypatch.setattr(loop_trial, "_optimizer_steps", 0)
    monkeypatch.setattr(loop_trial, "EVAL_ONLY_CALLS", 5)
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    a = _layer()
    with torch.no_grad():
        for _ in range(4):
            sim.step([a])
    sim.step([a])                     # a training call: the evaluation before it was one
    with torch.no_grad():
        for _ in range(5):
            sim.step([a])
    t = loop_trial._trials[0]
    assert len(t.marks) == 1          # the training call's, none of the nine evaluation calls
    with torch.no_grad():
        calls, verdict = 0, None
        while verdict is None and calls < 100:
            got = sim.step([a])[0]
            calls += 1
            if got[1] is not None:
                verdict = got[0]
    # the sixth call in a row is let through and marks step 1 (the training call marked step 0)
    assert verdict is True and calls == loop_trial.DECIDE_AT, calls


def test_reentrant_checkpointing_recomputes_on_its_forwards_path(monkeypatch):
    """Reentrant activation checkpointing runs a block's forward without autograd (as an
    evaluation does) and recomputes it in the backward: both must take one path in every step,
    also while the no-autograd rule holds (before the first optimizer step)."""
    monkeypatch.setattr(loop_trial, "_optimizer_steps", 0)
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    block, head = _layer(), _layer()          # the checkpointed block's layer, then the lm_head
    verdict, steps = None, 0
    while verdict is None and steps < 40:
        with torch.no_grad():
            fwd = loop_trial.decision(block, KEY, gpu_only())
        got = sim.step([head])[0]
        seen = []
        x = torch.ones(2, requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: seen.append(loop_trial.decision(block, KEY, gpu_only())))
        y.sum().backward()                    # the recomputation, inside the backward
        if fwd[1] is None and seen[0][1] is None:
            assert seen[0][0] == fwd[0], steps
        if got[1] is not None:
            verdict = got[0]
        loop_trial.note_optimizer_step()
        steps += 1
    assert verdict is True


def test_a_frozen_layer_is_not_held_back_by_the_evaluation_rule(monkeypatch):
    """A layer no optimizer steps (a frozen base under LoRA) may never see an optimizer step:
    its calls without autograd count as the trial's steps, as before the rule."""
    monkeypatch.setattr(loop_trial, "_optimizer_steps", 0)
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    frozen = _layer(trainable=False)
    with torch.no_grad():
        for _ in range(3):
            sim.step([frozen])
    assert len(loop_trial._trials[0].marks) == 3


def test_a_stale_anchor_in_an_inference_loop_keeps_its_evaluation_count(monkeypatch):
    monkeypatch.setattr(loop_trial, "_optimizer_steps", 0)
    monkeypatch.setattr(loop_trial, "EVAL_ONLY_CALLS", 2)
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    a = _layer()
    with torch.no_grad():
        for _ in range(4):
            sim.step([a])
        t = loop_trial._trials[0]
        assert len(t.marks) == 2
        t.reset()                             # (as a stale anchor resets it)
        sim.step([a])
    assert len(t.marks) == 1                  # marked at once: not held back for another 2 calls


def test_a_recomputed_forward_takes_its_steps_path_and_is_no_step(monkeypatch):
    """Activation checkpointing runs the forward again inside the backward: the
    same path as that step's forward (else checkpoint's saved tensors differ)."""
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    a = _layer()
    for _ in range(4):
        sim.step([a])                                # steps 0-3: BF16
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(loop_trial.decision(a, KEY, gpu_only())))
    y.sum().backward()                               # "recomputation" in step 3's backward
    assert seen == [(False, None)] and len(loop_trial._trials[0].marks) == 4
    assert sim.step([a])[0] == (True, None)          # step 4, the first FP8 step, is still step 4


def test_report_says_what_each_converted_layer_runs():
    """Converted is not the same as running FP8: the report's "runs" column and its
    headline count the layers policy auto sent to BF16, those in its trial, and those
    that have not cast yet, apart from the ones running FP8."""
    from fp8ops.report import format_table, headline
    k = (16, torch.float32)
    layers = [Fp8Linear(16, 16) for _ in range(5)]
    for layer in layers:
        layer.fp8_on_cpu = True                                                 # (as on the GPU)
    layers[0].fp8_policy[k] = (False, 0.8)                                      # auto: BF16
    layers[1].fp8_policy.update({k: (True, 1.5), (8, torch.float32): (False, 0.9)})  # FP8 at M=16
    layers[2]._fp8_pending[k] = None                                           # trial running
    layers[4]._fp8_delayed_ready = True                                        # cast (policy always)
    rows = fp8ops.report(torch.nn.Sequential(*layers, torch.nn.Linear(16, 4)), print_table=False)
    assert [r["runs"] for r in rows] == ["BF16 (policy)", "FP8", "trial", "not yet", "FP8", "BF16"]
    assert headline(rows) == ("5/6 linear layers converted, 2 running FP8; 1 BF16 by policy auto (FP8 not "
                              "faster here); 1 in policy auto's trial; 1 not cast yet")
    table = format_table(rows).splitlines()
    assert table[0] == "fp8ops report: " + headline(rows)
    col = table[1].index("runs") + len("runs")
    assert [line[col - 13:col].strip() for line in table[3:]] == [r["runs"] for r in rows]


def test_report_says_where_a_pending_trial_stands(monkeypatch):
    """While its trial runs, a layer's first steps alternate BF16 and FP8: the
    report must say so, not show it as converted and nothing more."""
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the layer sits on the CPU here
    layer, anchor = Fp8Linear(32, 32, config=Fp8Config(policy="auto")), _layer()
    layer._fp8_pending[KEY] = gpu_only()

    def reason():
        return fp8ops.report(torch.nn.Sequential(layer), print_table=False)[0]["reason"]
    assert "M=64-79: waiting on the trial in your loop: not started" in reason()
    for _ in range(5):
        sim.step([anchor, layer])
    assert f"M=64-79: waiting on the trial in your loop: step 4 of {loop_trial.DECIDE_AT}" in reason()
    for _ in range(5, loop_trial.DECIDE_AT):
        sim.step([anchor, layer])
    assert loop_trial.decision(anchor, KEY, gpu_only())[1] is not None  # the anchor's call decides
    assert "M=64-79: the trial in your loop chose FP8; applied at its next call" in reason()


def test_a_stale_anchor_restarts_the_trial(monkeypatch):
    monkeypatch.setattr(loop_trial, "STALE_CALLS", 3)
    sim = _SimLoop(monkeypatch, {"bf16": 5.0, "fp8": 6.0}, {"bf16": 10.0, "fp8": 9.0})
    gone, kept = _layer(), _layer()
    sim.step([gone])                  # the anchor, never called again (its model was dropped)
    for i in range(2 * loop_trial.DECIDE_AT):
        got = sim.step([kept])[0]
        if got[1] is not None:
            break
    # calls 0-2 wait, call 3 finds the anchor stale and starts over as step 0, call 3 + DECIDE_AT decides
    assert i == 3 + loop_trial.DECIDE_AT and got[0] is True


# ----------------------------------------------------------------------------------------- GPU


@pytest.fixture
def fresh_policy(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8OPS_POLICY_CACHE", str(tmp_path / "policy.json"))
    monkeypatch.setattr(policy, "_timings", None)
    monkeypatch.setattr(loop_trial, "_trials", {})


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.timing
def test_measure_times_both_ways(fresh_policy):
    layer = Fp8Linear(1024, 1024, device="cuda", config=Fp8Config(policy="auto"))
    t = policy.measure(layer, 2048, torch.bfloat16)
    assert all(v > 0 for v in t), t
    # pure GPU time cannot exceed the loop's own pace by more than noise; the
    # host's enqueue time neither
    for gpu, host, alone in ((t.gpu_bf16, t.host_bf16, t.alone_bf16), (t.gpu_fp8, t.host_fp8, t.alone_fp8)):
        assert gpu <= 1.5 * alone and host <= 1.5 * alone, t
    k = policy.key(layer.weight.device, 2048, 1024, 1024, torch.bfloat16, True, setup=policy.setup_of(layer))
    assert policy.cached(k) == t and k.endswith("|delayed/hybrid/accfast/wfloat32")
    # the sleep kernel's calibration: GPU clocks are 0.5-3 GHz (a timed first launch once made it 50 MHz)
    assert 5e5 < policy._cycles_per_ms() < 3e6


def test_measure_times_a_fused_norm_on_both_sides(fresh_policy, monkeypatch):
    """A layer with a fused LayerNorm or RMSNorm is timed with that norm on both sides (the FP8
    layer fuses it, BF16 runs it before F.linear), under a key of its own; the user's norm is
    not run. Timed here by counting the timing layers' calls (the CPU has no CUDA events)."""
    seen = []
    real_normalize = fp8ops.linear._normalize

    def normalize(ln, x):
        seen.append(type(ln).__name__)
        return real_normalize(ln, x)

    def alone(fn, reps=20):
        fn()
        return 1.0

    monkeypatch.setattr(fp8ops.linear, "_normalize", normalize)
    monkeypatch.setattr(policy, "_time_alone", alone)
    monkeypatch.setattr(policy, "_time_queued", lambda fn, hint, reps=20: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "cpu")
    monkeypatch.setattr(torch.cuda, "device", lambda dev: contextlib.nullcontext())
    real_init = Fp8Linear.__init__

    def init(self, *args, **kwargs):  # the timing layers run the C reference kernels here
        real_init(self, *args, **kwargs)
        self.fp8_on_cpu = True

    monkeypatch.setattr(Fp8Linear, "__init__", init)
    fn = fp8ops.linear._Fp8LayerNormLinearFn
    real_forward, fused = fn.forward, []

    def fused_forward(ctx, *args):
        fused.append(1)
        return real_forward(ctx, *args)

    monkeypatch.setattr(fn, "forward", staticmethod(fused_forward))
    for norm, want in ((torch.nn.LayerNorm(64, bias=False, dtype=torch.float32), "ln-wfloat32"),
                       (torch.nn.RMSNorm(64, elementwise_affine=False), "rms")):
        seen.clear(), fused.clear()
        user_calls = []
        norm.register_forward_pre_hook(lambda *a: user_calls.append(1))
        layer = Fp8Linear(64, 32, config=Fp8Config(policy="auto"))
        layer.__dict__["fp8_ln_input"] = norm
        assert policy.norm_of(layer) == want
        t = policy.measure(layer, 16, torch.float32)
        assert t == policy.Timing(1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
        # both timed steps of each side ran the norm: BF16's before F.linear, FP8's fused
        assert len(seen) == 2 and len(fused) == 2, (seen, fused)
        assert not user_calls  # the user's module was copied, not run
        k = policy.key(torch.device("cpu"), 16, 64, 32, torch.float32, True, setup=policy.setup_of(layer), norm=want)
        assert policy.cached(k) == t and f"|{want}|" in k


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_measuring_leaves_the_random_generators_as_they_were(fresh_policy):
    """The timing layers' init and inputs draw random numbers: the user's seeded run must be
    the same whether the timings were on disk or not (dropout masks, data order)."""
    layer = Fp8Linear(512, 512, device="cuda", config=Fp8Config(policy="auto"))
    cpu, gpu = torch.get_rng_state(), torch.cuda.get_rng_state()
    policy.measure(layer, 256, torch.bfloat16)
    assert torch.equal(cpu, torch.get_rng_state()) and torch.equal(gpu, torch.cuda.get_rng_state())


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_a_layer_settled_bf16_everywhere_frees_its_fp8_weight():
    """The trial's FP8 steps leave the weight's FP8 cast (and its transpose) cached; a
    layer then settled BF16 for every shape it meets frees it (it measured 0.16 GiB of
    peak memory over BF16's for GPT-2 small), one with an FP8 verdict left keeps it."""
    layer = Fp8Linear(256, 512, device="cuda", config=Fp8Config(policy="auto"))
    x = torch.randn(64, 256, device="cuda")
    key = (policy.rows_bucket(64), torch.bfloat16)
    layer.fp8_policy = {key: (True, 1.5)}
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x).sum().backward()
    fp8ops.step(layer)  # (the weight cast is cached in layers an optimizer step has updated)
    for verdicts, kept in (({key: (False, 0.9), (4096, torch.bfloat16): (True, 1.5)}, True),
                           ({key: (False, 0.9)}, False)):
        layer.fp8_policy = {key: (True, 1.5)}
        layer._fp8_bf16_key = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            layer(x).sum().backward()                                    # an FP8 step
        assert layer._w_cache is not None
        layer.fp8_policy = dict(verdicts)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)                                                 # now BF16 for this shape
            ref = torch.nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(y, ref) and (layer._w_cache is not None) is kept


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_first_forward_under_inference_mode_measures(fresh_policy, mode):
    """A model's first forward may be an evaluation under inference_mode (Lightning's
    sanity check): the policy's timing, which runs a backward, must still work, and
    the layer then trains."""
    torch.manual_seed(0)
    layer = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(1024, 1024)).cuda())[0]
    x = torch.randn(2048, 1024, device="cuda")
    with getattr(torch, mode)(), torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.shape == (2048, 1024) and torch.isfinite(y).all()
    assert policy.cached(policy.key(layer.weight.device, 2048, 1024, 1024, torch.bfloat16, True,
                                    setup=policy.setup_of(layer))) is not None
    with torch.autocast("cuda", dtype=torch.bfloat16):
        layer(x).float().square().mean().backward()
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.timing
@pytest.mark.parametrize("shape, gpu_bound", [((8192, 4096, 4096), True), ((64, 128, 256), False)])
def test_trial_in_a_real_loop(fresh_policy, monkeypatch, shape, gpu_bound):
    """Both layers are said (mocked) to be faster in FP8 on the GPU only. The
    trial runs them in blocks of BF16 and FP8 steps, and keeps FP8 where the loop is
    GPU-bound (a large layer: FP8 really is faster) and BF16 where the host sets
    the pace (a tiny layer, synchronized each step: FP8's extra host time shows)."""
    monkeypatch.setattr(policy, "measure", lambda layer, M, cdtype: gpu_only())
    M, K, N = shape
    layer = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(K, N)).cuda(), config=Fp8Config(policy="auto"))[0]
    x = torch.randn(M, K, device="cuda", requires_grad=True)
    for _ in range(loop_trial.DECIDE_AT + 2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.float().square().mean().backward()
        if not gpu_bound:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    k = (M, torch.bfloat16)
    wins, speedup = layer.fp8_policy[k]
    why = layer.fp8_policy_why[k]
    assert wins is gpu_bound and speedup == pytest.approx(1.5 if gpu_bound else 0.5), why
    assert "trial in your loop" in why
    bf16_steps = 1 + 4 * loop_trial.BLOCK                           # step 0 and the four BF16 blocks
    assert layer.fp8_fallback_calls == (bf16_steps if gpu_bound else bf16_steps + 2)  # + the 2 after, if BF16 won
    assert layer.fp8_amax_history.abs().sum() > 0                     # the FP8 steps of the trial ran FP8
    assert not layer._fp8_pending and not loop_trial._trials[torch.cuda.current_device()].pending
    reason = fp8ops.report(torch.nn.Sequential(layer), print_table=False)[0]["reason"]
    label = policy.rows_label(M)
    assert (f"{label}: FP8 (" if gpu_bound else f"{label}: BF16 (") in reason and "trial in your loop" in reason


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
def test_trial_under_activation_checkpointing(fresh_policy, monkeypatch):
    """A checkpointed block recomputes its forward inside the backward. Through the
    whole trial each recomputation must take its step's path (checkpoint raises
    if the recomputed forward saves other tensors than the first did), and the
    trial must count one step per training step, not two."""
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(policy, "measure", lambda layer, M, cdtype: gpu_only())
    model = fp8ops.convert(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                               torch.nn.Linear(512, 256)).cuda(), config=Fp8Config(policy="auto"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(1024, 256, device="cuda", requires_grad=True)
    for step in range(loop_trial.DECIDE_AT + 1):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = checkpoint(model, x, use_reentrant=False)
        y.float().square().mean().backward()
        opt.step()
        opt.zero_grad()
        trial = loop_trial._trials[torch.cuda.current_device()]
        if step < loop_trial.DECIDE_AT:
            assert len(trial.marks) == step + 1          # one mark per step: recomputations mark nothing
    k = (1024, torch.bfloat16)
    for layer in (model[0], model[2]):
        assert k in layer.fp8_policy and "trial in your loop" in layer.fp8_policy_why[k]
        assert layer.fp8_fallback_calls >= 2 * (1 + 4 * loop_trial.BLOCK)  # BF16 steps: forward + recomputation
    assert torch.isfinite(x.grad).all()


def test_rows_buckets_are_quarter_octaves():
    assert [policy.rows_bucket(m) for m in (16, 48, 63, 64, 79, 80, 96, 112, 127, 128, 144)] == \
        [16, 48, 63, 64, 64, 80, 96, 112, 112, 128, 128]
    assert [policy.rows_bucket(m) for m in (4096, 4112, 5119, 5120, 7168, 8191, 8192, 32768)] == \
        [4096, 4096, 4096, 5120, 7168, 7168, 8192, 32768]
    for m in range(64, 70000, 16):   # every bucket's lowest M is a multiple of 16, within 25 % of M
        lo = policy.rows_bucket(m)
        assert lo % 16 == 0 and lo <= m < 1.25 * lo and policy.rows_bucket(lo) == lo
    assert policy.rows_label(4096) == "M=4096-5119" and policy.rows_label(48) == "M=48"


def test_one_verdict_per_bucket_of_row_counts(monkeypatch):
    """Variable-length batches: row counts within a quarter octave share one timing (of the
    bucket's lowest M) and one verdict; the next bucket is measured on its own."""
    timed = []

    def measure(layer, M, cdtype):
        timed.append(M)
        return policy.Timing(1.5, 1.0, 1.5, 1.0, 0.1, 0.1)
    monkeypatch.setattr(policy, "measure", measure)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    layer = Fp8Linear(32, 32, config=Fp8Config(policy="auto"))
    assert all(layer._fp8_pays(m, torch.bfloat16) for m in (4096, 4112, 4800, 5104, 5120, 6000))
    assert timed == [4096, 5120]
    assert set(layer.fp8_policy) == {(4096, torch.bfloat16), (5120, torch.bfloat16)}


def test_trial_runs_for_row_counts_inside_a_bucket(monkeypatch):
    """A layer whose rows are not a bucket's lowest (4112 in 4096-5119) takes the trial's
    steps: its BF16 steps are the trial's, not a settled BF16 verdict that would skip the
    policy from then on (and leave the trial at step 0). CPU, with CUDA's parts faked."""
    class FakeCuda(torch.Tensor):
        is_cuda = property(lambda self: True)

    class Event:
        def __init__(self, enable_timing=True):
            pass

        def record(self, stream=None):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 1.0

    trial = loop_trial._Trial()
    monkeypatch.setattr(loop_trial, "_trial", lambda device: trial)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(policy, "measure", lambda layer, M, cdtype: policy.Timing(1.0, 2.0, 1.5, 1.0, 0.2, 0.4))
    layer = Fp8Linear(32, 32, config=Fp8Config(policy="auto"))
    x = torch.randn(4112, 32).as_subclass(FakeCuda)
    with torch.no_grad():
        for _ in range(loop_trial.DECIDE_AT + 2):
            layer(x)
    assert not layer._fp8_pending and (4096, torch.float32) in layer.fp8_policy
    assert "trial in your loop" in layer.fp8_policy_why[(4096, torch.float32)]
