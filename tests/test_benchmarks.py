"""The benchmark scripts' own logic on the CPU (bench_linear: variants, validation
against BF16, the compiled-vs-eager targets, the JSON and the table; bench_train: a
tiny GPT in BF16 and FP8). The GPU runs them for their numbers; CI has no GPU, so
here the FP8 layers run on fp8ops' CPU reference kernels and CUDA events are stood
in for by the host clock. Policy "auto" acts on CUDA inputs only: on the CPU the
fp8ops_auto variant runs the FP8 path like "always", and no verdict is recorded."""
import importlib
import json
import math
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from fp8ops.linear import Fp8Linear

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


class _HostEvent:
    """torch.cuda.Event on the host clock (ms), enough for the benchmark's timing loops."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3

    def synchronize(self):
        pass


def _convert_on_cpu(model, config=None, **_):
    """fp8ops.convert as the GPU would do it, with the layer on the CPU kernels."""
    new = Fp8Linear.from_linear(model, config)
    new.fp8_on_cpu = True
    return new


@pytest.fixture(autouse=True)
def _keep_dynamo_limit():
    """bench_train makes torch._dynamo fail at its recompile limit for its process: undone
    after the test."""
    cfg = torch._dynamo.config
    saved = cfg.fail_on_recompile_limit_hit
    yield
    cfg.fail_on_recompile_limit_hit = saved


@pytest.fixture
def bench_linear(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    mod = importlib.import_module("bench_linear")
    monkeypatch.setattr(mod, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "start", lambda path: {"gpu": "none (CPU test)"})
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    import fp8ops
    monkeypatch.setattr(fp8ops, "convert", _convert_on_cpu)
    return mod


@pytest.mark.parametrize("timing", ["loop", "bursts"])
def test_bench_linear_runs_every_fp8ops_variant_and_reports(bench_linear, tmp_path, monkeypatch, capsys, timing):
    out = tmp_path / "linear.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_linear.py", "--shapes", "64x64x64,64x128x64", "--variants",
        "bf16,bf16_compiled,fp8ops,fp8ops_compiled,fp8ops_auto", "--no-ceiling", "--reps", "4",
        "--rounds", "2", "--warmup", "3", "--timing", timing, "--json", str(out)])
    assert bench_linear.main() == 0
    result = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert not result["validation_failures"] and "All results match" in printed
    assert len(result["rows"]) == 2
    for row in result["rows"]:
        assert not row["errors"], row["errors"]
        for v in ("bf16", "bf16_compiled", "fp8ops", "fp8ops_compiled", "fp8ops_auto"):
            assert row[f"{v}_ms"] > 0 and row[f"{v}_speedup"] > 0, v
        # the FP8 layers were validated against BF16 (e4m3/e5m2 on random data: ~25-30 dB)
        assert 20 < row["validation"]["fp8ops"]["sqnr_y"] < 40
        assert row["validation"]["bf16_compiled"]["sqnr_y"] > 100   # the same BF16 math, compiled
    compiled = [t for t in result["targets"] if t["what"].startswith("fp8ops compiled >= fp8ops eager")]
    assert len(compiled) == 2 and all(t["bf16_compiled_vs_eager"] > 0 for t in compiled)
    assert all(t["verdict"] in ("PASS", "MISS") for t in compiled)
    assert "BF16 compiled vs eager:" in printed and "bf16 cmp x" in printed
    for row in result["rows"]:  # the host's queuing time: measured in loops, not in bursts
        assert (row["fp8ops_host_ms"] > 0) if timing == "loop" else (row["fp8ops_host_ms"] is None)


@pytest.mark.parametrize("gpu_lag, bound", [(1.0, True), (20.0, False)])
def test_bench_linear_says_whether_a_target_row_was_host_bound(bench_linear, tmp_path, monkeypatch, capsys,
                                                                gpu_lag, bound):
    """Each target line says whether fp8ops was host-bound there: the host's time to queue an
    iteration against the iteration's span. Events on the host clock make the loop host-bound
    (queuing is the whole span); events that read gpu_lag times longer stand for a GPU that
    took 20x the host's time (GPU-bound)."""
    class LaggingEvent(_HostEvent):
        def elapsed_time(self, end):
            return super().elapsed_time(end) * gpu_lag
    monkeypatch.setattr(torch.cuda, "Event", LaggingEvent)
    monkeypatch.setattr(bench_linear, "TARGETS", {(64, 64, 64): 0.01})
    out = tmp_path / "linear.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_linear.py", "--shapes", "64x64x64", "--variants", "bf16,fp8ops", "--no-ceiling",
        "--reps", "4", "--rounds", "2", "--warmup", "3", "--json", str(out)])
    assert bench_linear.main() == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["fp8ops_host_bound"] is bound and row["bf16_host_bound"] is bound
    # per iteration, as the span is: host-clock events make them equal, the lagging ones 20x apart
    assert 0.8 < row["fp8ops_host_ms"] * gpu_lag / row["fp8ops_ms"] < 1.25
    (t,) = [t for t in result["targets"] if t["what"].startswith("fp8ops eager vs BF16 eager")]
    assert t["host_bound"] is bound and 0 < t["fp8ops_host_ms"] and t["fp8ops_ms"] == row["fp8ops_ms"]
    printed = capsys.readouterr().out
    assert ("(host-bound: queuing an iteration took" in printed) is bound
    assert ("(GPU-bound: queuing an iteration took" in printed) is not bound
    table_rows = printed.split("fp8ops host ms")[-1]  # (after the table's header: its rows)
    assert ("(bound)" in table_rows) is bound


