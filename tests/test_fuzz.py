"""Fuzzing every fp8ops op (cast, amax, amax_update, gemm) with hypothesis.

Each generated case is a plain description (dtypes, shapes, layouts, value
seeds, special values, scales, flags) that is turned into tensors on a device.
For each case the op must do exactly one of two things:

  * succeed, and match fp8ops._reference: cast / amax / amax_update bit for bit
    (see "NaN signs" below), gemm on CPU within fp32 rounding (an interval
    check against an exact float64 product, see _assert_gemm_close);
  * raise RuntimeError whose message is "fp8ops::<op>: <arg> ..." naming one of
    the arguments that the case made invalid (x, scale, out_dtype, a, b,
    a_scale_inv, b_scale_inv, bias, amax_history, scale_inv, fp8_max, margin,
    algo). Which arguments are invalid is decided here from the documented
    contract (dtypes, contiguity, element counts, devices), not by the op.

Any other exception, a RuntimeError on a valid case, a success on an invalid
one, or a message naming a valid argument fails the case. The same case is
replayed on the meta device (the fake kernels that torch.compile uses): where
the C kernel succeeds, the fake kernel must succeed with the same output
shapes and dtypes; where the fake kernel raises, the message must name an
invalid argument too.

Decided semantics, asserted on top of the reference comparison:
  cast: out is NaN exactly where x * scale is NaN (NaN x, NaN scale, 0 * inf)
        or, in e4m3fn (which has no inf), where x is infinite; in e5m2 an
        infinite x gives +-inf (a non-finite input stays non-finite, as in
        nn.Linear); every finite x saturates to +-fp8_max, so a NaN scale gives
        all-NaN out, scale 0 gives signed zeros, scale inf gives +-fp8_max for a
        finite nonzero x; amax never depends on the scale.
  NaN signs: IEEE 754 leaves the sign of NaN * NaN unspecified; where both x
        and scale are NaN any NaN encoding is accepted, elsewhere bits match.
  amax: NaN if any element is NaN (any NaN encoding accepted), 0 if empty.

Profiles:
  CI (default): CI_EXAMPLES cases per op and device plus BATCH_CASES in a
    subprocess, deterministic (derandomize), no example database written.
  nightly: FP8OPS_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz.py -m slow
    (or just -m slow: 10000 by default) runs that many fresh random cases per
    op; a failure prints hypothesis' reproduction blob.

Crash isolation: test_fuzz_batch_in_subprocess runs a batch of cases over all
ops in `python -c`, so a segfault in a kernel fails that test (returncode) and
not the pytest process.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

import fp8ops
from fp8ops import ops
from fp8ops._reference import FP8_MAX, amax_ref, amax_update_ref, cast_ref

from conftest import HAS_FP8, requires_cuda, requires_fp8

F32, BF16, F16, F64 = torch.float32, torch.bfloat16, torch.float16, torch.float64
E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
HP = (F32, BF16, F16)
FP8 = (E4, E5)
FLT_MAX = torch.finfo(F32).max

CI_EXAMPLES = {"cast": 120, "amax": 60, "amax_update": 100, "gemm": 80}
BATCH_CASES = 150
NIGHTLY_DEFAULT = 10000

TESTS_DIR = Path(__file__).resolve().parent


# =============================================================================
# special values

def _f32(v: float) -> float:
    """v rounded to float32 (NaN and inf pass through)."""
    if math.isnan(v) or math.isinf(v):
        return v
    return struct.unpack("f", struct.pack("f", v))[0]


def _next32(v: float, toward: float) -> float:
    return torch.nextafter(torch.tensor(v, dtype=F32), torch.tensor(toward, dtype=F32)).item()


def _specials() -> list[float]:
    mags = [0.0, 1.0, 0.3, 2.0 ** -126, 2.0 ** -149, FLT_MAX, 3.3895313892515355e38,  # fp32 / bf16 max
            65504.0, 65520.0, 2.0 ** -24, 2.0 ** -14,                                 # fp16 max, overflow, subnormals
            float("inf"), float("nan")]
    for m, below, above, tie in ((448.0, 416.0, 480.0, 464.0), (57344.0, 49152.0, 61440.0, 53248.0)):
        # fp8 max, its neighbours one fp32 ulp and one fp8 ulp away, the rounding tie above max-1ulp
        mags += [m, _next32(m, math.inf), _next32(m, 0.0), below, above, tie,
                 _next32(tie, math.inf), _next32(tie, 0.0)]
    # e4m3 subnormals (2^-9 .. 7 * 2^-9), their ties, the smallest normal
    mags += [2.0 ** -9, 2.0 ** -10, 3 * 2.0 ** -10, 7 * 2.0 ** -9, 15 * 2.0 ** -10, 2.0 ** -6, 2.0 ** -7]
    # e5m2 subnormals (2^-16 .. 3 * 2^-16), ties, the smallest normal
    mags += [2.0 ** -16, 2.0 ** -17, 3 * 2.0 ** -17, 3 * 2.0 ** -16, 2.0 ** -15 * 1.5, 2.0 ** -14]
    out, seen = [], set()
    for m in mags:
        for v in (m, -m):
            key = struct.pack("f", v) if not math.isnan(v) else (b"-nan" if math.copysign(1, v) < 0 else b"nan")
            if key not in seen:
                seen.add(key)
                out.append(_f32(v))
    return out


SPECIALS = _specials()
AMAX_SPECIALS = [0.0, -0.0, float("nan"), -float("nan"), float("inf"), 2.0 ** -149, 2.0 ** -126, 1e-30, 1e-3,
                 1.0, 448.0, 57344.0, 3e38, FLT_MAX]
SCALE_SPECIALS = [1.0, 0.0, -0.0, -1.0, 0.37, 2.0 ** -10, 1000.0, float("nan"), -float("nan"), float("inf"),
                  -float("inf"), 2.0 ** -149, 1e-30, 1e30, FLT_MAX, 448.0 / 57344.0, 3.0]

# -----------------------------------------------------------------------------
# strategies: plain descriptions, turned into tensors by build_*()

f32_floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
special_lists = st.lists(st.one_of(st.sampled_from(SPECIALS), f32_floats), max_size=10)

DIMS = [0, 1, 2, 3, 5, 7, 8, 15, 16, 17, 31, 32, 33, 48, 63, 64, 100]
# memory layouts: the valid ones keep the tensor contiguous (row-major, maybe at a
# storage offset); the others are strided views the ops must reject (unless the
# view happens to be contiguous, e.g. a transpose with a size-1 dim)
VALID_LAYOUTS = ["contiguous"] * 3 + ["offset"]
STRIDED_LAYOUTS = ["transposed", "sliced", "sliced_rows", "expanded", "channels_last"]
VALUE_MODES = ["normal", "wide", "tiny", "huge", "sprinkle", "sprinkle", "specials_only"]
WRONG_X = [F64, torch.int32, torch.int64, torch.bool, E4, E5, torch.uint8, torch.int8, torch.complex64]
WRONG_FP8_OUT = [BF16, F32, F16, F64, torch.int8, torch.uint8, torch.bool]
WRONG_HP_OUT = [F64, torch.int32, E4, E5, torch.bool, torch.int8]
WRONG_OPERAND = [BF16, F32, F16, torch.uint8, torch.int8, torch.bool]


@st.composite
def faults(draw, names):
    """Which arguments (or argument properties) this case makes invalid: none
    in half the cases, one or two otherwise."""
    k = draw(st.sampled_from([0, 0, 0, 0, 1, 1, 1, 2]))
    return set(draw(st.lists(st.sampled_from(names), min_size=k, max_size=k, unique=True))) if k else set()


@st.composite
def shapes(draw, min_dims=1, max_dims=4, budget=1 << 14):
    if max_dims == 0:
        return ()
    if draw(st.integers(0, 5)) == 0:
        # leading dims up to ~5000 while the total stays small
        lead = draw(st.integers(1000, 5000))
        rest = draw(st.lists(st.sampled_from([1, 2, 3]), min_size=max(0, min_dims - 1), max_size=max(0, max_dims - 1)))
        return (lead, *rest)
    nd = draw(st.integers(min_dims, max_dims))
    dims = [draw(st.one_of(st.sampled_from(DIMS), st.integers(0, 70))) for _ in range(nd)]
    while math.prod(dims) > budget:          # shrink the largest dim until the total fits
        i = max(range(nd), key=lambda j: dims[j])
        dims[i] = max(1, dims[i] // 3)
    return tuple(dims)


@st.composite
def values(draw):
    """How to fill a tensor: a seed for the bulk, a mode, and hypothesis-chosen special values."""
    return {"seed": draw(st.integers(0, 2 ** 31 - 1)), "mode": draw(st.sampled_from(VALUE_MODES)),
            "specials": draw(special_lists)}


@st.composite
def tensor_specs(draw, dtypes, min_dims=1, max_dims=4, layouts=tuple(VALID_LAYOUTS), budget=1 << 14):
    return {"shape": draw(shapes(min_dims, max_dims, budget)), "dtype": draw(st.sampled_from(dtypes)),
            "layout": draw(st.sampled_from(layouts)), "offset": draw(st.integers(1, 5)),
            "values": draw(values())}


SCALE_FORMS_OK = ["1"] * 6 + ["0d", "1x1", "view"]
SCALE_FORMS_BAD = ["f64", "f16", "bf16", "i32", "empty", "two"]


@st.composite
def scale_specs(draw, bad=False, finite_positive=False):
    if finite_positive:
        v = draw(st.one_of(st.sampled_from([1.0, 0.37, 2.0 ** -10, 3.0, 1000.0, 448.0 / 57344.0]),
                           st.floats(2.0 ** -20, 2.0 ** 20, width=32)))
    else:
        v = draw(st.one_of(st.sampled_from(SCALE_SPECIALS), f32_floats))
    return {"value": v, "form": draw(st.sampled_from(SCALE_FORMS_BAD if bad else SCALE_FORMS_OK))}


# =============================================================================
# building tensors

def _fill(shape, v) -> torch.Tensor:
    """A contiguous float32 CPU tensor of `shape` filled as `v` describes."""
    g = torch.Generator().manual_seed(v["seed"])
    n = math.prod(shape)
    mode, sp = v["mode"], v["specials"]
    t = torch.randn(n, generator=g)
    if mode == "wide":
        t = t * torch.exp2(torch.randint(-40, 41, (n,), generator=g).float())
    elif mode == "tiny":
        t = t * 2.0 ** -12
    elif mode == "huge":
        t = t * 1e4
    elif mode == "specials_only":
        pool = torch.tensor(sp or SPECIALS, dtype=F32)
        t = pool[torch.randint(0, pool.numel(), (n,), generator=g)] if n else t
    if sp and n and mode != "specials_only":
        pos = torch.randint(0, n, (len(sp),), generator=g)
        t[pos] = torch.tensor(sp, dtype=F32)
    return t.reshape(shape)


def _convert(t: torch.Tensor, dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return t != 0
    if not (dtype.is_floating_point or dtype.is_complex):
        # integer dtypes: values must just exist (the op must reject them)
        return torch.nan_to_num(t, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-100, 100).to(dtype)
    return t.to(dtype)


def build_tensor(spec, device, data: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of spec's logical shape and dtype in spec's memory layout on `device`,
    holding _fill()'s values (or `data`, already of the right dtype). Empty on meta."""
    shape, dtype, layout = tuple(spec["shape"]), spec["dtype"], spec["layout"]
    nd = len(shape)
    if data is None:
        data = _convert(_fill(shape, spec["values"]), dtype)
    real = device != "meta"

    def empty(s):
        return torch.empty(s, dtype=dtype, device=device)

    if layout == "expanded" and nd >= 1 and 0 not in shape:
        d = next((i for i in range(nd) if shape[i] > 1), 0)
        base = empty(shape[:d] + (1,) + shape[d + 1:])
        if real:
            base.copy_(data.narrow(d, 0, 1))
        return base.expand(shape)
    if layout == "transposed" and nd >= 2:
        t = empty(shape[:-2] + (shape[-1], shape[-2])).transpose(-1, -2)
    elif layout == "sliced" and nd >= 1:
        t = empty(shape[:-1] + (2 * shape[-1],))[..., ::2]
    elif layout == "sliced_rows" and nd >= 1:
        t = empty((2 * shape[0],) + shape[1:])[::2]
    elif layout == "channels_last" and nd == 4:
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=torch.channels_last)
    elif layout == "offset":
        off = spec.get("offset", 1)
        t = empty((math.prod(shape) + off,))[off:].view(shape)
    else:
        t = empty(shape)
    if real:
        t.copy_(data)
    return t


