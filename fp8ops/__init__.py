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
from .config import Fp8Config  # noqa: E402
from .conversion import convert, convert_to_fp8_training, fp8_supported_here  # noqa: E402
from .fsdp import enable_fsdp_fp8_all_gather  # noqa: E402
from .policy import tune_policy  # noqa: E402
from .report import report  # noqa: E402
from .scaling import (exclude_from_ddp_broadcast, load_scaling_state_dict, scaling_state_dict,  # noqa: E402
                      set_scaling_group, step)
from .swiglu import SwiGLU  # noqa: E402
from .training import add_fp8_args, config_from_args, prepare_model  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    # convert and inspect
    "convert_to_fp8_training", "convert", "report", "Fp8Config", "tune_policy",
    # availability
    "is_available", "why_unavailable", "fp8_supported_here", "build_info",
    # DDP and FSDP2
    "exclude_from_ddp_broadcast", "enable_fsdp_fp8_all_gather", "set_scaling_group",
    # scaling state
    "scaling_state_dict", "load_scaling_state_dict", "step",
    # training scripts
    "add_fp8_args", "config_from_args", "prepare_model",
    # modules
    "SwiGLU",
    # ops
    "ops",
]
