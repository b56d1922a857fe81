"""Environment faults: `import fp8ops` works, `fp8ops.convert` falls back to the
plain model with one clear warning, `fp8ops.report` and the doctor say why,
and the doctor exits 0 -- in every environment fp8ops can meet:

  * a CUDA torch on a machine with no GPU (real here: CUDA_VISIBLE_DEVICES="")
  * a torch without CUDA (simulated: torch.version.cuda None, no libtorch_cuda)
  * a GPU below sm_89 (simulated: torch.cuda reports an A100 / RTX 3090 / T4)
  * a torch older than supported: its version string (simulated, and real when
    an old torch's venv is at hand), a libtorch lacking a shim symbol (real: a
    copy of the extension whose import names a symbol libtorch lacks, so the
    dynamic loader itself fails; and the loader's ImportError simulated)
  * an extension built without nvcc (simulated; and the real registration
    state checked against build_info, whatever this build is)
  * an extension that is not built, fails to register, or is loaded twice.

Each scenario runs in a fresh interpreter (`python -c`): the patches stand in
for the environment *before* fp8ops is imported and cannot leak into pytest.
The child imports the very fp8ops under test (or a copy of it) and prints one
JSON line; the doctor runs there as `python -m fp8ops` does
(runpy.run_module("fp8ops", run_name="__main__")), with the patches in place.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8ops
from fp8ops import _loader

PKG_DIR = Path(fp8ops.__file__).resolve().parent      # the fp8ops under test
BUILD = fp8ops.build_info()
MIN = "torch >= {}.{}".format(*_loader.MIN_TORCH)
OPS = ("cast", "amax", "amax_update", "gemm")

# ------------------------------------------------------------------ the probe

PROBE = r"""
import contextlib, copy, io, json, runpy, sys, warnings
import torch, torch.nn as nn
import fp8ops
from fp8ops.linear import Fp8Linear

res = {"torch": str(torch.__version__), "fp8ops_file": fp8ops.__file__,
       "is_available": fp8ops.is_available(), "why": fp8ops.why_unavailable(),
       "build_info": fp8ops.build_info(), "C_imported": "fp8ops._C" in sys.modules,
       "ops_registered": [hasattr(torch.ops.fp8ops, op) for op in ("cast", "amax", "amax_update", "gemm")]}
ok, reason = fp8ops.fp8_supported_here()
res["supported"], res["reason"] = ok, reason

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
ref = copy.deepcopy(model)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = fp8ops.convert(model)
res["warnings"] = [str(w.message) for w in caught if "fp8ops" in str(w.message)]
res["same_model"] = out is model
res["fp8_layers"] = sum(isinstance(m, Fp8Linear) for m in model.modules())
res["report"] = [{k: r[k] for k in ("name", "backend", "reason")} for r in fp8ops.report(model, print_table=False)]
x = torch.randn(8, 32)
res["same_output"] = torch.equal(model(x), ref(x))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(x).square().mean().backward()
opt.step()
res["trains"] = all(bool(torch.isfinite(p).all()) for p in model.parameters())

try:
    fp8ops.ops.cast(torch.randn(4, 16), torch.ones(1), torch.float8_e4m3fn, False)
    res["op_call"] = None
except Exception as e:  # noqa: BLE001
    res["op_call"] = {"type": type(e).__name__, "msg": str(e)}

buf = io.StringIO()
code = "no SystemExit"
with contextlib.redirect_stdout(buf):
    try:
        runpy.run_module("fp8ops", run_name="__main__", alter_sys=True)   # = python -m fp8ops
    except SystemExit as e:
        code = e.code
res["doctor_exit"], res["doctor"] = code, buf.getvalue()
print("ENV-RESULT " + json.dumps(res, default=str))
"""

# patches, as code run in the child before / after `import fp8ops`

FAKE_GPU = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda device=None: ({major}, {minor})
torch.cuda.get_device_name = lambda device=None: {name!r}
"""

CPU_ONLY_TORCH = """
import torch
torch.version.cuda = None
torch.cuda.is_available = lambda: False
torch.cuda.device_count = lambda: 0
torch.backends.cuda.is_built = lambda: False
"""


