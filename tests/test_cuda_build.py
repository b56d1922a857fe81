"""cuda_build.py: where the build finds nvcc, the CUDA headers and the static CUDA runtime, and
what an isolated build asks pip for. The layouts are built in tmp_path with a stand-in nvcc (a
shell script that prints what `nvcc --dryrun` prints), so no toolkit is needed; the last test
reads this machine's real nvcc where there is one."""
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import cuda_build  # noqa: E402


def fake_nvcc(path: Path, includes=(), libs=()):
    """An executable that answers `nvcc --dryrun` with these INCLUDES / LIBRARIES, as nvcc.profile does."""
    path.parent.mkdir(parents=True, exist_ok=True)
    inc = " ".join(f'"-I{d}"' for d in includes)
    lib = " ".join(f'"-L{d}"' for d in libs)
    path.write_text(f"#!/bin/sh\necho '#$ INCLUDES={inc}  ' >&2\necho '#$ LIBRARIES=  {lib}' >&2\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def touch(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    return path


def runtime_dist(site: Path, name="nvidia_cuda_runtime", version="13.0.96", pip_name="nvidia-cuda-runtime"):
    """A dist-info as pip leaves it, for importlib.metadata."""
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {pip_name}\nVersion: {version}\n")


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """No toolkit anywhere: an empty PATH, no CUDA_HOME, no site dirs, empty system dirs."""
    for var in ("CUDA_HOME", "CUDA_PATH", "FP8OPS_NO_CUDA"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "empty_bin").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "empty_bin"))
    sites = []
    monkeypatch.setattr(cuda_build, "site_dirs", lambda: [str(s) for s in sites])
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
    touch(cu / "include" / "cuda_runtime_api.h")
    touch(cu / "lib" / "libcudart_static.a")
    touch(target_env / "nvidia" / "cu13" / "include" / "cublasLt.h")
    touch(target_env / "nvidia" / "cu13" / "include" / "cuda_runtime_api.h")
    sites += [build_env, target_env]
    tc, why = cuda_build.find_toolchain()
    assert why == ""
    assert tc.nvcc == str(nvcc)
    # nvcc's own headers first, torch's cublasLt.h after
    assert tc.include_dirs == [str(cu / "include"), str(target_env / "nvidia" / "cu13" / "include")]
    assert tc.lib_dir == str(cu / "lib")


def test_debian_split_layout(machine):
    """Debian's toolkit: nvcc on PATH saying nothing useful, headers in /usr/include, the static
    runtime in /usr/lib/<multiarch>."""
    tmp, _ = machine
    nvcc = fake_nvcc(tmp / "usr" / "bin" / "nvcc")
    os.environ["PATH"] = str(nvcc.parent)
    touch(tmp / "usr" / "include" / "cuda_runtime_api.h")
    touch(tmp / "usr" / "include" / "cublasLt.h")
    touch(tmp / "usr" / "lib" / "x86_64-linux-gnu" / "libcudart_static.a")
    tc, why = cuda_build.find_toolchain()
    assert why == ""
    assert (tc.nvcc, tc.include_dirs, tc.lib_dir) == (
        str(nvcc), [str(tmp / "usr" / "include")], str(tmp / "usr" / "lib" / "x86_64-linux-gnu"))


def test_targets_layout_from_cuda_home_over_path(machine):
    """NVIDIA's and conda's targets/<arch>/ layout, read from nvcc; CUDA_HOME wins over PATH."""
    tmp, _ = machine
    target = tmp / "cuda" / "targets" / "x86_64-linux"
    nvcc = fake_nvcc(tmp / "cuda" / "bin" / "nvcc", includes=[target / "include"], libs=[target / "lib"])
    other = fake_nvcc(tmp / "other" / "bin" / "nvcc")
    os.environ["PATH"] = str(other.parent)
    os.environ["CUDA_HOME"] = str(tmp / "cuda")
    touch(target / "include" / "cuda_runtime_api.h")
    touch(target / "include" / "cublasLt.h")
    touch(target / "lib" / "libcudart_static.a")
    tc, why = cuda_build.find_toolchain()
    assert why == ""
    assert (tc.nvcc, tc.include_dirs, tc.lib_dir) == (str(nvcc), [str(target / "include")], str(target / "lib"))