def test_bench_linear_graph_variants_report_what_torch_skipped(bench_linear, tmp_path, monkeypatch, capsys):
    """The CUDA-graph variants (compile mode="reduce-overhead") run, validate, and get the
    graphs-vs-eager entry; on the CPU torch runs them without CUDA graphs, which the row and
    the verdict say (never a graphs number that had no graphs)."""
    out = tmp_path / "linear.json"
    monkeypatch.setattr(sys, "argv", [
        "bench_linear.py", "--shapes", "64x64x64", "--variants", "bf16,fp8ops,bf16_graphs,fp8ops_graphs",
        "--no-ceiling", "--reps", "2", "--rounds", "1", "--warmup", "3", "--json", str(out)])
    assert bench_linear.main() == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert not row["errors"], row["errors"]
    assert row["fp8ops_graphs_ms"] > 0 and row["bf16_graphs_ms"] > 0
    assert 20 < row["validation"]["fp8ops_graphs"]["sqnr_y"] < 40
    assert row["validation"]["bf16_graphs"]["sqnr_y"] > 100
    assert row["cudagraph_skips"].get("fp8ops_graphs", 0) > 0   # CPU tensors: no CUDA graphs
    (t,) = [t for t in result["targets"] if t["what"].startswith("fp8ops graphs")]
    assert t["verdict"] == "NO-GRAPHS" and t["bf16_graphs_vs_eager"] > 0
    printed = capsys.readouterr().out
    assert "torch skipped CUDA graphs" in printed and "fp8ops graphs x" in printed


def test_bench_linear_meets_no_target_with_outputs_that_do_not_match(bench_linear, tmp_path, monkeypatch):
    """A variant whose validation failed (here: the bound raised out of FP8's reach) is timed and
    marked, and its targets read INVALID where the time alone would pass."""
    out = tmp_path / "linear.json"
    monkeypatch.setattr(bench_linear, "SQNR_Y", 1000.0)
    monkeypatch.setattr(bench_linear, "COMPILE_TOLERANCE", 100.0)  # (the time alone passes)
    monkeypatch.setattr(sys, "argv", [
        "bench_linear.py", "--shapes", "64x64x64", "--variants", "bf16,fp8ops,fp8ops_compiled", "--no-ceiling",
        "--reps", "2", "--rounds", "1", "--warmup", "3", "--json", str(out)])
    assert bench_linear.main() == 1  # (a validation failure is the script's failure)
    result = json.loads(out.read_text())
    assert result["validation_failures"]
    (t,) = [t for t in result["targets"] if t["what"].startswith("fp8ops compiled >= fp8ops eager")]
    assert t["verdict"] == "INVALID"


