"""The training workflow on CPU: FP8 flags, prepare_model's decisions and fallbacks, and
examples/train_fp8.py end to end (train, checkpoint, resume into FP8, Ctrl-C).

    python -m pytest tests/test_training.py -q
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fp8ops
from fp8ops.training import add_fp8_args, config_from_args, portable_state_dict, prepare_model

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
from gpt2 import GPT, LM_HEAD_FILTER, GPTConfig  # noqa: E402

FP8_HERE = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def parse(*argv):
    p = argparse.ArgumentParser()
    add_fp8_args(p)
    return p.parse_args(list(argv))


def tiny_gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny"))


# ------------------------------------------------------------------------------------------------
# flags

def test_add_fp8_args_defaults():
    a = parse()
    assert a.use_fp8 is False
    assert (a.fp8_backend, a.fp8_fallback, a.fp8_recipe, a.fp8_format) == \
        ("fp8ops", "bf16", "delayed", "hybrid")
    assert (a.fp8_margin, a.fp8_interval, a.fp8_amax_history_len) == (0, 1, 1024)
    assert (a.fp8_amax_compute_algo, a.fp8_policy) == ("max", "auto")


def test_add_fp8_args_parses_every_flag():
    a = parse("--use_fp8", "--fp8_backend", "torchao", "--fp8_fallback", "fp8ops",
              "--fp8_recipe", "current", "--fp8_format", "e4m3", "--fp8_margin", "2",
              "--fp8_interval", "4", "--fp8_amax_history_len", "16",
              "--fp8_amax_compute_algo", "most_recent", "--fp8_policy", "always")
    assert a.use_fp8 and a.fp8_backend == "torchao" and a.fp8_fallback == "fp8ops"
    assert (a.fp8_recipe, a.fp8_format, a.fp8_margin, a.fp8_interval) == ("current", "e4m3", 2, 4)
    assert (a.fp8_amax_history_len, a.fp8_amax_compute_algo, a.fp8_policy) == \
        (16, "most_recent", "always")
    for backend in ("fp8ops", "torchao", "te", "bf16"):
        assert parse("--fp8_backend", backend).fp8_backend == backend


@pytest.mark.parametrize("argv", [["--fp8_backend", "msamp"], ["--fp8_format", "e3m4"],
                                  ["--fp8_amax_compute_algo", "mean"], ["--fp8_recipe", "static"]])
def test_add_fp8_args_rejects_unknown_choices(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [(["--fp8_interval", "0"], "--fp8_interval: expected an integer >= 1, found 0"),
                                        (["--fp8_amax_history_len", "-5"], "--fp8_amax_history_len: expected an integer in [1, 1048576], found -5"),
                                        (["--fp8_margin", "100"], "--fp8_margin: expected an integer in [-63, 16], found 100"),
                                        (["--fp8_margin", "20"], "--fp8_margin: expected an integer in [-63, 16], found 20"),
                                        (["--fp8_margin", "1.5"], "--fp8_margin: expected an integer, found '1.5'")])
def test_add_fp8_args_refuses_bad_values_at_parse_time(argv, said, capsys):
    """Before the model is built, and also for runs that would fall back (where Fp8Config,
    which checks them too, is never made)."""
    with pytest.raises(SystemExit):
        parse(*argv)
    assert said in capsys.readouterr().err


def test_config_from_args():
    cfg = config_from_args(parse("--fp8_recipe", "current", "--fp8_format", "e4m3",
                                 "--fp8_margin", "1", "--fp8_interval", "2",
                                 "--fp8_amax_history_len", "31",
                                 "--fp8_amax_compute_algo", "most_recent",
                                 "--fp8_policy", "always"))
    assert isinstance(cfg, fp8ops.Fp8Config)
    assert (cfg.recipe, cfg.fp8_format, cfg.margin, cfg.interval, cfg.amax_history_len,
            cfg.amax_compute_algo, cfg.policy) == ("current", "e4m3", 1, 2, 31, "most_recent", "always")


# ------------------------------------------------------------------------------------------------
# prepare_model

@pytest.mark.parametrize("argv", [[], ["--use_fp8", "--fp8_backend", "bf16"]])
def test_prepare_model_without_fp8_leaves_model_unchanged(argv):
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    types = [type(m) for m in model.modules()]
    lines = []
    out, info = prepare_model(model, parse(*argv), logger=lines.append)
    assert out is model and [type(m) for m in out.modules()] == types
    assert all(torch.equal(before[k], v) for k, v in out.state_dict().items())
    assert info["backend"] == "bf16" and info["fp8_layers"] == 0
    if not argv:
        assert info["summary"] == "bf16 (FP8 not requested)"
    assert len(lines) == 1 and lines[0].startswith("FP8: off")
    with info["autocast"]():
        pass


@pytest.mark.skipif(FP8_HERE, reason="this machine can run FP8; the fallback is for machines without")
def test_prepare_model_fp8ops_falls_back_and_says_why(recwarn):
    model = tiny_gpt()
    lines = []
    out, info = prepare_model(model, parse("--use_fp8"), logger=lines.append,
                              module_filter_fn=LM_HEAD_FILTER)
    assert info["requested"] == "fp8ops" and info["backend"] == "bf16"
    assert info["fp8_layers"] == 0 and info["reason"]
    assert all(type(m) is nn.Linear for m in out.modules() if isinstance(m, nn.Linear))
    # one plain line, carrying the reason; convert's own warning is not repeated on top of it
    assert len(lines) == 1 and lines[0].startswith("FP8: off") and info["reason"] in lines[0]
    assert not [w for w in recwarn if "fp8ops" in str(w.message)]
    x = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(out(x, x)[1])


@pytest.mark.parametrize("backend, module", [("torchao", "torchao"), ("te", "transformer_engine")])
def test_prepare_model_missing_backend_continues(backend, module, monkeypatch):
    try:
        __import__(module)
        pytest.skip(f"{module} is installed")
    except ImportError:
        pass
    model = tiny_gpt()
    lines = []
    if not torch.cuda.is_available():
        # without a GPU that is the reason given, not an install that would not help
        out, info = prepare_model(model, parse("--use_fp8", "--fp8_backend", backend), logger=lines.append)
        assert info["backend"] == "bf16" and "no CUDA GPU" in info["reason"] and "install" not in info["reason"]
        lines.clear()
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (as on a GPU machine)
    out, info = prepare_model(model, parse("--use_fp8", "--fp8_backend", backend),
                              logger=lines.append)
    assert out is model and info["backend"] == "bf16" and info["requested"] == backend
    assert "not installed" in info["reason"] and "--fp8_backend fp8ops" in info["reason"]
    assert len(lines) == 1 and "continuing in BF16" in lines[0]
    monkeypatch.undo()

    # --fp8_fallback fp8ops: hand over to fp8ops, which makes its own decision
    lines.clear()
    out, info = prepare_model(tiny_gpt(), parse("--use_fp8", "--fp8_backend", backend,
                                                "--fp8_fallback", "fp8ops"),
                              logger=lines.append, module_filter_fn=LM_HEAD_FILTER)
    assert "falling back to fp8ops" in lines[0]
    assert info["config"] is not None


def test_prepare_model_e5m2_keeps_e5m2_with_fp8ops():
    lines = []
    _, info = prepare_model(tiny_gpt(), parse("--use_fp8", "--fp8_format", "e5m2"),
                            logger=lines.append, module_filter_fn=LM_HEAD_FILTER)
    assert info["config"].fp8_format == "e5m2"
    assert not any("hybrid" in line for line in lines)


def test_prepare_model_counts_fp8_layers(monkeypatch):
    """The decision line, read back from fp8ops.report, when convert does swap layers."""
    class FakeFp8Linear(nn.Linear):
        pass

    def fake_convert(model, *, config=None, module_filter_fn=None):
        for fqn, m in list(model.named_modules()):
            if type(m) is nn.Linear and module_filter_fn(m, fqn):
                m.__class__ = FakeFp8Linear
        return model

    def fake_report(model, print_table=True):
        return [{"name": n, "backend": "fp8ops" if type(m) is FakeFp8Linear else "bf16",
                 "reason": "converted" if type(m) is FakeFp8Linear else "excluded by module_filter_fn"}
                for n, m in model.named_modules() if isinstance(m, nn.Linear)]

    monkeypatch.setattr(fp8ops, "convert_to_fp8_training", fake_convert)
    monkeypatch.setattr(fp8ops, "report", fake_report)
    lines = []
    _, info = prepare_model(tiny_gpt(), parse("--use_fp8"), logger=lines.append,
                            module_filter_fn=LM_HEAD_FILTER)
    assert info["backend"] == "fp8ops" and info["fp8_layers"] == 8
    (line,) = [line for line in lines if line.startswith("FP8: on")]  # (on a GPU machine also a note: on the CPU)
    assert "8 linear layers converted to FP8, 1 run BF16" in line  # policy auto: converted, not yet running
    assert "excluded by module_filter_fn" in line


def test_prepare_model_says_when_the_converted_model_is_on_the_cpu(monkeypatch):
    """convert checks the machine, not where the model lives: a model left on the CPU of an
    FP8 GPU machine would run every call in plain precision under an "FP8: on" line."""
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lines = []
    prepare_model(tiny_gpt(), parse("--use_fp8"), logger=lines.append, module_filter_fn=LM_HEAD_FILTER)
    assert any("weights are on the CPU" in line and "model.cuda()" in line for line in lines), lines


def test_run_summary_says_what_ran_at_the_end():
    """The end-of-run line counts what the layers ran, not what prepare_model converted:
    policy auto may have sent every converted layer to BF16 by then."""
    from fp8ops.linear import Fp8Linear
    from fp8ops.training import run_summary

    k, k8 = (16, torch.bfloat16), (8, torch.bfloat16)
    layers = [Fp8Linear(16, 16) for _ in range(5)]
    for layer in layers:
        layer.fp8_on_cpu = True                                  # (as on the GPU: not "on the CPU")
    layers[0].fp8_policy[k] = (False, 0.8)                       # auto chose BF16
    layers[1].fp8_policy.update({k: (True, 1.5), k8: (False, 0.9)})  # FP8 for one shape
    layers[2]._fp8_pending[k] = None                             # trial not finished
    # layers[3]: never cast
    layers[4]._fp8_delayed_ready = True                          # cast, no verdict (policy always)
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    line = run_summary(model, {"backend": "fp8ops", "summary": "fp8ops (5 FP8 layers, 1 BF16)"})
    assert line.startswith("fp8ops (2 of 5 converted layers ran FP8; 1 ran BF16: policy auto")
    assert "; 1 still in policy auto's trial; 1 never ran FP8; 1 not converted)" in line
    layers[1].fp8_policy[k] = (False, 0.7)
    assert "1 of 5 converted layers ran FP8; 2 ran BF16" in run_summary(model, {"backend": "fp8ops"})
    assert run_summary(model, {"backend": "bf16", "summary": "bf16 (no GPU)"}) == "bf16 (no GPU)"


def _fake_modules(monkeypatch, modules):
    """Install stand-in packages and pretend the GPU can run FP8, to test the plumbing on CPU."""
    import fp8ops.training as training
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(training, "_gpu_reason", lambda model: None)


def test_prepare_model_torchao_plumbing(monkeypatch):
    import dataclasses
    import types

    class Float8Linear(nn.Linear):
        pass

    @dataclasses.dataclass(frozen=True)
    class CastConfig:
        target_dtype: object = None

    @dataclasses.dataclass(frozen=True)
    class Float8LinearConfig:
        cast_config_grad_output: object = None

    seen = {}

    def convert_to_float8_training(model, *, module_filter_fn=None, config=None):
        seen["config"] = config
        for fqn, m in model.named_modules():
            if type(m) is nn.Linear and module_filter_fn(m, fqn):
                m.__class__ = Float8Linear
        return model

    f8 = types.SimpleNamespace(CastConfig=CastConfig, Float8LinearConfig=Float8LinearConfig,
                               convert_to_float8_training=convert_to_float8_training)
    _fake_modules(monkeypatch, {"torchao": types.ModuleType("torchao"), "torchao.float8": f8})
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 24), nn.Linear(24, 32))
    lines = []
    _, info = prepare_model(model, parse("--use_fp8", "--fp8_backend", "torchao",
                                         "--fp8_format", "e4m3"), logger=lines.append,
                            module_filter_fn=lambda m, fqn: fqn != "2")
    # 64->24 is not a multiple of 16 and "2" is filtered out: only the first layer converts
    assert [type(m).__name__ for m in model] == ["Float8Linear", "Linear", "Linear"]
    assert info["backend"] == "torchao" and info["fp8_layers"] == 1
    assert seen["config"].cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    assert any("FP8: on (torchao" in line for line in lines)


def test_prepare_model_takes_hand_made_args():
    """A Namespace with only some FP8 flags (AttributeError before), a mapping from a config
    file (read as "FP8 not requested" before, with a hint to add --use_fp8) and a backend
    outside the choices (a KeyError before) are handled or refused naming the flag."""
    import dataclasses  # noqa: PLC0415

    class Config:  # (flags as class attributes)
        use_fp8 = True
        fp8_backend = "bf16"

    @dataclasses.dataclass(slots=True)
    class Slots:
        use_fp8: bool = True
        fp8_backend: str = "bf16"
    for args in (argparse.Namespace(use_fp8=True, fp8_backend="bf16"), {"use_fp8": True, "fp8_backend": "bf16"},
                 Config(), Slots()):
        _, info = prepare_model(tiny_gpt(), args, logger=lambda s: None)
        assert info["reason"] == "--fp8_backend bf16"
    with pytest.raises(ValueError, match=r"args.fp8_backend \(--fp8_backend\) must be one of \('fp8ops', 'torchao', "
                                         r"'te', 'bf16'\), found 'TE'"):
        prepare_model(tiny_gpt(), {"use_fp8": True, "fp8_backend": "TE"}, logger=lambda s: None)
    with pytest.raises(TypeError, match="args must be the parsed arguments"):
        prepare_model(tiny_gpt(), ["--use_fp8"], logger=lambda s: None)


def test_prepare_model_torchao_fp8ops_only_flags(monkeypatch):
    """fp8ops' own flags are named as not applying under torchao, and the example's
    --fsdp_fp8_all_gather turns on torchao's FSDP2 FP8 all-gather where its config has one."""
    import dataclasses
    import types

    @dataclasses.dataclass(frozen=True)
    class Float8LinearConfig:
        enable_fsdp_float8_all_gather: bool = False

    seen = {}

    def convert_to_float8_training(model, *, module_filter_fn=None, config=None):
        seen["config"] = config
        model[0].__class__ = type("Float8Linear", (nn.Linear,), {})
        return model

    f8 = types.SimpleNamespace(CastConfig=object, Float8LinearConfig=Float8LinearConfig,
                               convert_to_float8_training=convert_to_float8_training)
    _fake_modules(monkeypatch, {"torchao": types.ModuleType("torchao"), "torchao.float8": f8})
    args = parse("--use_fp8", "--fp8_backend", "torchao", "--fp8_policy", "always")
    args.fsdp_fp8_all_gather = True
    lines = []
    _, info = prepare_model(nn.Sequential(nn.Linear(32, 64)), args, logger=lines.append)
    assert info["backend"] == "torchao" and seen["config"].enable_fsdp_float8_all_gather is True
    assert any("--fp8_policy always is fp8ops'" in line and "does not apply" in line for line in lines)
    # the default policy says nothing; a torchao without the field says the flag does not apply
    monkeypatch.setattr(f8, "Float8LinearConfig", dataclasses.make_dataclass("Float8LinearConfig", []))
    args = parse("--use_fp8", "--fp8_backend", "torchao")
    args.fsdp_fp8_all_gather = True
    lines = []
    prepare_model(nn.Sequential(nn.Linear(32, 64)), args, logger=lines.append)
    assert not any("--fp8_policy" in line for line in lines)
    assert any("no FSDP2 FP8 all-gather; --fsdp_fp8_all_gather does not apply" in line for line in lines)


