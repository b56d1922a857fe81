"""cuda_build.py: where the build finds nvcc, the CUDA headers and the static CUDA runtime, and
what an isolated build asks pip for. The layouts are built in tmp_path with a stand-in nvcc (a
shell script that prints what `nvcc --dryrun` prints), so no toolkit is needed; the last test
reads this machine's real nvcc where there is one."""
import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_cuda_build():
    """cuda_build.py by its path: putting the repository on sys.path would make processes spawned
    by later tests (which inherit sys.path) import the source tree's fp8ops, not the installed one."""
    spec = importlib.util.spec_from_file_location("cuda_build", REPO / "cuda_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cuda_build = _load_cuda_build()


REAL_SITE_DIRS = cuda_build.site_dirs
REAL_PIP_OFFLINE = cuda_build._pip_offline


def fake_nvcc(path: Path, includes=(), libs=(), release="13.0"):
    """An executable that answers `nvcc --version` and `nvcc --dryrun` (with these INCLUDES /
    LIBRARIES, as nvcc.profile does)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    inc = " ".join(f'"-I{d}"' for d in includes)
    lib = " ".join(f'"-L{d}"' for d in libs)
    path.write_text(f"#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release {release}, "
                    f"V{release}.88'; exit 0; fi\n"
                    f"echo '#$ INCLUDES={inc}  ' >&2\necho '#$ LIBRARIES=  {lib}' >&2\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def touch(path: Path, text=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def runtime_headers(d: Path, major=13, nvtx=True):
    """cuda_runtime_api.h and (as toolkits and torch's wheels ship it beside) NVTX's header."""
    touch(d / "cuda_runtime_api.h", f"#define CUDART_VERSION  {major}000\n")
    if nvtx:
        touch(d / "nvtx3" / "nvToolsExtMemCudaRt.h")


def cublas_headers(d: Path, major=13):
    touch(d / "cublasLt.h", "#include <cublas_api.h>\n")
    touch(d / "cublas_api.h", f"#define CUBLAS_VER_MAJOR {major}\n")


def dist(site: Path, pip_name="nvidia-cuda-runtime", version="13.0.96"):
    """A dist-info as pip leaves it, for importlib.metadata."""
    d = site / f"{pip_name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pip_name}\nVersion: {version}\n")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """No toolkit anywhere: an empty PATH, no CUDA_HOME, no site dirs, empty system dirs, an
    interpreter prefix without nvcc, a pip with an index."""
    for var in ("CUDA_HOME", "CUDA_PATH", "FP8OPS_NO_CUDA", "FP8OPS_FETCH_NVCC", "PIP_NO_INDEX"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "empty_bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty_bin"))
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "python_prefix"))
    sites = []
    monkeypatch.setattr(cuda_build, "site_dirs", lambda: [str(s) for s in sites])
    monkeypatch.setattr(cuda_build, "_pip_offline", lambda: False)
    monkeypatch.setattr(cuda_build, "_pip_config_files", lambda: [])
    monkeypatch.setattr(cuda_build, "SYSTEM_INCLUDE", str(tmp_path / "usr" / "include"))
    monkeypatch.setattr(cuda_build, "SYSTEM_LIB", str(tmp_path / "usr" / "lib"))
    monkeypatch.setattr(cuda_build.sysconfig, "get_config_var",
                        lambda name: "x86_64-linux-gnu" if name == "MULTIARCH" else None)
    return tmp_path, sites


def test_torch_wheels_plus_the_nvcc_wheel(machine):
    """pip's isolated build: nvcc, cuda_runtime_api.h and libcudart_static.a in the build's own
    environment (nvidia/cu13, whose nvcc.profile names lib64 where the wheel has lib), cublasLt.h
    only in the environment torch is installed in."""
    tmp, sites = machine
    build_env, target_env = tmp / "build_env", tmp / "target_env"
    cu = build_env / "nvidia" / "cu13"
    nvcc = fake_nvcc(cu / "bin" / "nvcc", includes=[cu / "include"], libs=[cu / "lib64" / "stubs", cu / "lib64"])
    runtime_headers(cu / "include")
    touch(cu / "lib" / "libcudart_static.a")
    cublas_headers(target_env / "nvidia" / "cu13" / "include")
    runtime_headers(target_env / "nvidia" / "cu13" / "include")
    sites += [build_env, target_env]
    tc, why = cuda_build.find_toolchain()
    assert why == ""
    assert tc.nvcc == str(nvcc)
    # nvcc's own headers first, torch's cublasLt.h after
    assert tc.include_dirs == [str(cu / "include"), str(target_env / "nvidia" / "cu13" / "include")]
    assert tc.lib_dir == str(cu / "lib")


def test_debian_split_layout(machine, monkeypatch):
    """Debian's toolkit: nvcc on PATH saying nothing useful, headers in /usr/include, the static
    runtime in /usr/lib/<multiarch>."""
    tmp, _ = machine
    nvcc = fake_nvcc(tmp / "usr" / "bin" / "nvcc", release="12.4")
    monkeypatch.setenv("PATH", str(nvcc.parent))
    runtime_headers(tmp / "usr" / "include", major=12)
    cublas_headers(tmp / "usr" / "include", major=12)
    touch(tmp / "usr" / "lib" / "x86_64-linux-gnu" / "libcudart_static.a")
    tc, why = cuda_build.find_toolchain()
    assert why == ""
    assert (tc.nvcc, tc.include_dirs, tc.lib_dir) == (
        str(nvcc), [str(tmp / "usr" / "include")], str(tmp / "usr" / "lib" / "x86_64-linux-gnu"))


def test_targets_layout_from_cuda_home_over_path(machine, monkeypatch):
    """NVIDIA's and conda's targets/<arch>/ layout, read from nvcc; CUDA_HOME wins over PATH."""
    tmp, _ = machine
    target = tmp / "cuda" / "targets" / "x86_64-linux"
    nvcc = fake_nvcc(tmp / "cuda" / "bin" / "nvcc", includes=[target / "include"], libs=[target / "lib"])
    other = fake_nvcc(tmp / "other" / "bin" / "nvcc")
    monkeypatch.setenv("PATH", str(other.parent))
    monkeypatch.setenv("CUDA_HOME", str(tmp / "cuda"))
    runtime_headers(target / "include")
    cublas_headers(target / "include")
    touch(target / "lib" / "libcudart_static.a")
    tc, why = cuda_build.find_toolchain()
    assert why == ""
    assert (tc.nvcc, tc.include_dirs, tc.lib_dir) == (str(nvcc), [str(target / "include")], str(target / "lib"))


def test_an_inactive_conda_environments_nvcc(machine):
    """A conda environment's Python run by path: its bin/ (with nvcc) is not on PATH."""
    tmp, _ = machine
    nvcc = fake_nvcc(Path(sys.prefix) / "bin" / "nvcc")
    assert cuda_build.find_nvcc() == (str(nvcc), "")


@pytest.mark.parametrize("missing", ["cublasLt.h", "cuda_runtime_api.h", "nvToolsExtMemCudaRt.h", "libcudart_static.a"])
def test_a_missing_piece_is_named_with_the_remedy(machine, monkeypatch, missing):
    tmp, _ = machine
    top = tmp / "cuda"
    nvcc = fake_nvcc(top / "bin" / "nvcc", includes=[top / "include"], libs=[top / "lib64"])
    monkeypatch.setenv("PATH", str(nvcc.parent))
    if missing != "cuda_runtime_api.h":
        runtime_headers(top / "include", nvtx=missing != "nvToolsExtMemCudaRt.h")
    if missing != "cublasLt.h":
        cublas_headers(top / "include")
    if missing != "libcudart_static.a":
        touch(top / "lib64" / "libcudart_static.a")
    tc, why = cuda_build.find_toolchain()
    assert tc is None
    assert f"{missing} was not found" in why and str(nvcc) in why and "reinstall fp8ops" in why


def test_pieces_of_two_cuda_versions_are_refused(machine, monkeypatch):
    """nvcc 13 with its runtime headers, and only CUDA 12's cuBLAS headers in /usr/include: refused
    with the versions named (the compiler would otherwise fail on 13's types, or the first GEMM
    on a cuBLAS of another major)."""
    tmp, _ = machine
    top = tmp / "cuda"
    nvcc = fake_nvcc(top / "bin" / "nvcc", includes=[top / "include"], libs=[top / "lib64"])
    monkeypatch.setenv("PATH", str(nvcc.parent))
    runtime_headers(top / "include", major=13)
    touch(top / "lib64" / "libcudart_static.a")
    cublas_headers(tmp / "usr" / "include", major=12)
    tc, why = cuda_build.find_toolchain()
    assert tc is None
    assert "different CUDA versions (nvcc 13, cuda_runtime_api.h 13, cublas_api.h 12" in why


def test_system_cublas_of_another_cuda_is_not_taken_before_the_wheels(machine):
    """nvcc 13 from its wheel, torch's cu13 headers, and CUDA 12's cuBLAS headers in /usr/include:
    the wheels' headers are used (the system's come last)."""
    tmp, sites = machine
    cu = tmp / "env" / "nvidia" / "cu13"
    nvcc = fake_nvcc(cu / "bin" / "nvcc", includes=[cu / "include"], libs=[cu / "lib64"])
    runtime_headers(cu / "include")
    cublas_headers(cu / "include")
    touch(cu / "lib" / "libcudart_static.a")
    cublas_headers(tmp / "usr" / "include", major=12)
    sites.append(tmp / "env")
    tc, why = cuda_build.find_toolchain()
    assert why == "" and tc.nvcc == str(nvcc) and tc.include_dirs == [str(cu / "include")]


def test_an_nvcc_that_reports_no_release_is_refused(machine, monkeypatch):
    tmp, _ = machine
    nvcc = tmp / "cuda" / "bin" / "nvcc"
    touch(nvcc, "#!/bin/sh\necho 'error while loading shared libraries' >&2; exit 127\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(nvcc.parent))
    tc, why = cuda_build.find_toolchain()
    assert tc is None and "did not report its CUDA release" in why and "error while loading" in why


def test_cuda12_nvcc_wheel_layout_is_not_taken(machine):
    """CUDA 12's nvidia/cuda_nvcc/bin (ptxas only in its wheel; an nvcc there would be 12's)."""
    tmp, sites = machine
    fake_nvcc(tmp / "env" / "nvidia" / "cuda_nvcc" / "bin" / "nvcc", release="12.8")
    sites.append(tmp / "env")
    assert cuda_build.find_nvcc()[0] is None


def test_cuda12_cublas_wheel_is_not_taken_for_nvcc_13(machine, monkeypatch):
    """torch's CUDA 12 wheels lay cuBLAS out as nvidia/cublas/include: not nvcc 13's."""
    tmp, sites = machine
    top = tmp / "cuda"
    nvcc = fake_nvcc(top / "bin" / "nvcc", includes=[top / "include"], libs=[top / "lib64"])
    monkeypatch.setenv("PATH", str(nvcc.parent))
    runtime_headers(top / "include")
    touch(top / "lib64" / "libcudart_static.a")
    cublas_headers(tmp / "env" / "nvidia" / "cublas" / "include", major=12)
    sites.append(tmp / "env")
    tc, why = cuda_build.find_toolchain()
    assert tc is None and "cublasLt.h was not found" in why


def test_no_nvcc_anywhere(machine):
    tc, why = cuda_build.find_toolchain()
    assert tc is None
    assert why.startswith("nvcc was not found when fp8ops was installed")
    assert "reinstall fp8ops" in why and "nvcc on PATH" in why
    # it becomes a C string literal (-DFP8OPS_NO_CUDA_REASON="...") inside a 512-byte message
    assert len("built without CUDA ()" + why) < 512


def test_fp8ops_no_cuda_wins(machine, monkeypatch):
    tmp, _ = machine
    monkeypatch.setenv("PATH", str(fake_nvcc(tmp / "cuda" / "bin" / "nvcc").parent))
    monkeypatch.setenv("FP8OPS_NO_CUDA", "1")
    tc, why = cuda_build.find_toolchain()
    assert tc is None and "FP8OPS_NO_CUDA was set" in why
    assert cuda_build.nvcc_wheel_requirements() == []


def test_an_nvcc_wheel_is_found_without_a_toolkit(machine):
    """`pip install nvidia-cuda-nvcc` then `pip install --no-build-isolation .`: nvcc is in the
    environment itself."""
    tmp, sites = machine
    env = tmp / "env"
    nvcc = fake_nvcc(env / "nvidia" / "cu13" / "bin" / "nvcc")
    sites.append(env)
    assert cuda_build.find_nvcc() == (str(nvcc), "")


def torch_cuda13_env(machine, toolkit=None):
    tmp, sites = machine
    env = tmp / "env"
    dist(env, "nvidia-cuda-runtime", "13.0.96")
    if toolkit:
        dist(env, "cuda-toolkit", toolkit)
    cublas_headers(env / "nvidia" / "cu13" / "include")
    sites.append(env)


def test_isolated_build_asks_for_the_nvcc_torch_pins(machine):
    """torch's cuda-toolkit metapackage names exactly its nvcc, crt, nvvm and runtime."""
    torch_cuda13_env(machine, toolkit="13.0.2")
    assert cuda_build.nvcc_wheel_requirements() == ["cuda-toolkit[nvcc,crt,nvvm,cudart]==13.0.2"]


@pytest.mark.parametrize("toolkit", [None, "12.9.1"])
def test_isolated_build_without_a_matching_metapackage_pins_each_wheel(machine, toolkit):
    torch_cuda13_env(machine, toolkit=toolkit)
    assert cuda_build.nvcc_wheel_requirements() == [
        "nvidia-cuda-nvcc==13.0.*", "nvidia-cuda-crt==13.0.*", "nvidia-nvvm==13.0.*",
        "nvidia-cuda-runtime==13.0.96"]


def test_the_metapackage_beside_torchs_runtime_is_the_one_pinned(machine):
    """A cuda-toolkit in an earlier site dir without a runtime beside it is not torch's."""
    tmp, sites = machine
    dist(tmp / "other", "cuda-toolkit", "13.2.0")
    sites.append(tmp / "other")
    torch_cuda13_env(machine, toolkit="13.0.2")
    assert cuda_build.nvcc_wheel_requirements() == ["cuda-toolkit[nvcc,crt,nvvm,cudart]==13.0.2"]


@pytest.mark.parametrize("case", ["nvcc_on_path", "no_cublas_header", "cuda12_wheels", "cuda12_plain_name",
                                  "no_torch_wheels", "fetch_off", "fetch_false", "pip_no_index", "pip_offline"])
def test_isolated_build_asks_for_nothing(machine, monkeypatch, case):
    """Nothing to fetch where nvcc is there already, where the user turned it off or pip has no
    index (it would fail the install, which used to build CPU-only); nothing that could not
    build either: CUDA 12's nvcc wheel has no nvcc, and without torch's cublasLt.h nvcc alone
    would not do. (The build is then CPU-only and says why.)"""
    tmp, sites = machine
    env = tmp / "env"
    env.mkdir()
    sites.append(env)
    if case not in ("no_torch_wheels", "cuda12_wheels", "cuda12_plain_name"):
        dist(env, "nvidia-cuda-runtime", "13.0.96")
    if case == "cuda12_plain_name":  # a runtime wheel of CUDA 12 under the unsuffixed name
        dist(env, "nvidia-cuda-runtime", "12.9.79")
    if case != "no_cublas_header":
        cublas_headers(env / "nvidia" / "cu13" / "include")
    if case == "nvcc_on_path":
        monkeypatch.setenv("PATH", str(fake_nvcc(tmp / "cuda" / "bin" / "nvcc").parent))
    if case == "cuda12_wheels":
        dist(env, "nvidia-cuda-runtime-cu12", "12.8.90")
    if case == "fetch_off":
        monkeypatch.setenv("FP8OPS_FETCH_NVCC", "0")
    if case == "fetch_false":
        monkeypatch.setenv("FP8OPS_FETCH_NVCC", "False")
    if case == "pip_no_index":
        monkeypatch.setattr(cuda_build, "_pip_offline", REAL_PIP_OFFLINE)
        monkeypatch.setenv("PIP_NO_INDEX", "1")
    if case == "pip_offline":
        monkeypatch.setattr(cuda_build, "_pip_offline", lambda: True)
    assert cuda_build.nvcc_wheel_requirements() == []



@pytest.mark.parametrize("flag,offline", [("--no-index", True), ("--no-ind", True), ("--no-input", False),
                                          ("--index-url=x", False)])
def test_pips_no_index_is_read_off_its_command_line(flag, offline, monkeypatch):
    """A build backend runs as a child of pip: the child reads `--no-index` (or a prefix optparse
    would take for it) off its parent's argv."""
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    code = (f"import importlib.util as u; s = u.spec_from_file_location('cuda_build', {str(REPO / 'cuda_build.py')!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); m._pip_config_files = lambda: []; "
            "print(m._pip_offline())")
    # sh stays the parent (the trailing `; true` keeps it from exec-ing python); $0 is the flag
    p = subprocess.run(["sh", "-c", f"{sys.executable} -c \"$CODE\"; true", flag], env={**os.environ, "CODE": code},
                       capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == str(offline), p.stderr


@pytest.mark.parametrize("env,files,offline", [
    ("false", [], False), ("yes", [], True), ("", ["[global]\nno-index = true\n"], True),
    ("", ["[global]\nno-index = true\n[install]\nno-index = off\n"], False),
    ("", ["[global]\nno-index = true\n", "[global]\nno-index = 0\n"], False),
    ("0", ["[global]\nno-index = true\n"], False), ("", ["not an ini file ["], False)])
def test_pips_no_index_from_its_environment_and_config(monkeypatch, tmp_path, env, files, offline):
    """PIP_NO_INDEX with pip's true/false words (it wins), else pip's config files in order."""
    monkeypatch.setattr(cuda_build.os, "getppid", lambda: 0)  # /proc/0: no parent command line
    monkeypatch.setenv("PIP_NO_INDEX", env)
    paths = [touch(tmp_path / f"pip{i}.conf", text) for i, text in enumerate(files)]
    monkeypatch.setattr(cuda_build, "_pip_config_files", lambda: [str(p) for p in paths])
    assert REAL_PIP_OFFLINE() is offline


def test_pips_config_files_in_its_order(monkeypatch, tmp_path):
    """Global, user, the environment's own, PIP_CONFIG_FILE last; /dev/null there turns them off."""
    monkeypatch.setenv("PIP_CONFIG_FILE", str(tmp_path / "mine.conf"))
    files = cuda_build._pip_config_files()
    assert files[-2:] == [os.path.join(sys.prefix, "pip.conf"), str(tmp_path / "mine.conf")]
    assert files.index("/etc/pip.conf") < files.index(os.path.expanduser("~/.pip/pip.conf"))
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    assert cuda_build._pip_config_files() == []


def test_the_user_site_is_searched(monkeypatch, tmp_path):
    """`pip install --user torch`: its CUDA wheels are in the user site, not on an isolated build's path."""
    monkeypatch.setattr(cuda_build.site, "getusersitepackages", lambda: str(tmp_path))
    assert str(tmp_path) in REAL_SITE_DIRS()


def test_backend_adds_to_setuptools_requirements():
    """The PEP 517 hooks are setuptools', plus the nvcc wheels. (In a child process: setuptools'
    hooks run setup.py in the calling process, which puts the repository on its sys.path.)"""
    code = ("import cuda_build as c, setuptools.build_meta as b\n"
            "c.nvcc_wheel_requirements = lambda: ['nvidia-cuda-nvcc==13.0.*']\n"
            "print(c.get_requires_for_build_wheel()[-1], c.get_requires_for_build_editable()[-1])\n"
            "print(sorted(set(b.__all__) - set(dir(c))))\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-2:] == ["nvidia-cuda-nvcc==13.0.* nvidia-cuda-nvcc==13.0.*", "[]"]


def test_this_machines_nvcc(monkeypatch):
    """The real nvcc: the directories found hold what the build compiles and links against."""
    if not (shutil.which("nvcc") or os.environ.get("CUDA_HOME")):
        pytest.skip("no CUDA toolkit on this machine")
    monkeypatch.delenv("FP8OPS_NO_CUDA", raising=False)
    tc, why = cuda_build.find_toolchain()
    assert tc is not None, why
    headers = {h for d in tc.include_dirs for h in ("cuda_runtime_api.h", "cublasLt.h")
               if (Path(d) / h).is_file()}
    assert headers == {"cuda_runtime_api.h", "cublasLt.h"}
    assert (Path(tc.lib_dir) / "libcudart_static.a").is_file()
