"""Where the main thread's time goes in a `py-spy record --native -f raw` profile of
spy_loop.py: the share of its samples inside step() (the import's samples left out) that
each frame holds, inclusive of what it calls, largest first. The autograd engine's device
thread, which runs the backward on CUDA, is listed apart (py-spy samples it only while it
holds a Python thread state, so its share is not comparable).
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
    """'func (file.py:123)' -> 'func (file.py)': a frame's lines are summed together."""
    if " (" not in f:
        return f
    name, where = f.split(" (", 1)
    return f"{name} ({where.split(':')[0].rstrip(')')})"


stacks = []
with open(args.profile) as fh:
    for line in fh:
        stack, n = line.rstrip("\n").rsplit(" ", 1)
        stacks.append((stack.split(";"), int(n)))
main = [(fr, n) for fr, n in stacks
        if any(f.startswith("step (") for f in fr) and not any("_find_and_load" in f for f in fr)]
engine = [(fr, n) for fr, n in stacks
          if any("Engine::thread_main" in f for f in fr) and not any("ReadyQueue::pop" in f for f in fr)
          and not any(f.startswith("step (") for f in fr)]
for title, sel in (("main thread, inside step()", main), ("autograd engine thread, busy", engine)):
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