def build_info_patch(**over) -> str:
    """After import: make fp8ops see a different build (read at call time)."""
    return ("import fp8ops._loader as _L\n_real_bi = _L.build_info\n"
            f"_L.build_info = lambda: {{**_real_bi(), **{over!r}}}\n")


def failing_extension(exc: str) -> str:
    """Before import: importing fp8ops._C raises `exc` (a Python expression),
    as the interpreter would for a .so the dynamic loader refuses."""
    return f"""
import importlib.abc, importlib.machinery, sys
class _FailC(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "fp8ops._C" else None
    def create_module(self, spec):
        raise {exc}
    def exec_module(self, module):
        pass
sys.meta_path.insert(0, _FailC())
"""


CUDA_BUILD = dict(built_with_cuda=1, cuda_kernels_registered=1, cuda_reason="", cuda_archs="89 90 100 120 ptx")
SO_PATH = "/site-packages/fp8ops/_C.abi3.so"
NO_NVCC = ("built without CUDA (nvcc was not found when fp8ops was installed (not in CUDA_HOME or CUDA_PATH, on "
           "PATH, in this environment or as an nvidia-cuda-nvcc wheel); put a CUDA toolkit's nvcc on PATH, or "
           "install torch with its CUDA 13 wheels first and reinstall fp8ops with pip in that environment (pip "
           "install --no-cache-dir --force-reinstall --no-deps <fp8ops source>): its build then fetches nvcc from "
           "the package index)")  # (csrc/module.c with cuda_build.find_nvcc's reason)

# name -> (pre-import code, post-import code, extra env)
SCENARIOS = {
    "no_gpu": ("", "", {"CUDA_VISIBLE_DEVICES": ""}),
    "no_gpu_cuda_build": ("", build_info_patch(**CUDA_BUILD), {"CUDA_VISIBLE_DEVICES": ""}),
    "cpu_only_torch": (CPU_ONLY_TORCH, build_info_patch(
        built_with_cuda=1, cuda_kernels_registered=0, cuda_archs="89 90 ptx",
        cuda_reason="this torch has no CUDA (libtorch_cuda.so is not loaded)"), {}),
    "cpu_only_torch_cpu_build": (CPU_ONLY_TORCH, build_info_patch(
        built_with_cuda=0, cuda_kernels_registered=0, cuda_archs="",
        cuda_reason=NO_NVCC), {}),
    "sm80": (FAKE_GPU.format(major=8, minor=0, name="NVIDIA A100-SXM4-80GB"), build_info_patch(**CUDA_BUILD), {}),
    "no_nvcc_on_h100": (FAKE_GPU.format(major=9, minor=0, name="NVIDIA H100 80GB HBM3"), build_info_patch(
        built_with_cuda=0, cuda_kernels_registered=0, cuda_archs="", cuda_reason=NO_NVCC), {}),
    # the default build on Jetson Thor: no sm_110 cubin, and the PTX is sm_120's
    "sm110": (FAKE_GPU.format(major=11, minor=0, name="NVIDIA Thor"), build_info_patch(**CUDA_BUILD), {}),
    "torch_2.9.0": ("import torch\ntorch.__version__ = '2.9.0'\n", "", {}),
    "torch_2.9.1+cu128": ("import torch\ntorch.__version__ = '2.9.1+cu128'\n", "", {}),
    "torch_1.13.1": ("import torch\ntorch.__version__ = '1.13.1'\n", "", {}),
    "torch_2.10.0a0+git": ("import torch\ntorch.__version__ = '2.10.0a0+git1234abc'\n", "", {}),
    "missing_symbol": (failing_extension(f"ImportError('{SO_PATH}: undefined symbol: torch_library_impl')"), "", {}),
    "not_built": (failing_extension("ModuleNotFoundError(\"No module named 'fp8ops._C'\", name='fp8ops._C')"), "", {}),
    "register_fails": (failing_extension(
        "ImportError('fp8ops: could not define the fp8ops op library (is another copy of fp8ops already loaded?)')"),
        "", {}),
    "init_raises": (failing_extension("RuntimeError('boom in PyInit__C')"), "", {}),
}


# ------------------------------------------------------------------ running

