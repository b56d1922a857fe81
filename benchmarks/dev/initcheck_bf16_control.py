"""initcheck control: the BF16 reference half of test_fp8_linear_cuda_sqnr_vs_bf16, no fp8ops
Run: compute-sanitizer --tool initcheck --nvtx yes python3 benchmarks/dev/initcheck_bf16_control.py | awk -f benchmarks/dev/initcheck_by_section.awk"""
import torch, torch.nn as nn
torch.manual_seed(0)
for master in (torch.float32, torch.bfloat16):
    ref = nn.Linear(1024, 512).cuda().to(master)
    xb = torch.randn(4, 256, 1024, device="cuda").requires_grad_()
    print("--- forward", master, flush=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y_ref = ref(xb)
    g = torch.randn_like(y_ref)
    print("--- backward", master, flush=True)
    y_ref.backward(g)
    print("--- y_ref.float()", master, flush=True)
    y_ref.float().sum().item()
    torch.cuda.synchronize()
print("OK")
