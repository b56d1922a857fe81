"""Loads the C core (fp8ops._C) without ever failing `import fp8ops`.

If the extension cannot load (not compiled, torch too old, a missing shim
symbol, ...) the package still imports: `is_available()` is False and
`why_unavailable()` says why and what to do.
"""
from __future__ import annotations

import hashlib
import os
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
        if _source_checkout():
            return (f"fp8ops is imported from its source checkout ({_source_checkout()}), where the C "
                    f"extension is not built (a pip-installed fp8ops, if any, is hidden behind it): run "
                    f"from another directory, or build the checkout in place with `pip install -e .`")
        return ("fp8ops' C extension (fp8ops/_C*.so) is not built; install the package with "
                "`pip install .` (a C compiler is required; nvcc for the CUDA kernels)")
    return f"fp8ops' C extension failed to load: {msg}"


def _source_checkout() -> str | None:
    """The source tree this package is imported from (setup.py and csrc/ beside it), or None
    for an installed copy."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ok = os.path.isfile(os.path.join(root, "setup.py")) and os.path.isdir(os.path.join(root, "csrc"))
    return root if ok else None


def source_digest(root: str) -> str:
    """setup.py's digest of root/csrc (the same bytes, the same order)."""
    h = hashlib.sha256()
    csrc = os.path.join(root, "csrc")
    for name in sorted(os.listdir(csrc)):
        path = os.path.join(csrc, name)
        if os.path.isfile(path) and name.endswith((".c", ".h", ".cu", ".cuh")):
            with open(path, "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()[:16]


def _stale(mod) -> str | None:
    """Why a build imported from a source checkout does not match the sources beside it
    (`git pull` or an edit after `pip install -e .`), or None."""
    root = _source_checkout()
    built = dict(mod.build_info()).get("source_digest", "")
    if root is None or not built:
        return None
    try:
        now = source_digest(root)
    except OSError:
        return None
    if now == built:
        return None
    return (f"fp8ops' C extension in {os.path.dirname(os.path.abspath(__file__))} was built from other "
            f"sources than the csrc/ beside it (built {built}, now {now}): rebuild it with "
            f"`pip install -e .` (or `python setup.py build_ext --inplace`) in {root}")


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
    _reason = _stale(mod)
    if _reason is None:
        _C = mod


def simulate_unavailable(reason: str) -> None:
    """Treat the extension as not loaded (tests of the fallback paths; ops.py when its
    registrations fail on a build that lacks ops this package needs)."""
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