@pytest.mark.parametrize("missing", ["cublasLt.h", "cuda_runtime_api.h", "libcudart_static.a"])
def test_a_missing_piece_is_named_with_the_remedy(machine, missing):
    tmp, _ = machine
    top = tmp / "cuda"
    nvcc = fake_nvcc(top / "bin" / "nvcc", includes=[top / "include"], libs=[top / "lib64"])
    os.environ["PATH"] = str(nvcc.parent)
    for p in (top / "include" / "cuda_runtime_api.h", top / "include" / "cublasLt.h",
              top / "lib64" / "libcudart_static.a"):
        if p.name != missing:
            touch(p)
    tc, why = cuda_build.find_toolchain()
    assert tc is None
    assert f"{missing} was not found" in why and str(nvcc) in why and "reinstall fp8ops" in why


def test_no_nvcc_anywhere(machine):
    tc, why = cuda_build.find_toolchain()
    assert tc is None
    assert why.startswith("nvcc was not found when fp8ops was installed")
    assert "reinstall fp8ops" in why and "nvcc on PATH" in why
    # it becomes a C string literal (-DFP8OPS_NO_CUDA_REASON="...") inside a 512-byte message
    assert '"' not in why and len("built without CUDA ()" + why) < 512


def test_fp8ops_no_cuda_wins(machine):
    tmp, _ = machine
    os.environ["PATH"] = str(fake_nvcc(tmp / "cuda" / "bin" / "nvcc").parent)
    os.environ["FP8OPS_NO_CUDA"] = "1"
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


def test_isolated_build_asks_for_nvcc_at_torchs_cuda_version(machine):
    tmp, sites = machine
    env = tmp / "env"
    runtime_dist(env, version="13.0.96")
    touch(env / "nvidia" / "cu13" / "include" / "cublasLt.h")
    sites.append(env)
    assert cuda_build.nvcc_wheel_requirements() == [
        "nvidia-cuda-nvcc==13.0.*", "nvidia-cuda-crt==13.0.*", "nvidia-nvvm==13.0.*",
        "nvidia-cuda-runtime==13.0.96"]


@pytest.mark.parametrize("case", ["nvcc_on_path", "no_cublas_header", "cuda12_wheels", "no_torch_wheels"])
def test_isolated_build_asks_for_nothing(machine, case):
    """Nothing to fetch where nvcc is there already; nothing that could not build either: CUDA 12's
    nvcc wheel has no nvcc, and without torch's cublasLt.h nvcc alone would not do. (The build is
    then CPU-only and says why.)"""
    tmp, sites = machine
    env = tmp / "env"
    env.mkdir()
    sites.append(env)
    if case == "nvcc_on_path":
        os.environ["PATH"] = str(fake_nvcc(tmp / "cuda" / "bin" / "nvcc").parent)
    if case in ("nvcc_on_path", "no_cublas_header"):
        runtime_dist(env)
    if case != "no_cublas_header":
        touch(env / "nvidia" / "cu13" / "include" / "cublasLt.h")
    if case == "cuda12_wheels":
        runtime_dist(env, name="nvidia_cuda_runtime_cu12", version="12.8.90", pip_name="nvidia-cuda-runtime-cu12")
        touch(env / "nvidia" / "cuda_runtime" / "include" / "cuda_runtime_api.h")
    assert cuda_build.nvcc_wheel_requirements() == []


def test_backend_adds_to_setuptools_requirements(monkeypatch):
    """The PEP 517 hooks are setuptools', plus the nvcc wheels."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(cuda_build, "nvcc_wheel_requirements", lambda: ["nvidia-cuda-nvcc==13.0.*"])
    for hook in (cuda_build.get_requires_for_build_wheel, cuda_build.get_requires_for_build_editable):
        req = hook()
        assert req[-1] == "nvidia-cuda-nvcc==13.0.*"
    assert cuda_build.build_wheel is cuda_build._setuptools_backend.build_wheel
    assert cuda_build.build_sdist is cuda_build._setuptools_backend.build_sdist


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
