"""Where fp8ops' CUDA build finds its pieces, and the PEP 517 backend that fetches nvcc.

The CUDA half of the build needs nvcc, the headers cuda_runtime_api.h and cublasLt.h (types and
enums only: cuBLASLt itself is the copy torch loads) and libcudart_static.a. They come from:
  * a CUDA toolkit: CUDA_HOME / CUDA_PATH, or nvcc on PATH, in NVIDIA's layout (bin/, include/,
    lib64/), conda's (targets/<arch>/) or Debian's split one (/usr/include, /usr/lib/<multiarch>);
    nvcc itself says where its headers and libraries are (`nvcc --dryrun`), so we ask it;
  * the pip wheels of torch's CUDA 13 build (nvidia/cu13/{include,lib}: cuda_runtime_api.h,
    cublasLt.h and libcudart_static.a are all there) plus NVIDIA's nvidia-cuda-nvcc wheel for nvcc.

Used two ways:
  * setup.py calls find_toolchain() to compile and link;
  * pyproject.toml names this module as the build backend: setuptools' own, plus one hook. Where no
    nvcc is found but torch's CUDA 13 wheels are installed, an isolated `pip install .` also fetches
    nvidia-cuda-nvcc at the version of the CUDA runtime torch brought. So a machine with torch and
    no CUDA toolkit builds the CUDA kernels instead of a CPU-only fp8ops.
No torch import here: the build must not need torch (setup.py links a stub libtorch).
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from typing import NamedTuple, Optional

from setuptools import build_meta as _setuptools_backend
from setuptools.build_meta import *  # noqa: F401,F403  (every other PEP 517 hook is setuptools')

NVCC_WHEEL_MIN_MAJOR = 13  # the first CUDA whose nvidia-cuda-nvcc wheel carries nvcc (12's has ptxas only)
SYSTEM_INCLUDE = "/usr/include"  # Debian's split layout: headers here,
SYSTEM_LIB = "/usr/lib"          # libraries in /usr/lib/<multiarch>


class Toolchain(NamedTuple):
    nvcc: str
    include_dirs: list  # for the host C files that include cuda_runtime_api.h / cublasLt.h
    lib_dir: str        # holds libcudart_static.a


def site_dirs():
    """Where pip wheels may have put nvidia/...: this interpreter's path (an isolated build's
    environment, where the nvcc wheel lands) and the environment fp8ops installs into, where
    torch's CUDA wheels are (an isolated build hides it from sys.path, not from sysconfig)."""
    dirs = [*sys.path, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    seen, out = set(), []
    for d in dirs:
        d = os.path.abspath(d or ".")
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            out.append(d)
    return out


def _wheel_paths(pattern):
    """Files matching nvidia/<pattern> under each site dir, in site-dir order."""
    return [p for d in site_dirs() for p in sorted(glob.glob(os.path.join(d, "nvidia", pattern)))]


def find_nvcc():
    """(path of nvcc or None, why none)."""
    if os.environ.get("FP8OPS_NO_CUDA", "0") not in ("", "0"):
        return None, "FP8OPS_NO_CUDA was set at install time; unset it and reinstall for the CUDA kernels"
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc"), ""
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc, ""
    for nvcc in _wheel_paths(os.path.join("cu*", "bin", "nvcc")):
        if os.access(nvcc, os.X_OK):
            return nvcc, ""
    return None, ("nvcc was not found when fp8ops was installed (not on PATH, not in CUDA_HOME, no "
                  "nvidia-cuda-nvcc wheel); install torch with its CUDA 13 wheels first, then reinstall "
                  "fp8ops with pip install --no-cache-dir --force-reinstall --no-deps (its build then "
                  "fetches nvcc), or put a CUDA toolkit's nvcc on PATH")


def nvcc_search_dirs(nvcc):
    """(include dirs, library dirs) nvcc compiles and links with, read from `nvcc --dryrun`
    (its nvcc.profile's INCLUDES / LIBRARIES); empty where it prints none."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "fp8ops_probe.cu"], capture_output=True, text=True,
                             timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return [], []
    includes, libs = [], []
    for line in out.splitlines():
        m = re.match(r"#\$ (INCLUDES|LIBRARIES)=(.*)", line)
        if m:
            flag, into = ("-I", includes) if m.group(1) == "INCLUDES" else ("-L", libs)
            for tok in re.findall(r'"([^"]*)"|(\S+)', m.group(2)):
                tok = tok[0] or tok[1]
                if tok.startswith(flag):
                    into.append(os.path.normpath(tok[2:]))
    return includes, libs


def _first_dir_with(name, dirs):
    for d in dirs:
        if os.path.isfile(os.path.join(d, name)):
            return d
    return None


def find_toolchain():
    """(Toolchain or None, why none)."""
    nvcc, why = find_nvcc()
    if not nvcc:
        return None, why
    top = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    nvcc_includes, nvcc_libs = nvcc_search_dirs(nvcc)
    wheel_includes = [os.path.dirname(p) for p in _wheel_paths(os.path.join("*", "include", "cublasLt.h"))]
    include_dirs = []
    for header in ("cuda_runtime_api.h", "cublasLt.h"):
        found = _first_dir_with(header, [*nvcc_includes, os.path.join(top, "include"), SYSTEM_INCLUDE,
                                         *wheel_includes])
        if not found:
            return None, (f"{header} was not found when fp8ops was installed (nvcc: {nvcc}); install the "
                          f"CUDA toolkit's {'cuBLAS ' if header == 'cublasLt.h' else ''}headers or torch's "
                          f"CUDA 13 wheels, then reinstall fp8ops")
        if found not in include_dirs:
            include_dirs.append(found)
    lib_dirs = [*nvcc_libs, *(os.path.join(top, d) for d in ("lib64", "lib", os.path.join("lib", multiarch))),
                os.path.join(SYSTEM_LIB, multiarch),
                *(os.path.dirname(p) for p in _wheel_paths(os.path.join("*", "lib", "libcudart_static.a")))]
    lib_dir = _first_dir_with("libcudart_static.a", lib_dirs)
    if not lib_dir:
        return None, (f"libcudart_static.a was not found when fp8ops was installed (nvcc: {nvcc}); install "
                      f"the CUDA toolkit's runtime library or torch's CUDA 13 wheels, then reinstall fp8ops")
    return Toolchain(nvcc, include_dirs, lib_dir), ""


def nvcc_wheel_requirements():
    """What an isolated build must fetch for nvcc: nothing where nvcc is found (or CUDA is off);
    where it is not, NVIDIA's nvcc wheels at the version of the CUDA runtime wheel torch brought,
    if that CUDA has an nvcc wheel and torch's wheels hold cublasLt.h; else nothing (the build is
    then CPU-only and says why)."""
    if os.environ.get("FP8OPS_NO_CUDA", "0") not in ("", "0") or find_nvcc()[0]:
        return []
    for dist in metadata.distributions(path=site_dirs()):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") != "nvidia-cuda-runtime":
            continue
        version = dist.version
        m = re.match(r"(\d+)\.(\d+)", version)
        if not m or int(m.group(1)) < NVCC_WHEEL_MIN_MAJOR:
            continue
        root = dist.locate_file("")
        if not os.path.isfile(os.path.join(str(root), "nvidia", f"cu{m.group(1)}", "include", "cublasLt.h")):
            continue
        series = f"{m.group(1)}.{m.group(2)}.*"
        # the runtime pinned too: nvcc's wheel would otherwise pull the newest runtime's headers
        return [f"nvidia-cuda-nvcc=={series}", f"nvidia-cuda-crt=={series}", f"nvidia-nvvm=={series}",
                f"nvidia-cuda-runtime=={version}"]
    return []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools_backend.get_requires_for_build_wheel(config_settings) + nvcc_wheel_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools_backend.get_requires_for_build_editable(config_settings) + nvcc_wheel_requirements()
