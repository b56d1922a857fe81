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