def child_env(pythonpath: list[str], extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["PYTHONPATH"] = os.pathsep.join(pythonpath)
    env.update(extra or {})
    return env


def run_child(code: str, cwd, pythonpath: list[str], extra_env=None, python=sys.executable, timeout=300):
    p = subprocess.run([python, "-c", code], cwd=str(cwd), env=child_env(pythonpath, extra_env),
                       capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"child exited {p.returncode}:\n{out[-5000:]}"
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("ENV-RESULT ")), None)
    assert line, f"no result line:\n{out[-5000:]}"
    res = json.loads(line[len("ENV-RESULT "):])
    res["stderr"] = p.stderr
    return res


def run_probe(pre: str, post: str, cwd, pythonpath=None, extra_env=None, python=sys.executable):
    code = "\n".join([pre, "import fp8ops", post, PROBE])
    return run_child(code, cwd, pythonpath or [str(PKG_DIR.parent)], extra_env, python)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """scenario(name) -> the probe's result; all scenarios run in parallel the
    first time one is asked for."""
    cwd = tmp_path_factory.mktemp("env")
    results: dict[str, object] = {}

    def one(name):
        pre, post, env = SCENARIOS[name]
        try:
            return run_probe(pre, post, cwd, extra_env=env)
        except BaseException as e:  # noqa: BLE001 -- reported by the test that asks
            return e

    def get(name):
        if not results:
            with concurrent.futures.ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2))) as ex:
                results.update(zip(SCENARIOS, ex.map(one, SCENARIOS)))
        r = results[name]
        if isinstance(r, BaseException):
            raise r
        return r

    return get


def assert_falls_back(res, reason_has: list[str]):
    """import worked, convert left the model as it was with one warning, the
    report and the doctor say why, the doctor exits 0."""
    assert res["supported"] is False
    for s in reason_has:
        assert s in res["reason"], f"{s!r} not in the reason: {res['reason']!r}"
    assert res["same_model"] and res["fp8_layers"] == 0 and res["same_output"] and res["trains"]
    off = [w for w in res["warnings"] if "FP8 is OFF" in w]
    assert len(off) == 1, f"convert must warn exactly once: {res['warnings']}"
    assert res["reason"] in off[0]
    assert [r["backend"] for r in res["report"]] == ["bf16", "bf16"]
    assert all(r["reason"] == res["reason"] for r in res["report"]), res["report"]
    assert res["doctor_exit"] == 0, res["doctor"]
    doctor = res["doctor"]
    assert doctor.startswith("fp8ops doctor")
    assert f"FP8 can run here             no: {res['reason']}" in doctor, doctor
    assert "will keep every layer in BF16/FP32" in doctor


def assert_extension_unavailable(res, why_has: list[str]):
    assert res["is_available"] is False
    for s in why_has:
        assert s in res["why"], f"{s!r} not in why_unavailable(): {res['why']!r}"
    assert res["build_info"] == {}
    assert res["ops_registered"] == [False] * 4
    assert_falls_back(res, ["fp8ops extension not loaded", res["why"]])
    assert "extension loaded             False" in res["doctor"]
    assert f"why not                      {res['why']}" in res["doctor"]


# ============================================================ no GPU / no CUDA

def test_cuda_torch_without_gpu(scenario):
    """The real thing here (a CUDA torch, no GPU visible)."""
    res = scenario("no_gpu")
    assert Path(res["fp8ops_file"]).resolve().parent == PKG_DIR, res["fp8ops_file"]
    assert res["is_available"] is True and res["why"] is None and res["ops_registered"] == [True] * 4
    info = res["build_info"]
    if not info["built_with_cuda"]:
        expect = ["built without CUDA"]
    elif not info["cuda_kernels_registered"]:
        expect = ["CUDA kernels not registered", info["cuda_reason"]]
    else:
        expect = ["no CUDA GPU visible to torch"]
    assert_falls_back(res, expect)
    assert "GPU                          none visible to torch" in res["doctor"]
    assert res["op_call"] is None                          # CPU kernels still run