def _convert_model_on_cpu(model, config=None, module_filter_fn=None):
    """fp8ops.convert of a whole model, every eligible nn.Linear onto the CPU kernels, and its
    GELUs fused as the config says (not its LayerNorms)."""
    from fp8ops.gelu_fusion import fuse_gelu  # noqa: PLC0415
    for name, parent in list(model.named_modules()):
        for cname, child in list(parent.named_children()):
            fqn = f"{name}.{cname}" if name else cname
            if (type(child) is torch.nn.Linear and child.in_features % 16 == 0 and child.out_features % 16 == 0
                    and (module_filter_fn is None or module_filter_fn(child, fqn))):
                setattr(parent, cname, _convert_on_cpu(child, config))
    if config is None or config.fuse_gelu:
        fuse_gelu(model)
    return model


def _bench_train_on_cpu(monkeypatch, n_layer: int):
    """bench_train with a tiny GPT on the CPU kernels, CUDA's timing and memory calls stood in."""
    monkeypatch.syspath_prepend(str(BENCH))
    bench = importlib.import_module("bench_train")
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "MODELS", {"small": dict(cfg=dict(n_layer=n_layer, n_head=2, n_embd=64, block_size=32),
                                                        batch=2)})
    monkeypatch.setattr(bench, "VOCAB", 256)
    monkeypatch.setattr(bench, "start", lambda path: {"gpu": "none (CPU test)"})
    for name, stub in (("Event", _HostEvent), ("synchronize", lambda *a, **k: None),
                       ("reset_peak_memory_stats", lambda *a, **k: None), ("max_memory_allocated", lambda *a, **k: 1)):
        monkeypatch.setattr(torch.cuda, name, stub)
    import fp8ops
    monkeypatch.setattr(fp8ops, "convert", _convert_model_on_cpu)
    return bench


def _run_bench_train(bench, monkeypatch, tmp_path, *argv) -> tuple:
    """(main's exit status, its JSON result) of bench_train with these arguments, for the model
    "small" under policy "always"."""
    out = tmp_path / "train.json"
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--models", "small", "--fp8-policy", "always", *argv,
                                      "--json", str(out)])
    rc = bench.main()
    return rc, json.loads(out.read_text())


def test_bench_train_runs_a_tiny_gpt_in_fp8_and_validates_it(monkeypatch, tmp_path, capsys):
    bench = _bench_train_on_cpu(monkeypatch, n_layer=2)
    rc, result = _run_bench_train(bench, monkeypatch, tmp_path, "--variants", "bf16,fp8ops,fp8ops_lmhead",
                                  "--steps", "3", "--warmup", "4")
    assert rc == 0
    rows = {r["variant"]: r for r in result["rows"]}
    assert set(rows) == {"bf16", "fp8ops", "fp8ops_lmhead"} and not result["validation_failures"]
    # the tied lm_head converted too, still tied (the validation's gradients are those of one weight)
    assert rows["fp8ops_lmhead"]["note"].startswith("9/9 linears Fp8Linear") and rows["fp8ops_lmhead"]["valid"]
    assert rows["fp8ops_lmhead"]["fp8_layers_ran"] == 9
    fp8 = rows["fp8ops"]
    assert fp8["valid"] and fp8["tokens_per_s"] > 0 and fp8["note"].startswith("8/9 linears Fp8Linear")
    assert fp8["fp8_layers_ran"] == 8 and "; 8 ran FP8" in fp8["note"]
    assert fp8["warmup_losses"] != rows["bf16"]["warmup_losses"]   # FP8 numerics, not the BF16 path again
    assert any(t["what"].startswith("small: fp8ops vs bf16 tokens/s") for t in result["targets"])
    assert re.search(r"small \| +fp8ops +\|", capsys.readouterr().out)
    # after the warm-up, the settled path against BF16 from the same weights: FP8's rounding, not BF16's bits
    assert 10 < fp8["settled_check"]["grad_sqnr_db"] < 60, fp8["settled_check"]
    assert rows["bf16"]["settled_check"]["grad_sqnr_db"] > 100