def build_scale(spec, device) -> torch.Tensor:
    v, form = spec["value"], spec["form"]
    one = torch.tensor([v], dtype=F32)
    t = {"1": one, "0d": one.reshape(()), "1x1": one.reshape(1, 1),
         "view": torch.tensor([0.0, v, 0.0], dtype=F32)[1:2],
         "f64": one.double(), "f16": one.half(), "bf16": one.bfloat16(),
         "i32": _convert(one, torch.int32), "empty": torch.empty(0), "two": torch.tensor([v, v])}[form]
    if form == "view" and device != "meta":
        return torch.tensor([0.0, v, 0.0], dtype=F32, device=device)[1:2]
    return t.to(device) if device != "meta" else torch.empty(t.shape, dtype=t.dtype, device="meta")


def _other(device: str) -> str:
    """The device a mixed-device case moves one argument to."""
    return "meta" if device == "cpu" else "cpu"


# =============================================================================
# outcome checking

def _named(msg: str, op: str, names: set[str]) -> str | None:
    """The invalid argument that the message of fp8ops::<op> names, if any."""
    m = re.search(rf"fp8ops::{op}: (.*)", msg)
    if not m:
        return None
    text = m.group(1)
    for n in names:
        if n == "M, N and K":
            if "M, N and K" in text:
                return n
            continue
        e = re.escape(n)
        if re.match(rf"{e}\b", text) or re.search(rf"\b(and|but) {e}\b", text):
            return n
    return None


def _outcome(op: str, bad: set[str], fn, *, fake=False):
    """Run fn; return (result, None) or (None, message). Checks the contract:
    RuntimeError naming an invalid argument iff the case is invalid."""
    try:
        res = fn()
    except RuntimeError as e:
        msg = str(e)
        assert bad, f"fp8ops::{op}{' (fake kernel)' if fake else ''} raised on a valid case: {msg}"
        assert _named(msg, op, bad), (f"fp8ops::{op}{' (fake kernel)' if fake else ''}: the error does not name "
                                      f"one of the invalid arguments {sorted(bad)}: {msg}")
        return None, msg
    except Exception as e:  # noqa: BLE001 -- any other type breaks the contract
        raise AssertionError(f"fp8ops::{op} raised {type(e).__name__}, not RuntimeError: {e}") from e
    if not fake:
        assert not bad, f"fp8ops::{op} accepted invalid arguments {sorted(bad)}"
    return res, None


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _assert_same_bits(got, ref, nan_ok=None, what=""):
    """Bit-identical, except positions in nan_ok where both are NaN (any encoding)."""
    assert got.shape == ref.shape and got.dtype == ref.dtype, f"{what}: {got.shape}/{got.dtype} vs {ref.shape}/{ref.dtype}"
    same = _bits(got) == _bits(ref)
    if nan_ok is not None:
        same |= nan_ok.cpu() & got.cpu().float().isnan() & ref.cpu().float().isnan()
    bad = (~same).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {same.numel()} elements differ, first at "
                              f"{bad[:3].tolist()}: got {_at(got, bad[0])}, ref {_at(ref, bad[0])}")


