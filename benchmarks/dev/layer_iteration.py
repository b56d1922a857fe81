"""One training iteration of a single layer, as the dev timing scripts run it:
grads cleared, forward under bf16 autocast, backward, and (for fp8ops) the
optimizer step's scale update."""
import torch

import fp8ops


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