def test_prepare_model_te_plumbing(monkeypatch):
    import contextlib
    import dataclasses
    import enum
    import types

    class Linear(nn.Linear):
        def __init__(self, i, o, bias=True, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, dtype=params_dtype, device=device)

    class Format(enum.Enum):
        E4M3 = 1
        HYBRID = 2

    @dataclasses.dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024
        amax_compute_algo: str = "max"

    entered = []

    @contextlib.contextmanager
    def autocast(enabled=True, recipe=None):
        entered.append(recipe)
        yield

    te = types.SimpleNamespace(Linear=Linear, autocast=autocast)
    recipe = types.SimpleNamespace(Format=Format, DelayedScaling=DelayedScaling)
    common = types.SimpleNamespace(recipe=recipe)
    _fake_modules(monkeypatch, {"transformer_engine": types.ModuleType("transformer_engine"),
                                "transformer_engine.pytorch": te,
                                "transformer_engine.common": common})
    model = tiny_gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lines = []
    model, info = prepare_model(model, parse("--use_fp8", "--fp8_backend", "te",
                                             "--fp8_amax_history_len", "16"),
                                logger=lines.append, module_filter_fn=LM_HEAD_FILTER)
    assert info["backend"] == "te" and info["fp8_layers"] == 8
    assert type(model.transformer.h[0].mlp.c_fc) is Linear and type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    after = portable_state_dict(model)
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    with info["autocast"]():
        pass
    assert entered[0].amax_history_len == 16 and entered[0].fp8_format is Format.HYBRID
    # without the filter the tied lm_head is still kept: te.Linear would untie it from the embedding
    model, lines = tiny_gpt(), []
    model, info = prepare_model(model, parse("--use_fp8", "--fp8_backend", "te"), logger=lines.append)
    assert info["fp8_layers"] == 8 and type(model.lm_head) is nn.Linear
    assert model.lm_head.weight is model.transformer.wte.weight
    assert ("FP8: lm_head stays an nn.Linear (not FP8): its parameters are tied to transformer.wte.weight, "
            "and te.Linear, which makes its own, would untie them") in lines, lines
    # where the tied layer was the only one eligible, the reason says so
    model, lines = tiny_gpt(), []
    model, info = prepare_model(model, parse("--use_fp8", "--fp8_backend", "te"), logger=lines.append,
                                module_filter_fn=lambda m, fqn: fqn == "lm_head")
    assert info["fp8_layers"] == 0 and "parameters not tied to others: lm_head" in info["reason"], info
    # a model that is one nn.Linear: the swapped layer is what comes back
    root, info = prepare_model(nn.Linear(32, 64), parse("--use_fp8", "--fp8_backend", "te"), logger=lines.append)
    assert type(root) is Linear and info["backend"] == "te" and "model" not in info


