"""fp8ops::amax_update (delayed scaling): history roll, max / most_recent,
margin, and the rule that a zero or non-finite amax keeps the previous scale."""
import pytest
import torch

from fp8ops import ops
from fp8ops._reference import amax_update_ref

from conftest import DEVICES, requires_cuda


def _state(H, n, device, gen, fill=None):
    hist = (torch.rand(H, n, generator=gen) * 100).to(device) if fill is None else torch.full((H, n), fill, device=device)
    scale = (torch.rand(n, generator=gen) + 0.5).to(device)
    fmax = torch.tensor([448.0, 57344.0] * n, device=device)[:n].contiguous()
    return hist, scale, torch.empty(n, device=device), fmax


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 2.5])
@pytest.mark.parametrize("H,n", [(1, 1), (31, 3), (1024, 7), (5, 1000)])
def test_amax_update_matches_reference(H, n, margin, algo, device):
    gen = torch.Generator().manual_seed(H * 131 + n)
    hist, scale, sinv, fmax = _state(H, n, device, gen)
    hist[0, :: 3] = 0.0                      # zero amax: keeps scale if the history is zero too
    hist[0, 1::4] = float("nan")             # this step: keeps the scale
    hist[-1, 2::5] = float("inf")            # an older step's: skipped by algo max
    ref_h, ref_s, ref_si = amax_update_ref(hist, scale, sinv, fmax, margin, algo)
    ops.amax_update(hist, scale, sinv, fmax, margin, algo)
    assert torch.equal(hist.cpu().view(torch.int32), ref_h.cpu().view(torch.int32))  # bits: the roll is a copy
    torch.testing.assert_close(scale.cpu(), ref_s.cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(sinv.cpu(), ref_si.cpu(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_poisoned_incoming_scale_is_not_kept(device):
    """A scale that came in 0, negative, inf or NaN (written by hand, a corrupt state) was kept
    wherever this step's amax keeps the scale (0 here), and so was its inverse: NaN outputs
    for good. It becomes 1 (the columns with an amax get theirs as always)."""
    bad = [float("nan"), 0.0, -2.0, float("inf"), 1e-39, 3.0]
    n = len(bad)
    hist = torch.zeros(4, n, device=device)
    hist[0, -1] = 7.0
    scale = torch.tensor(bad, device=device)
    sinv, fmax = torch.empty(n, device=device), torch.full((n,), 448.0, device=device)
    ref_h, ref_s, ref_si = amax_update_ref(hist, scale, sinv, fmax)
    ops.amax_update(hist, scale, sinv, fmax)
    assert scale.tolist() == [1.0] * (n - 1) + [64.0] == ref_s.tolist() and sinv.tolist() == ref_si.tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_scale_and_scale_inv_must_not_share_memory(device):
    hist, s = torch.zeros(4, 1, device=device), torch.ones(1, device=device)
    with pytest.raises(RuntimeError, match="scale, scale_inv and amax_history must be three tensors of their own"):
        ops.amax_update(hist, s, s, torch.tensor([448.0], device=device))
    # views that overlap part-way share memory too: scale_inv = 1 / scale was computed from
    # scales another column had already overwritten (scale_inv read [224, 112, 0.0089])
    buf = torch.ones(8, device=device)
    h3 = torch.zeros(4, 3, device=device)
    h3[0] = torch.tensor([1.0, 2.0, 4.0])
    fmax = torch.full((3,), 448.0, device=device)
    for scale, scale_inv, fm, counts, named in (
            (buf[0:3], buf[1:4], fmax, None, "scale and scale_inv"),
            (buf[0:3], buf[4:7], buf[2:5], None, "scale and fp8_max"),
            (torch.ones(3, device=device), torch.ones(3, device=device), fmax, h3.view(-1)[:6].view(torch.int64)[:3],
             "amax_history and overflow_count")):
        before = (buf.clone(), h3.clone())
        with pytest.raises(RuntimeError, match=f"found {named} sharing memory"):
            ops.amax_update(h3, scale, scale_inv, fm, 0.0, "max", counts)
        assert torch.equal(buf, before[0]) and torch.equal(h3, before[1])


@pytest.mark.parametrize("device", DEVICES)
def test_roll_direction(device):
    hist = torch.tensor([[5.0], [1.0], [2.0], [3.0]], device=device)
    scale, sinv, fmax = torch.ones(1, device=device), torch.ones(1, device=device), torch.tensor([448.0], device=device)
    ops.amax_update(hist, scale, sinv, fmax, 0.0, "max")
    assert hist.flatten().tolist() == [0.0, 2.0, 3.0, 5.0]   # torch.roll(h, -1); row 0 zeroed
    assert scale.item() == pytest.approx(448.0 / 5.0)
    assert sinv.item() == pytest.approx(5.0 / 448.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), float("-inf")])
def test_bad_amax_keeps_previous_scale(bad, device):
    hist = torch.tensor([[bad]], device=device)
    scale = torch.tensor([3.0], device=device)
    sinv, fmax = torch.zeros(1, device=device), torch.tensor([448.0], device=device)
    ops.amax_update(hist, scale, sinv, fmax, 0.0, "most_recent")
    assert scale.item() == 3.0 and sinv.item() == pytest.approx(1 / 3.0)
    assert torch.isfinite(scale).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_bad_amax_holds_the_scale_for_its_step_only(bad, device):
    """A NaN/inf amax (an overflowed step) keeps the scale that step and is counted. It stays
    in the history (the record of that step) but holds no later scale: under algo max it would
    otherwise keep the scale for the next H steps whatever the amaxes do."""
    hist = torch.tensor([[bad], [1.0], [2.0], [3.0]], device=device)
    scale, sinv, fmax = torch.tensor([7.0], device=device), torch.ones(1, device=device), torch.tensor([448.0], device=device)
    count = torch.zeros(1, dtype=torch.int64, device=device)
    torch.ops.fp8ops.amax_update.default(hist, scale, sinv, fmax, 0.0, ops.AMAX_ALGOS["max"], count)
    assert scale.item() == 7.0 and count.item() == 1
    assert hist[:3].flatten().tolist() == [0.0, 2.0, 3.0] and not torch.isfinite(hist[3]).any()
    hist[0, 0] = 0.5                                 # the next step: finite again
    torch.ops.fp8ops.amax_update.default(hist, scale, sinv, fmax, 0.0, ops.AMAX_ALGOS["max"], count)
    assert scale.item() == pytest.approx(448.0 / 3.0) and count.item() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_tiny_amax_scale_is_clamped_finite(device):
    hist = torch.tensor([[1e-45]], device=device)  # 448 / 1e-45 overflows fp32
    scale, sinv, fmax = torch.ones(1, device=device), torch.ones(1, device=device), torch.tensor([448.0], device=device)
    ops.amax_update(hist, scale, sinv, fmax, 0.0, "max")
    assert scale.item() == torch.finfo(torch.float32).max
    assert torch.isfinite(sinv).all()


@pytest.mark.parametrize("device", DEVICES)
def test_single_tensor_1d_history(device):
    hist = torch.tensor([4.0, 8.0, 2.0], device=device)
    scale, sinv, fmax = torch.ones(1, device=device), torch.ones(1, device=device), torch.tensor([448.0], device=device)
    ops.amax_update(hist, scale, sinv, fmax, 1.0, "max")
    assert hist.tolist() == [0.0, 2.0, 4.0]          # [8, 2, 4] rolled up, row 0 zeroed
    assert scale.item() == pytest.approx(448.0 / 8.0 / 2.0)


@pytest.mark.parametrize("device", DEVICES)
def test_amax_update_errors(device):
    h, s, si, m = torch.zeros(4, 3, device=device), torch.ones(3, device=device), torch.ones(3, device=device), torch.ones(3, device=device)
    cases = [
        (lambda: ops.amax_update(h.double(), s, si, m), r"amax_history must be float32, found float64"),
        (lambda: ops.amax_update(h, torch.ones(2, device=device), si, m), r"scale must have 3 elements.*found 2"),
        (lambda: ops.amax_update(h, s, si[:2], m), r"scale_inv must have 3 elements"),
        (lambda: ops.amax_update(h, s, si, torch.ones(4, device=device)), r"fp8_max must have 3 elements"),
        (lambda: ops.amax_update(h.t(), s, si, m), r"amax_history must be contiguous"),
        (lambda: ops.amax_update(torch.zeros(2, 2, 2, device=device), s, si, m), r"must be \[H\].*found 3 dims"),
        (lambda: ops.amax_update(torch.zeros(0, 3, device=device), s, si, m), r"at least 1 row"),
        (lambda: torch.ops.fp8ops.amax_update(h, s, si, m, 0.0, 7, ops._no_counts(h)), r"algo must be 0 \(max\) or 1"),
        (lambda: ops.amax_update(h, s, si, m, float("nan")), r"margin must be a number in \(-64, 64\)"),
    ]
    for fn, pattern in cases:
        with pytest.raises(RuntimeError, match=pattern):
            fn()
    with pytest.raises(ValueError, match="algo must be one of"):
        ops.amax_update(h, s, si, m, 0.0, "mean")


@requires_cuda
@pytest.mark.gpu
def test_amax_update_mixed_devices():
    with pytest.raises(RuntimeError, match=r"scale is on cpu but amax_history is on cuda:0"):
        ops.amax_update(torch.zeros(4, 1, device="cuda"), torch.ones(1), torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))


