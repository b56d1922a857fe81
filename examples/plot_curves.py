"""Compare training runs: loss against step from two or more metrics.json files.

Shows whether FP8 training tracks BF16: it prints each run's final train and validation loss with
the relative difference from the first run, and draws the curves to a PNG (if matplotlib is
installed; the numbers are printed either way).

    python examples/train_fp8.py --out_dir runs/bf16
    python examples/train_fp8.py --out_dir runs/fp8 --use_fp8
    python examples/plot_curves.py runs/bf16/metrics.json runs/fp8/metrics.json -o curves.png
"""

import argparse
import json
import os
import sys
from pathlib import Path


def smooth(values, window):
    """Trailing moving average: per-step loss is noisy, the trend is what compares."""
    if window <= 1:
        return list(values)
    out = []
    for i in range(len(values)):
        recent = values[max(0, i + 1 - window):i + 1]
        out.append(sum(recent) / len(recent))  # (a NaN in the window gives NaN there only)
    return out


def label_of(path, metrics):
    """The run's directory and what ran (fp8_ran: converted is not running FP8 under policy auto)."""
    return f"{Path(path).parent.name or path} ({metrics.get('fp8_ran') or metrics.get('backend', '?')})"


def tokens_per_s(metrics):
    """A run's steady tokens/s: the median of its log windows, or the mean where only that was saved."""
    v = metrics.get("median_tokens_per_s")
    return metrics.get("mean_tokens_per_s") if v is None else v


def rel(a, b):
    return f"{100 * (b - a) / a:+.2f}%" if a else "-"


def differences(base: dict, m: dict) -> list[str]:
    """What makes two runs' losses and tokens/s incomparable: their length, tokens per step, model."""
    out = []
    for key, what in (("last_step", "its last step"), ("tokens_per_step", "tokens per step"),
                      ("model_config", "its model")):
        if key in base and key in m and base[key] != m[key]:
            out.append(f"{what} ({m[key]} vs {base[key]})" if key != "model_config" else what)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("metrics", nargs="+", help="metrics.json files written by train_fp8.py; "
                                              "the first is the baseline")
    p.add_argument("-o", "--out", default="loss_curves.png", help="PNG to write")
    p.add_argument("--smooth", type=int, default=20,
                   help="moving-average window over training steps (1 = raw)")
    args = p.parse_args(argv)
    if len(args.metrics) < 2:
        p.error("give at least two metrics.json files to compare")

    runs = []
    for path in args.metrics:
        try:
            with open(path) as f:
                m = json.load(f)
            # (a diverged run's NaN/inf losses are written as null: plotted as gaps)
            for key in ("train_loss", "val_loss"):
                m[key] = [float("nan") if v is None else v for v in m.get(key, [])]
            runs.append((path, m))
        except (OSError, ValueError) as e:
            p.error(f"{path}: {e} (a metrics.json that train_fp8.py wrote)")

    # --- numbers -----------------------------------------------------------------------------------
    base = runs[0][1]
    width = max(len(label_of(path, m)) for path, m in runs)
    print(f"{'run':<{width}}  {'steps':>6}  {'train':>8}  {'vs first':>9}  {'val':>8}  "
          f"{'vs first':>9}  {'tokens/s':>10}  {'vs first':>9}")
    for path, m in runs:
        # (the median of the log windows; metrics.json files before it have the mean only)
        tr, va, tps = m.get("final_train_loss"), m.get("final_val_loss"), tokens_per_s(m)
        btr, bva = base.get("final_train_loss"), base.get("final_val_loss")
        btps = tokens_per_s(base)
        print(f"{label_of(path, m):<{width}}  {m.get('last_step', 0):>6}  "
              f"{'-' if tr is None else format(tr, '.4f'):>8}  "
              f"{rel(btr, tr) if None not in (btr, tr) else '-':>9}  "
              f"{'-' if va is None else format(va, '.4f'):>8}  "
              f"{rel(bva, va) if None not in (bva, va) else '-':>9}  "
              f"{'-' if tps is None else format(tps, ',.0f'):>10}  "
              f"{rel(btps, tps) if None not in (btps, tps) else '-':>9}")
    print("train = mean of the last 10 steps; val = last evaluation")
    for path, m in runs[1:]:
        for line in differences(base, m):
            print(f"note: {label_of(path, m)} differs from the first run in {line}: its ratios compare unlike runs")

    # --- plot --------------------------------------------------------------------------------------
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written")
        return 0
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):  # (after the numbers, which are printed either way)
        p.error(f"-o {args.out}: the folder {out_dir} does not exist; create it or write the PNG elsewhere")
    fig, ax = plt.subplots(figsize=(9, 5))
    for path, m in runs:
        name = label_of(path, m)
        line, = ax.plot(m["steps"], smooth(m["train_loss"], args.smooth), lw=1,
                        label=f"{name} train")
        if m.get("val_steps"):
            ax.plot(m["val_steps"], m["val_loss"], "o--", ms=3, color=line.get_color(),
                    label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel(f"loss (train: {args.smooth}-step moving average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
