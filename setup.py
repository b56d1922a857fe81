"""Build fp8ops._C from csrc/: C11 sources with the system C compiler, CUDA
sources with nvcc when present (cuda_build.py finds nvcc, its headers and the static
CUDA runtime: a toolkit's, or torch's CUDA wheels' plus NVIDIA's nvcc wheel). No torch
at build time: the module is linked against a stub libtorch_cpu.so (same SONAME,
empty functions) generated here, and at import the real libtorch_cpu.so that
`import torch` loaded satisfies it.

Environment:
  FP8OPS_NO_CUDA=1          build CPU kernels only, even if nvcc is found
  FP8OPS_CUDA_ARCHS="89;90;100;120"   SM archs (add "a" for arch-specific, e.g. 90a);
                            PTX of the last one is embedded for newer GPUs. Unset: those
                            of the four this nvcc can build
  CUDA_HOME / CUDA_PATH     where to find nvcc (default: nvcc on PATH, else an nvidia-cuda-nvcc wheel)
  FP8OPS_FETCH_NVCC=0       an isolated build never fetches NVIDIA's nvcc wheels (cuda_build.py)
  DEBUG=1                   -O0 -g
"""
import glob
import hashlib
import os
import re
import subprocess
import sys
import sysconfig

import setuptools
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_build import find_toolchain  # noqa: E402  (beside this file: also the PEP 517 backend)

DEFAULT_ARCHS = "89;90;100;120"
CUDA_ONLY_C = {"gemm_cuda.c", "sanitizer_marks.c"}  # host C files that need the CUDA headers
PY_LIMITED = "0x030A0000"  # CPython 3.10+
SOURCE_SUFFIXES = (".c", ".h", ".cu", ".cuh")  # what the digest reads (not an editor's swap file)


def source_digest():
    """Digest of the csrc/ sources: compiled into the build, compared by the Python package
    with the sources beside it (a source checkout built before a `git pull`)."""
    h = hashlib.sha256()  # (fp8ops/_loader.py's source_digest reads the same bytes in the same order)
    for name in sorted(os.listdir("csrc")):
        path = os.path.join("csrc", name)
        if os.path.isfile(path) and name.endswith(SOURCE_SUFFIXES):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def cuda_archs(nvcc):
    """The SM archs to compile: FP8OPS_CUDA_ARCHS (accepted as "89;90a", "8.9", "sm_90"), else
    the default ones this nvcc knows (an older toolkit lacks sm_100 / sm_120)."""
    given = os.environ.get("FP8OPS_CUDA_ARCHS", "").strip()
    archs = []
    for a in given.replace(",", ";").replace(" ", ";").split(";"):
        a = a.strip().lower()
        if not a:
            continue
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d*)([af]?)", a)
        if not m:
            raise SystemExit(f"FP8OPS_CUDA_ARCHS: {a!r} is not an SM arch; expected e.g. "
                             f"FP8OPS_CUDA_ARCHS=\"89;90a;100\" (major and minor digits, optional a/f suffix)")
        archs.append(m.group(1) + m.group(2) + m.group(3))
    if archs:
        return archs
    try:
        known = subprocess.check_output([nvcc, "--list-gpu-arch"], text=True).split()
    except (OSError, subprocess.CalledProcessError):
        return DEFAULT_ARCHS.split(";")
    known = {k.split("_", 1)[1] for k in known if k.startswith("compute_")}
    archs = [a for a in DEFAULT_ARCHS.split(";") if a in known]
    dropped = [a for a in DEFAULT_ARCHS.split(";") if a not in known]
    if dropped:
        print(f"fp8ops: this nvcc cannot build sm_{', sm_'.join(dropped)}; building {', '.join(archs) or 'none'}",
              flush=True)
    if not archs:
        raise SystemExit("fp8ops: this nvcc knows none of the FP8 archs (sm_89, sm_90, sm_100, sm_120): "
                         "install CUDA 12.0 or newer, or build without CUDA (FP8OPS_NO_CUDA=1)")
    return archs


def run(cmd):
    print(" ".join(cmd), flush=True)
    subprocess.check_call(cmd)