def _at(t, idx):
    v = t.cpu()[tuple(idx.tolist())]
    return f"{v.float().item()!r} (bits {int(_bits(v.reshape(1))[0]) & 0xFFFFFFFF:#x})"


def _assert_scalar_equal(got, ref, what):
    """Float32 scalars: bit-identical, or both NaN."""
    g, r = got.detach().cpu().reshape(()), ref.detach().cpu().reshape(())
    if math.isnan(g.item()) and math.isnan(r.item()):
        return
    assert _bits(g.reshape(1)).item() == _bits(r.float().reshape(1)).item(), f"{what}: got {g.item()!r}, ref {r.item()!r}"


# =============================================================================
# cast

@st.composite
def cast_cases(draw, device="cpu"):
    f = draw(faults(["x_dtype", "x_layout", "x_0d", "scale", "out_dtype", "mix"]))
    x0d = "x_0d" in f
    return {"op": "cast",
            "x": draw(tensor_specs(WRONG_X if "x_dtype" in f else HP, min_dims=0 if x0d else 1,
                                   max_dims=0 if x0d else 4,
                                   layouts=STRIDED_LAYOUTS if "x_layout" in f else VALID_LAYOUTS)),
            "scale": draw(scale_specs(bad="scale" in f)),
            "out_dtype": draw(st.sampled_from(WRONG_FP8_OUT if "out_dtype" in f else FP8)),
            "transpose": draw(st.booleans()),
            # mixed devices: on CPU the other device is meta (the fake kernel checks it), on CUDA cpu
            "mix": draw(st.sampled_from(["x", "scale"])) if "mix" in f else None}


def cast_bad(x, scale, out_dtype) -> set[str]:
    bad = set()
    if x.dtype not in HP or x.dim() == 0 or not x.is_contiguous():
        bad.add("x")
    if out_dtype not in FP8:
        bad.add("out_dtype")
    if scale.dtype != F32 or scale.numel() != 1:
        bad.add("scale")
    if scale.device != x.device:
        bad |= {"scale", "x"}
    return bad


def check_cast(case, device="cpu") -> str:
    mix = case["mix"]
    x = build_tensor(case["x"], _other(device) if mix == "x" else device)
    scale = build_scale(case["scale"], _other(device) if mix == "scale" else device)
    out_dtype, transpose = case["out_dtype"], case["transpose"]
    bad = cast_bad(x, scale, out_dtype)
    # mixed cpu/meta: the fake kernel's device check must reject it like the C one does cpu/cuda
    res, err = _outcome("cast", bad, lambda: ops.cast(x, scale, out_dtype, transpose))
    if err is None:
        _check_cast_result(x, scale, out_dtype, transpose, *res)
    if device == "cpu" and mix is None:
        _mirror_on_meta("cast", case, bad, res,
                        lambda: ops.cast(build_tensor(case["x"], "meta"), build_scale(case["scale"], "meta"),
                                         out_dtype, transpose))
    return "raised" if err else "ok"


def _check_cast_result(x, scale, out_dtype, transpose, out, out_t, amax):
    dev = x.device
    assert out.shape == x.shape and out.dtype == out_dtype and out.device == dev
    assert amax.shape == () and amax.dtype == F32 and amax.device == dev
    cols = x.shape[-1]
    rows = x.numel() // cols if cols else 0
    if not transpose:
        assert out_t.shape == (0,) and out_t.dtype == out_dtype
    elif cols:
        assert out_t.shape == (cols, rows) and out_t.dtype == out_dtype
    else:
        # x [.., 0]: out_t is empty with 0 rows (its second dim: see test_cast_zero_cols_transpose_shape)
        assert out_t.dtype == out_dtype and out_t.dim() == 2 and out_t.shape[0] == 0
    xc, sc = x.cpu(), scale.cpu()
    r_out, _, r_amax = cast_ref(xc, sc, out_dtype, False)
    s = sc.reshape(()).item()
    r_out = _nan_sign_from_input(r_out, xc, s)
    nan_ok = xc.float().isnan() & math.isnan(s)          # NaN * NaN: sign unspecified
    _assert_same_bits(out, r_out, nan_ok, "cast out")
    if transpose and cols and rows:
        _assert_same_bits(out_t, r_out.reshape(rows, cols).t(), nan_ok.reshape(rows, cols).t(), "cast out_t")
    _assert_scalar_equal(amax, r_amax, "cast amax")
    # the decided semantics, spelled out
    if x.numel():
        o = out.cpu().float()
        prod_nan = (xc.float() * s).isnan()
        inf_x = xc.float().isinf() & ~prod_nan
        if out_dtype == torch.float8_e4m3fn:
            assert torch.equal(o.isnan(), prod_nan | inf_x), \
                "cast: e4m3fn out must be NaN exactly where x * scale is NaN or x is infinite"
        else:
            assert torch.equal(o.isnan(), prod_nan), "cast: out must be NaN exactly where x * scale is NaN"
            assert torch.equal(o.isinf(), inf_x), "cast: e5m2 out must be +-inf exactly where x is infinite"
            assert torch.equal(o[inf_x].sign(), (xc.float() * s)[inf_x].sign()), "cast: an infinite x keeps its sign"
        finite = ~prod_nan & ~inf_x
        assert (o[finite].abs() <= FP8_MAX[out_dtype]).all()
        if s == 0.0:
            assert (o[finite] == 0).all()
        if math.isinf(s):
            nz = finite & (xc.float() != 0)
            assert (o[nz].abs() == FP8_MAX[out_dtype]).all(), "cast: a finite nonzero x times inf saturates"


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _nan_sign_from_input(r_out: torch.Tensor, x: torch.Tensor, s: float) -> torch.Tensor:
    """The reference with a torch quirk corrected: a NaN x keeps its sign bit
    through the cast (fp8_convert.h: "the sign bit copied, NaN included"), but
    torch's scalar float16 -> float32 conversion (the tail of a vectorised
    loop, e.g. element 1000 of 1001) drops the sign of a NaN, so the reference's
    NaN sign depends on the element's position. With a non-NaN scale, out is
    the NaN 0x7F with x's raw sign bit."""
    if math.isnan(s) or not x.is_floating_point():
        return r_out
    x_nan = x.float().isnan()
    if not x_nan.any():
        return r_out
    neg = (_bits(x) < 0) if x.element_size() > 1 else None
    fixed = torch.where(neg, torch.tensor(0xFF, dtype=torch.uint8), torch.tensor(0x7F, dtype=torch.uint8))
    bits = torch.where(x_nan, fixed, _bits(r_out))
    return bits.view(r_out.dtype)


