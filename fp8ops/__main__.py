"""`python -m fp8ops`: the doctor. Says what is installed, what loaded, and
whether FP8 can run here -- and if not, why and what to do. It exits 0 either
way (running in BF16 is fp8ops' fallback, not an error); with --check it exits 1
where FP8 cannot run, for scripts: `python -m fp8ops --check && ...`."""
from __future__ import annotations

import argparse
import platform
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="fp8ops-doctor" if sys.argv[0].endswith("fp8ops-doctor") else "python -m fp8ops",  # (the entry point)
        description="fp8ops doctor: what is installed, what loaded, and whether FP8 can run here")
    ap.add_argument("--check", action="store_true", help="exit 1 where FP8 cannot run here (default: exit 0)")
    args = ap.parse_args(argv)
    import torch

    import fp8ops
    from fp8ops import _loader

    def line(k, v):
        print(f"  {k:<28} {v}")

    print("fp8ops doctor")
    line("fp8ops", f"{fp8ops.__version__} ({fp8ops.__file__.rsplit('/', 1)[0]})")
    line("python / platform", f"{platform.python_version()} / {platform.machine()}")
    line("torch", torch.__version__)
    line("torch CUDA", torch.version.cuda or "none (CPU-only torch)")
    line("extension loaded", fp8ops.is_available())
    if not fp8ops.is_available():
        line("why not", fp8ops.why_unavailable())
    else:
        info = _loader.build_info()
        line("built with CUDA", bool(info["built_with_cuda"]))
        line("CUDA archs compiled", info["cuda_archs"] or "-")
        line("ops registered", "fp8ops::" + ", fp8ops::".join(info["ops"].split()))
        line("CUDA kernels registered", bool(info["cuda_kernels_registered"]) or info["cuda_reason"])
        line("min torch (shim symbols)", info["min_torch"])
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            line(f"GPU {i}", f"{torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    else:
        line("GPU", "none visible to torch")
    ok, reason = fp8ops.fp8_supported_here()
    line("FP8 can run here", "yes" if ok else f"no: {reason}")
    if not ok:
        print("  -> fp8ops.convert(model) will keep every layer in BF16/FP32 and say so.")
        return 1 if args.check else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