def test_no_gpu_reason_with_a_cuda_build(scenario):
    res = scenario("no_gpu_cuda_build")
    assert_falls_back(res, ["no CUDA GPU visible to torch", "torch.cuda.is_available() is False"])


@pytest.mark.parametrize("name,expect", [
    ("cpu_only_torch", ["fp8ops CUDA kernels not registered", "this torch has no CUDA"]),
    ("cpu_only_torch_cpu_build", ["built without CUDA"]),
])
def test_torch_without_cuda(scenario, name, expect):
    res = scenario(name)
    assert res["is_available"] is True
    assert_falls_back(res, expect)
    assert "torch CUDA                   none (CPU-only torch)" in res["doctor"]
    assert "GPU                          none visible to torch" in res["doctor"]


# ================================================================= below sm_89

def test_gpu_below_sm89(scenario):
    res = scenario("sm80")
    assert_falls_back(res, ["NVIDIA A100-SXM4-80GB", "sm_80", "sm_89"])
    assert "GPU 0                        NVIDIA A100-SXM4-80GB (sm_80)" in res["doctor"]


@pytest.mark.parametrize("cc,gpu", [((8, 9), "NVIDIA L40S"), ((9, 0), "NVIDIA H100 80GB HBM3"),
                                    ((12, 0), "NVIDIA RTX PRO 6000")])