class BuildFp8ops(build_ext):
    """Compiles and links fp8ops._C by hand: setuptools' compiler would compile
    .c files fine but knows nothing of nvcc or the stub library."""

    def build_extension(self, ext):
        debug = os.environ.get("DEBUG", "0") not in ("", "0")
        tmp = os.path.abspath(os.path.join(self.build_temp, "fp8ops"))
        os.makedirs(tmp, exist_ok=True)
        out = os.path.abspath(self.get_ext_fullpath(ext.name))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        cc = os.environ.get("CC") or ((sysconfig.get_config_var("CC") or "").split() or ["cc"])[0]
        cuda, no_cuda_reason = find_toolchain()
        nvcc = cuda.nvcc if cuda else None
        if cuda:
            print(f"fp8ops: CUDA build with {nvcc}; headers from {', '.join(cuda.include_dirs)}; "
                  f"libcudart_static.a from {cuda.lib_dir}", flush=True)
        else:
            print(f"fp8ops: building without CUDA: {no_cuda_reason}", flush=True)
        archs = cuda_archs(nvcc) if nvcc else []
        opt = ["-O0", "-g"] if debug else ["-O2"]

        cflags = ["-std=c11", "-fPIC", "-fexceptions", "-Wall", "-Wextra", *opt,
                  f"-DPy_LIMITED_API={PY_LIMITED}", "-I" + sysconfig.get_paths()["include"], "-Icsrc",
                  f'-DFP8OPS_SOURCE_DIGEST="{source_digest()}"']
        if nvcc:
            cflags += ["-DFP8OPS_WITH_CUDA", f'-DFP8OPS_CUDA_ARCHS="{" ".join(archs)} ptx"',
                       *("-I" + d for d in cuda.include_dirs)]
        else:
            c_literal = no_cuda_reason.replace("\\", "\\\\").replace('"', '\\"')  # (paths may hold either)
            cflags += [f'-DFP8OPS_NO_CUDA_REASON="{c_literal}"']
        objects = []
        for src in sorted(glob.glob("csrc/*.c")):
            if os.path.basename(src) in CUDA_ONLY_C and not nvcc:
                continue
            obj = os.path.join(tmp, os.path.basename(src) + ".o")
            run([cc, *cflags, "-c", src, "-o", obj])
            objects.append(obj)
        if nvcc:
            gencode = []
            for a in archs:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
            last = re.sub(r"[^0-9]", "", archs[-1])
            gencode += ["-gencode", f"arch=compute_{last},code=compute_{last}"]
            nvflags = ["-std=c++17", "-Xcompiler", "-fPIC", "-Icsrc", "--threads", "0",
                       *(["-g", "-lineinfo"] if debug else ["-O3", "-lineinfo"]), *gencode]
            for src in sorted(glob.glob("csrc/*.cu")):
                obj = os.path.join(tmp, os.path.basename(src) + ".o")
                run([nvcc, *nvflags, "-c", src, "-o", obj])
                objects.append(obj)

        stub_dir = self.make_torch_stub(cc, objects, tmp)
        libs = ["-L" + stub_dir, "-ltorch_cpu", "-ldl", "-lpthread"]
        if nvcc:
            # static cudart: no NEEDED entry for libcudart, so a CPU-only torch imports us
            libs = ["-L" + cuda.lib_dir, "-lcudart_static", "-lrt", "-lstdc++", *libs]
        run([cc, "-shared", "-o", out, *objects, *libs, "-lm"])

    @staticmethod
    def make_torch_stub(cc, objects, tmp):
        """A libtorch_cpu.so with the right SONAME defining every shim symbol
        we use as an empty function; it is only linked against, never shipped."""
        syms = set()
        for obj in objects:
            listing = subprocess.check_output(["nm", "-u", obj], text=True)
            for line in listing.split():
                if re.match(r"^(aoti_torch_|torch_)\w+$", line):
                    syms.add(line)
        stub_dir = os.path.join(tmp, "stub")
        os.makedirs(stub_dir, exist_ok=True)
        src = os.path.join(stub_dir, "torch_cpu_stub.c")
        with open(src, "w") as f:
            f.write("/* generated by setup.py: link-time stand-in for libtorch_cpu.so */\n")
            for s in sorted(syms):
                f.write(f"void {s}(void) {{}}\n")
        run([cc, "-shared", "-fPIC", "-Wl,-soname,libtorch_cpu.so", "-o",
             os.path.join(stub_dir, "libtorch_cpu.so"), src])
        return stub_dir


def require_setuptools(version: str, minimum=(77, 0)) -> None:
    """pyproject.toml gives the license as an SPDX string, which setuptools < 77 rejects with a
    schema dump that names no remedy (the TOML-table form stops building after Feb 2027)."""
    found = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    found += (0,) * (2 - len(found))  # ("77" is 77.0)
    if found < minimum:
        raise SystemExit(
            f"fp8ops: building needs setuptools >= {minimum[0]}, found {version} (pyproject.toml's license "
            f"is an SPDX expression). Run `python -m pip install 'setuptools>={minimum[0]},<82'` (torch 2.11 "
            f"requires setuptools < 82; keep your torch's bound), or build with plain `pip install .`, whose "
            f"isolated build fetches it.")


require_setuptools(setuptools.__version__)
setup(
    ext_modules=[Extension("fp8ops._C", sources=sorted(glob.glob("csrc/*.c")), py_limited_api=True)],
    cmdclass={"build_ext": BuildFp8ops},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
