"""torch.compile with row counts that change from call to call (variable sequence lengths):
torch makes the row count symbolic from the second length on (or from the first, with
dynamic=True), and one graph should then serve every length. A converted layer that
specialized its row count would recompile the model at each new length, until torch's
recompile limit (8 graphs per frame) sends it back to eager for the rest of the run.

CPU tests run the C reference kernels (policy "always"); the CUDA case runs policy "auto"
with verdicts set by hand, so that no timing runs."""
import copy

import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters

import fp8ops
from fp8ops import Fp8Config
from fp8ops._reference import sqnr
from fp8ops.linear import Fp8Linear
from fp8ops.policy import rows_bucket

from conftest import FP8_DEVICES, convert_as_on_fp8_gpu
from test_rmsnorm_fusion import LlamaBlock


class GptBlock(nn.Module):
    """Pre-LayerNorm MLP with a tanh GELU: the LayerNorm and the GELU both fuse."""

    def __init__(self, d=64):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(self.gelu(self.fc(self.ln(x))))


# batch 2: rows 2 * T, every one a multiple of 16 (cuBLASLt's FP8 GEMMs want M % 16 == 0), in
# ten quarter-octave buckets of policy "auto" (64 ... 320 rows); 12 lengths, more than torch's
# recompile limit
LENGTHS = (32, 40, 48, 56, 64, 72, 80, 96, 112, 128, 144, 160)
FLIP_AT = 128  # the "mixed" layer's verdicts: BF16 below this many rows, FP8 from it on


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _compiled_verdict_fn(layer, cdtype):
    def f(x):
        return x * (2.0 if layer._fp8_pays(x.shape[0], cdtype, torch.compiler.is_compiling()) else 3.0)
    return f


@pytest.mark.parametrize("verdicts, flips", [
    ({}, 0),
    ({64: False, 96: False, 256: False}, 0),
    ({64: True, 128: True}, 0),
    ({64: False, 96: False, 128: True, 4096: True}, 1),
    ({64: True, 128: False, 4096: True}, 2),
])
def test_compiled_policy_needs_no_graph_per_row_count(monkeypatch, verdicts, flips):
    """Compiled code reads policy "auto"'s verdicts as a step function of the row count: the
    verdict of the highest settled bucket at or below it (the lowest bucket's below all), FP8
    with no verdict. Only the counts where the verdict changes are compared with the symbolic
    row count, so a layer needs one graph per run of equal verdicts, however many lengths come."""
    monkeypatch.setattr("fp8ops.conversion.fp8_supported_here", lambda device=None: (True, "ok"))
    layer = fp8ops.convert(nn.Linear(16, 16), config=Fp8Config(policy="auto"))
    layer.fp8_policy.update({(lo, torch.bfloat16): (wins, 1.4 if wins else 0.9) for lo, wins in verdicts.items()})
    layer.fp8_policy[(64, torch.float16)] = (False, 0.9)  # another dtype's verdict: not read
    rows = (64, 80, 96, 130, 200, 1000, 4096, 5000, 9000)

    def expected(M):
        marks = sorted(verdicts.items())
        below = [wins for lo, wins in marks if lo <= M]
        return below[-1] if below else (marks[0][1] if marks else True)

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_compiled_verdict_fn(layer, torch.bfloat16), dynamic=True, fullgraph=True)
    got = [f(torch.ones(M, 2))[0, 0].item() == 2.0 for M in rows]
    assert got == [expected(M) for M in rows]
    assert _graphs() == flips + 1, f"{_graphs()} graphs for {len(rows)} row counts and {flips} verdict changes"
    # (eager code, with M an int, still reads the exact bucket; here every bucket has a verdict)
    assert all(layer._fp8_pays(lo, torch.bfloat16) is wins for lo, wins in verdicts.items())


def _train(model, fn, device, dtype):
    """One fwd + bwd + fp8ops.step per length; outputs and parameter gradients."""
    torch.manual_seed(1)
    out = []
    for T in LENGTHS:
        x = torch.randn(2, T, 64, device=device)
        with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
            y = fn(x)
        y.float().square().mean().backward()
        out.append((y.detach().float(), [p.grad.float().clone() for p in model.parameters()]))
        fp8ops.step(model)
        model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("block", [GptBlock, LlamaBlock])
@pytest.mark.parametrize("dynamic", [None, True])
def test_variable_lengths_train_in_a_few_graphs(monkeypatch, device, block, dynamic):
    """A block with its norm and activation fused trains over 12 lengths, compiled with
    torch's automatic dynamic shapes (dynamic=None, the default) or dynamic=True, in a few
    graphs (the first length's, the symbolic one, the delayed recipe's switch after the first
    step; on CUDA one more for the "mixed" layer's verdict change), like eager to FP8 rounding.
    On CUDA under policy "auto": the second layer settled BF16 below FLIP_AT rows and FP8 from
    it on, the others FP8 for every bucket."""
    torch.manual_seed(0)
    base = block().to(device)
    runs = []
    for compiled in (False, True):
        model = copy.deepcopy(base)
        if device == "cpu":
            convert_as_on_fp8_gpu(model, monkeypatch)
        else:
            fp8ops.convert(model, config=Fp8Config(policy="auto"))
            for i, m in enumerate(m for m in model.modules() if isinstance(m, Fp8Linear)):
                for lo in {rows_bucket(2 * T) for T in LENGTHS}:
                    wins = lo >= FLIP_AT or i != 1
                    m.fp8_policy[(lo, torch.bfloat16)] = (wins, 1.4 if wins else 0.9)
        torch._dynamo.reset()
        counters.clear()
        fn = torch.compile(model, dynamic=dynamic) if compiled else model
        runs.append(_train(model, fn, device, torch.bfloat16))
        if compiled:
            graphs = _graphs()
        else:
            layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
            assert layers and all(m.fp8_step == len(LENGTHS) for m in layers)
            if device == "cuda":  # the mixed layer ran BF16 (a fallback call) below FLIP_AT rows only
                assert layers[1].fp8_fallback_calls == sum(2 * T < FLIP_AT for T in LENGTHS)
                assert all(m.fp8_fallback_calls == 0 for m in layers if m is not layers[1])
            else:
                assert all(m.fp8_fallback_calls == 0 for m in layers)
    assert graphs <= (3 if device == "cpu" else 4), f"{graphs} graphs for {len(LENGTHS)} lengths"
    # (CPU: the reference kernels, compiled and eager alike. CUDA: inductor's BF16 code rounds
    # otherwise than eager's, and a value that moves across an FP8 rounding boundary upstream
    # moves by an FP8 step: one gradient of the Llama block read 27.5 dB at the first length
    # on an H200; a wrong path, such as a GELU lost or applied twice, changes whole gradients)
    min_grad_sqnr = 30 if device == "cpu" else 20
    for i, ((y1, g1), (y2, g2)) in enumerate(zip(*runs)):
        assert sqnr(y1, y2) >= 40, f"length {LENGTHS[i]}"
        for a, b in zip(g1, g2):
            assert sqnr(a, b) >= min_grad_sqnr, f"length {LENGTHS[i]}"