def test_fp8_gpus_are_accepted_unless_cublaslt_is_unusable(monkeypatch, cc, gpu):
    """sm_89 (Ada) and up with a CUDA build for them: FP8 runs; with cuBLASLt unusable, not."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: gpu)
    monkeypatch.setattr(_loader, "build_info", lambda: {**BUILD, **CUDA_BUILD})
    if not _loader.is_available():
        pytest.skip(f"the extension did not load: {_loader.why_unavailable()}")

    class C:  # the loaded module's cuBLASLt probe, answered here
        status = None

        @staticmethod
        def cublaslt_status():
            return C.status
    monkeypatch.setattr(_loader, "_C", C)
    assert fp8ops.fp8_supported_here() == (True, "ok")
    C.status = "libcublasLt.so.13 not loaded"
    assert fp8ops.fp8_supported_here() == (False, "cuBLASLt unusable: libcublasLt.so.13 not loaded")


@pytest.mark.parametrize("cc,gpu", [((8, 6), "NVIDIA GeForce RTX 3090"), ((7, 5), "Tesla T4"),
                                    ((8, 0), "NVIDIA A100-SXM4-80GB")])
def test_gpu_below_sm89_in_process(monkeypatch, capsys, cc, gpu):
    """The same in this process (monkeypatched, restored after), on whatever build is installed."""
    import copy  # noqa: PLC0415

    import torch.nn as nn  # noqa: PLC0415

    from fp8ops.__main__ import main  # noqa: PLC0415

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: cc)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: gpu)
    monkeypatch.setattr(_loader, "build_info", lambda: {**BUILD, **CUDA_BUILD})
    sm = f"sm_{cc[0]}{cc[1]}"
    ok, reason = fp8ops.fp8_supported_here()
    assert not ok and sm in reason and "sm_89" in reason and gpu in reason
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    before = copy.deepcopy(model)
    with pytest.warns(UserWarning, match="FP8 is OFF") as caught:
        assert fp8ops.convert(model) is model
    assert len([w for w in caught if "FP8 is OFF" in str(w.message)]) == 1
    assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    x = torch.randn(4, 32)
    assert torch.equal(model(x), before(x))
    assert all(r["backend"] == "bf16" and r["reason"] == reason for r in fp8ops.report(model, print_table=False))
    capsys.readouterr()
    assert main([]) == 0
    out = capsys.readouterr().out
    assert f"GPU 0                        {gpu} ({sm})" in out and f"no: {reason}" in out
    assert main(["--check"]) == 1  # for scripts: FP8 cannot run here


# ========================================================= built without nvcc

def test_built_without_nvcc_on_an_fp8_gpu(scenario):
    """Even on an H100, a build without nvcc falls back, and says so first."""
    res = scenario("no_nvcc_on_h100")
    assert_falls_back(res, ["built without CUDA", "reinstall fp8ops", "nvcc on PATH"])
    doctor = res["doctor"]
    assert "built with CUDA              False" in doctor
    assert "CUDA kernels registered      built without CUDA (nvcc was not found" in doctor
    assert "GPU 0                        NVIDIA H100 80GB HBM3 (sm_90)" in doctor


def test_gpu_arch_not_compiled_in(scenario):
    """A GPU the build has no code for (sm_110 against 89 90 100 120 + PTX 120) falls back at
    convert, naming the archs and the remedy, instead of failing at the first kernel."""
    res = scenario("sm110")
    assert_falls_back(res, ["NVIDIA Thor is sm_110", "compiled for 89 90 100 120 ptx only",
                            'FP8OPS_CUDA_ARCHS="110"'])


@pytest.mark.parametrize("archs,sm,ok", [
    ("89 90 100 120 ptx", (8, 9), True), ("89 90 100 120 ptx", (9, 0), True),
    ("89 90 100 120 ptx", (10, 3), True), ("89 90 100 120 ptx", (12, 1), True),
    ("89 90 100 120 ptx", (11, 0), False), ("89 90 100 120 ptx", (8, 6), False),
    ("89 90 100 120 ptx", (13, 0), True),  # the PTX, compiled by the driver
    ("90 ptx", (8, 9), False), ("90a ptx", (9, 0), True), ("90a", (10, 0), False),
    ("100a 120", (10, 3), False), ("89", (8, 9), True), ("", (9, 0), False)])
def test_runs_on(archs, sm, ok):
    from fp8ops.conversion import runs_on  # noqa: PLC0415
    assert runs_on(archs, *sm) is ok


def test_a_build_from_other_sources_is_not_used(tmp_path, monkeypatch):
    """A source checkout whose csrc/ changed since its build (`git pull` after `pip install -e .`):
    the extension is not used (every layer falls back), and the reason says to rebuild. The
    digest is setup.py's: the same files give the same one."""
    (tmp_path / "csrc").mkdir()
    (tmp_path / "setup.py").write_text("")
    (tmp_path / "csrc" / "ops.c").write_text("int x;\n")
    monkeypatch.setattr(_loader, "_source_checkout", lambda: str(tmp_path))
    built = _loader.source_digest(str(tmp_path))

    class Build:
        @staticmethod
        def build_info():
            return {"source_digest": built}
    assert _loader._stale(Build) is None
    (tmp_path / "csrc" / ".ops.c.swp").write_text("an editor's file")  # not a source: no change
    assert _loader._stale(Build) is None
    (tmp_path / "csrc" / "ops.c").write_text("int y;\n")
    why = _loader._stale(Build)
    assert why and "built from other sources" in why and "pip install -e ." in why and str(tmp_path) in why
    # the digest setup.py compiles in, for these files
    setup_src = (Path(__file__).resolve().parents[1] / "setup.py").read_text()
    fn = setup_src[setup_src.index("def source_digest"):setup_src.index("def cuda_archs")]
    suffixes = next(ln for ln in setup_src.splitlines() if ln.startswith("SOURCE_SUFFIXES ="))
    ns: dict = {"hashlib": __import__("hashlib"), "os": os}
    exec(suffixes + "\n" + fn, ns)  # noqa: S102 -- setup.py's own function, run on tmp_path's csrc
    (tmp_path / "csrc" / "load.cuh").write_text("// a header\n")
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert ns["source_digest"]() == _loader.source_digest(str(tmp_path))
    finally:
        os.chdir(cwd)


def test_not_built_in_a_source_checkout_says_so(monkeypatch):
    monkeypatch.setattr(_loader, "_source_checkout", lambda: "/home/me/fp8ops")
    why = _loader._explain(ModuleNotFoundError("No module named 'fp8ops._C'"))
    assert "source checkout (/home/me/fp8ops)" in why and "pip install -e ." in why


