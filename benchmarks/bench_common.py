"""Helpers shared by the benchmark scripts: the environment header every table
starts with, the FP8 readiness check, JSON output, fixed-width tables and torch.compile's
counters."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

import torch


def environment() -> dict:
    """GPU, driver, torch/CUDA versions and date; printed at the top and stored in the JSON."""
    env = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "host": platform.node(), "python": platform.python_version(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "argv": sys.argv}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sm=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                   gpu_mem_gib=round(p.total_memory / 2**30, 1))
        try:
            q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,power.limit,clocks.max.sm",
                                "--format=csv,noheader", "-i", "0"], capture_output=True, text=True,
                               timeout=20)
            if q.returncode == 0:
                env["nvidia_smi"] = q.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        import fp8ops
        env["fp8ops"] = getattr(fp8ops, "__version__", "?")
        env["fp8ops_build"] = {k: str(v) for k, v in fp8ops.build_info().items()}
    except Exception as e:  # noqa: BLE001 -- the header must print whatever is broken
        env["fp8ops"] = f"not importable: {e}"
    try:
        import torchao
        env["torchao"] = torchao.__version__
    except Exception as e:  # noqa: BLE001
        env["torchao"] = f"not importable: {type(e).__name__}: {e}"
    return env


def print_environment(env: dict) -> None:
    print(f"# {os.path.basename(sys.argv[0])}  {env['date']}  host {env['host']}")
    if "gpu" in env:
        print(f"# GPU: {env['gpu']} (sm_{env['sm'].replace('.', '')}, {env['sms']} SMs, {env['gpu_mem_gib']} GiB)"
              f"  driver, power limit, max SM clock: {env.get('nvidia_smi', '?')}")
    else:
        print("# GPU: none visible to torch")
    print(f"# torch {env['torch']}  CUDA {env['cuda']}  python {env['python']}  fp8ops {env.get('fp8ops')} (CUDA archs {env.get('fp8ops_build', {}).get('cuda_archs', '?')})"
          f"  torchao {env.get('torchao')}")


def fp8_ready() -> str | None:
    """None when CUDA + an FP8-capable GPU + fp8ops' CUDA kernels are all here; else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import fp8ops
    except Exception as e:  # noqa: BLE001
        return f"fp8ops is not importable: {e}"
    ok, why = fp8ops.fp8_supported_here()
    return None if ok else why


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def report_validation(result: dict, failures: list[str]) -> None:
    """Print the validation outcome before timing; store it in the JSON result."""
    if failures:
        print("VALIDATION FAILED (timing anyway; affected rows are marked '!'):")
        for f in failures:
            print("  " + f)
    else:
        print("All results match. Starting benchmarks.")
    result["validation_failures"] = failures


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    cells = [[str(c) for c in r] for r in rows]
    w = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "-+-".join("-" * x for x in w)
    out = [title] if title else []
    out += [" | ".join(h.rjust(x) for h, x in zip(headers, w)), line]
    out += [" | ".join(c.rjust(x) for c, x in zip(r, w)) for r in cells]
    return "\n".join(out)


def _dynamo_counter(group: str, key: str | None = None) -> int:
    """torch._dynamo's counter group[key] so far in this process, or the group's sum (0 where
    this torch has none)."""
    try:
        from torch._dynamo.utils import counters  # noqa: PLC0415
        c = counters[group]
        return int(c[key] if key else sum(c.values()))
    except Exception:  # noqa: BLE001
        return 0


def graph_breaks() -> int:
    """torch.compile graph breaks so far in this process."""
    return _dynamo_counter("graph_break")


def graphs_compiled() -> int:
    """Graphs torch.compile made so far in this process."""
    return _dynamo_counter("stats", "unique_graphs")


def cudagraph_skips() -> int:
    """How often inductor ran a graph without CUDA graphs so far in this process."""
    return _dynamo_counter("inductor", "cudagraph_skips")


def inductor_cache_hits() -> int:
    """Graphs inductor took from its FX graph cache so far in this process (their passes do
    not run again: gelu_grads_fused() does not count them)."""
    return _dynamo_counter("inductor", "fxgraph_cache_hit")


def gelu_grads_fused() -> int:
    """GELU gradients inductor's pass has moved into their producers' gradient casts so far in
    this process, in graphs it compiled (fp8ops/gelu_grad_pass.py; 0 without fp8ops)."""
    try:
        from fp8ops import gelu_grad_pass  # noqa: PLC0415
    except ImportError:
        return 0
    return gelu_grad_pass.FUSED[0]


def residual_adds_fused() -> tuple[int, int, int]:
    """(residual adds run inside the next fused norm's forward, residual gradients added inside
    the fused norms' backward, of those the ones that also wrote the sum's 16-bit copy) that
    inductor's pass has rewritten so far in this process, in graphs it compiled
    (fp8ops/residual_pass.py, on unless its ENABLED is False; zeros without fp8ops)."""
    try:
        from fp8ops import residual_pass  # noqa: PLC0415
    except ImportError:
        return 0, 0, 0
    return residual_pass.FUSED_ADDS[0], residual_pass.FUSED[0], residual_pass.COPIES[0]


def cat_grads_fused() -> int:
    """Fp8Linear backwards inductor's pass has given their dy as the pieces of a concatenation
    (the q, k, v gradients), read in place by the cast, so far in this process, in graphs it
    compiled (fp8ops/cat_grad_pass.py; 0 without fp8ops)."""
    try:
        from fp8ops import cat_grad_pass  # noqa: PLC0415
    except ImportError:
        return 0
    return cat_grad_pass.FUSED[0]


def start(json_path: str | None) -> dict | None:
    """Print the environment header; return it, or None (after saying why and
    writing the JSON) when FP8 cannot run here and the script should exit 0."""
    env = environment()
    print_environment(env)
    why = fp8_ready()
    if why is not None:
        print(f"{os.path.basename(sys.argv[0]).removesuffix('.py')}: nothing to measure here: {why}. "
              f"FP8 needs CUDA and an sm_89+ GPU; exiting.")
        write_json(json_path, {"env": env, "skipped": why})
        return None
    return env