@pytest.mark.parametrize("eager_loss", [False, True], ids=["loss_compiled", "loss_eager"])
def test_bench_train_compiles_ten_blocks_into_two_graphs_and_the_loss_apart(monkeypatch, tmp_path, eager_loss):
    """Compile scope "blocks" with torch's recompile limit (8) and more blocks than that: every
    block shares fp8ops' two graphs (delayed scaling's first step, the steps after), and the
    row says so; a block past the limit would fail the row, not time eager code. The loss is
    one graph more, unless --eager-loss. The row also counts the GELU gradients inductor's pass
    fused."""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=10)
    limit = torch._dynamo.config.recompile_limit
    with torch.compiler.config.patch(force_disable_caches=True):  # (a cached graph runs no pass)
        rc, result = _run_bench_train(bench, monkeypatch, tmp_path, "--variants", "fp8ops_compiled", "--steps", "2",
                                      "--warmup", "3", *(["--eager-loss"] if eager_loss else []))
    assert rc == 0
    (row,) = [r for r in result["rows"] if r["variant"] == "fp8ops_compiled"]
    assert row["valid"] and row["fp8_layers_ran"] == 40, row
    graphs = 2 if eager_loss else 3
    assert row["graphs"] == graphs and f"; {graphs} graph(s)" in row["note"], row
    # (the blocks' one delayed-scaling backward graph: its MLP's GELU gradient in c_fc's cast)
    assert row["gelu_grads_fused"] == 1 and row["inductor_cache_hits"] == 0, row
    # (and its attention's q, k, v gradients read in place by c_attn's cast)
    assert row["cat_grads_fused"] == 1, row
    assert torch._dynamo.config.recompile_limit == limit  # (torch's, not raised for the run)


def test_bench_train_compiled_autograd_trains_the_compiled_variants_under_it(monkeypatch, tmp_path):
    """--compiled-autograd: the compiled variants' steps run under compiled autograd (its
    captures counted in the row, which says so), train FP8 and validate; the eager ones do not."""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    with torch.compiler.config.patch(force_disable_caches=True):
        rc, result = _run_bench_train(bench, monkeypatch, tmp_path, "--variants", "fp8ops,fp8ops_compiled",
                                      "--steps", "2", "--warmup", "3", "--compiled-autograd")
    assert rc == 0 and not result["validation_failures"]
    rows = {r["variant"]: r for r in result["rows"]}
    row = rows["fp8ops_compiled"]
    assert row["valid"] and row["fp8_layers_ran"] == 4 and row["compiled_autograd_captures"] >= 1, row
    assert "compiled autograd" in row["note"] and "compiled_autograd_captures" not in rows["fp8ops"]


def test_bench_train_compile_scope_model_keeps_the_loss_in_the_models_graph(monkeypatch, tmp_path, capsys):
    """--compile-scope model: one compiled model, the loss inside its graph (GPT.forward's), so no
    graph of its own (fp8ops: its two, delayed scaling's first step and the steps after); the
    variant trains like BF16. --eager-loss with it is refused, naming both flags."""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    rc, result = _run_bench_train(bench, monkeypatch, tmp_path, "--variants", "fp8ops_compiled", "--steps", "2",
                                  "--warmup", "3", "--compile-scope", "model")
    assert rc == 0
    (row,) = [r for r in result["rows"] if r["variant"] == "fp8ops_compiled"]
    assert row["valid"] and row["graphs"] == 2, row
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--models", "small", "--compile-scope", "model",
                                      "--eager-loss"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        bench.main()
    err = capsys.readouterr().err
    assert "--eager-loss" in err and "--compile-scope model" in err, err


def test_bench_train_repeats_in_alternating_order_and_pairs_ratios_within_a_repeat(monkeypatch, tmp_path, capsys):
    """--repeats 2: every variant twice, from fresh builds, the second pass in reverse order; each
    ratio pairs rows of one pass, and the target is the median of those ratios."""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    rc, result = _run_bench_train(bench, monkeypatch, tmp_path, "--variants", "bf16,fp8ops", "--steps", "2",
                                  "--warmup", "2", "--repeats", "2")
    assert rc == 0
    assert [(r["variant"], r["repeat"]) for r in result["rows"]] == \
        [("bf16", 0), ("fp8ops", 0), ("fp8ops", 1), ("bf16", 1)]
    assert all(r["valid"] for r in result["rows"]) and not result["validation_failures"]
    by = {(r["variant"], r["repeat"]): r for r in result["rows"]}
    per = [by[("fp8ops", i)]["tokens_per_s"] / by[("bf16", i)]["tokens_per_s"] for i in (0, 1)]
    assert [by[("fp8ops", i)]["speedup_vs_bf16_same_mode"] for i in (0, 1)] == pytest.approx(per)
    tokens = next(t for t in result["targets"] if t["what"].startswith("small: fp8ops vs bf16 tokens/s"))
    assert tokens["per_repeat"] == pytest.approx(per) and tokens["value"] == pytest.approx(sum(per) / 2)
    text = capsys.readouterr().out
    assert "-- repeat 2 of 2: fp8ops, bf16" in text and "fp8ops #2" in text and "(median of " in text


