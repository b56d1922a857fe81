#!/usr/bin/env bash
# A/B of two fp8ops builds on one GPU machine, in one call: this checkout ("new")
# against an older commit ("old"), the same benchmark scripts (this checkout's),
# runs interleaved new, old, new, old so that a drift of the machine shows.
# Each run measures policy "auto" afresh (its own policy cache file).
#   here:   mkdir -p .old && git archive REV | gzip > .old/REV.tar.gz   (.old ignored; carry it)
#   device: bash benchmarks/dev/ab_builds.sh .old/REV.tar.gz
#           HOST_ROUNDS=6 bash benchmarks/dev/ab_builds.sh ...   (host time only, 256^3, alternating)
#           TRAIN=1 bash benchmarks/dev/ab_builds.sh ...   (bench_train instead, TRAIN_ARGS, new old new old)
#           SKIP_BUILD=1 ...   (a later call on the same warm machine: both builds are still there)
#           SHAPES=MxKxN,... ...   (bench_linear on these shapes instead of --quick's)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FP8OPS_CUDA_ARCHS=${FP8OPS_CUDA_ARCHS:-90}
R=$(pwd)
if [ -z "${SKIP_BUILD:-}" ]; then
  python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build_new.log" 2>&1 || { tail -30 "$OUT/build_new.log"; exit 1; }
  rm -rf /tmp/oldsrc /tmp/oldsite && mkdir -p /tmp/oldsrc && tar -xzf "$1" -C /tmp/oldsrc
  (cd /tmp/oldsrc && python3 -m pip install -q --no-build-isolation --no-deps --target /tmp/oldsite .) \
    > "$OUT/build_old.log" 2>&1 || { tail -30 "$OUT/build_old.log"; exit 1; }
fi
site() { [ "$1" = old ] && echo /tmp/oldsite || echo ""; }
if [ -n "${HOST_ROUNDS:-}" ]; then  # host time only, 256^3, alternating sides
  for r in $(seq "$HOST_ROUNDS"); do
    for side in new old; do
      echo -n "$side: "
      (cd /tmp && PYTHONPATH=$(site $side) python3 "$R/benchmarks/dev/host_split.py" --totals 5 --iters 300) 2>&1 | tail -1
    done
  done
  exit 0
fi
if [ -n "${TRAIN:-}" ]; then  # bench_train, new old new old, each its own policy cache
  i=0
  for side in new old new old; do
    i=$((i + 1))
    echo "== bench_train run $i ($side)"
    (cd "$R/benchmarks" && PYTHONPATH=$(site $side) FP8OPS_POLICY_CACHE=/tmp/policy_train_$i.json python3 \
      bench_train.py ${TRAIN_ARGS:---models small --variants bf16,fp8ops --steps 20} \
      --json "$OUT/train_ab_${i}_$side.json") 2>&1 | grep -v Warning | tail -${TRAIN_TAIL:-8}
  done
  exit 0
fi
for side in new old; do
  echo "== host_split ($side)"
  (cd /tmp && PYTHONPATH=$(site $side) python3 "$R/benchmarks/dev/host_split.py") 2>&1 | tail -12
done
SHAPE_ARGS=${SHAPES:+--shapes $SHAPES}; SHAPE_ARGS=${SHAPE_ARGS:---quick}
i=0
for side in new old new old; do
  i=$((i + 1))
  echo "== bench_linear run $i ($side)"
  (cd /tmp && PYTHONPATH=$(site $side) FP8OPS_POLICY_CACHE=/tmp/policy_$i.json timeout 150 python3 \
    "$R/benchmarks/bench_linear.py" $SHAPE_ARGS --variants ${VARIANTS:-bf16,fp8ops,fp8ops_auto} --no-ceiling \
    --reps ${REPS:-40} --rounds 2 --json "$OUT/linear_ab_${i}_$side.json") 2>&1 | grep -v Warning | tail -14
done
