"""fp8ops::cast and fp8ops::amax: bit-exact against the plain-PyTorch reference
((x.float() * scale).clamp(-max, max).to(fp8)) evaluated on the CPU, for the
CPU and the CUDA kernels alike. (torch's own CUDA multiply returns a canonical
NaN, so the reference is always taken on the CPU, where NaN keeps its sign.)"""
import pytest
import torch

import fp8ops
from fp8ops import ops
from fp8ops._reference import FP8_MAX, amax_ref, cast_ref

from conftest import DEVICES, assert_bitwise, requires_cuda

HP = [torch.float32, torch.bfloat16, torch.float16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
SHAPES = [(1, 16), (5, 160), (217, 256), (5, 4, 3, 160), (3, 7), (1, 1), (64, 48)]


def _edge_values(dtype, fp8):
    m = FP8_MAX[fp8]
    tiny = 2.0 ** -9 if fp8 == torch.float8_e4m3fn else 2.0 ** -16  # smallest fp8 subnormal
    vals = [0.0, -0.0, 1.0, -1.0, m, -m, m * 1.01, -m * 1.5, 1e30, -1e30, float("inf"), float("-inf"),
            tiny, tiny / 2, tiny * 1.5, tiny * 2.5, -tiny * 0.5001, 3 * tiny / 2, 1.0625, 1.1875,
            240.0, 232.0, 448.0 + 16, 57344.0, 61440.0, 1e-8, -1e-8, 6e-5, 2.0 ** -6, 2.0 ** -14, 0.3]
    x = torch.tensor(vals, dtype=torch.float32)
    return x.to(dtype)


def _case(shape, dtype, device, gen):
    x = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 4)
    return x.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cast_bitwise(shape, dtype, fp8, transpose, device):
    gen = torch.Generator().manual_seed(hash((shape, str(dtype), str(fp8))) % 2**31)
    x = _case(shape, dtype, device, gen)
    for scale_val in (1.0, 0.37, 1000.0):
        scale = torch.tensor([scale_val], device=device)
        out, out_t, amax = ops.cast(x, scale, fp8, transpose)
        r_out, r_t, r_amax = cast_ref(x.cpu(), scale.cpu(), fp8, transpose)
        assert_bitwise(out, r_out, "out")
        if transpose:
            assert_bitwise(out_t, r_t, "out_t")
        else:
            assert out_t.numel() == 0
        assert amax.shape == () and amax.dtype == torch.float32
        assert torch.equal(amax.cpu(), r_amax.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", HP, ids=["f32", "bf16", "f16"])
def test_cast_edge_values(dtype, fp8, device):
    """Saturation, subnormals, ties, +-inf, signed zeros: every value bit-exact."""
    x = _edge_values(dtype, fp8)
    x = torch.cat([x, -x, x * 0.999, x * 1.001]).reshape(4, -1).to(device)
    for scale_val in (1.0, 0.5, 3.0, 2.0 ** -10):
        scale = torch.tensor([scale_val], device=device)
        out, out_t, _ = ops.cast(x, scale, fp8, True)
        r_out, r_t, _ = cast_ref(x.cpu(), scale.cpu(), fp8, True)
        assert_bitwise(out, r_out, f"scale={scale_val}")
        assert_bitwise(out_t, r_t, "transpose")


@pytest.mark.parametrize("device", DEVICES)
def test_cast_nan_stays_nan_and_amax_propagates(device):
    x = torch.tensor([[1.0, float("nan"), -2.0, -float("nan")] * 4], device=device)
    out, _, amax = ops.cast(x, torch.ones(1, device=device), torch.float8_e4m3fn, False)
    r_out, _, _ = cast_ref(x.cpu(), torch.ones(1), torch.float8_e4m3fn)
    assert_bitwise(out, r_out)
    assert out.float().isnan().sum() == 8
    assert torch.isnan(amax)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HP, ids=["f32", "bf16", "f16"])
def test_amax(dtype, device):
    gen = torch.Generator().manual_seed(1)
    for n in (0, 1, 7, 1000, 65537):
        x = (torch.randn(n, generator=gen) * 50).to(dtype).to(device)
        assert torch.equal(ops.amax(x).cpu(), amax_ref(x.cpu()))
    x = torch.tensor([1.0, float("-inf"), 3.0], dtype=dtype, device=device)
    assert ops.amax(x).item() == float("inf")


def test_cast_empty():
    x = torch.empty(0, 32)
    out, out_t, amax = ops.cast(x, torch.ones(1), torch.float8_e4m3fn, True)
    assert out.shape == (0, 32) and out_t.shape == (32, 0) and amax.item() == 0.0


def test_zero_width_rows_of_any_count():
    """A zero last dim lets the leading dims be anything torch allows: the ops return at once,
    and a row count past int64 is refused by name (not an internal error)."""
    x = torch.empty(2**20, 3, 0)
    out, out_t, amax = ops.cast(x, torch.ones(1), torch.float8_e4m3fn, False)
    assert out.shape == (2**20, 3, 0) and amax.item() == 0.0
    assert torch.ops.fp8ops.swiglu.default(x).shape == (2**20, 3, 0)
    huge = torch.empty(2**62, 3, 0)
    for call in (lambda: ops.cast(huge, torch.ones(1), torch.float8_e4m3fn, True),
                 lambda: torch.ops.fp8ops.swiglu.default(huge)):
        with pytest.raises(RuntimeError, match=r"x has more rows \(the product of its leading dims\) than int64"):
            call()


