"""Where fp8ops' CUDA build finds its pieces, and the PEP 517 backend that fetches nvcc.

The CUDA half of the build needs nvcc, the headers cuda_runtime_api.h, cublasLt.h (types and
enums only: cuBLASLt itself is the copy torch loads) and NVTX's, and libcudart_static.a. They come
from:
  * a CUDA toolkit: CUDA_HOME / CUDA_PATH, or nvcc on PATH, in NVIDIA's layout (bin/, include/,
    lib64/), conda's (targets/<arch>/) or Debian's split one (/usr/include, /usr/lib/<multiarch>);
    nvcc itself says where its headers and libraries are (`nvcc --dryrun`), so we ask it;
  * the pip wheels of torch's CUDA 13 build (nvidia/cu13/{include,lib}: all the headers and
    libcudart_static.a are there) plus NVIDIA's nvidia-cuda-nvcc wheel for nvcc.

Used two ways:
  * setup.py calls find_toolchain() to compile and link;
  * pyproject.toml names this module as the build backend: setuptools' own, plus one hook. Where no
    nvcc is found but torch's CUDA 13 wheels are installed, an isolated `pip install .` also fetches
    NVIDIA's nvcc wheels at the versions torch's wheels pin. So a machine with torch and no CUDA
    toolkit builds the CUDA kernels instead of a CPU-only fp8ops. Not where pip has no index
    (--no-index, PIP_NO_INDEX, pip.conf), nor with FP8OPS_FETCH_NVCC=0 (an index that lacks
    NVIDIA's wheels): the build is then CPU-only and says why, as before.
  * the pieces must be of one CUDA major (nvcc, cuda_runtime_api.h, cublas_api.h): a mix is refused
    with its versions named, not left to fail in the compiler or at the first GEMM.
No torch import here: the build must not need torch (setup.py links a stub libtorch).
"""
import configparser
import glob
import os
import re
import shutil
import site
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
NO_FETCH_VAR = "FP8OPS_FETCH_NVCC"  # =0: an isolated build never asks pip for nvcc's wheels
FALSE_WORDS = ("0", "n", "no", "f", "false", "off")  # pip's strtobool
TRUE_WORDS = ("1", "y", "yes", "t", "true", "on")
WHEEL_CUDA_DIRS = "cu[0-9]*"  # nvidia/cu13/...; not CUDA 12's nvidia/cuda_nvcc, nvidia/cublas, ...
# the headers the host C files include (csrc/gemm_cuda.c, csrc/sanitizer_marks.c)
HEADERS = (("cuda_runtime_api.h", ""), ("cublasLt.h", "cuBLAS "), (os.path.join("nvtx3", "nvToolsExtMemCudaRt.h"), "NVTX "))


class Toolchain(NamedTuple):
    nvcc: str
    include_dirs: list  # for the host C files that include the CUDA runtime's, cuBLASLt's and NVTX's headers
    lib_dir: str        # holds libcudart_static.a


def _no_cuda():
    """FP8OPS_NO_CUDA set to anything but "" or "0" (its rule since the first build)."""
    return os.environ.get("FP8OPS_NO_CUDA", "") not in ("", "0")


