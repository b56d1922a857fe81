"""Run: compute-sanitizer --tool memcheck python3 benchmarks/dev/sanitizer_diag.py leak|leak_control
     compute-sanitizer --tool initcheck --nvtx yes python3 benchmarks/dev/sanitizer_diag.py policy
Device diagnostics for issue E: (1) where memory_allocated grows under memcheck, and who
holds what survives; leak_control: the same measurement for a torch-only custom op;
(2) which initcheck reports in test_fp8_linear_cuda_compile_and_graph come from which path."""
import gc, sys, torch, torch.nn as nn
import fp8ops
from fp8ops import ops
mode = sys.argv[1]
x = torch.randn(64, 64, device="cuda"); s = torch.ones(1, device="cuda")
if mode == "leak":
    def live():
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))
    def run(name, fn, n=300):
        for _ in range(5): fn()
        torch.cuda.synchronize(); gc.collect()
        b = torch.cuda.memory_allocated(); t = live(); st0 = torch.cuda.memory_stats()
        for _ in range(n): fn()
        torch.cuda.synchronize(); gc.collect()
        st1 = torch.cuda.memory_stats()
        print(f"{name}: {(torch.cuda.memory_allocated() - b) / n:.0f} B/call, live tensors +{live() - t}, "
              f"active +{(st1['active_bytes.all.current'] - st0['active_bytes.all.current']) / n:.0f} B/call, "
              f"allocs +{st1['allocation.all.allocated'] - st0['allocation.all.allocated']} frees +{st1['allocation.all.freed'] - st0['allocation.all.freed']}", flush=True)
    run("torch abs.amax", lambda: x.abs().amax())
    run("ops.amax", lambda: ops.amax(x))
    run("torch.ops.fp8ops.amax.default", lambda: torch.ops.fp8ops.amax.default(x))
    run("torch.ops.fp8ops.cast.default", lambda: torch.ops.fp8ops.cast.default(x, s, torch.float8_e4m3fn, True))
    y = torch.ops.fp8ops.amax.default(x)
    print("sys.getrefcount(op output) =", sys.getrefcount(y), "(2 = only the local name)")
    torch.cuda.memory._record_memory_history(max_entries=1000)
    keep = [torch.ops.fp8ops.amax.default(x) for _ in range(1)]; del keep
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] == "active_allocated" and blk.get("frames"):
                fr = [f"{f['name']}" for f in blk["frames"]][:14]
                print("still allocated:", blk["size"], "bytes from", " <- ".join(fr))
    torch.cuda.memory._record_memory_history(enabled=None)
    # who holds the cast outputs that survive the call
    gc.collect()
    before = {id(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    torch.ops.fp8ops.cast.default(x, s, torch.float8_e4m3fn, True)
    gc.collect()
    new = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and id(o) not in before]
    print("tensors alive after one cast call:", [tuple(t.shape) for t in new])
    for t in new[:1]:
        for r in gc.get_referrers(t):
            if r is new:
                continue
            for rr in gc.get_referrers(r):
                if type(rr).__name__ == "frame":
                    print("  held through", type(r).__name__, "by the frame of", rr.f_code.co_name, rr.f_code.co_filename,
                          "line", rr.f_lineno)
                    # and who keeps that frame alive: up to three levels of referrers
                    level, seen = [rr], {id(new), id(rr)}
                    for depth in range(3):
                        nxt = []
                        for obj in level:
                            for ref in gc.get_referrers(obj):
                                if id(ref) in seen or ref is level or ref is nxt:
                                    continue
                                seen.add(id(ref))
                                desc = type(ref).__name__
                                if desc == "frame":
                                    desc += f" {ref.f_code.co_name} ({ref.f_code.co_filename}:{ref.f_lineno})"
                                elif isinstance(ref, BaseException):
                                    desc += f" {ref!r}"[:200]
                                elif desc == "module":
                                    desc += f" {ref.__name__}"
                                elif desc == "function":
                                    desc += f" {ref.__module__}.{ref.__qualname__}"
                                elif desc == "dict":
                                    desc += f" keys {list(ref)[:6]}"
                                elif desc == "list":
                                    desc += f" of {len(ref)}"
                                print("    " * (depth + 2) + f"<- {desc}")
                                nxt.append(ref)
                        level = nxt[:8]
elif mode == "leak_control":
    # torch alone: a pure-Python custom op with a Python autograd formula, the same machinery
    # (torch/_library/autograd.py) that fp8ops' cast and gemm go through; no fp8ops code runs
    @torch.library.custom_op("diagctl::twice", mutates_args=())
    def twice(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return t * 2, t * 3

    @twice.register_fake
    def _(t):
        return torch.empty_like(t), torch.empty_like(t)

    torch.library.register_autograd("diagctl::twice", lambda ctx, g1, g2: g1 * 2 + g2 * 3)
    for name, fn in (("torch op without autograd formula (mul)", lambda: (x * 2, x * 3)),
                     ("diagctl::twice (Python custom op + autograd formula)", lambda: twice(x))):
        for _ in range(5):
            fn()
        torch.cuda.synchronize(); gc.collect()
        b = torch.cuda.memory_allocated()
        for _ in range(300):
            fn()
        torch.cuda.synchronize(); gc.collect()
        print(f"{name}: {(torch.cuda.memory_allocated() - b) / 300:.0f} B/call still allocated", flush=True)
else:
    torch.manual_seed(0)
    class MLP(nn.Module):  # tests/test_linear.py's
        def __init__(self, d, h):
            super().__init__()
            self.up, self.down, self.head = nn.Linear(d, h), nn.Linear(h, d), nn.Linear(d, 16, bias=False)
        def forward(self, x):
            return self.head(self.down(torch.relu(self.up(x))))
    for policy in ("always", "auto"):
        model = fp8ops.convert(MLP(256, 512).cuda(), config=fp8ops.Fp8Config(policy=policy))
        x = torch.randn(64, 256, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x)
            print(f"--- policy={policy} eager fwd .float(); BF16 layers: {[m.fp8_policy for m in model.modules() if hasattr(m, 'fp8_policy')]}", flush=True)
            model(x).float().sum().item()
            torch._dynamo.reset()
            cm = torch.compile(model, fullgraph=True)
            cm(x)
            print(f"--- policy={policy} compiled fwd .float()", flush=True)
            cm(x).float().sum().item()
    print("--- plain nn.Linear bf16 autocast .float()", flush=True)
    lin = nn.Linear(256, 512).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lin(x).float().sum().item()
    torch.cuda.synchronize()
    print("OK")
