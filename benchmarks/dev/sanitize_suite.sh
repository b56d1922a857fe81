#!/usr/bin/env bash
# compute-sanitizer over the pytest suite on CUDA (issue E). Each job is
# "tool:file[,file...][:pytest -k expression, ~ for spaces]" and runs in its own process; all jobs run at once on one
# GPU (a suite under one tool takes longer than one device call). --nvtx yes lets
# initcheck see which GEMM outputs cuBLASLt wrote (csrc/sanitizer_marks.c).
# Per-test results and the tool's reports: $OUT/sanitize_logs.tgz. Usage, repo root,
# fp8ops installed:
#   JOBS="memcheck:test_cast.py initcheck:test_gemm.py,test_fused.py" bash benchmarks/dev/sanitize_suite.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
REPO=$(pwd)
# the files that run CUDA kernels; not test_environment.py (its GPU cases hide the GPU from
# a child process) nor test_distributed.py (gloo on CPU; parallel jobs would share its port)
ALL="test_cast.py,test_gemm.py,test_fused.py,test_amax_update.py,test_linear.py,test_guards.py,test_emulated.py,test_fuzz.py,test_training.py"
JOBS=${JOBS:-"memcheck:$ALL racecheck:$ALL synccheck:$ALL initcheck:$ALL"}
LIMIT=${SANITIZE_LIMIT:-480}
LOGS=$(mktemp -d)
# policy "auto" times torch's BF16 GEMMs the first time it meets a shape; under racecheck that
# timing loop ended the process (RESULTS.md §1). One plain run first caches the verdicts
# (~/.cache/fp8ops/policy.json), so the runs under the tools only read them. PRIME=0 skips it.
if [ "${PRIME:-1}" = 1 ]; then
  (cd /tmp && python3 -m pytest "$REPO/tests/test_linear.py" "$REPO/tests/test_guards.py" \
      "$REPO/tests/test_emulated.py" -q -p no:cacheprovider > "$LOGS/00_plain_prime.log" 2>&1)
  echo "policy cache primed: $(tail -1 "$LOGS/00_plain_prime.log")"
fi
i=0
for job in $JOBS; do
  IFS=: read -r tool files kexpr <<< "$job"; i=$((i + 1)); kexpr=${kexpr//\~/ }
  paths=""; for f in ${files//,/ }; do paths="$paths $REPO/tests/$f"; done
  log="$LOGS/$(printf %02d $i)_${tool}_${files%%,*}.log"
  # from /tmp so the installed package (with _C) is imported, not the source tree
  ( cd /tmp && timeout "$LIMIT" compute-sanitizer --tool "$tool" --nvtx yes ${SANITIZER_ARGS:-} --error-exitcode 9 \
      --print-limit 200 python3 -m pytest $paths -v -p no:cacheprovider -m "not slow" --tb=short \
      ${kexpr:+-k "$kexpr"} ${PYTEST_ARGS:-} > "$log" 2>&1
    echo "exit=$?" >> "$log" ) &
done
wait
status=0
for log in "$LOGS"/[0-9][0-9]_*check_*.log; do
  # pytest's own totals; a run cut off by the limit has none: count the per-test words
  # (a tool's report can sit between a test's name and its PASSED)
  totals=$(grep -E "^=+ .*(passed|failed).* in [0-9.]+s" "$log" | tail -1)
  [ -n "$totals" ] || totals="cut off after $(grep -c "PASSED" "$log") passed, $(grep -c "FAILED" "$log") failed"
  echo "$(basename "$log" .log): $totals; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|^exit=' "$log" | tr '\n' ' ')"
  grep -q '^exit=0$' "$log" || status=1
done
tar czf "$OUT/sanitize_logs.tgz" -C "$LOGS" .
exit $status