# --------------------------------------------------------------------- errors

@pytest.mark.parametrize("device", DEVICES)
def test_cast_errors(device):
    x = torch.randn(4, 16, device=device)
    s = torch.ones(1, device=device)
    e4 = torch.float8_e4m3fn
    cases = [
        (lambda: ops.cast(x.int(), s, e4), r"x must be float32, bfloat16 or float16, found int32"),
        (lambda: ops.cast(x.double(), s, e4), r"found float64"),
        (lambda: ops.cast(x, s, torch.bfloat16), r"out_dtype must be float8_e4m3fn or float8_e5m2, found bfloat16"),
        (lambda: ops.cast(x.t(), s, e4), r"x must be contiguous"),
        (lambda: ops.cast(x, s.half(), e4), r"scale must be float32, found float16"),
        (lambda: ops.cast(x, torch.ones(2, device=device), e4), r"scale must hold exactly 1 element.*found 2"),
        (lambda: ops.cast(x[0, 0], s, e4), r"x must have at least 1 dim"),
        (lambda: ops.amax(x.t()), r"x must be contiguous"),
        (lambda: ops.amax(x.long()), r"found int64"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()


def _freed(t):
    """t with its storage resized to 0 bytes, as FSDP frees a parameter outside its forward."""
    t = t.clone()
    t.untyped_storage().resize_(0)
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_ops_refuse_undefined_and_freed_tensors(device):
    """A freed tensor (numel > 0, no storage) crashed gemm and linear_bwd, and a freed bias or
    norm weight was read as none; None for a Tensor argument gave "internal error: shim call
    failed". Each now names the argument. Unknown dtype codes (torch crashes on them) too."""
    x = torch.randn(16, 16, device=device)
    s = torch.ones(1, device=device)
    e4 = torch.float8_e4m3fn
    a8 = ops.cast(x, s, e4)[0]
    bias = torch.zeros(16, device=device, dtype=torch.bfloat16)
    cases = [
        (lambda: ops.cast(_freed(x), s, e4), r"fp8ops::cast: x has no storage \(freed"),
        (lambda: ops.amax(_freed(x)), r"fp8ops::amax: x has no storage"),
        (lambda: ops.gemm(_freed(a8), a8, s, s), r"fp8ops::gemm: a has no storage"),
        (lambda: ops.gemm(a8, a8, s, s, bias=_freed(bias)), r"fp8ops::gemm: bias has no storage"),
        (lambda: torch.ops.fp8ops.cast.default(x, None, ops.ST[e4], False),
         r"fp8ops::cast: scale is None \(an undefined tensor\); pass a tensor"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
    with pytest.raises(TypeError, match=r"cast: out_dtype must be a torch.dtype .*found 99"):
        ops.cast(x, s, 99)


def _shrunk(t, nbytes: int):
    """t with its storage resized smaller than t, but not to 0 bytes."""
    t = t.clone()
    t.untyped_storage().resize_(nbytes)
    return t


@pytest.mark.parametrize("device", DEVICES)
def test_ops_refuse_tensors_whose_storage_shrank(device):
    """A storage resized smaller after its tensor was made (not to 0 bytes) passed the checks:
    amax_update wrote past its end and crashed the process, a cast read past it. Refused,
    with the bytes needed and held; a view that fits in its storage still runs."""
    x = torch.randn(16, 16, device=device)
    s = torch.ones(1, device=device)
    h, sc, si = torch.zeros(16, 3, device=device), torch.ones(3, device=device), torch.ones(3, device=device)
    cases = [
        (lambda: ops.cast(_shrunk(x, 100), s, torch.float8_e4m3fn), r"fp8ops::cast: x needs 1024 bytes of its "
                                                                    r"storage, which holds 100 \(resized smaller"),
        (lambda: torch.ops.fp8ops.amax_update(_shrunk(h, 8), sc, si, torch.full((3,), 448.0, device=device), 0.0, 0,
                                              torch.zeros(3, dtype=torch.int64, device=device)),
         r"fp8ops::amax_update: amax_history needs 192 bytes of its storage, which holds 8"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
    big = torch.randn(64, 16, device=device)
    tail = big[48:]  # (a view at an offset, inside its storage)
    e4 = torch.float8_e4m3fn
    assert torch.equal(ops.cast(tail, s, e4)[0].float(), ops.cast(tail.clone(), s, e4)[0].float())


@requires_cuda
@pytest.mark.gpu
def test_cast_mixed_devices():
    with pytest.raises(RuntimeError, match=r"scale is on cpu but x is on cuda:0"):
        ops.cast(torch.randn(4, 16, device="cuda"), torch.ones(1), torch.float8_e4m3fn)


# ----------------------------------------------------- dispatcher integration

@pytest.mark.parametrize("device", DEVICES)
def test_cast_opcheck(device):
    # x without requires_grad: aot_autograd's opcheck would sum the fp8 outputs'
    # tangents, which torch cannot do for float8; the straight-through gradient
    # is tested directly below
    x = torch.randn(32, 48, device=device)
    s = torch.tensor([2.0], device=device)
    for transpose in (False, True):
        for fp8 in FP8:
            torch.library.opcheck(torch.ops.fp8ops.cast.default, (x, s, fp8, transpose))
    torch.library.opcheck(torch.ops.fp8ops.amax.default, (x,))


def test_cast_straight_through_grad():
    x = torch.randn(8, 16, requires_grad=True)
    s = torch.tensor([4.0])
    out, out_t, _ = ops.cast(x, s, torch.float8_e4m3fn, True)
    (out.float().sum() + 2 * out_t.float().sum()).backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 3 * 4.0))


@pytest.mark.parametrize("device", DEVICES)
def test_cast_compile_fullgraph(device):
    def f(x, s):
        out, out_t, amax = ops.cast(x, s, torch.float8_e4m3fn, True)
        return out.float().sum() + out_t.float().sum() + amax + ops.amax(x)

    x = torch.randn(64, 32, device=device)
    s = torch.tensor([3.0], device=device)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True)(x, s)
    assert torch.equal(got, f(x, s))


# ------------------------------------------------------------------ GPU-only

@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(16384, 4096), (4096, 14336), (1000, 1000), (1, 8), (8, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_cast_cuda_large_matches_cpu(shape, dtype):
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(shape, generator=gen) * 30).to(dtype)
    s = torch.tensor([5.0])
    c = ops.cast(x.cuda(), s.cuda(), torch.float8_e4m3fn, True)
    r = cast_ref(x, s, torch.float8_e4m3fn, True)
    assert_bitwise(c[0], r[0])
    assert_bitwise(c[1], r[1])
    assert torch.equal(c[2].cpu(), r[2].cpu())


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
def test_cast_cuda_16384x14336_with_edge_values_matches_cpu(fp8):
    """The largest target shape, bf16, with every edge value (inf, NaN, +-0,
    subnormals, fp8_max +- 1 ulp, huge) planted at random positions among
    values spread over many octaves: the CUDA cast + transpose + amax is bit
    for bit the CPU reference."""
    gen = torch.Generator().manual_seed(14336)
    shape = (16384, 14336)
    x = (torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-20, 12, shape, generator=gen).float()))
    edges = torch.cat([_edge_values(torch.float32, fp8), torch.tensor([float("nan"), -float("nan")])])
    pos = torch.randint(0, x.numel(), (4096,), generator=gen)
    x.view(-1)[pos] = edges[torch.arange(4096) % edges.numel()]
    x = x.to(torch.bfloat16)
    s = torch.tensor([0.75])
    c = ops.cast(x.cuda(), s.cuda(), fp8, True)
    r = cast_ref(x, s, fp8, True)
    assert_bitwise(c[0], r[0], "out")
    assert_bitwise(c[1], r[1], "out_t")
    assert torch.equal(c[2].cpu(), r[2].cpu()) or (c[2].isnan().item() and r[2].isnan().item())


@requires_cuda
@pytest.mark.gpu
def test_cast_cuda_unaligned_view():
    base = torch.randn(1 + 64 * 48, device="cuda", dtype=torch.bfloat16)
    x = base[1:].view(64, 48)  # storage offset of 2 bytes: not 16-byte aligned
    s = torch.tensor([1.5], device="cuda")
    c, r = ops.cast(x, s, torch.float8_e5m2, True), cast_ref(x.cpu(), s.cpu(), torch.float8_e5m2, True)
    assert_bitwise(c[0], r[0])
    assert_bitwise(c[1], r[1])


@requires_cuda
@pytest.mark.gpu
def test_cast_cuda_non_default_stream_and_graph():
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor([2.0], device="cuda")
    ref = cast_ref(x.cpu(), s.cpu(), torch.float8_e4m3fn, True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got = ops.cast(x, s, torch.float8_e4m3fn, True)
    torch.cuda.current_stream().wait_stream(stream)
    assert_bitwise(got[0], ref[0])
    assert_bitwise(got[1], ref[1])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        cap = ops.cast(x, s, torch.float8_e4m3fn, True)
    x.copy_(torch.randn_like(x) * 7)
    g.replay()
    torch.cuda.synchronize()
    ref = cast_ref(x.cpu(), s.cpu(), torch.float8_e4m3fn, True)
    assert_bitwise(cap[0], ref[0])
    assert_bitwise(cap[1], ref[1])
    assert torch.equal(cap[2].cpu(), ref[2])


@requires_cuda
@pytest.mark.gpu
def test_cast_cuda_no_leak():
    x = torch.randn(64, 64, device="cuda")
    s = torch.ones(1, device="cuda")
    for _ in range(10):
        ops.cast(x, s, torch.float8_e4m3fn, True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    for _ in range(10000):
        ops.cast(x, s, torch.float8_e4m3fn, True)
        ops.amax(x)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == base
