"""Why bench_train's settled check can read a low SQNR for one parameter (1B, fp8ops eager,
h.0.attn.c_attn.weight at -2.0 dB on an H200, twentieth session): bench_train's own run with
its settled_check wrapped, printing per Fp8Linear the check's amaxes (row 0 of the history after
the check's forward + backward; row 0 is zeroed at each update) against the history's maximum,
which sets the delayed scale: a ratio above 1 is saturation, far below 1 lost resolution.
    cd benchmarks && python3 dev/settled_check_probe.py --models 1b --variants fp8ops --batch-1b 8 --steps 2
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_train  # noqa: E402

real_check = bench_train.settled_check
COLS = ("x", "w", "dy")


def probe(model, call, GPT, cfg, batch):
    lins = {n: m for n, m in model.named_modules() if type(m).__name__ == "Fp8Linear"}
    before = {n: m.fp8_amax_history.detach().float().cpu().clone() for n, m in lins.items()}
    chk = real_check(model, call, GPT, cfg, batch)
    rows = []
    for n, m in lins.items():
        h = m.fp8_amax_history.detach().float().cpu()
        now, past = h[0], before[n][1:]
        hmax = past.amax(0)
        ratio = [float(now[c] / hmax[c]) if hmax[c] > 0 else float("nan") for c in range(3)]
        rows.append((n, ratio, now, hmax, m.fp8_scale.detach().float().cpu()))
    print(f"\n[probe] check: {chk}")
    print("[probe] per layer: amax now / history max (x, w, dy); > 1 saturates; the 12 farthest from 1")
    for n, ratio, now, hmax, s in sorted(rows, key=lambda r: -max(abs(torch.tensor(r[1]).log2().nan_to_num(0))))[:12]:
        print(f"[probe] {n:32s} ratio x {ratio[0]:8.3g} w {ratio[1]:8.3g} dy {ratio[2]:8.3g} | now dy {now[2]:.3g} "
              f"hist max dy {hmax[2]:.3g} scale dy {s[2]:.3g}")
    worst = chk["min_param"].replace("_orig_mod.", "").rsplit(".", 1)[0]
    lowest_dy = [r[0] for r in sorted(rows, key=lambda r: r[1][2])[:2]]
    for name in dict.fromkeys([worst, "transformer.h.0.attn.c_attn", "transformer.h.8.mlp.c_fc"] + lowest_dy):
        if name not in before:
            continue
        # each update rolls row h + 1 into row h and the step's row 0 into row H - 1: the steps
        # run so far end at row H - 1, oldest first, from the first row that ever held an amax
        # (a step that cast nothing, e.g. one of the trial's BF16 steps, rolled in a zero row)
        past = before[name]
        seen = past[1:].gt(0).any(1).nonzero()
        recent = past[1 + int(seen[0]):] if len(seen) else past[:0]
        for c, what in ((2, "dy"), (0, "x")):
            print(f"[probe] {name}: {what} amax per step, oldest first: "
                  + " ".join(f"{float(v):.3g}" for v in recent[:, c]))
    return chk


bench_train.settled_check = probe
sys.argv = ["bench_train.py"] + sys.argv[1:]
sys.exit(bench_train.main())