def test_ops_missing_from_the_build_fall_back(tmp_path):
    """An extension that lacks an op this Python code registers (a build of older sources):
    import works, the extension counts as not loaded, and the reason says to reinstall."""
    pre = """
import torch
_real = torch.library.register_fake
def register_fake(name, *a, **k):
    if name == "fp8ops::swiglu":
        raise RuntimeError("operator fp8ops::swiglu does not exist")
    return _real(name, *a, **k)
torch.library.register_fake = register_fake
"""
    post = """
import json
print("ENV-RESULT " + json.dumps({"available": fp8ops.is_available(), "why": fp8ops.why_unavailable(),
                                  "supported": fp8ops.fp8_supported_here()}))
"""
    res = run_child("\n".join([pre, "import fp8ops", post]), tmp_path, [str(PKG_DIR.parent)])
    assert res["available"] is False
    assert "does not match this fp8ops' Python code" in res["why"] and "fp8ops::swiglu" in res["why"]
    assert res["supported"][0] is False


def test_sdist_has_every_source(tmp_path):
    """The sdist (what `python -m build` builds the wheel from) carries csrc/ whole: the
    headers and CUDA sources too, not only the C files setup.py names; and cuda_build.py."""
    repo = Path(__file__).resolve().parents[1]
    pytest.importorskip("setuptools")
    p = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path),
                        "sdist", "--dist-dir", str(tmp_path)], cwd=repo, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    import tarfile  # noqa: PLC0415
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    want = {f"csrc/{f.name}" for f in (repo / "csrc").iterdir() if f.is_file()}
    want.add("cuda_build.py")  # setup.py's toolchain finder and the build backend pyproject.toml names
    assert want <= names, sorted(want - names)


def test_an_old_setuptools_is_refused_with_the_remedy():
    """setup.py under a setuptools too old for pyproject.toml's SPDX license: a message that
    names the version found and the command that fixes it, not setuptools' schema dump."""
    repo = Path(__file__).resolve().parents[1]
    pytest.importorskip("setuptools")
    code = ("import runpy, sys, setuptools; setuptools.__version__ = '65.5.0'; "
            "sys.argv = ['setup.py', '--version']; runpy.run_path('setup.py', run_name='__main__')")
    p = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    out = p.stdout + p.stderr
    assert "needs setuptools >= 77, found 65.5.0" in out and "pip install 'setuptools>=77,<82'" in out, out


@pytest.mark.parametrize("archs", ["sm_9x", "90;ampere"])
def test_bad_cuda_archs_are_refused_by_name(tmp_path, archs):
    repo = Path(__file__).resolve().parents[1]
    if not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("no nvcc: the archs are not read")
    env = dict(os.environ, FP8OPS_CUDA_ARCHS=archs)
    env.pop("FP8OPS_NO_CUDA", None)
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "-b", str(tmp_path / "b"), "-t", str(tmp_path / "t")],
                       cwd=repo, capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode != 0
    assert "FP8OPS_CUDA_ARCHS:" in p.stderr + p.stdout and "is not an SM arch" in p.stderr + p.stdout


