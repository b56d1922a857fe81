#!/usr/bin/env bash
# One device call: build, doctor, the whole pytest suite on CUDA, standalone
# kernel checks, compute-sanitizer. Logs go to $OUT. Usage (repo root):
#   bash benchmarks/dev/device_suite.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$(pwd)
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda)"; date -u; } 2>&1 | tee "$OUT/env.log"
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
(cd /tmp && python3 -m fp8ops) 2>&1 | tee "$OUT/doctor.log"
status=0
# from /tmp so the installed package (with _C) is imported, not the source tree
(cd /tmp && python3 -m pytest "$REPO/tests" -q -rs -p no:cacheprovider ${PYTEST_ARGS:-}) > "$OUT/pytest.log" 2>&1; rc=$?; status=$((status | rc))
tail -30 "$OUT/pytest.log"
if [ "${SANITIZE:-1}" = 1 ]; then
  for tool in ${SANITIZE_TOOLS:-memcheck}; do
    log="$OUT/sanitize_$tool.log.tmp"
    timeout 300 compute-sanitizer --tool "$tool" --nvtx yes --error-exitcode 9 python3 benchmarks/dev/sanitize_ops.py > "$log" 2>&1; rc=$?
    echo "compute-sanitizer $tool: rc=$rc $(grep -E 'ERROR SUMMARY|^OK' "$log" | tr '\n' ' ')"; status=$((status | rc))
    { echo "=== $tool rc=$rc"; head -c 200000 "$log"; } >> "$OUT/sanitize.log"; rm -f "$log"
  done
fi
exit $status