def site_dirs():
    """Where pip wheels may have put nvidia/...: this interpreter's path (an isolated build's
    environment, where the nvcc wheel lands), the environment fp8ops installs into, where torch's
    CUDA wheels are (an isolated build hides it from sys.path, not from sysconfig), and the user
    site (`pip install --user`)."""
    dirs = [*sys.path, sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    try:
        dirs.append(site.getusersitepackages())
    except (AttributeError, TypeError):  # site without a user site (some embedded interpreters)
        pass
    seen, out = set(), []
    for d in dirs:
        if not d:  # sys.path's "" (the working directory): not a site dir
            continue
        d = os.path.abspath(d)
        if d not in seen and os.path.isdir(d):
            seen.add(d)
            out.append(d)
    return out


def _wheel_paths(pattern):
    """Files matching nvidia/<pattern> under each site dir, in site-dir order."""
    return [p for d in site_dirs() for p in sorted(glob.glob(os.path.join(d, "nvidia", pattern)))]


NVCC_NOT_FOUND = ("nvcc was not found when fp8ops was installed (not in CUDA_HOME or CUDA_PATH, on PATH, in "
                  "this environment or as an nvidia-cuda-nvcc wheel); put a CUDA toolkit's nvcc on PATH, or "
                  "install torch with its CUDA 13 wheels first and reinstall fp8ops with pip in that "
                  "environment (pip install --no-cache-dir --force-reinstall --no-deps <fp8ops source>): "
                  "its build then fetches nvcc from the package index")


def find_nvcc():
    """(path of nvcc or None, why none)."""
    if _no_cuda():
        return None, "FP8OPS_NO_CUDA was set at install time; unset it and reinstall for the CUDA kernels"
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc"), ""
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc, ""
    # a conda environment's nvcc where the environment is not activated (its bin/ not on PATH)
    candidates = [os.path.join(sys.prefix, "bin", "nvcc"), *_wheel_paths(os.path.join(WHEEL_CUDA_DIRS, "bin", "nvcc"))]
    for nvcc in candidates:
        if os.access(nvcc, os.X_OK):
            return nvcc, ""
    return None, NVCC_NOT_FOUND


def _nvcc_output(nvcc, *args):
    try:
        p = subprocess.run([nvcc, *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return p.stdout + p.stderr


def nvcc_search_dirs(nvcc):
    """(include dirs, library dirs) nvcc compiles and links with, read from `nvcc --dryrun`
    (its nvcc.profile's INCLUDES / LIBRARIES); empty where it prints none."""
    includes, libs = [], []
    for line in _nvcc_output(nvcc, "--dryrun", "-c", "fp8ops_probe.cu").splitlines():
        m = re.match(r"#\$ (INCLUDES|LIBRARIES)=(.*)", line)
        if m:
            flag, into = ("-I", includes) if m.group(1) == "INCLUDES" else ("-L", libs)
            for tok in re.findall(r'"([^"]*)"|(\S+)', m.group(2)):
                tok = tok[0] or tok[1]
                if tok.startswith(flag):
                    into.append(os.path.normpath(tok[2:]))
    return includes, libs


def nvcc_major(version_text) -> Optional[int]:
    """The CUDA major in `nvcc --version`'s output ("... release 13.0, V13.0.88")."""
    m = re.search(r"release (\d+)\.", version_text)
    return int(m.group(1)) if m else None


def header_major(path, macro, divisor=1) -> Optional[int]:
    """The CUDA major a header was shipped with (CUDART_VERSION 13000 -> 13, CUBLAS_VER_MAJOR 13)."""
    try:
        with open(path, errors="replace") as f:
            m = re.search(rf"#\s*define\s+{macro}\s+(\d+)", f.read())
    except OSError:
        return None
    return int(m.group(1)) // divisor if m else None


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
    version_text = _nvcc_output(nvcc, "--version")
    major = nvcc_major(version_text)
    if major is None:  # it would not compile either: say so here, with what it printed
        said = " ".join(version_text.split())[:160]
        return None, (f"{nvcc} did not report its CUDA release (nvcc --version: {said or 'no output'}); "
                      f"repair or replace that nvcc (CUDA_HOME, PATH), then reinstall fp8ops")
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    nvcc_includes, nvcc_libs = nvcc_search_dirs(nvcc)
    # torch's wheels of nvcc's own CUDA only (nvidia/cu13/...): CUDA 12's nvidia/cublas/include
    # would pair 12's cuBLAS with 13's runtime; the system's headers last, for the same reason
    wheel_includes = [os.path.dirname(p) for p in _wheel_paths(os.path.join(f"cu{major}", "include", "cuda_runtime_api.h"))]
    search = [*nvcc_includes, os.path.join(top, "include"), *wheel_includes, SYSTEM_INCLUDE]
    include_dirs = []
    for header, part in HEADERS:
        found = _first_dir_with(header, search)
        if not found:
            return None, (f"{os.path.basename(header)} was not found when fp8ops was installed (nvcc: {nvcc}); "
                          f"install the CUDA toolkit's {part}headers or torch's CUDA 13 wheels, then reinstall fp8ops")
        if found not in include_dirs:
            include_dirs.append(found)
    # the headers the compiler will take (cublasLt.h includes <cublas_api.h>: the first -I dir's)
    versions = {"nvcc": major}
    for header, macro, divisor in (("cuda_runtime_api.h", "CUDART_VERSION", 1000), ("cublas_api.h", "CUBLAS_VER_MAJOR", 1)):
        d = _first_dir_with(header, include_dirs)
        versions[header] = header_major(os.path.join(d, header), macro, divisor) if d else None
    known = {v for v in versions.values() if v is not None}
    if len(known) > 1:
        return None, ("the CUDA pieces found when fp8ops was installed are of different CUDA versions ("
                      + ", ".join(f"{k} {v}" for k, v in versions.items()) + "); install the matching cuBLAS "
                      f"headers or point CUDA_HOME at one toolkit, then reinstall fp8ops (headers from "
                      f"{', '.join(include_dirs)})")
    lib_dirs = [*nvcc_libs, *(os.path.join(top, d) for d in ("lib64", "lib", os.path.join("lib", multiarch))),
                *(os.path.dirname(p) for p in _wheel_paths(os.path.join(f"cu{major}", "lib", "libcudart_static.a"))),
                os.path.join(SYSTEM_LIB, multiarch)]
    lib_dir = _first_dir_with("libcudart_static.a", lib_dirs)
    if not lib_dir:
        return None, (f"libcudart_static.a was not found when fp8ops was installed (nvcc: {nvcc}); install "
                      f"the CUDA toolkit's runtime library or torch's CUDA 13 wheels, then reinstall fp8ops")
    return Toolchain(nvcc, include_dirs, lib_dir), ""


def _pip_config_files():
    """pip's configuration files, in the order it reads them (global, user, site, then
    PIP_CONFIG_FILE; PIP_CONFIG_FILE=/dev/null: none at all)."""
    if os.environ.get("PIP_CONFIG_FILE") == os.devnull:
        return []
    home = os.path.expanduser("~")
    xdg = os.environ.get("XDG_CONFIG_HOME") or os.path.join(home, ".config")
    files = [*(os.path.join(d, "pip", "pip.conf") for d in (os.environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(":")),
             "/etc/pip.conf", os.path.join(home, ".pip", "pip.conf"), os.path.join(xdg, "pip", "pip.conf"),
             os.path.join(sys.prefix, "pip.conf")]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(os.environ["PIP_CONFIG_FILE"])
    return files


def _pip_offline():
    """Whether pip runs without an index. Its --no-index is not passed to a build backend, so it
    is read where pip reads it: its command line (the hook's parent process; optparse takes any
    unambiguous prefix), PIP_NO_INDEX, and its configuration files' [global] / [install]."""
    env = os.environ.get("PIP_NO_INDEX", "").strip().lower()
    if env:
        return env in TRUE_WORDS
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
        if any(a.startswith("--no-ind") and "--no-index".startswith(a) for a in args):
            return True
    except OSError:
        pass
    offline = False
    for path in _pip_config_files():
        config = configparser.RawConfigParser()
        try:
            config.read(path)
        except (configparser.Error, UnicodeDecodeError):
            continue
        for section in ("global", "install"):  # a later file / section overrides an earlier one
            value = config.get(section, "no-index", fallback=None)
            if value is not None:
                offline = value.strip().lower() in TRUE_WORDS
    return offline


def nvcc_wheel_requirements():
    """What an isolated build must fetch for nvcc: nothing where nvcc is found, CUDA is off,
    FP8OPS_FETCH_NVCC=0 or pip runs without an index; else NVIDIA's nvcc wheels at the versions
    torch's CUDA wheels pin (the cuda-toolkit metapackage torch requires, or its CUDA runtime
    wheel's series), if that CUDA has an nvcc wheel and torch's wheels hold cublasLt.h; else
    nothing (the build is then CPU-only and says why)."""
    if (_no_cuda() or os.environ.get(NO_FETCH_VAR, "1").strip().lower() in FALSE_WORDS
            or find_nvcc()[0] or _pip_offline()):
        return []
    # per environment (site dir): torch's runtime wheel and metapackage, if there
    envs = {}
    for dist in metadata.distributions(path=site_dirs()):
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in ("cuda-toolkit", "nvidia-cuda-runtime"):
            envs.setdefault(str(dist.locate_file("")), {}).setdefault(name, dist.version)
    for root, found in envs.items():  # in site-dir order: the build's own, then the target's
        runtime = found.get("nvidia-cuda-runtime")
        m = re.match(r"(\d+)\.(\d+)", runtime or "")
        if not m or int(m.group(1)) < NVCC_WHEEL_MIN_MAJOR:
            continue
        if not os.path.isfile(os.path.join(root, "nvidia", f"cu{m.group(1)}", "include", "cublasLt.h")):
            continue
        toolkit = found.get("cuda-toolkit")
        if toolkit and toolkit.split(".")[0] == m.group(1):
            # the metapackage torch pins: exactly its nvcc, crt, nvvm and runtime
            return [f"cuda-toolkit[nvcc,crt,nvvm,cudart]=={toolkit}"]
        series = f"{m.group(1)}.{m.group(2)}.*"
        # each pinned: nvcc's wheel leaves crt, nvvm and the runtime unpinned, and the newest
        # crt/nvvm next to an older nvcc emit PTX its ptxas rejects
        return [f"nvidia-cuda-nvcc=={series}", f"nvidia-cuda-crt=={series}", f"nvidia-nvvm=={series}",
                f"nvidia-cuda-runtime=={runtime}"]
    return []


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools_backend.get_requires_for_build_wheel(config_settings) + nvcc_wheel_requirements()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools_backend.get_requires_for_build_editable(config_settings) + nvcc_wheel_requirements()
