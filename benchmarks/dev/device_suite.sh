#!/usr/bin/env bash
# One device call: build, doctor, the whole pytest suite on CUDA, standalone
# kernel checks, compute-sanitizer. Logs go to $OUT. Usage (repo root):
#   bash benchmarks/dev/device_suite.sh   (WORKERS=1: one pytest process; SANITIZE=0: no sanitizers;
#   INSTALL=0: no pip install)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$(pwd)
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda)"; date -u; } 2>&1 | tee "$OUT/env.log"
if [ "${INSTALL:-1}" = 1 ]; then  # (INSTALL=0: the package this tree built in an earlier call on the same machine)
  python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
fi
(cd /tmp && python3 -m fp8ops) 2>&1 | tee "$OUT/doctor.log"
status=0
# from /tmp so the installed package (with _C) is imported, not the source tree. With
# pytest-xdist the suite runs in WORKERS processes, one file each at a time (~345 s for the
# whole suite on an H200 with 8, against ~800 s in one process); the tests marked `timing`
# then run alone, since other workers' load moves the timings they assert on.
if [ "${WORKERS:-8}" -gt 1 ] && python3 -c "import xdist" 2>/dev/null; then
  # (-v: each test's result as it ends, so a run cut short by a time limit still names its failures)
  (cd /tmp && python3 -m pytest "$REPO/tests" -n "${WORKERS:-8}" --dist loadfile -m "not timing" -v -rfEs \
     -p no:cacheprovider --durations=30 ${PYTEST_ARGS:-}) > "$OUT/pytest.log" 2>&1; rc=$?; status=$((status | rc))
  grep -E "^\[gw[0-9]+\].* (FAILED|ERROR)" "$OUT/pytest.log" | head -20
  tail -30 "$OUT/pytest.log"
  (cd /tmp && python3 -m pytest "$REPO/tests" -m timing -q -rs -p no:cacheprovider ${PYTEST_ARGS:-}) \
     > "$OUT/pytest_timing.log" 2>&1; rc=$?; status=$((status | rc))
  tail -5 "$OUT/pytest_timing.log"
else
  (cd /tmp && python3 -m pytest "$REPO/tests" -q -rs -p no:cacheprovider ${PYTEST_ARGS:-}) > "$OUT/pytest.log" 2>&1; rc=$?; status=$((status | rc))
  tail -30 "$OUT/pytest.log"
fi
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck}; do
    log="$OUT/sanitize_$tool.log.tmp"
    timeout 300 compute-sanitizer --tool "$tool" --nvtx yes --error-exitcode 9 python3 benchmarks/dev/sanitize_ops.py > "$log" 2>&1; rc=$?
    echo "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|^OK' "$log" | tr '\n' ' ')"; status=$((status | rc))
    { echo "=== $tool rc=$rc"; head -c 200000 "$log"; } >> "$OUT/sanitize.log"; rm -f "$log"
  done
fi
exit $status
