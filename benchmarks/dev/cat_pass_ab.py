"""bench_train with one more variant, fp8ops_nocat_compiled: fp8ops compiled with
cat_grad_pass's rewrite off (inductor concatenates the q, k, v gradients before c_attn's cast,
as before the pass), beside fp8ops_compiled in the same run, for an A/B of the rewrite. Inductor's
caches are off for the whole run (their key holds the pass's source, not this switch, so a graph
compiled with the rewrite could be served to the other side).
    python benchmarks/dev/cat_pass_ab.py --models 1b --variants bf16_compiled,fp8ops_compiled,fp8ops_nocat_compiled \
        --batch-1b 8 --steps 20 --repeats 2
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_train  # noqa: E402
from fp8ops import cat_grad_pass  # noqa: E402

NOCAT = "fp8ops_nocat_compiled"
_fuse, _build = cat_grad_pass.fuse_cat_grads, bench_train.build


def build(variant, *args, **kwargs):
    # (the variants run one after another, each compiled in its own warm-up: the switch holds
    # from one build to the next)
    cat_grad_pass.fuse_cat_grads = (lambda graph: 0) if variant == NOCAT else _fuse
    return _build("fp8ops_compiled" if variant == NOCAT else variant, *args, **kwargs)


bench_train.VARIANTS = bench_train.VARIANTS + (NOCAT,)
bench_train.build = build
torch.compiler.config.force_disable_caches = True
sys.exit(bench_train.main())