@pytest.mark.parametrize("device", DEVICES)
def test_amax_update_opcheck_and_compile(device):
    h, s, si, m = torch.rand(8, 3, device=device), torch.ones(3, device=device), torch.ones(3, device=device), torch.full((3,), 448.0, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)
    torch.library.opcheck(torch.ops.fp8ops.amax_update.default, (h.clone(), s.clone(), si.clone(), m, 0.0, 0, counts))

    def f(h, s, si, m):
        ops.amax_update(h, s, si, m, 0.0, "max")
        return s * 2

    torch._dynamo.reset()
    h2, s2, si2 = h.clone(), s.clone(), si.clone()
    out = torch.compile(f, fullgraph=True)(h2, s2, si2, m)
    h3, s3, si3 = h.clone(), s.clone(), si.clone()
    f(h3, s3, si3, m)
    assert torch.equal(h2, h3) and torch.equal(s2, s3) and torch.equal(out, s3 * 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [3, 70])  # 70: several CUDA blocks of columns
def test_overflow_count_counts_nonfinite_current_amax(n, device):
    hist = torch.rand(4, n, device=device) + 0.5
    bad_cols = list(range(1, n, 3))
    for i, c in enumerate(bad_cols):
        hist[0, c] = (float("nan"), float("inf"), float("-inf"))[i % 3]
    hist[2, 0] = float("nan")                # an older row is not this step's overflow
    counts = torch.full((n,), 5, dtype=torch.int64, device=device)
    scale, sinv, fmax = torch.ones(n, device=device), torch.ones(n, device=device), torch.full((n,), 448.0, device=device)
    ops.amax_update(hist, scale, sinv, fmax, 0.0, "max", overflow_count=counts)
    want = torch.full((n,), 5, dtype=torch.int64)
    want[bad_cols] += 1
    assert torch.equal(counts.cpu(), want)
    ops.amax_update(hist, scale, sinv, fmax, 0.0, "max", overflow_count=counts)  # row 0 now clean
    assert torch.equal(counts.cpu(), want)


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_count_bad_arguments(device):
    h, s, si, m = torch.ones(2, 3, device=device), torch.ones(3, device=device), torch.ones(3, device=device), torch.full((3,), 448.0, device=device)
    with pytest.raises(RuntimeError, match="overflow_count must be int64, found float32"):
        ops.amax_update(h, s, si, m, overflow_count=torch.zeros(3, device=device))
    with pytest.raises(RuntimeError, match="overflow_count must have 3 elements"):
        ops.amax_update(h, s, si, m, overflow_count=torch.zeros(2, dtype=torch.int64, device=device))
    assert torch.equal(h, torch.ones(2, 3, device=device))  # rejected calls change nothing


