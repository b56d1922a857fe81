"""Where the main thread's time goes in a `py-spy record --native -f raw` profile of
spy_loop.py: the share of its samples in the timed loop's calls of step() (the warm-up's
calls and the import's samples left out) that each frame holds, inclusive of what it calls,
largest first. The timed loop is the call site of step() on the script's highest line.
The autograd engine's device thread, which runs the backward on CUDA, is listed apart: py-spy
recorded few of its samples (why is not established), so its shares are not comparable.
py-spy leaves out samples it judges idle unless recorded with --idle: waits may be under-counted.
    python benchmarks/dev/spy_summary.py PROFILE.txt [--top 120] [--min 0.8]
"""
import argparse
import collections

ap = argparse.ArgumentParser()
ap.add_argument("profile")
ap.add_argument("--top", type=int, default=120)
ap.add_argument("--min", type=float, default=0.8, help="leave out frames under this percentage")
args = ap.parse_args()


def frame_name(f: str) -> str:
    """'func (file.py:123)' -> 'func (file.py)': a frame's lines are summed together (the last
    ' (' opens the location: C++ names hold parentheses of their own)."""
    if " (" not in f:
        return f
    name, where = f.rsplit(" (", 1)
    return f"{name} ({where.split(':')[0].rstrip(')')})"


def step_call_site(fr: list) -> int | None:
    """The script line that called step() in this stack, or None."""
    for caller, callee in zip(fr, fr[1:]):
        if callee.startswith("step (") and caller.startswith("<module> (") and ":" in caller:
            return int(caller.rsplit(":", 1)[1].rstrip(")"))
    return None


stacks = []  # (frames, samples, the line that called step() or None)
with open(args.profile) as fh:
    for line in fh:
        stack, n = line.rstrip("\n").rsplit(" ", 1)
        frames = stack.split(";")
        stacks.append((frames, int(n), step_call_site(frames)))
loop_line = max((site for *_, site in stacks if site is not None), default=None)
main = [(fr, n) for fr, n, site in stacks
        if site is not None and site == loop_line and not any("_find_and_load" in f for f in fr)]
engine = [(fr, n) for fr, n, site in stacks
          if site is None and any("Engine::thread_main" in f for f in fr)
          and not any("ReadyQueue::pop" in f for f in fr)]
for title, sel in ((f"main thread, the timed loop's step() (called from line {loop_line})", main),
                   ("autograd engine thread, busy", engine)):
    total = sum(n for _, n in sel)
    print(f"===== {title}: {total} samples")
    if not total:
        continue
    inclusive = collections.Counter()
    for fr, n in sel:
        for name in {frame_name(f) for f in fr}:
            inclusive[name] += n
    for name, n in inclusive.most_common(args.top):
        if 100 * n / total >= args.min:
            print(f"{100 * n / total:5.1f}%  {name[:150]}")