def test_registration_matches_build_info():
    """Real, for this build: CPU and fake kernels always; CUDA kernels exactly
    when build_info says they are registered (never for a build without nvcc)."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    for op in OPS:
        assert has(f"fp8ops::{op}", "CPU") and has(f"fp8ops::{op}", "Meta"), op
        assert has(f"fp8ops::{op}", "CUDA") == bool(BUILD["cuda_kernels_registered"]), op
    if not BUILD["built_with_cuda"]:
        assert not BUILD["cuda_kernels_registered"] and "built without CUDA" in BUILD["cuda_reason"]
        assert BUILD["cuda_archs"] == ""
    # CPU and meta (fake) kernels work in every build
    x, s = torch.randn(4, 16), torch.ones(1)
    out, _, _ = torch.ops.fp8ops.cast(x, s, torch.float8_e4m3fn, False)
    assert out.dtype == torch.float8_e4m3fn
    out, _, _ = torch.ops.fp8ops.cast(x.to("meta"), s.to("meta"), torch.float8_e4m3fn, True)
    assert out.device.type == "meta" and out.shape == (4, 16)


def test_doctor_real(tmp_path):
    """`python -m fp8ops` itself, as a user runs it, here."""
    p = subprocess.run([sys.executable, "-m", "fp8ops"], cwd=tmp_path, env=child_env([str(PKG_DIR.parent)]),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    assert out.startswith("fp8ops doctor") and "extension loaded             True" in out
    assert "ops registered               fp8ops::cast, fp8ops::amax, fp8ops::amax_update, fp8ops::gemm" in out
    if BUILD["cuda_kernels_registered"]:
        assert "CUDA kernels registered      True" in out
    else:
        assert f"CUDA kernels registered      {BUILD['cuda_reason']}" in out
    ok, reason = fp8ops.fp8_supported_here()
    assert ("FP8 can run here             yes" in out) if ok else (f"FP8 can run here             no: {reason}" in out)
    p = subprocess.run([sys.executable, "-m", "fp8ops", "--check"], cwd=tmp_path,
                       env=child_env([str(PKG_DIR.parent)]), capture_output=True, text=True, timeout=120)
    assert p.returncode == (0 if ok else 1), p.stdout + p.stderr


# ============================================================ torch too old

@pytest.mark.parametrize("version", ["2.9.0", "2.9.1+cu128", "1.13.1"])
def test_torch_version_too_old(scenario, version):
    res = scenario(f"torch_{version}")
    assert_extension_unavailable(res, [f"torch {version} is too old", MIN, "pip install -U"])
    assert res["C_imported"] is False               # the C core never meets an unsupported libtorch
    assert f"torch                        {version}" in res["doctor"]


def test_torch_dev_version_of_a_supported_release(scenario):
    res = scenario("torch_2.10.0a0+git")
    assert res["is_available"] is True and res["why"] is None and res["ops_registered"] == [True] * 4


def test_missing_shim_symbol_simulated(scenario):
    """The loader sees the ImportError a torch without torch_library_impl gives."""
    res = scenario("missing_symbol")
    # this torch (>= the minimum) should export it: the advice is to reinstall fp8ops
    assert_extension_unavailable(res, ["torch_library_impl", MIN, "reinstall fp8ops"])


def _package_copy(dest: Path, name: str = "fp8ops") -> Path:
    target = dest / name
    shutil.copytree(PKG_DIR, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def _extension(pkg: Path) -> Path:
    sos = sorted(pkg.glob("_C*.so"))
    if not sos:
        pytest.skip(f"no compiled extension in {pkg} (an in-tree build?)")
    return sos[0]


@pytest.fixture(scope="module")
def broken_symbol_pkg(tmp_path_factory):
    """A copy of fp8ops whose extension imports `torch_library_impX` instead of
    `torch_library_impl` (same length, patched in the dynamic string table):
    the real dynamic loader then fails exactly as on a libtorch lacking a symbol."""
    root = tmp_path_factory.mktemp("badsym")
    pkg = _package_copy(root)
    so = _extension(pkg)
    data = so.read_bytes()
    old, new = b"\x00torch_library_impl\x00", b"\x00torch_library_impX\x00"
    if old not in data:
        pytest.skip("the extension does not import torch_library_impl by name")
    so.write_bytes(data.replace(old, new))
    return root


def test_missing_shim_symbol_real_loader_error(broken_symbol_pkg):
    res = run_probe("", "", broken_symbol_pkg, pythonpath=[str(broken_symbol_pkg)])
    assert Path(res["fp8ops_file"]).resolve().parent == (broken_symbol_pkg / "fp8ops").resolve()
    assert_extension_unavailable(res, ["needs libtorch symbol torch_library_impX", MIN])


def test_missing_symbol_message_does_not_ask_to_install_the_torch_we_have(broken_symbol_pkg):
    res = run_probe("", "", broken_symbol_pkg, pythonpath=[str(broken_symbol_pkg)])
    assert "pip install -U 'torch>=" not in res["why"], res["why"]


def test_op_call_without_extension_says_why(scenario):
    res = scenario("missing_symbol")
    assert res["op_call"]["type"] == "RuntimeError" and MIN in res["op_call"]["msg"], res["op_call"]


# ===================================================== not built / broken / twice

def test_extension_not_built(scenario):
    res = scenario("not_built")
    if _loader._source_checkout():  # (the package under test is an in-place build of a checkout)
        assert_extension_unavailable(res, ["is not built", "source checkout", "pip install -e ."])
    else:
        assert_extension_unavailable(res, ["is not built", "pip install ."])


@pytest.mark.parametrize("name,why", [
    ("register_fails", ["failed to load", "is another copy of fp8ops already loaded?"]),
    ("init_raises", ["failed to load", "boom in PyInit__C"]),
])
def test_extension_fails_to_initialise(scenario, name, why):
    res = scenario(name)
    assert_extension_unavailable(res, why)


def test_two_copies_in_one_process(tmp_path):
    """A second copy of the extension cannot register the fp8ops namespace
    again: that copy says why and falls back, the first keeps working."""
    _extension(PKG_DIR)
    _package_copy(tmp_path, "fp8ops_copy")
    code = ("import fp8ops, fp8ops_copy, torch, json\n"
            "out = fp8ops.ops.cast(torch.randn(4, 16), torch.ones(1))[0]\n"
            "print('ENV-RESULT ' + json.dumps({'first': fp8ops.is_available(), 'copy': fp8ops_copy.is_available(),"
            " 'why': fp8ops_copy.why_unavailable(), 'reason': fp8ops_copy.fp8_supported_here()[1],"
            " 'cast_ok': out.dtype == torch.float8_e4m3fn}))\n")
    res = run_child(code, tmp_path, [str(tmp_path), str(PKG_DIR.parent)])
    assert res["first"] is True and res["cast_ok"] is True
    assert res["copy"] is False and "another copy of fp8ops already loaded" in res["why"]
    assert res["reason"].startswith("fp8ops extension not loaded")


# ============================================ other torch installations (optional)

def _other_torch_pythons() -> list[str]:
    """Interpreters of other torch installs to try this fp8ops with:
    FP8OPS_TEST_TORCH_PYTHONS (os.pathsep-separated), else the venv-*
    directories next to this interpreter's venv, if any (none on a fresh CI)."""
    paths = [p for p in os.environ.get("FP8OPS_TEST_TORCH_PYTHONS", "").split(os.pathsep) if p]
    if not paths:
        here = Path(sys.prefix).resolve()
        paths = [str(p) for p in sorted(here.parent.glob("venv-*/bin/python"))
                 if p.resolve().parent.parent != here and os.access(p, os.X_OK)]
    return paths