@pytest.mark.parametrize("device", DEVICES)
def test_padded_scale_inv(device):
    """scale_inv as a 1-D view with stride 4 (Fp8Linear's layout: every entry
    16-byte aligned for cuBLASLt): the same values, the padding untouched."""
    gen = torch.Generator().manual_seed(3)
    hist, scale, _, fmax = _state(8, 3, device, gen)
    ref_h, ref_s, ref_si = amax_update_ref(hist, scale, torch.empty(3, device=device), fmax, 1.0, "max")
    storage = torch.full((3, 4), -7.0, device=device)
    sinv = storage[:, 0]
    assert sinv.stride() == (4,) and not sinv.is_contiguous()
    ops.amax_update(hist, scale, sinv, fmax, 1.0, "max")
    torch.testing.assert_close(sinv.cpu(), ref_si.cpu(), rtol=1e-6, atol=0)
    assert (storage[:, 1:] == -7.0).all()
    with pytest.raises(RuntimeError, match=r"scale_inv must be contiguous or a 1-D view with a positive stride"):
        ops.amax_update(hist, scale, torch.ones(3, 2, device=device)[:, 0:1], fmax)


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("widths", [(3, 1, 40, 3), (3, 3, 3, 3), (1, 1, 1, 1)])
def test_amax_update_many_matches_the_op(widths):
    """_C.amax_update_many (the optimizer hook's path: all layers in few launches)
    gives bit for bit what amax_update gives layer by layer, over more than one
    launch (> 32 jobs), mixed H / margin / algo, padded scale_inv, NaN rows; with
    mixed widths (a 32-column block) and with every history as narrow as
    Fp8Linear's (the launch's block shaped for 3 or 1 columns)."""
    from fp8ops import _loader
    gen = torch.Generator().manual_seed(7)
    jobs, refs, states = [], [], []
    for i in range(70):
        H, n = (1, 16, 3, 1024)[i % 4], widths[i % 4]
        margin, algo = (0.0, 1.0, 2.5)[i % 3], ("max", "most_recent")[i % 2]
        hist = torch.rand(H, n, generator=gen) * 100
        if i % 5 == 0:
            hist[0, 0] = float("nan")
        scale = torch.rand(n, generator=gen) + 0.5
        fmax = torch.full((n,), 448.0)
        counts = torch.arange(n, dtype=torch.int64)
        ref = [t.clone().cuda() for t in (hist, scale, torch.ones(n), fmax, counts)]
        ops.amax_update(ref[0], ref[1], ref[2], ref[3], margin, algo, overflow_count=ref[4])
        refs.append(ref)
        st = [t.clone().cuda() for t in (hist, scale)] + [torch.ones(n, 4, device="cuda")[:, 0],
                                                            fmax.cuda(), counts.cuda()]
        states.append(st)
        jobs.append((st[0].data_ptr(), st[1].data_ptr(), st[2].data_ptr(), st[3].data_ptr(), st[4].data_ptr(),
                     n, H, 4, margin, ops.AMAX_ALGOS[algo]))
    _loader._C.amax_update_many(torch.cuda.current_device(), jobs)
    for i, (st, ref) in enumerate(zip(states, refs)):
        for name, got, want in zip(("history", "scale", "scale_inv", "fp8_max", "counts"), st, ref):
            assert torch.equal(got.view(torch.int32) if got.is_floating_point() else got,
                               want.view(torch.int32) if want.is_floating_point() else want), f"job {i}: {name}"


