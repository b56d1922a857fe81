"""One training iteration of a single layer, as the dev timing scripts run it:
grads cleared, forward under bf16 autocast, backward, and (for fp8ops) the
optimizer step's scale update."""
import copy

import torch

import fp8ops
from fp8ops import policy


def make_iteration(mod, x, g, step: bool, device: str = "cuda"):
    params = list(mod.parameters())

    def it():
        x.grad = None
        for p in params:
            p.grad = None
        with torch.autocast(device, dtype=torch.bfloat16):
            y = mod(x)
        y.backward(g)
        if step:
            fp8ops.step(mod)
    return it


def layer_and_batch(shape: str, device: str = "cuda"):
    """((M, K, N), nn.Linear(K, N) without bias (seed 0), x [M, K] bf16 requiring grad, and
    g [M, N], the output's gradient) for a shape "MxKxN", as the dev timing scripts use them."""
    M, K, N = (int(v) for v in shape.split("x"))
    torch.manual_seed(0)
    base = torch.nn.Linear(K, N, bias=False, device=device)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(M, N, device=device, dtype=torch.bfloat16) * 1e-3  # gradients are small
    return (M, K, N), base, x, g


def settled_bf16(base, x, g, cast_first: bool, rest: bool = True):
    """A converted copy of `base` under policy "auto" that runs BF16 for x's rows: after 5 FP8
    steps (cast_first, as a trial's FP8 blocks run them), and with the verdict BF16 through the
    layer's own decision (rest: it rests at the next optimizer step) or set by hand (no
    decision, so no rest: the scale update runs every step)."""
    key = (x.shape[0], torch.bfloat16)
    layer = fp8ops.convert(copy.deepcopy(base), config=fp8ops.Fp8Config(policy="auto"))
    it = make_iteration(layer, x, g, True)
    if cast_first:
        layer.fp8_policy[key] = (True, 1.0)
        for _ in range(5):
            it()
        del layer.fp8_policy[key]
    if rest:
        measure = policy.measure
        policy.measure = lambda *a: policy.Timing(1.0, 2.0, 1.0, 2.0, 0.1, 0.2)
        it()
        policy.measure = measure
    else:
        layer.fp8_policy[key] = (False, 1.0)
        layer.__dict__["_fp8_bf16_key"] = None
    return layer
