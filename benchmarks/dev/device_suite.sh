#!/usr/bin/env bash
# One device call: build, doctor, the whole pytest suite on CUDA, the standalone
# kernel checks. Logs go to $OUT. Usage (on the GPU machine, repo root):
#   bash benchmarks/dev/device_suite.sh [pytest args...]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; python3 -c "import torch;print('torch', torch.__version__, torch.version.cuda)"; date -u; } 2>&1 | tee "$OUT/env.log"
python3 -m pip install -q --no-build-isolation --no-deps . > "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
(cd /tmp && python3 -m fp8ops) 2>&1 | tee "$OUT/doctor.log"
status=0
python3 -m pytest tests -q -rs -p no:cacheprovider "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40; status=$((status | ${PIPESTATUS[0]}))
exit $status