def _mirror_on_meta(op, case, bad, cpu_res, fn):
    """The fake kernel (meta) agrees with the C kernel: same output shapes and
    dtypes where C succeeded; where it raises, it names an invalid argument."""
    meta_res, meta_err = _outcome(op, bad, fn, fake=True)
    if meta_err is None and cpu_res is not None:
        got = meta_res if isinstance(meta_res, (tuple, list)) else (meta_res,)
        want = cpu_res if isinstance(cpu_res, (tuple, list)) else (cpu_res,)
        for g, w in zip(got, want):
            assert g.device.type == "meta", f"fp8ops::{op} fake kernel returned a {g.device} tensor for meta inputs"
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"fp8ops::{op}: fake {g.shape}/{g.dtype} vs real {w.shape}/{w.dtype}"
    if meta_err is not None:
        assert cpu_res is None, f"fp8ops::{op}: the fake kernel rejects a case the C kernel accepts: {meta_err}"


# =============================================================================
# amax

@st.composite
def amax_cases(draw, device="cpu"):
    f = draw(faults(["x_dtype", "x_layout"]))
    x0d = draw(st.integers(0, 10)) == 0       # a 0-dim x is fine for amax
    return {"op": "amax", "x": draw(tensor_specs(WRONG_X if "x_dtype" in f else HP, min_dims=0 if x0d else 1,
                                                 max_dims=0 if x0d else 4,
                                                 layouts=STRIDED_LAYOUTS if "x_layout" in f else VALID_LAYOUTS))}


def check_amax(case, device="cpu") -> str:
    x = build_tensor(case["x"], device)
    bad = set() if (x.dtype in HP and x.is_contiguous()) else {"x"}
    res, err = _outcome("amax", bad, lambda: ops.amax(x))
    if err is None:
        assert res.shape == () and res.dtype == F32 and res.device == x.device
        _assert_scalar_equal(res, amax_ref(x.cpu()), "amax")
        if x.numel() and not x.cpu().float().isnan().any():
            assert res.item() == x.cpu().float().abs().max().item()
    if device == "cpu":
        _mirror_on_meta("amax", case, bad, res, lambda: ops.amax(build_tensor(case["x"], "meta")))
    return "raised" if err else "ok"


# =============================================================================
# amax_update

MARGINS_OK = [0.0, 0.0, 1.0, 2.0, 0.5, -3.0, 2.5, 63.0, -63.0]
MARGINS_BAD = [float("nan"), float("inf"), -float("inf"), 64.0, -64.0, 127.0, -200.0, 1e6, -1e6, 1e7]
STATE = ("scale", "scale_inv", "fp8_max")


@st.composite
def _state_tensor(draw, name, f):
    return {"dtype": draw(st.sampled_from([F64, F16, BF16, torch.int32] if f"{name}_dtype" in f else [F32])),
            "delta": draw(st.sampled_from([1, -1] if f"{name}_numel" in f else [0])),
            "layout": draw(st.sampled_from(["sliced"] if f"{name}_layout" in f else ["contiguous"] * 3 + ["offset"])),
            "seed": draw(st.integers(0, 2 ** 31 - 1)),
            "specials": draw(st.lists(st.sampled_from(AMAX_SPECIALS + [-1.0, 448.0, 57344.0]), max_size=3))}


@st.composite
def amax_update_cases(draw, device="cpu"):
    gpu = device != "cpu"
    names = ["hist_dtype", "hist_layout", "hist_3d", "hist_H0", "algo", "margin"] + \
        [f"{n}_{what}" for n in STATE for what in ("dtype", "numel", "layout")] + (["mix"] if gpu else [])
    f = draw(faults(names))
    H = 0 if "hist_H0" in f else draw(st.sampled_from([1, 1, 2, 3, 5, 16, 1024]))
    n = draw(st.sampled_from([1, 1, 2, 3, 7, 0]))
    form = "3d" if "hist_3d" in f else draw(st.sampled_from(["2d"] * 5 + ["1d"]))
    margin = draw(st.sampled_from(MARGINS_BAD)) if "margin" in f else \
        draw(st.one_of(st.sampled_from(MARGINS_OK), st.floats(-70, 70, width=32)))  # (past +-64: refused)
    return {"op": "amax_update", "H": H, "n": n, "form": form,
            "history": {"seed": draw(st.integers(0, 2 ** 31 - 1)),
                        "mode": draw(st.sampled_from(["rand", "rand", "wide", "zeros", "specials"])),
                        "specials": draw(st.lists(st.sampled_from(AMAX_SPECIALS), max_size=6)),
                        "dtype": draw(st.sampled_from([F64, F16, torch.int32] if "hist_dtype" in f else [F32])),
                        "layout": "transposed" if "hist_layout" in f else draw(st.sampled_from(["contiguous", "offset"]))},
            **{name: draw(_state_tensor(name, f)) for name in STATE},
            "margin": margin,
            "algo": draw(st.sampled_from([2, -1, 7, 2 ** 40])) if "algo" in f else draw(st.sampled_from([0, 1])),
            "mix": draw(st.sampled_from(["amax_history", *STATE])) if "mix" in f else None}


def _place(t: torch.Tensor, layout: str, device: str) -> torch.Tensor:
    """t's values in `layout` on device: "offset" (storage offset), "sliced"
    (every other element of a 1-D buffer), "transposed" (a 2-D transpose view)."""
    shape, n = tuple(t.shape), t.numel()

    def empty(s):
        return torch.empty(s, dtype=t.dtype, device=device)

    if layout == "offset":
        s = empty((n + 2,))[2:].view(shape)
    elif layout == "sliced" and t.dim() == 1:
        s = empty((2 * n,))[::2]
    elif layout == "transposed" and t.dim() == 2:
        s = empty(shape[::-1]).t()
    else:
        s = empty(shape)
    if device != "meta":
        s.copy_(t)
    return s


def build_amax_update(case, device):
    H, n, form = case["H"], case["n"], case["form"]
    hs = case["history"]
    g = torch.Generator().manual_seed(hs["seed"])
    shape = {"2d": (H, n), "1d": (H,), "3d": (H, n, 1)}[form]
    numel = math.prod(shape)
    mode = hs["mode"]
    h = torch.rand(numel, generator=g) * 100
    if mode == "wide":
        h = h * torch.exp2(torch.randint(-60, 61, (numel,), generator=g).float())
    elif mode == "zeros":
        h = torch.zeros(numel)
    elif mode == "specials":
        pool = torch.tensor(hs["specials"] or AMAX_SPECIALS, dtype=F32)
        h = pool[torch.randint(0, pool.numel(), (numel,), generator=g)] if numel else h
    if hs["specials"] and numel and mode != "specials":
        h[torch.randint(0, numel, (len(hs["specials"]),), generator=g)] = torch.tensor(hs["specials"], dtype=F32)
    hist_vals = _convert(h.reshape(shape), hs["dtype"])
    ncols = n if form != "1d" else 1

    def state(name, default):
        sp = case[name]
        k = max(0, ncols + sp["delta"])
        gg = torch.Generator().manual_seed(sp["seed"])
        if name == "fp8_max":
            v = torch.tensor([448.0, 57344.0])[torch.randint(0, 2, (k,), generator=gg)] if k else torch.empty(0)
        else:
            v = torch.rand(k, generator=gg) + 0.5
        if sp["specials"] and k and torch.rand((), generator=gg) < 0.3:
            v[torch.randint(0, k, (len(sp["specials"]),), generator=gg)] = torch.tensor(sp["specials"], dtype=F32)
        return _convert(v, sp["dtype"]), sp["layout"]

    mix = case["mix"]
    dev = {k: (_other(device) if mix == k else device) for k in ("amax_history", "scale", "scale_inv", "fp8_max")}
    hist = _place(hist_vals, hs["layout"], dev["amax_history"])
    tensors = {"amax_history": hist}
    for name in ("scale", "scale_inv", "fp8_max"):
        v, layout = state(name, None)
        tensors[name] = _place(v, layout, dev[name])
    return tensors