def test_portable_state_dict_drops_extra_state_and_compile_prefix():
    class WithExtra(nn.Linear):
        def get_extra_state(self):
            return torch.zeros(1)

        def set_extra_state(self, state):
            pass

    model = nn.Sequential(WithExtra(16, 16))
    assert "0._extra_state" in model.state_dict()
    wrapped = nn.Module()
    wrapped._orig_mod = model
    assert list(portable_state_dict(wrapped)) == ["0.weight", "0.bias"]


# ------------------------------------------------------------------------------------------------
# examples/train_fp8.py, as a user runs it

SMALL_RUN = ["--model", "tiny", "--batch_size", "4", "--block_size", "64", "--eval_iters", "2",
             "--log_every", "2"]


def run_example(*argv, timeout=120):
    # The child imports the same fp8ops as this test process (source tree or installed).
    env = dict(os.environ, PYTHONPATH=str(Path(fp8ops.__file__).resolve().parent.parent))
    return subprocess.run([sys.executable, str(EXAMPLES / "train_fp8.py"), *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    r = run_example(*SMALL_RUN, "--steps", "6", "--eval_every", "3", "--save_every", "3",
                    "--device", "cpu", "--out_dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r.stdout


def test_example_runs_and_writes_checkpoints(trained):
    out, stdout = trained
    for name in ("ckpt_latest.pt", "ckpt_best.pt", "ckpt_step3.pt", "ckpt_step6.pt",
                 "metrics.json"):
        assert (out / name).exists(), name
    assert "FP8: off" in stdout and "summary" in stdout
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == [1, 2, 3, 4, 5, 6] and len(m["train_loss"]) == 6
    assert m["val_steps"] == [3, 6] and all(v == v for v in m["val_loss"])
    assert m["mean_tokens_per_s"] > 0 and m["last_step"] == 6
    # (steps 1-6 logged every 2: three windows; the first, with the warm-up, is left out)
    import statistics  # noqa: PLC0415
    assert len(m["tokens_per_s"]) == 3 and m["median_tokens_per_s"] == statistics.median(m["tokens_per_s"][1:])


def test_the_best_checkpoint_holds_its_own_val_loss(trained):
    """ckpt_best.pt was saved before best_val_loss took the new value: it held the previous best
    (inf at the first evaluation), so a resume from it saved a worse model over it as "best"."""
    out, _ = trained
    best = torch.load(out / "ckpt_best.pt", map_location="cpu", weights_only=True)
    m = json.loads((out / "metrics.json").read_text())
    assert best["best_val_loss"] == m["val_loss"][m["val_steps"].index(best["step"])] == min(m["val_loss"])


def test_checkpoint_holds_the_plain_models_state(trained):
    out, _ = trained
    ckpt = torch.load(out / "ckpt_latest.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == 6 and ckpt["best_val_loss"] < float("inf")
    assert {"optimizer", "args", "rng", "model_config", "fp8_scaling"} <= set(ckpt)
    plain = GPT(GPTConfig(**ckpt["model_config"])).state_dict()
    assert list(ckpt["model"]) == list(plain)
    for k, v in plain.items():
        assert ckpt["model"][k].shape == v.shape and ckpt["model"][k].dtype == v.dtype, k


def test_resume_with_use_fp8_continues_from_saved_step(trained, tmp_path):
    out, _ = trained
    r = run_example(*SMALL_RUN, "--steps", "8", "--eval_every", "4", "--save_every", "100",
                    "--device", "cpu", "--out_dir", str(tmp_path),
                    "--resume", str(out / "ckpt_latest.pt"), "--use_fp8")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "step 6" in r.stdout and "training steps 6..8" in r.stdout
    m = json.loads((tmp_path / "metrics.json").read_text())
    assert m["steps"] == list(range(1, 9)) and m["last_step"] == 8
    assert torch.load(tmp_path / "ckpt_latest.pt", weights_only=True)["step"] == 8


def test_resume_with_nothing_to_train_leaves_the_finished_run_as_it_is(trained, tmp_path):
    """Checking a finished run (or forgetting --use_fp8 on it) must not rewrite its checkpoint
    and metrics with this invocation's flags, nor purge its last TensorBoard points."""
    out, _ = trained
    run_dir = tmp_path / "run"
    shutil.copytree(out, run_dir)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    r = run_example(*SMALL_RUN, "--steps", "6", "--device", "cpu", "--out_dir", str(run_dir), "--resume", "auto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing to train" in r.stdout
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before
    # its summary names no file it did not write, and no command that would start afresh
    assert "  checkpoints     none from this run" in r.stdout, r.stdout
    assert "continue with   the same command with --steps above 6" in r.stdout and "--resume auto" not in r.stdout


def test_resume_keeps_the_checkpoint_steps_tensorboard_points(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    common = [*SMALL_RUN, "--eval_every", "2", "--save_every", "4", "--log_every", "2", "--device", "cpu",
              "--out_dir", str(tmp_path), "--tensorboard"]
    for steps in ("4", "8"):
        r = run_example(*common, "--steps", steps, *(["--resume", "auto"] if steps == "8" else []))
        assert r.returncode == 0, r.stdout + r.stderr
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    # every step's training loss, the values metrics.json holds (not only the log steps' last)
    m = json.loads((tmp_path / "metrics.json").read_text())
    train = acc.Scalars("train/loss")
    assert [e.step for e in train] == m["steps"] == list(range(1, 9))
    assert [e.value for e in train] == pytest.approx(m["train_loss"], rel=1e-6)
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4, 6, 8]


@pytest.mark.parametrize("argv, said", [(["--block_size", "0"], "--block_size must be at least 1"),
                                        (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt: no such file"),
                                        (["--resume", "/nonexistent/ckpt.pt"], "--resume /nonexistent/ckpt.pt: no such file")])
def test_example_refuses_bad_arguments_before_building_anything(argv, said):
    r = run_example(*SMALL_RUN, "--steps", "2", "--device", "cpu", *argv)
    assert r.returncode == 2 and said in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize("argv, said", [
    (["--lr", "-1"], "--lr must be a positive number (got -1.0)"),
    (["--lr", "nan"], "--lr must be a positive number (got nan)"),
    (["--dropout", "2"], "--dropout must be in [0, 1) (got 2.0)"),
    (["--warmup_steps", "-5"], "--warmup_steps must be at least 0 (got -5)"),
    (["--n_embd", "128", "--n_head", "3"], "--n_embd 128 must be a multiple of --n_head 3"),
    (["--data", "/"], "--data /: is a directory"),
    (["--lr", "1e-3", "--min_lr", "0.5"], "--min_lr 0.5 must be at most --lr 0.001"),
    (["--warmup_steps", "5"], "--warmup_steps 5 must be at most --steps 2")])
def test_example_names_the_bad_flag(argv, said, capsys):
    """Flags torch would refuse later with a traceback (AdamW, nn.Dropout, the model) are
    refused at parse time, by name."""
    import train_fp8
    with pytest.raises(SystemExit) as e:
        train_fp8.parse_args(["--steps", "2", *argv])
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_an_out_dir_that_cannot_be_made_is_named(tmp_path):
    """--out_dir under a file (or where this user may not write) ended in a traceback from
    mkdir; it is named with the reason."""
    (tmp_path / "afile").write_text("x")
    r = run_example(*SMALL_RUN, "--steps", "2", "--device", "cpu", "--out_dir", str(tmp_path / "afile" / "sub"))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"--out_dir {tmp_path / 'afile' / 'sub'}: cannot write there (Not a directory)" in r.stderr


def test_a_resume_names_a_changed_seed_as_ignored_and_a_changed_dtype():
    """The resume restores the checkpoint's random state, so a new --seed changes nothing (it
    was listed as a change); a new --dtype was not listed."""
    import train_fp8
    args = train_fp8.parse_args(["--seed", "1", "--dtype", "bf16"])
    saved = {**vars(train_fp8.parse_args([])), "seed": 1337, "dtype": "fp32"}
    lines = train_fp8.resume_differences(args, saved, {})
    assert "--seed 1 ignored: the run keeps its seed, 1337 (its random state and validation batches continue)" in lines
    assert "--dtype bf16 (the checkpoint's run: fp32)" in lines


def test_a_head_count_the_presets_width_does_not_divide_is_refused_by_name():
    """--n_head alone, against the preset's width: refused when the config is made, which the
    example turns into a "model flags" message (it was a traceback from inside GPT())."""
    from gpt2 import GPTConfig
    with pytest.raises(ValueError, match=r"n_embd \(128\) must be a multiple of n_head \(3\)"):
        GPTConfig.preset("tiny", n_head=3)


def test_a_run_without_fp8_is_named_by_its_precision():
    """An FP32 run (the CPU) is not labelled bf16: the summary, which the example writes to
    metrics.json and its plots, names the precision the layers run in."""
    _, info = prepare_model(nn.Sequential(nn.Linear(32, 32)), parse(), logger=lambda m: None, precision="FP32")
    assert info["backend"] == "bf16" and info["summary"] == "fp32 (FP8 not requested)"
    _, info = prepare_model(nn.Sequential(nn.Linear(32, 32)), parse("--use_fp8", "--fp8_backend", "bf16"),
                            logger=lambda m: None, precision="FP32")
    assert info["summary"] == "fp32 (--fp8_backend bf16)"


def test_fallback_to_fp8ops_keeps_the_e5m2_format():
    """--fp8_format e5m2 is downgraded to hybrid for torchao / Transformer Engine only: their
    fallback to fp8ops (which emulates all-E5M2 GEMMs) keeps e5m2."""
    parser = argparse.ArgumentParser()
    fp8ops.add_fp8_args(parser)
    args = parser.parse_args(["--use_fp8", "--fp8_backend", "te", "--fp8_fallback", "fp8ops",
                              "--fp8_format", "e5m2"])
    said = []
    _, info = fp8ops.prepare_model(nn.Sequential(nn.Linear(32, 32)), args, logger=said.append)
    assert info["config"] is not None and info["config"].fp8_format == "e5m2", (info, said)
    assert any("which keeps --fp8_format e5m2" in s for s in said), said


def test_ctrl_c_during_start_up_exits_without_a_traceback(monkeypatch, tmp_path, capsys):
    import train_fp8

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_fp8, "load_data", interrupted)
    code = train_fp8.main([*SMALL_RUN, "--steps", "2", "--device", "cpu", "--out_dir", str(tmp_path),
                           "--no-tensorboard"])
    assert code == 130 and "interrupted (Ctrl-C) outside the training steps" in capsys.readouterr().err


def test_an_abort_names_the_checkpoints_it_leaves(monkeypatch, tmp_path, capsys):
    """The second Ctrl-C (a KeyboardInterrupt inside a step) saves nothing and says which
    checkpoints there are: the latest (none here) and the best, which an evaluation wrote."""
    import train_fp8
    lr_at = train_fp8.lr_at

    def interrupted_at_step_5(step, args):
        if step == 4:  # (lr_at takes the 0-based step: this is the fifth)
            raise KeyboardInterrupt
        return lr_at(step, args)
    monkeypatch.setattr(train_fp8, "lr_at", interrupted_at_step_5)
    code = train_fp8.main([*SMALL_RUN, "--steps", "20", "--eval_every", "2", "--save_every", "100",
                           "--device", "cpu", "--out_dir", str(tmp_path), "--no-tensorboard"])
    out = capsys.readouterr().out
    best = torch.load(tmp_path / "ckpt_best.pt", map_location="cpu", weights_only=True)["step"]
    assert code == 130 and not (tmp_path / "ckpt_latest.pt").exists(), out
    assert (f"aborted during step 5; last checkpoint: none from this run; best: step {best} (ckpt_best.pt)"
            in out), out


def test_a_run_stopped_before_its_first_step_names_no_files(tmp_path, capsys):
    """It wrote nothing: no paths to files that do not exist, nor to an earlier run's files in
    the same directory, nor a "continue with" that would resume that earlier run."""
    import train_fp8
    (tmp_path / "ckpt_step100.pt").write_bytes(b"an earlier run's")
    code = train_fp8.main([*SMALL_RUN, "--steps", "5", "--max_time_min", "1e-9", "--device", "cpu",
                           "--out_dir", str(tmp_path), "--tensorboard"])
    out = capsys.readouterr().out
    assert code == 0 and "stopped at step 0 of 5: --max_time_min 1e-09 reached" in out, out
    assert "  checkpoints     none" in out and "ckpt_step100" not in out and "continue with" not in out
    assert "metrics.json" not in out and "tensorboard --logdir" not in out
    assert [p.name for p in tmp_path.glob("ckpt_*.pt")] == ["ckpt_step100.pt"]
    assert not (tmp_path / "metrics.json").exists()


def test_tensorboard_gets_the_steps_after_the_last_log_step(monkeypatch, tmp_path):
    """A run stopped between two log steps (Ctrl-C, --max_time_min) still writes every step's
    training loss to TensorBoard, as metrics.json has it."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import train_fp8

    class StopBeforeStep6:
        def __init__(self, log):
            self.asked = 0

        code = 130

        @property
        def requested(self):  # asked once before each step
            self.asked += 1
            return "Ctrl-C" if self.asked > 5 else None

        def restore(self, *signals):
            pass
    monkeypatch.setattr(train_fp8, "StopOnInterrupt", StopBeforeStep6)
    code = train_fp8.main([*SMALL_RUN, "--steps", "20", "--log_every", "2", "--eval_every", "100",
                           "--device", "cpu", "--out_dir", str(tmp_path), "--tensorboard"])
    assert code == 130
    m = json.loads((tmp_path / "metrics.json").read_text())
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == m["steps"] == [1, 2, 3, 4, 5]


def test_batches_reach_every_window_of_the_data():
    """Every window of block_size + 1 bytes can be drawn, the last one too (its last byte is a
    target like any other)."""
    import train_fp8
    data = torch.arange(10, dtype=torch.uint8)
    g = torch.Generator().manual_seed(0)
    x, y = train_fp8.get_batch(data, 400, 4, g)
    assert set(x[:, 0].tolist()) == set(range(6)) and int(y.max()) == 9
    assert torch.equal(y[:, :-1], x[:, 1:])


def test_example_refuses_a_corpus_too_small_for_the_context(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    r = run_example(*SMALL_RUN, "--steps", "2", "--device", "cpu", "--out_dir", str(tmp_path), "--data", str(empty))
    assert r.returncode == 1 and "0 bytes; with a context of 64 (--block_size) it needs at least 660" in r.stderr, \
        r.stdout + r.stderr
    assert "Traceback" not in r.stderr


def test_a_diverging_run_stops_and_keeps_its_last_good_checkpoint(tmp_path):
    """A loss that is NaN or inf at a log step stops the run (exit 1) with the remedy; no
    checkpoint is written from the diverged weights, and metrics.json stays valid JSON (null
    for the non-finite losses)."""
    r = run_example(*SMALL_RUN, "--steps", "40", "--device", "cpu", "--out_dir", str(tmp_path), "--no-tensorboard",
                    "--lr", "1e4", "--grad_clip", "0", "--warmup_steps", "0", "--eval_every", "1000",
                    "--save_every", "1000")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "training diverged" in r.stdout and "Lower --lr" in r.stdout, r.stdout
    assert not (tmp_path / "ckpt_latest.pt").exists()

    def no_constants(name):
        raise AssertionError(f"metrics.json holds {name}")
    m = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=no_constants)
    assert m["train_loss"][-1] is None and m["last_step"] < 40
    # checkpoints and evaluations between log steps: none is written once a loss was not finite,
    # and the message names the first such step and the last checkpoint really written
    r = run_example(*SMALL_RUN, "--steps", "40", "--device", "cpu", "--out_dir", str(tmp_path / "often"),
                    "--no-tensorboard", "--lr", "1e6", "--grad_clip", "0", "--warmup_steps", "0",
                    "--eval_every", "1", "--save_every", "1", "--log_every", "10")
    assert r.returncode == 1, r.stdout + r.stderr
    m = json.loads((tmp_path / "often" / "metrics.json").read_text())
    first_bad = next(s for s, l in zip(m["steps"], m["train_loss"]) if l is None)
    assert f"at step {first_bad}: training diverged" in r.stdout, r.stdout
    saved = sorted(int(p.stem.removeprefix("ckpt_step")) for p in (tmp_path / "often").glob("ckpt_step*.pt"))
    assert saved == list(range(1, first_bad)), (saved, first_bad)
    assert (f"last checkpoint: step {first_bad - 1} (ckpt_latest.pt)" if first_bad > 1
            else "last checkpoint: none from this run") in r.stdout
    for name in ("ckpt_latest.pt", "ckpt_best.pt"):
        if (tmp_path / "often" / name).exists():
            ck = torch.load(tmp_path / "often" / name, weights_only=False)
            assert ck["step"] < first_bad and all(torch.isfinite(t).all() for t in ck["model"].values())


def test_resume_names_the_flags_that_differ_and_the_summary_repeats_the_run(tmp_path):
    """The summary's "continue with" line is this run's command with --resume auto; a resume
    with other recipe flags (here the default --lr) or model-shape flags says which."""
    common = [*SMALL_RUN, "--device", "cpu", "--out_dir", str(tmp_path), "--no-tensorboard", "--save_every", "2"]
    r = run_example(*common, "--steps", "2", "--lr", "1e-3")
    assert r.returncode == 0, r.stdout + r.stderr
    line = next(ln for ln in r.stdout.splitlines() if "continue with" in ln)
    assert "--lr 1e-3" in line and line.endswith("--resume auto"), line
    assert line.split("continue with")[1].split()[:2] == ["python", os.path.relpath(EXAMPLES / "train_fp8.py")]
    r = run_example(*common, "--steps", "3", "--resume", "auto", "--n_layer", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resume: --lr 0.0006 (the checkpoint's run: 0.001)" in r.stdout, r.stdout
    assert "resume: --steps 3 (the checkpoint's run: 2)" in r.stdout
    assert "resume: --n_layer 4 ignored: the model keeps the checkpoint's shape" in r.stdout
    # shape flags that match the checkpoint's model say nothing (tiny is this machine's default preset)
    r = run_example(*common, "--steps", "3", "--resume", "auto", "--arch", "gpt2", "--dropout", "0.0")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ignored" not in r.stdout, r.stdout
    r = run_example(*common, "--steps", "3", "--resume", "auto", "--model", "small")
    assert "resume: --model small ignored: the model keeps the checkpoint's shape" in r.stdout, r.stdout


def test_plot_curves_takes_a_run_stopped_before_its_first_evaluation(tmp_path, capsys):
    sys.path.insert(0, str(EXAMPLES))
    import plot_curves
    runs = []
    for name, val, ran in (("a", 2.5, "bf16 (no FP8)"), ("b", None, "fp8ops (0 of 8 converted layers ran FP8)")):
        d = tmp_path / name
        d.mkdir()
        (d / "metrics.json").write_text(json.dumps({
            "steps": [1, 2], "train_loss": [3.0, 2.9], "val_steps": [2] if val else [], "val_loss": [val] if val else [],
            "final_train_loss": 2.9, "final_val_loss": val, "backend": "fp8ops", "fp8_ran": ran, "last_step": 2}))
        runs.append(str(d / "metrics.json"))
    plot_curves.main([*runs, "-o", str(tmp_path / "c.png")])
    out = capsys.readouterr().out
    assert "b (fp8ops (0 of 8 converted layers ran FP8))" in out  # what ran, not only what was converted
    # a diverged run (its NaN losses written as null) against the others
    d = tmp_path / "c"
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps({
        "steps": [1, 2, 3], "train_loss": [3.0, None, None], "val_steps": [2], "val_loss": [None],
        "final_train_loss": None, "final_val_loss": None, "backend": "fp8ops", "fp8_ran": "fp8ops", "last_step": 3}))
    plot_curves.main([*runs, str(d / "metrics.json"), "-o", str(tmp_path / "c2.png")])
    assert (tmp_path / "c2.png").stat().st_size > 0
    assert plot_curves.smooth([1.0, float("nan"), 3.0, 5.0], 2)[3] == 4.0  # (a NaN spoils only its window)


def test_resume_from_a_file_that_is_no_checkpoint_says_so(tmp_path):
    bad = tmp_path / "notes.pt"
    torch.save({"hello": 1}, bad)
    r = run_example(*SMALL_RUN, "--steps", "2", "--device", "cpu", "--out_dir", str(tmp_path), "--resume", str(bad))
    assert r.returncode == 1 and "not readable as a checkpoint of this script" in r.stderr, r.stdout + r.stderr
    assert "ckpt_step*.pt, ckpt_best.pt" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_describes_default_corpus():
    r = run_example("--help")
    text = " ".join(r.stdout.split())  # argparse wraps lines
    assert r.returncode == 0 and "standard library" in text and "--use_fp8" in text


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT delivery differs on Windows")
@pytest.mark.parametrize("sig, name, times", [(signal.SIGINT, "Ctrl-C", 1), (signal.SIGTERM, "SIGTERM", 1),
                                              (signal.SIGTERM, "SIGTERM", 2)])
def test_ctrl_c_saves_a_checkpoint(tmp_path, sig, name, times):
    """Ctrl-C, or SIGTERM (`timeout`, a scheduler's preemption), stops after the step with a
    checkpoint; the exit status is the signal's (SIGTERM used to end the run unsaved). A second
    SIGTERM (torchrun passes its own on to workers a job-wide one reached) still saves."""
    env = dict(os.environ, PYTHONPATH=str(Path(fp8ops.__file__).resolve().parent.parent))
    err = open(tmp_path / "stderr.txt", "w")
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / "train_fp8.py"), *SMALL_RUN,
                             "--steps", "1000000", "--device", "cpu", "--out_dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    try:
        for line in proc.stdout:  # wait until the training loop has started
            if line.startswith("training steps"):
                break
        time.sleep(1.0)
        for _ in range(times):
            proc.send_signal(sig)
            time.sleep(0.005)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        err.close()
    assert proc.returncode == 128 + sig, rest
    assert f"interrupted ({name})" in rest
    ckpt = torch.load(tmp_path / "ckpt_latest.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] > 0


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """Run fp8ops' real FP8 path on the CPU (its C reference kernels), so the FP8 side of the
    workflow (scaling state in checkpoints, resume) is tested without a GPU."""
    if not fp8ops.is_available():
        pytest.skip(f"fp8ops extension not loaded: {fp8ops.why_unavailable()}")
    from fp8ops.linear import Fp8Linear
    conversion = sys.modules[fp8ops.convert_to_fp8_training.__module__]
    monkeypatch.setattr(conversion, "fp8_supported_here", lambda device=None: (True, "ok"))
    init = Fp8Linear._init_fp8_state

    def init_on_cpu(self, config):
        init(self, config)
        self.fp8_on_cpu = True

    monkeypatch.setattr(Fp8Linear, "_init_fp8_state", init_on_cpu)


def test_fp8_checkpoints_resume_both_ways(fp8_on_cpu, tmp_path, capsys):
    import train_fp8
    common = SMALL_RUN + ["--device", "cpu", "--out_dir", str(tmp_path), "--no-tensorboard",
                          "--eval_every", "2", "--save_every", "2"]
    assert train_fp8.main(common + ["--steps", "2", "--use_fp8"]) == 0
    out = capsys.readouterr().out
    assert "FP8: on (fp8ops" in out and "8 linear layers converted to FP8" in out
    assert "FP8             fp8ops (8 of 8 converted layers ran FP8; 1 not converted)" in out
    ran = json.loads((tmp_path / "metrics.json").read_text())["fp8_ran"]
    assert ran == "fp8ops (8 of 8 converted layers ran FP8; 1 not converted)"
    ckpt = torch.load(tmp_path / "ckpt_latest.pt", map_location="cpu", weights_only=True)
    assert ckpt["fp8_backend"] == "fp8ops" and ckpt["fp8_scaling"]
    plain = GPT(GPTConfig(**ckpt["model_config"])).state_dict()
    assert list(ckpt["model"]) == list(plain)
    assert all(ckpt["model"][k].dtype == v.dtype for k, v in plain.items())

    assert train_fp8.main(common + ["--steps", "4", "--use_fp8", "--resume", "auto"]) == 0
    assert "FP8 scaling state restored" in capsys.readouterr().out
    assert train_fp8.main(common + ["--steps", "5", "--resume", "auto"]) == 0  # FP8 -> BF16
    out = capsys.readouterr().out
    assert "FP8 scaling state is not used" in out and "training steps 4..5" in out


def test_deterministic_flag_repeats_an_fp8_run_exactly(fp8_on_cpu, tmp_path, capsys):
    """--deterministic: two identical runs (FP8 path, CPU kernels) log identical losses. The
    flag sets process-wide torch switches, restored here so later tests are unaffected. Under
    the default policy "auto" it says that the GPU's timings may settle layers differently."""
    import json

    import train_fp8
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
             torch.backends.cuda.cudnn_sdp_enabled())
    try:
        losses = []
        for run in ("a", "b"):
            out = tmp_path / run
            assert train_fp8.main(SMALL_RUN + ["--device", "cpu", "--out_dir", str(out), "--no-tensorboard",
                                               "--steps", "4", "--eval_every", "4", "--use_fp8",
                                               "--deterministic"]) == 0
            losses.append(json.loads((out / "metrics.json").read_text())["train_loss"])
        assert losses[0] == losses[1] and len(losses[0]) == 4
        assert capsys.readouterr().out.count("for runs that repeat bit for bit add --fp8_policy always") == 2
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
        torch.backends.cuda.enable_flash_sdp(saved[4])
        torch.backends.cuda.enable_mem_efficient_sdp(saved[5])
        torch.backends.cuda.enable_cudnn_sdp(saved[6])


def test_delayed_scaling_flags_under_current_scaling_are_named_as_unused(fp8_on_cpu):
    """--fp8_recipe current reads none of the delayed-scaling flags: those set are named (torchao's
    path said so; fp8ops' was silent)."""
    lines = []
    prepare_model(tiny_gpt(), parse("--use_fp8", "--fp8_recipe", "current", "--fp8_interval", "5",
                                    "--fp8_amax_history_len", "16"), logger=lines.append)
    assert any("--fp8_interval, --fp8_amax_history_len apply to delayed scaling only" in x for x in lines), lines
    lines.clear()
    prepare_model(tiny_gpt(), parse("--use_fp8", "--fp8_recipe", "current"), logger=lines.append)
    assert not any("delayed scaling only" in x for x in lines), lines


def test_prepare_model_names_a_misspelt_fp8_key_of_a_mapping():
    """A config file's misspelt key ran at the flag's default, silently."""
    with pytest.warns(UserWarning, match=r"args has 'fp8_backnd', which no FP8 flag reads"):
        prepare_model(tiny_gpt(), {"use_fp8": True, "fp8_backnd": "te"}, logger=lambda *_: None)


def test_plot_curves_says_when_runs_differ_and_refuses_a_missing_folder(tmp_path, capsys):
    import plot_curves
    paths = []
    for name, last in (("a", 20), ("b", 10)):
        m = {"steps": list(range(1, last + 1)), "train_loss": [1.0] * last, "val_steps": [], "val_loss": [],
             "last_step": last, "tokens_per_step": 256, "final_train_loss": 1.0}
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(m))
    plot_curves.main([str(p) for p in paths] + ["-o", str(tmp_path / "c.png")])
    assert "differs from the first run in its last step (10 vs 20)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        plot_curves.main([str(p) for p in paths] + ["-o", str(tmp_path / "no" / "c.png")])
    assert "the folder" in capsys.readouterr().err