OTHER_TORCH = _other_torch_pythons()


def _is_old(ver: str) -> bool:
    parts = ver.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) < _loader.MIN_TORCH


@pytest.mark.skipif(not OTHER_TORCH, reason="no other torch installation found (set FP8OPS_TEST_TORCH_PYTHONS)")
@pytest.mark.parametrize("python", OTHER_TORCH or [""], ids=[Path(p).parent.parent.name for p in OTHER_TORCH] or ["none"])
def test_real_other_torch(python, tmp_path):
    """This build of fp8ops imported into another real torch: an old one is
    refused by version (and, made to try, by the dynamic loader: a missing
    shim symbol), a supported one runs the CPU kernels."""
    _extension(PKG_DIR)
    _package_copy(tmp_path)
    res = run_probe("", "", tmp_path, pythonpath=[str(tmp_path)], python=python)
    version = res["torch"]
    assert Path(res["fp8ops_file"]).resolve().parent == (tmp_path / "fp8ops").resolve()
    if _is_old(version):
        assert_extension_unavailable(res, [f"torch {version} is too old", MIN])
        assert res["C_imported"] is False
        # past the version gate, the real libtorch lacks a symbol the extension needs
        spoof = "import torch\ntorch.__version__ = '%d.%d.0'\n" % _loader.MIN_TORCH
        res = run_probe(spoof, "", tmp_path, pythonpath=[str(tmp_path)], python=python)
        assert_extension_unavailable(res, ["needs libtorch symbol", MIN])
    else:
        assert res["is_available"] is True and res["ops_registered"] == [True] * 4, res["why"]
        assert res["op_call"] is None
        assert res["doctor_exit"] == 0


def test_import_leaves_dynamo_unimported(tmp_path):
    """`import fp8ops` does not import torch._dynamo (about a second of start-up for a script
    that never compiles): the functions dynamo must treat as constants are marked as
    torch.compiler.assume_constant_result marks them, without the decorator's import."""
    code = "import sys, fp8ops; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