NO_COUNTS = torch.empty(0, dtype=torch.int64)  # amax_update without overflow counters


def amax_update_bad(t, margin, algo) -> set[str]:
    bad = set()
    h = t["amax_history"]
    for name, x in t.items():
        # scale_inv may also be a 1-D strided view (Fp8Linear pads it for GEMM alignment)
        layout_ok = x.is_contiguous() or (name == "scale_inv" and x.dim() == 1 and x.stride(0) >= 1)
        if x.dtype != F32 or not layout_ok:
            bad.add(name)
        if x.device != h.device:
            bad |= {name, "amax_history"}
    if h.dim() not in (1, 2) or h.shape[0] == 0:
        bad.add("amax_history")
    n = h.shape[1] if h.dim() == 2 else 1
    for name in ("scale", "scale_inv", "fp8_max"):
        if t[name].numel() != n:
            bad.add(name)
    if algo not in (0, 1):
        bad.add("algo")
    if not (-64 < margin < 64):         # also NaN
        bad.add("margin")
    return bad


def check_amax_update(case, device="cpu") -> str:
    t = build_amax_update(case, device)
    margin, algo = case["margin"], case["algo"]
    bad = amax_update_bad(t, margin, algo)
    before = {k: v.clone() for k, v in t.items()}
    res, err = _outcome("amax_update", bad, lambda: torch.ops.fp8ops.amax_update.default(
        t["amax_history"], t["scale"], t["scale_inv"], t["fp8_max"], margin, algo, NO_COUNTS))
    if err is not None:
        # a rejected call leaves every buffer untouched
        for k, v in t.items():
            if v.device.type != "meta":
                _assert_same_bits(v, before[k], what=f"amax_update (raised) {k}")
    else:
        assert res is None
        _check_amax_update_result(t, before, margin, algo, gpu=device != "cpu")
    if device == "cpu":
        _mirror_on_meta("amax_update", case, bad, None if err else (), lambda: torch.ops.fp8ops.amax_update.default(
            *(_meta_like(v) for v in t.values()), margin, algo, NO_COUNTS))
    return "raised" if err else "ok"


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in float32 ulps (same-sign finite values; inf/NaN compare as huge)."""
    ia, ib = _bits(a).long(), _bits(b).long()
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return (ia - ib).abs()


def _check_amax_update_result(t, before, margin, algo, gpu=False):
    h0 = before["amax_history"]
    n = h0.shape[1] if h0.dim() == 2 else 1
    _assert_same_bits(t["fp8_max"], before["fp8_max"], what="fp8_max is read-only")
    if n == 0:
        for k in ("amax_history", "scale", "scale_inv"):
            _assert_same_bits(t[k], before[k], what=f"amax_update n=0 {k}")
        return
    rh, rs, rsi = amax_update_ref(h0.cpu(), before["scale"].cpu(), before["scale_inv"].cpu(), before["fp8_max"].cpu(),
                                  margin, "max" if algo == 0 else "most_recent")
    _assert_same_bits(t["amax_history"], rh, what="amax_update history")
    for name, got, ref in (("scale", t["scale"], rs), ("scale_inv", t["scale_inv"], rsi)):
        got, ref = got.cpu().reshape(-1), ref.reshape(-1)
        both_nan = got.isnan() & ref.isnan()
        if gpu and margin != int(margin):
            # CUDA's exp2f is within 2 ulp, not correctly rounded; 1/scale adds one more
            close = (_ulps(got, ref) <= 3) | both_nan | (got == ref)
            assert close.all(), f"amax_update {name}: got {got.tolist()}, ref {ref.tolist()}"
        else:
            _assert_same_bits(got, ref, both_nan, f"amax_update {name}")


# =============================================================================
# gemm

GEMM_DIMS = [0, 1, 2, 3, 5, 15, 16, 17, 31, 32, 33, 48, 64]
FP8_SPECIALS = [0.0, -0.0, 448.0, -448.0, 2.0 ** -9, -(2.0 ** -9), 57344.0, 2.0 ** -16, 1.0, -1.0,
                float("nan"), float("inf"), -float("inf")]


@st.composite
def gemm_operand(draw, name, f, finite=False):
    return {"dtype": draw(st.sampled_from(WRONG_OPERAND if f"{name}_dtype" in f else [E4, E5])),
            "dims": draw(st.sampled_from(["1d", "3d"])) if f"{name}_dims" in f else "2d",
            "layout": draw(st.sampled_from(["transposed", "sliced", "sliced_rows", "expanded"] if f"{name}_layout" in f
                                           else VALID_LAYOUTS)),
            "offset": draw(st.integers(1, 5)),
            "seed": draw(st.integers(0, 2 ** 31 - 1)),
            "mode": draw(st.sampled_from(["normal"] * 3 + (["sprinkle"] if finite else ["bytes", "sprinkle", "sprinkle"]))),
            "specials": draw(st.lists(st.sampled_from(FP8_SPECIALS[:10] if finite else FP8_SPECIALS), max_size=6)),
            "finite": finite}


@st.composite
def gemm_cases(draw, device="cpu"):
    gpu = device != "cpu"
    names = ["a_dtype", "b_dtype", "e5e5", "a_dims", "b_dims", "K", "a_layout", "b_layout", "sa", "sb", "bias",
             "out_dtype"] + (["mix", "dims16"] if gpu else [])
    f = draw(faults(names))
    if gpu:
        # cuBLASLt: M, N, K positive multiples of 16 (others must raise)
        dim = st.sampled_from([17, 8, 0, 1, 24]) if "dims16" in f else st.sampled_from([16, 32, 48, 64])
        M, N, K = draw(dim), draw(dim), draw(dim)
    elif draw(st.integers(0, 7)) == 0:
        M, N, K = draw(st.integers(1000, 5000)), draw(st.sampled_from([1, 2, 3, 4])), draw(st.sampled_from([0, 1, 2, 3, 16]))
    else:
        M, N, K = (draw(st.sampled_from(GEMM_DIMS)) for _ in range(3))
        if draw(st.booleans()):
            K = draw(st.integers(0, 200))
    a = draw(gemm_operand("a", f, finite=gpu))
    b = draw(gemm_operand("b", f, finite=gpu))
    if "e5e5" in f:
        a["dtype"] = b["dtype"] = E5
    elif a["dtype"] == E5 and b["dtype"] == E5:
        b["dtype"] = E4
    return {"op": "gemm", "M": M, "N": N, "K": K, "a": a, "b": b,
            "K_b": draw(st.sampled_from([K + 1, K + 16])) if "K" in f else None,   # a different K for b
            "sa": draw(scale_specs(bad="sa" in f, finite_positive=gpu)),
            "sb": draw(scale_specs(bad="sb" in f, finite_positive=gpu)),
            "bias": {"kind": draw(st.sampled_from(["wrong_dtype", "wrong_len", "2d", "sliced"] if "bias" in f else
                                                  ["none", "valid", "valid", "empty_int"])),
                     "seed": draw(st.integers(0, 2 ** 31 - 1)),
                     "specials": draw(st.lists(st.sampled_from([0.0, -0.0, 65504.0] if gpu else
                                                               [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 65504.0, 1e30]),
                                               max_size=3))},
            "out_dtype": draw(st.sampled_from(WRONG_HP_OUT if "out_dtype" in f else HP)),
            "fast_accum": draw(st.booleans()),
            "mix": draw(st.sampled_from(["a", "b", "sa", "sb", "bias"])) if "mix" in f else None}


def _fp8_values(spec, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec["seed"])
    n = math.prod(shape)
    if spec["mode"] == "bytes" and dtype in FP8:
        # every bit pattern: subnormals, max, NaN (and inf for e5m2)
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(dtype)
    t = (torch.randn(n, generator=g) * 4 * torch.exp2(torch.randint(-3, 4, (n,), generator=g).float()))
    if spec["mode"] == "sprinkle" and spec["specials"] and n:
        t[torch.randint(0, n, (len(spec["specials"]),), generator=g)] = torch.tensor(spec["specials"], dtype=F32)
    t = t.reshape(shape)
    if dtype in FP8:
        # sprinkled values beyond fp8_max become NaN (e4m3fn) / inf (e5m2), except for "finite" operands
        t = t.clamp(-FP8_MAX[dtype], FP8_MAX[dtype]) if spec["mode"] != "sprinkle" or spec.get("finite") else t
        return t.to(dtype)
    return _convert(t, dtype)


def build_gemm(case, device):
    M, N, K = case["M"], case["N"], case["K"]
    Kb = case["K_b"] if case["K_b"] is not None else K
    mix = case["mix"]

    def operand(name, rows, k):
        sp = case[name]
        shape = {"2d": (rows, k), "1d": (k,), "3d": (2, rows, k)}[sp["dims"]]
        dt = sp["dtype"]
        data = _fp8_values(sp, shape, dt)
        spec = {"shape": shape, "dtype": dt, "layout": sp["layout"], "offset": sp["offset"]}
        return build_tensor(spec, _other(device) if mix == name else device, data)

    a, b = operand("a", M, K), operand("b", N, Kb)
    sa = build_scale(case["sa"], _other(device) if mix == "sa" else device)
    sb = build_scale(case["sb"], _other(device) if mix == "sb" else device)
    out_dtype = case["out_dtype"]
    bs = case["bias"]
    kind = bs["kind"]
    bdt = ops._bias_dtype(out_dtype) if out_dtype in HP else BF16
    g = torch.Generator().manual_seed(bs["seed"])
    bdev = _other(device) if mix == "bias" else device
    if kind == "none":
        bias = None
    elif kind == "empty_int":
        bias = torch.empty(0, dtype=torch.int32, device=bdev)            # no elements: "absent"
    else:
        length = N + 1 if kind == "wrong_len" else N
        v = torch.randn(length, generator=g) * 3
        if bs["specials"] and length:
            v[torch.randint(0, length, (len(bs["specials"]),), generator=g)] = torch.tensor(bs["specials"], dtype=F32)
        dt = {BF16: F16, F16: F32, F32: BF16}[bdt] if kind == "wrong_dtype" else bdt
        spec = {"shape": (1, length) if kind == "2d" else (length,), "dtype": dt,
                "layout": "sliced" if kind == "sliced" else "contiguous"}
        bias = build_tensor(spec, bdev, v.reshape(spec["shape"]).to(dt))
    return a, b, sa, sb, bias, out_dtype


def gemm_bad(a, b, sa, sb, bias, out_dtype, gpu=False) -> set[str]:
    bad = set()
    for name, t in (("a", a), ("b", b)):
        if t.dtype not in FP8 or t.dim() != 2 or not t.is_contiguous():
            bad.add(name)
    if out_dtype not in HP:
        bad.add("out_dtype")
    if a.dtype == E5 and b.dtype == E5:
        bad |= {"a", "b"}
    if a.dim() == 2 and b.dim() == 2 and a.shape[1] != b.shape[1]:
        bad |= {"a", "b"}
    if b.device != a.device:
        bad |= {"a", "b"}
    for name, s in (("a_scale_inv", sa), ("b_scale_inv", sb)):
        if s.dtype != F32 or s.numel() != 1:
            bad.add(name)
        if s.device != a.device:
            bad |= {name, "a"}
    if bias is not None and bias.numel() > 0 and b.dim() == 2 and out_dtype in HP:
        if bias.dim() != 1 or bias.numel() != b.shape[0] or bias.dtype != ops._bias_dtype(out_dtype) \
                or not bias.is_contiguous():
            bad.add("bias")
        if bias.device != a.device:
            bad |= {"bias", "a"}
    if gpu and not bad:
        M, K, N = a.shape[0], a.shape[1], b.shape[0]
        if M % 16 or N % 16 or K % 16 or 0 in (M, N, K):
            bad.add("M, N and K")
    return bad


def check_gemm(case, device="cpu") -> str:
    a, b, sa, sb, bias, out_dtype = build_gemm(case, device)
    fast = case["fast_accum"]
    gpu = device != "cpu"
    bad = gemm_bad(a, b, sa, sb, bias, out_dtype, gpu)
    res, err = _outcome("gemm", bad, lambda: ops.gemm(a, b, sa, sb, bias, out_dtype, fast))
    if err is None:
        M, N = a.shape[0], b.shape[0]
        assert res.shape == (M, N) and res.dtype == out_dtype and res.device == a.device
        _assert_gemm_close(res, a, b, sa, sb, bias, out_dtype, gpu=gpu)
    if device == "cpu":
        def meta():
            mbias = None if bias is None else _meta_like(bias)
            return ops.gemm(_meta_like(a), _meta_like(b), build_scale(case["sa"], "meta"),
                            build_scale(case["sb"], "meta"), mbias, out_dtype, fast)
        _mirror_on_meta("gemm", case, bad, res, meta)
    return "raised" if err else "ok"


def _assert_gemm_close(got, a, b, sa, sb, bias, out_dtype, gpu=False):
    """got must lie between the two roundings of the exact result's error
    interval: out = round_out(round32(round32(sum_k a*b) * s32) + bias), where
    the fp32 accumulation of K exact fp8 products is off by at most
    ~K * 2^-24 * sum|a*b| (any summation order), s32 = fp32(sa * sb), and every
    later step (fp32 multiply, fp32 bias add, rounding to out_dtype) is
    monotonic. NaN only where an interval end is NaN, or where the accumulated
    value may be exactly 0 and s32 is inf (0 * inf)."""
    A, B = a.cpu().double(), b.cpu().double()
    acc = A @ B.t()
    absacc = A.abs() @ B.abs().t()
    s32 = (sa.cpu().float().reshape(()) * sb.cpu().float().reshape(()))
    s = s32.double()
    K = a.shape[1]
    rel = (2.0 ** -8) if gpu else (K + 1) * 2.0 ** -24 * 1.01
    err = torch.where(absacc.isfinite(), absacc * rel + absacc * 2.0 ** -45, torch.zeros_like(absacc))
    lo_acc, hi_acc = acc - err, acc + err
    t1, t2 = lo_acc * s, hi_acc * s
    lo, hi = torch.minimum(t1, t2), torch.maximum(t1, t2)
    lo = lo - lo.abs() * 2.0 ** -50
    hi = hi + hi.abs() * 2.0 ** -50
    lo32, hi32 = lo.float(), hi.float()           # double -> float: monotonic, overflows to inf
    if bias is not None and bias.numel():
        bf = bias.cpu().float()
        lo32, hi32 = lo32 + bf, hi32 + bf
    lo_o, hi_o = lo32.to(out_dtype).float(), hi32.to(out_dtype).float()
    g = got.cpu().float()
    zero_times_inf = torch.isinf(s) & (lo_acc <= 0) & (hi_acc >= 0)
    lo_nan, hi_nan = lo_o.isnan(), hi_o.isnan()
    nan_allowed = lo_nan | hi_nan | zero_times_inf
    # the non-NaN values allowed: between the non-NaN ends (none if both are NaN)
    lo_b, hi_b = torch.where(lo_nan, hi_o, lo_o), torch.where(hi_nan, lo_o, hi_o)
    lo_b, hi_b = torch.minimum(lo_b, hi_b), torch.maximum(lo_b, hi_b)
    in_range = (g >= lo_b) & (g <= hi_b)
    ok = torch.where(g.isnan(), nan_allowed, in_range)
    bad = (~ok).nonzero()
    assert bad.numel() == 0, (
        f"gemm: {bad.shape[0]} of {g.numel()} outputs outside the rounding interval; first at {bad[0].tolist()}: "
        f"got {g[tuple(bad[0])].item()!r}, allowed [{lo_b[tuple(bad[0])].item()!r}, {hi_b[tuple(bad[0])].item()!r}]"
        f" (exact {(acc * s)[tuple(bad[0])].item()!r}, NaN allowed: {bool(nan_allowed[tuple(bad[0])])})")


# =============================================================================
# drivers

CHECKS = {"cast": check_cast, "amax": check_amax, "amax_update": check_amax_update, "gemm": check_gemm}
STRATEGIES = {"cast": cast_cases, "amax": amax_cases, "amax_update": amax_update_cases, "gemm": gemm_cases}


def _hyp_settings(n: int, derandomize: bool):
    return settings(max_examples=n, deadline=None, database=None, derandomize=derandomize,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def fuzz(op: str, n: int, device: str = "cpu", derandomize: bool = True, seed: int | None = None,
         counts: dict | None = None) -> dict:
    """Run n hypothesis cases of op ("any": all ops mixed) on device; returns outcome counts."""
    counts = counts if counts is not None else {}
    strategy = (st.one_of(*(STRATEGIES[o](device) for o in CHECKS)) if op == "any" else STRATEGIES[op](device))

    @_hyp_settings(n, derandomize)
    @given(case=strategy)
    def run(case):
        outcome = CHECKS[case["op"]](case, device)
        key = f"{case['op']}:{outcome}"
        counts[key] = counts.get(key, 0) + 1

    if seed is not None:
        run = hyp_seed(seed)(run)
    run()
    return counts


def _nightly_examples(config) -> int:
    env = os.environ.get("FP8OPS_FUZZ_EXAMPLES")
    if env:
        return int(env)
    markexpr = config.getoption("markexpr", "") or ""
    if re.search(r"(?<!not )\bslow\b", markexpr):
        return NIGHTLY_DEFAULT
    return 0


# -----------------------------------------------------------------------------
# CI profile

CPU_AND_CUDA = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]
CPU_AND_FP8 = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.fp8, requires_fp8])]


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_fuzz_cast(device):
    counts = fuzz("cast", CI_EXAMPLES["cast"], device)
    assert counts.get("cast:ok", 0) > 0 and counts.get("cast:raised", 0) > 0, counts


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_fuzz_amax(device):
    counts = fuzz("amax", CI_EXAMPLES["amax"], device)
    assert counts.get("amax:ok", 0) > 0, counts


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_fuzz_amax_update(device):
    counts = fuzz("amax_update", CI_EXAMPLES["amax_update"], device)
    assert counts.get("amax_update:ok", 0) > 0 and counts.get("amax_update:raised", 0) > 0, counts


@pytest.mark.parametrize("device", CPU_AND_FP8)
def test_fuzz_gemm(device):
    counts = fuzz("gemm", CI_EXAMPLES["gemm"], device)
    assert counts.get("gemm:ok", 0) > 0 and counts.get("gemm:raised", 0) > 0, counts


def _subprocess_env() -> dict:
    """The child imports the very fp8ops this process imported (installed or
    in-tree), never a source tree it happens to start in."""
    env = dict(os.environ)
    pkg_parent = str(Path(fp8ops.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([pkg_parent, str(TESTS_DIR)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


BATCH_SCRIPT = """
import json, sys
import test_fuzz as F
counts = F.fuzz("any", {n}, "{device}", derandomize=False, seed={seed})
total = sum(counts.values())
print("FUZZ-BATCH " + json.dumps({{"cases": total, "counts": counts}}), flush=True)
"""


def run_batch(n: int, seed: int, device: str, tmp_path, timeout: int):
    code = BATCH_SCRIPT.format(n=n, seed=seed, device=device)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_subprocess_env(), capture_output=True,
                       text=True, timeout=timeout)
    tail = (p.stdout + p.stderr)[-6000:]
    assert p.returncode == 0, f"fuzz batch (seed {seed}) died with returncode {p.returncode} " \
                              f"({'signal ' + str(-p.returncode) if p.returncode < 0 else 'exit'}):\n{tail}"
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("FUZZ-BATCH ")), None)
    assert line, f"no summary line:\n{tail}"
    summary = json.loads(line[len("FUZZ-BATCH "):])
    return summary


def test_fuzz_batch_in_subprocess(tmp_path):
    """A segfault or abort in any kernel fails this test (returncode), not pytest."""
    s = run_batch(BATCH_CASES, seed=20261122, device="cpu", tmp_path=tmp_path, timeout=300)
    assert s["cases"] >= BATCH_CASES // 2, s
    ops_seen = {k.split(":")[0] for k in s["counts"]}
    assert ops_seen == set(CHECKS), s
    assert sum(v for k, v in s["counts"].items() if k.endswith(":ok")) > 0, s
    assert sum(v for k, v in s["counts"].items() if k.endswith(":raised")) > 0, s


@pytest.mark.gpu
@requires_fp8
def test_fuzz_batch_in_subprocess_cuda(tmp_path):
    s = run_batch(BATCH_CASES, seed=20261123, device="cuda", tmp_path=tmp_path, timeout=600)
    assert s["cases"] >= BATCH_CASES // 2, s


# -----------------------------------------------------------------------------
# nightly profile

@pytest.mark.slow
@pytest.mark.parametrize("op", list(CHECKS))
@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_fuzz_nightly(op, device, request):
    n = _nightly_examples(request.config)
    if not n:
        pytest.skip("nightly fuzzing: set FP8OPS_FUZZ_EXAMPLES=10000 (or run with -m slow)")
    if op == "gemm" and device == "cuda" and not HAS_FP8:
        pytest.skip("needs an FP8 GPU (sm_89+)")
    counts = fuzz(op, n, device, derandomize=False)
    print(f"{op}/{device}: {counts}")
    assert sum(counts.values()) >= n // 2, counts


@pytest.mark.slow
def test_fuzz_nightly_batch_in_subprocess(request, tmp_path):
    n = _nightly_examples(request.config)
    if not n:
        pytest.skip("nightly fuzzing: set FP8OPS_FUZZ_EXAMPLES=10000 (or run with -m slow)")
    s = run_batch(n, seed=int.from_bytes(os.urandom(4), "little"), device="cpu", tmp_path=tmp_path, timeout=3600)
    assert s["cases"] >= n // 2, s


# =============================================================================
# fixed cases: the decided semantics, and what the fuzzing found

@pytest.mark.parametrize("fp8", FP8, ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [float("nan"), 0.0, -0.0, float("inf"), -float("inf"), -1.0, 2.0 ** -149, FLT_MAX])
def test_cast_special_scales(scale, fp8):
    x = torch.tensor([[1.0, -2.0, 0.0, -0.0, 448.0, 1e-30, float("inf"), -float("inf"), float("nan"), 3e38,
                       2.0 ** -9, -57344.0, 65504.0, 1e-45, 7.0, -0.25]])
    s = torch.tensor([scale])
    out, out_t, amax = ops.cast(x, s, fp8, True)
    ref, ref_t, ref_amax = cast_ref(x, s, fp8, True)
    ref, ref_t = _nan_sign_from_input(ref, x, scale), _nan_sign_from_input(ref_t, x.t().contiguous(), scale)
    nan_ok = x.isnan() & math.isnan(scale)
    _assert_same_bits(out, ref, nan_ok, "out")
    _assert_same_bits(out_t, ref_t, nan_ok.t(), "out_t")
    assert amax.isnan()                               # x holds a NaN: amax is NaN whatever the scale
    o = out.float()
    if math.isnan(scale):
        assert o.isnan().all()
    elif scale == 0:
        finite = x.isfinite()
        assert (o[finite] == 0).all() and o[~finite].isnan().all()   # 0 * inf = NaN
        assert torch.equal(torch.signbit(o[finite]), torch.signbit(x[finite] * scale))
    elif math.isinf(scale):
        nz = x.isfinite() & (x != 0)
        assert (o[nz].abs() == FP8_MAX[fp8]).all()


@pytest.mark.parametrize("dtype", HP, ids=["f32", "bf16", "f16"])
def test_cast_nan_sign_kept_at_every_position(dtype):
    """Found by the nightly fuzzing: 1001 float16 -NaN; torch's reference gives
    +NaN for the last element (its scalar f16->f32 tail), the C kernel -NaN for all."""
    neg_nan_bits = {F32: (-4194304, torch.int32), BF16: (-64, torch.int16), F16: (-512, torch.int16)}[dtype]
    x = torch.full((1001,), neg_nan_bits[0], dtype=neg_nan_bits[1]).view(dtype)      # -NaN, by its bits
    for fp8 in FP8:
        out, _, _ = ops.cast(x, torch.ones(1), fp8)
        assert (out.view(torch.uint8) == 0xFF).all()


def test_cast_zero_cols_outputs():
    for shape in [(5, 0), (0,), (3, 2, 0), (0, 5), (2, 0, 3)]:
        x = torch.empty(shape)
        out, out_t, amax = ops.cast(x, torch.ones(1), E4, True)
        assert out.shape == shape and out_t.numel() == 0 and amax.item() == 0.0


def test_cast_zero_cols_transpose_shape():
    out, out_t, _ = ops.cast(torch.empty(5, 0), torch.ones(1), E4, True)
    assert out_t.shape == (0, 5)


def test_reference_cast_zero_cols():
    cast_ref(torch.empty(5, 0), torch.ones(1), E4, True)


def test_amax_update_margin_float32():
    """The margin reaches the kernel as float32: margins that are float32 values
    agree bit for bit with the reference (see the fuzzing's margins)."""
    for m in (0.5, 1 / 3, 2.7, 63.9):
        m32 = _f32(m)
        h, s, si, fm = torch.tensor([[3.0]]), torch.ones(1), torch.ones(1), torch.tensor([448.0])
        rh, rs, rsi = amax_update_ref(h, s, si, fm, m32, "max")
        ops.amax_update(h, s, si, fm, m32, "max")
        _assert_same_bits(s, rs, what=f"margin {m32}")
        _assert_same_bits(si, rsi, what=f"margin {m32}")


@pytest.mark.parametrize("hist,algo", [([[-5.0], [3.0]], "max"), ([[-2.0]], "most_recent"),
                                       ([[-float("inf")], [3.0]], "max")])
def test_amax_update_negative_history_matches_reference(hist, algo):
    h, s, si, fm = torch.tensor(hist), torch.ones(1), torch.ones(1), torch.tensor([448.0])
    rh, rs, rsi = amax_update_ref(h, s, si, fm, 0.0, algo)
    ops.amax_update(h, s, si, fm, 0.0, algo)
    _assert_same_bits(s, rs, what="scale")


def _fake_gap_cases():
    e4 = torch.float8_e4m3fn
    s = torch.ones(1)

    def m(t):
        return t.to("meta") if t.is_contiguous() else torch.empty(t.shape[::-1], dtype=t.dtype, device="meta").t()

    x = torch.randn(4, 16)
    a, b = torch.randn(16, 32).to(e4), torch.randn(8, 32).to(e4)
    h = torch.zeros(4, 3)
    return {
        "cast_x_transposed": lambda d: ops.cast(x.t() if d == "cpu" else m(x.t()), s.to(d), e4),
        "amax_x_transposed": lambda d: ops.amax(x.t() if d == "cpu" else m(x.t())),
        "amax_update_scale_numel": lambda d: ops.amax_update(h.to(d), torch.ones(2, device=d), torch.ones(3, device=d),
                                                             torch.ones(3, device=d)),
        "amax_update_algo": lambda d: torch.ops.fp8ops.amax_update(h.to(d), torch.ones(3, device=d),
                                                                   torch.ones(3, device=d), torch.ones(3, device=d), 0.0, 7,
                                                                   NO_COUNTS),
        "gemm_a_transposed": lambda d: ops.gemm(a.t().contiguous().t() if d == "cpu" else m(a.t().contiguous().t()),
                                                a.to(d), s.to(d), s.to(d)),
        "gemm_scale_dtype": lambda d: ops.gemm(a.to(d), b.to(d), s.double().to(d), s.to(d)),
        "gemm_bias_len": lambda d: ops.gemm(a.to(d), b.to(d), s.to(d), s.to(d), torch.ones(5, dtype=BF16, device=d)),
    }


@pytest.mark.parametrize("case", list(_fake_gap_cases()))
def test_fake_kernels_mirror_c_checks(case):
    fn = _fake_gap_cases()[case]
    with pytest.raises(RuntimeError) as cpu_err:
        fn("cpu")
    with pytest.raises(RuntimeError) as meta_err:
        fn("meta")
    arg = re.compile(r"fp8ops::\w+: (\w+)")
    assert arg.search(str(cpu_err.value)).group(1) == arg.search(str(meta_err.value)).group(1)


def test_gemm_cpu_meta_mix_raises():
    a, b = torch.randn(16, 32).to(E4), torch.randn(16, 32).to(E4).to("meta")
    with pytest.raises(RuntimeError, match=r"fp8ops::gemm: .*\bb\b"):
        ops.gemm(a, b, torch.ones(1), torch.ones(1))


def test_amax_update_cpu_meta_mix_raises():
    h = torch.tensor([[4.0]])
    with pytest.raises(RuntimeError, match=r"fp8ops::amax_update: .*scale"):
        ops.amax_update(h, torch.ones(1, device="meta"), torch.ones(1), torch.tensor([448.0]))


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("which", ["x", "scale"])
def test_cast_mixed_cuda_cpu_raises(which):
    x = torch.randn(32, 16, device="cpu" if which == "x" else "cuda")
    s = torch.ones(1, device="cpu" if which == "scale" else "cuda")
    with pytest.raises(RuntimeError, match=r"fp8ops::cast: scale is on .* but x is on"):
        ops.cast(x, s, E4)


@requires_fp8
@pytest.mark.gpu
@pytest.mark.fp8
@pytest.mark.parametrize("which", ["b", "a_scale_inv", "b_scale_inv", "bias"])
def test_gemm_mixed_cuda_cpu_raises(which):
    dev = {k: ("cpu" if k == which else "cuda") for k in ("b", "a_scale_inv", "b_scale_inv", "bias")}
    a = torch.randn(32, 32, device="cuda").to(E4)
    b = torch.randn(32, 32, device=dev["b"]).to(E4)
    bias = torch.randn(32, dtype=BF16, device=dev["bias"])
    with pytest.raises(RuntimeError, match=rf"fp8ops::gemm: {which} is on cpu but a is on cuda:0"):
        ops.gemm(a, b, torch.ones(1, device=dev["a_scale_inv"]), torch.ones(1, device=dev["b_scale_inv"]), bias)