def test_bench_train_refuses_zero_repeats(monkeypatch):
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--repeats", "0"])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2


def _bench_train_with_settled_bounds(monkeypatch, tmp_path, min_db: float, max_deficit_db: float):
    """bench_train on the CPU (bf16 and fp8ops) with the settled check's bounds set: (main's
    exit status, the JSON result, the module)."""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    monkeypatch.setattr(bench, "SETTLED_MIN_SQNR_DB", min_db)
    monkeypatch.setattr(bench, "SETTLED_MAX_DEFICIT_DB", max_deficit_db)
    rc, result = _run_bench_train(bench, monkeypatch, tmp_path, "--variants", "bf16,fp8ops", "--steps", "2",
                                  "--warmup", "2")
    return rc, result, bench


def test_bench_train_marks_a_variant_whose_settled_path_disagrees(monkeypatch, tmp_path):
    """The settled check fails the row (and lists it) where the gradients do not match BF16's
    to the bound and FP32 does not acquit them; here both bounds are out of FP8's reach."""
    rc, result, _ = _bench_train_with_settled_bounds(monkeypatch, tmp_path, 100.0, 0.0)
    assert rc == 1  # (a validation failure is the script's failure)
    rows = {r["variant"]: r for r in result["rows"]}
    assert rows["bf16"]["valid"] and not rows["fp8ops"]["valid"]
    assert any("settled path vs BF16" in f for f in result["validation_failures"])
    chk = rows["fp8ops"]["settled_check"]
    assert chk["verdict"] == "fail" and chk["fp8_vs_fp32_db"] < chk["bf16_vs_fp32_db"]  # the FP32 pass ran


def test_bench_train_settled_check_is_inconclusive_where_bf16_itself_is_far_from_fp32(monkeypatch, tmp_path, capsys):
    """Where FP8 misses the bound against BF16 but BF16's own gradients are too far from FP32's
    for the comparison to mean anything (here: bounds of 100 and 60 dB, so that BF16's ~47 dB
    against FP32 falls under their sum, 160, and no parameter counts as sound) and FP8's SQNR
    against FP32 is at most 60 dB below BF16's, the check says so instead of failing."""
    rc, result, bench = _bench_train_with_settled_bounds(monkeypatch, tmp_path, 100.0, 60.0)
    assert rc == 0
    rows = {r["variant"]: r for r in result["rows"]}
    chk = rows["fp8ops"]["settled_check"]
    assert rows["fp8ops"]["valid"] and chk["verdict"] == "inconclusive", chk
    assert chk["bf16_vs_fp32_db"] - bench.SETTLED_MAX_DEFICIT_DB <= chk["fp8_vs_fp32_db"] < chk["bf16_vs_fp32_db"]
    assert rows["bf16"]["settled_check"]["verdict"] == "pass" and chk["sound_params"] == 0
    assert rows["fp8ops"]["note"].endswith("; settled check inconclusive") and len(result["validation_inconclusive"]) == 1
    out = capsys.readouterr().out
    assert "INCONCLUSIVE: BF16's own gradients have an SQNR of" in out and "validation inconclusive" in out


_LOW = {"grad_sqnr_db": 2.7, "loss": 12.524, "loss_bf16": 12.520}  # an H100 1B run's check, FP8 vs BF16


