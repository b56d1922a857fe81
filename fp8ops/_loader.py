"""Loads the C core (fp8ops._C) without ever failing `import fp8ops`.

If the extension cannot load (not compiled, torch too old, a missing shim
symbol, ...) the package still imports: `is_available()` is False and
`why_unavailable()` says why and what to do.
"""
from __future__ import annotations

import re

import torch

MIN_TORCH = (2, 10)

_C = None
_reason: str | None = None


def _torch_version() -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _explain(err: BaseException) -> str:
    msg = str(err)
    sym = re.search(r"undefined symbol: (\S+)", msg)
    if sym:
        head = (f"fp8ops' C extension needs libtorch symbol {sym.group(1)}, which torch "
                f"{torch.__version__} does not export")
        if _torch_version() < MIN_TORCH:
            return (f"{head}; fp8ops needs torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]} "
                    f"(pip install -U 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}')")
        return (f"{head}, although this torch meets fp8ops' minimum (torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}): "
                f"the installed fp8ops build does not match it; reinstall fp8ops "
                f"(pip install --force-reinstall --no-cache-dir .) and report a bug if it persists")
    if "No module named" in msg or "cannot import name '_C'" in msg:
        return ("fp8ops' C extension (fp8ops/_C*.so) is not built; install the package with "
                "`pip install .` (a C compiler is required; nvcc for the CUDA kernels)")
    return f"fp8ops' C extension failed to load: {msg}"


def load() -> None:
    global _C, _reason
    if _torch_version() < MIN_TORCH:
        _reason = (f"torch {torch.__version__} is too old: fp8ops needs torch >= "
                   f"{MIN_TORCH[0]}.{MIN_TORCH[1]} for the stable C shim it registers ops through "
                   f"(pip install -U 'torch>={MIN_TORCH[0]}.{MIN_TORCH[1]}')")
        return
    try:
        from . import _C as mod  # noqa: PLC0415 -- registers torch.ops.fp8ops.*
    except ImportError as e:
        _reason = _explain(e)
        return
    except Exception as e:  # a registration failure surfaces as ImportError, but be safe
        _reason = _explain(e)
        return
    _C = mod


def simulate_unavailable(reason: str) -> None:
    """For tests of the fallback paths: pretend the extension did not load."""
    global _C, _reason
    _C, _reason = None, reason


def is_available() -> bool:
    """True when fp8ops' C extension is loaded and its ops are registered."""
    return _C is not None


def why_unavailable() -> str | None:
    """None when the extension loaded, else the reason and the remedy."""
    return _reason if _C is None else None


def build_info() -> dict:
    return dict(_C.build_info()) if _C is not None else {}
