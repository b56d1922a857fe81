#!/usr/bin/env bash
# Run every fp8ops benchmark with short timings (about 8 minutes on one H100; each script is also
# capped by a timeout so the whole run stays under ~10 minutes). Builds nothing: fp8ops (and,
# for the torchao columns, torchao) must already be installed in the Python that runs this.
#
#   OUT=/some/dir bash benchmarks/run_all.sh        # logs + JSON in $OUT (default ./bench_out)
#   PYTHON=/path/to/python FULL=1 bash benchmarks/run_all.sh   # all shapes, longer timings (~30 min:
#                                                              # too long for one 10-minute device call)
# Install first, in a separate call (the build alone takes minutes):
#   python3 -m pip install --no-build-isolation --no-deps . && python3 -m pip install --no-deps .whl/torchao-0.18.0-*.whl
#
# Writes $OUT/<name>.log and $OUT/<name>.json per script, $OUT/env.log (nvidia-smi, versions,
# `python -m fp8ops`), $OUT/linear_profile/ (profiler tables and traces), $OUT/linear.png and
# $OUT/summary.txt (every PASS/MISS target line). Carries on past a failing script; exits
# non-zero at the end if any failed (crash, timeout, or failed validation).
set -u -o pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-$PWD/bench_out}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
FULL="${FULL:-0}"
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

failed=()
t_start=$SECONDS

run() {  # run NAME TIMEOUT_S ARGS... : one script, logged, JSON to $OUT/NAME.json
  local name=$1 limit=$2
  shift 2
  echo
  echo "=== $name (timeout ${limit}s) $(date +%T)"
  timeout -k 15 "$limit" "$PY" "$HERE/$name.py" "$@" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && echo "=== $name: TIMED OUT after ${limit}s (partial JSON kept)" | tee -a "$OUT/$name.log"
    echo "=== $name: exit status $rc"
    failed+=("$name($rc)")
  fi
  echo "=== $name done in $((SECONDS - t_start))s since start"
}

{
  date
  nvidia-smi 2>&1 || echo "nvidia-smi not available"
  "$PY" -c "import sys, torch; print('python', sys.version.split()[0], '| torch', torch.__version__, '| CUDA', torch.version.cuda)"
  "$PY" -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
  (cd /tmp && "$PY" -m fp8ops) 2>&1 || echo "python -m fp8ops failed"  # /tmp: the installed package, not ./fp8ops
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

if [ "$FULL" = "1" ]; then
  run bench_cast 240
  run bench_gemm 240 --reps 200
  run bench_linear 900 --profile --profile-dir "$OUT/linear_profile" --plot "$OUT/linear.png"
  run bench_train 900 --steps 30
else
  # order: the cheap kernel checks first (they validate the ops everything else uses)
  run bench_cast 120 --reps 60
  run bench_gemm 60 --reps 40 --rounds 2
  run bench_linear 170 --quick --reps 24 --rounds 2 --warmup 4 \
      --profile --profile-shape 16384x4096x14336 --profile-iters 3 --profile-rows 15 \
      --profile-variants bf16,fp8ops,fp8ops_compiled \
      --profile-dir "$OUT/linear_profile" --plot "$OUT/linear.png"
  run bench_train 230 --models 1b,small --steps 10 --warmup 4
fi

grep -h -E "^target: |VALIDATION FAILED|validation failed|All results match" "$OUT"/bench_*.log \
  > "$OUT/summary.txt" 2>/dev/null || true
echo
echo "=== summary ($((SECONDS - t_start))s) -> $OUT/summary.txt"
grep -h "^target: " "$OUT/summary.txt" || true
if [ ${#failed[@]} -ne 0 ]; then
  echo "FAILED: ${failed[*]}"
  exit 1
fi
echo "all benchmarks ran"