@pytest.mark.parametrize("chk, verdict", [
    ({"grad_sqnr_db": 30.0, "loss": 10.0, "loss_bf16": 10.01}, "pass"),
    ({"grad_sqnr_db": 3.0, "loss": 10.0, "loss_bf16": 10.01}, None),  # the FP32 pass is needed
    # a loss off by more than 2 % (or NaN) fails at once, with no FP32 pass
    ({"grad_sqnr_db": 30.0, "loss": 11.0, "loss_bf16": 10.0}, "fail"),
    ({"grad_sqnr_db": 2.7, "loss": float("nan"), "loss_bf16": 10.0}, "fail"),
    # BF16 close to FP32: the reference is sound and FP8's 3 dB a failure
    ({"grad_sqnr_db": 3.0, "loss": 10.0, "loss_bf16": 10.01, "bf16_vs_fp32_db": 46.0, "fp8_vs_fp32_db": 3.0}, "fail"),
    # BF16 itself 6.4 dB from FP32, FP8 2.4 dB (that H100 run): nothing to validate against ...
    ({**_LOW, "bf16_vs_fp32_db": 6.4, "fp8_vs_fp32_db": 2.4, "sound_params": 0}, "inconclusive"),
    ({**_LOW, "bf16_vs_fp32_db": 6.4, "fp8_vs_fp32_db": 2.4, "sound_params": 40, "sound_bf16_vs_fp32_db": 45.0,
      "sound_fp8_vs_fp32_db": 30.0}, "inconclusive"),
    # ... unless FP8 is far off where BF16 is sound (a broken backward reads ~0 dB there) ...
    ({**_LOW, "bf16_vs_fp32_db": 6.4, "fp8_vs_fp32_db": 2.4, "sound_params": 40, "sound_bf16_vs_fp32_db": 45.0,
      "sound_fp8_vs_fp32_db": 0.5}, "fail"),
    # ... or far beyond its usual deficit over the whole model, or not a number, or unarbitrated
    ({**_LOW, "bf16_vs_fp32_db": 16.0, "fp8_vs_fp32_db": -12.0, "sound_params": 0}, "fail"),
    ({**_LOW, "bf16_vs_fp32_db": 6.4, "fp8_vs_fp32_db": float("nan"), "sound_params": 0}, "fail"),
    ({**_LOW, "grad_sqnr_db": -math.inf, "arbiter_error": "out of memory in the FP32 pass"}, "fail"),
])
def test_settled_verdict(monkeypatch, chk, verdict):
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    assert bench.settled_verdict(chk) == verdict


def test_grad_sqnr_reads_a_nan_or_inf_gradient_as_all_error(monkeypatch):
    """(noise NaN used to read as no noise: inf dB, a pass)"""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    ref = {"w": torch.ones(4), "b": torch.ones(2)}
    for bad in (float("nan"), float("inf")):
        overall, per_param = bench.grad_sqnr({"w": torch.tensor([1.0, bad, 1.0, 1.0]), "b": torch.ones(2)}, ref)
        assert overall == -math.inf and dict((n, db) for db, n in per_param) == {"w": -math.inf, "b": math.inf}
    assert bench.grad_sqnr({"w": torch.ones(4) * 1.1, "b": torch.ones(2) * 1.1}, ref)[0] == pytest.approx(20.0)


def test_model_grads_in_unequal_slices_is_the_whole_batch(monkeypatch):
    """The FP32 arbiter's pass in slices: 5 rows in slices of 2, 2 and 1 give the whole batch's
    loss and gradients (each slice weighted by its share of the rows)."""
    bench = _bench_train_on_cpu(monkeypatch, n_layer=1)
    GPT, GPTConfig, _, _ = bench.import_gpt()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64, dropout=0.0))
    batch = (torch.randint(0, 64, (5, 16)), torch.randint(0, 64, (5, 16)))
    loss1, g1 = bench.model_grads(model, model, batch, autocast=False)
    g1 = bench.grads_to_cpu(g1)
    loss4, g4 = bench.model_grads(model, model, batch, autocast=False, slices=4)
    assert loss4 == pytest.approx(loss1, rel=1e-6) and g4.keys() == g1.keys()
    for n in g1:
        torch.testing.assert_close(g4[n], g1[n], rtol=1e-4, atol=1e-7)
    overall, _ = bench.grad_sqnr(g4, g1)
    assert overall > 80
