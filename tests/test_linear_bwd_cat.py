"""fp8ops::linear_bwd_cat (Fp8Linear's compiled backward with dy given as three column blocks,
never concatenated) and the inductor pass that calls it (cat_grad_pass.py): the op equals
linear_bwd_sink on the concatenation bit for bit, on the CPU (blocks copied side by side) and on
CUDA (the cast reading the blocks in place where the shape allows, copied otherwise); compiled
GPT-2 attention blocks take it for c_attn and train as they did without it.

CPU tests run the C reference kernels; the CUDA parametrisations run the cast kernels."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import fp8ops
from fp8ops import cat_grad_pass, ops

from conftest import DEVICES, FP8_DEVICES, convert_as_on_fp8_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt2  # noqa: E402

E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
ST = ops.ST


def _blocks(M, widths, dtype, device, packed, pad=8, seed=0):
    """Three [M, n_i] blocks: views into one [M, sum + pad] buffer (as q, k, v of one projection,
    with a row stride wider than each) when packed, else separate contiguous tensors."""
    g = torch.Generator().manual_seed(seed)
    if packed:
        buf = (torch.randn(M, sum(widths) + pad, generator=g) * 4).to(dtype).to(device)
        starts = [0, widths[0], widths[0] + widths[1]]
        return [buf[:, s:s + n] for s, n in zip(starts, widths)]
    return [(torch.randn(M, n, generator=g) * 4).to(dtype).to(device) for n in widths]


def _bwd(fn, gy_args, K, device, g_fmt, need_db, prior=0.5, with_gelu_input=True, need_dx=True, need_dw=True):
    N = sum(t.shape[1] for t in gy_args)
    M = gy_args[0].shape[0]
    g = torch.Generator().manual_seed(1)
    w8t = torch.randn(K, N, generator=g).to(E4).to(device)
    x8t = torch.randn(K, M, generator=g).to(E4).to(device)
    f32 = lambda v: torch.tensor([v], device=device)  # noqa: E731
    g_amax = f32(prior)
    gelu = [torch.empty(0, dtype=gy_args[0].dtype, device=device)] if with_gelu_input else []
    out = fn(*gy_args, w8t, x8t, f32(0.75), g_amax, f32(1 / 0.75), f32(0.5), f32(0.25), *gelu, ST[g_fmt],
             ST[torch.bfloat16], ST[torch.float32], need_dx, need_dw, need_db)
    return out, g_amax


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("M,widths,dtype,pad", [
    (256, (256, 128, 128), torch.bfloat16, 8),   # the fused cast on CUDA (tiles inside one block each)
    (384, (128, 256, 48), torch.float16, 8),     # fused; the last block a partial tile
    (240, (128, 128, 128), torch.bfloat16, 8),   # fused; the last row tile partial
    (256, (128, 0, 256), torch.bfloat16, 8),     # fused; an empty block between two
    (256, (128, 128, 128), torch.bfloat16, 3),   # packed: rows not 16-byte aligned, copied first
    (128, (96, 128, 128), torch.bfloat16, 8),    # a block that is not a whole tile: copied first
    (64, (32, 16, 48), torch.float32, 8),        # fp32: copied first
])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("g_fmt,need_db", [(E5, True), (E5, False), (E4, True)])
def test_linear_bwd_cat_is_linear_bwd_sink_of_the_concatenation(M, widths, dtype, pad, packed, g_fmt, need_db,
                                                                device):
    blocks = _blocks(M, widths, dtype, device, packed, pad)
    gy = torch.cat(blocks, 1)
    want, amax_want = _bwd(torch.ops.fp8ops.linear_bwd_sink.default, [gy], 64, device, g_fmt, need_db)
    got, amax_got = _bwd(torch.ops.fp8ops.linear_bwd_cat.default, blocks, 64, device, g_fmt, need_db,
                         with_gelu_input=False)
    for name, a, b in zip(("dx", "dw", "db"), want, got):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    assert torch.equal(amax_got, amax_want)  # dy's amax folded into the slot, as the plain op does
    assert amax_got.item() == max(0.5, gy.float().abs().max().item())


@pytest.mark.parametrize("device", FP8_DEVICES)
@pytest.mark.parametrize("need_dx,need_dw", [(True, False), (False, True), (False, False)])
def test_linear_bwd_cat_without_some_gradients(need_dx, need_dw, device):
    """A frozen weight (no dw: no transposed dy, which the fused cast writes) or no dx."""
    blocks = _blocks(256, (128, 128, 128), torch.bfloat16, device, packed=True)
    want, amax_want = _bwd(torch.ops.fp8ops.linear_bwd_sink.default, [torch.cat(blocks, 1)], 64, device, E5, True,
                           need_dx=need_dx, need_dw=need_dw)
    got, amax_got = _bwd(torch.ops.fp8ops.linear_bwd_cat.default, blocks, 64, device, E5, True,
                         with_gelu_input=False, need_dx=need_dx, need_dw=need_dw)
    for a, b in zip(want, got):
        assert a.shape == b.shape and torch.equal(a, b)
    assert torch.equal(amax_got, amax_want)


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_linear_bwd_cat_keeps_non_finite_values_and_amax(device):
    blocks = _blocks(256, (128, 128, 128), torch.bfloat16, device, packed=True)
    blocks[1][3, 7] = float("nan")
    blocks[2][9, 1] = float("inf")
    gy = torch.cat(blocks, 1)
    want, amax_want = _bwd(torch.ops.fp8ops.linear_bwd_sink.default, [gy], 64, device, E5, True)
    got, amax_got = _bwd(torch.ops.fp8ops.linear_bwd_cat.default, blocks, 64, device, E5, True,
                         with_gelu_input=False)
    assert amax_got.isnan().all() and amax_want.isnan().all()
    for a, b in zip(want, got):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("device", DEVICES)
def test_linear_bwd_cat_errors_name_the_block(device):
    a, b, c = _blocks(32, (16, 16, 16), torch.bfloat16, device, packed=False)
    cat = torch.ops.fp8ops.linear_bwd_cat.default
    cases = [
        ((a, b[:16], c), r"gy_b must have gy_a's 32 rows"),
        ((a, b, c.float()), r"gy_c must have gy_a's dtype"),
        ((a, b.t().contiguous().t(), c), r"gy_b's columns must be adjacent"),
        ((a.int(), b, c), r"gy_a must be float32, bfloat16 or float16"),
        ((a[None], b, c), r"gy_a must be 2-D"),
        ((a, b[:1].expand(32, 16), c), r"gy_b's rows must not overlap"),
    ]
    for blocks, pattern in cases:
        with pytest.raises(Exception, match=pattern):
            _bwd(cat, list(blocks), 16, device, E5, True, with_gelu_input=False)
    # past the blocks' own checks the messages name their concatenation (the op has no "gy")
    f32 = lambda v: torch.tensor([v], device=device)  # noqa: E731
    w8t_bad, x8t = torch.randn(16, 49).to(E4).to(device), torch.randn(16, 32).to(E4).to(device)
    with pytest.raises(RuntimeError, match=r"w8t must be \[K, N\] for cat\(gy_a, gy_b, gy_c\) \[32, 48\]"):
        cat(a, b, c, w8t_bad, x8t, f32(1.0), f32(0.0), f32(1.0), f32(1.0), f32(1.0), ST[E5], ST[torch.bfloat16],
            ST[torch.float32], True, True, False)


# ------------------------------------------------------------------ the pass

def _attention_blocks(n_embd=256, n_head=2, n_layer=2):
    cfg = gpt2.GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=64, vocab_size=128)
    torch.manual_seed(0)
    return torch.nn.Sequential(*[gpt2.Block(cfg) for _ in range(n_layer)])


def _train(base, monkeypatch, device, compiled, steps=4, cat_pass=True, **cfg):
    model = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, device, **cfg).to(device)
    if not cat_pass:
        monkeypatch.setattr(cat_grad_pass, "fuse_cat_grads", lambda graph: 0)
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True) if compiled else model
    torch.manual_seed(1)
    outs = []
    with torch.compiler.config.patch(force_disable_caches=True):
        for _ in range(steps):
            x = torch.randn(2, 64, 256, device=device, requires_grad=True)
            with torch.autocast(device, dtype=torch.bfloat16):
                y = fn(x)
            y.float().square().mean().backward()
            outs.append([y.detach(), x.grad, *[p.grad.clone() for p in model.parameters()]])
            fp8ops.step(model)
            model.zero_grad()
    monkeypatch.undo()
    return outs


@pytest.mark.parametrize("device", FP8_DEVICES)
def test_compiled_attention_reads_q_k_v_gradients_in_place(device, monkeypatch):
    """Under torch.compile c_attn's backward takes the three gradients as blocks (a rewrite in
    the graph after delayed scaling's first step), and training is the same bit for bit as
    compiled code without the pass (whose match with eager code other tests check)."""
    base = _attention_blocks()
    before = cat_grad_pass.FUSED[0]
    fused = _train(base, monkeypatch, device, compiled=True)
    rewrites = cat_grad_pass.FUSED[0] - before
    assert rewrites >= 1
    unfused = _train(base, monkeypatch, device, compiled=True, cat_pass=False)
    assert cat_grad_pass.FUSED[0] - before == rewrites  # (the second run's pass was off)
    for step, (a, b) in enumerate(zip(fused, unfused)):
        for i, (t, u) in enumerate(zip(a, b)):
            assert torch.equal(t, u), f"step {step}, tensor {i}"


def test_current_scaling_reads_dy_before_its_cast_so_the_cat_stays(monkeypatch):
    """Under current scaling dy's amax is computed before the cast: the concatenation has
    another use and the pass leaves it (and training matches eager code, as before)."""
    base = _attention_blocks(n_layer=1)
    before = cat_grad_pass.FUSED[0]
    _train(base, monkeypatch, "cpu", compiled=True, steps=2, recipe="current")
    assert cat_grad_pass.FUSED[0] == before


class _SplitAttention(torch.nn.Module):
    """One projection split into q, k, v, attended by hand (nanoGPT without flash attention), or
    v broadcast over the tokens: the k gradient comes back transposed at batch 1, the v gradient
    of the broadcast with row stride 0."""

    def __init__(self, mode, C=64):
        super().__init__()
        self.c_attn, self.mode, self.C = torch.nn.Linear(C, 3 * C), mode, C

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.C, dim=-1)
        if self.mode == "expand":
            return q * k + v.sum(-2, keepdim=True)
        B, T, _ = x.shape
        q, k, v = (t.view(B, T, 1, self.C).transpose(1, 2) for t in (q, k, v))  # (one head)
        att = (q @ k.transpose(-2, -1)) * (1.0 / self.C ** 0.5)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(causal.logical_not(), float("-inf")).softmax(-1)
        return (att @ v).transpose(1, 2).contiguous().view(B, T, self.C)


@pytest.mark.parametrize("mode,shape", [("manual", (1, 32, 64)), ("expand", (1, 32, 64))])
def test_pieces_the_op_does_not_take_stay_concatenated(mode, shape, monkeypatch):
    """A block the op cannot read in place (a transposed or broadcast gradient) keeps inductor's
    concatenation: compiled training runs and equals compiled code without the pass."""
    base = _SplitAttention(mode)
    runs = []
    for cat_pass in (True, False):
        model = convert_as_on_fp8_gpu(copy.deepcopy(base), monkeypatch, "cpu")
        if not cat_pass:
            monkeypatch.setattr(cat_grad_pass, "fuse_cat_grads", lambda graph: 0)
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True)
        torch.manual_seed(1)
        outs = []
        with torch.compiler.config.patch(force_disable_caches=True):
            for _ in range(3):
                x = torch.randn(*shape, requires_grad=True)
                fn(x).square().mean().backward()
                outs.append([x.grad, *[p.grad.clone() for p in model.parameters()]])
                fp8ops.step(model)
                model.zero_grad()
        monkeypatch.undo()
        runs.append(outs)
    for a, b in zip(*runs):
        for t, u in zip(a, b):
            assert torch.equal(t, u)