@requires_cuda
@pytest.mark.gpu
def test_amax_update_many_rejects_bad_jobs():
    from fp8ops import _loader
    dev = torch.cuda.current_device()
    h = torch.zeros(4, 3, device="cuda")
    p = h.data_ptr()
    with pytest.raises(RuntimeError, match="bad sizes"):
        _loader._C.amax_update_many(dev, [(p, p, p, p, 0, 3, 0, 1, 0.0, 0)])
    with pytest.raises(RuntimeError, match="null pointer"):
        _loader._C.amax_update_many(dev, [(0, p, p, p, 0, 3, 4, 1, 0.0, 0)])
    with pytest.raises(RuntimeError, match=r"margin must be a number in \(-64, 64\)"):
        _loader._C.amax_update_many(dev, [(p, p, p, p, 0, 3, 4, 1, float("nan"), 0)])
    with pytest.raises(TypeError, match="a job is"):
        _loader._C.amax_update_many(dev, [(p, p)])
    assert torch.equal(h, torch.zeros(4, 3, device="cuda"))


def test_amax_update_many_rejects_malformed_job_lists():
    """The C entry point parses its arguments before touching any device."""
    from fp8ops import _loader
    many = _loader._C.amax_update_many
    with pytest.raises(TypeError):
        many(0, ((1, 2, 3),))                      # not a list
    with pytest.raises(TypeError, match="each job must be a tuple"):
        many(0, [[1, 2, 3, 4, 5, 3, 4, 1, 0.0, 0]])
    with pytest.raises(TypeError, match="a job is"):
        many(0, [(1, 2)])
