"""fp8ops: FP8 training for PyTorch.

    import fp8ops
    model = fp8ops.convert(model)      # nn.Linear -> FP8 where it runs and pays
    fp8ops.report(model)               # what runs in FP8, what fell back, and why

`import fp8ops` never fails because of the environment: without the C
extension, CUDA, or an FP8-capable GPU, the package imports and convert()
falls back to BF16, saying why. `python -m fp8ops` prints a doctor report.
"""
import torch  # noqa: F401 -- must load libtorch before the C extension

from . import _loader

_loader.load()

from . import ops  # noqa: E402
from ._loader import build_info, is_available, why_unavailable  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # availability
    "is_available", "why_unavailable", "build_info",
    # ops
    "ops",
]
