#!/usr/bin/env bash
# Issue E item 5: GPT-2 small, FP8 (all 48 linears, policy always) vs BF16 from the same seed,
# on the embedded corpus (default: the stdlib, ~5 MB: 2000 steps are ~7 passes over it, the model
# overfits) and on a corpus large enough for 2000 steps to stay under one epoch (every .py file
# under the stdlib and torch directories, tens of MB: CORPUS=big). The runs go side by side on the
# GPU (all four at once), so their tokens/s say nothing; their losses do not depend on timing.
# ARCH="gpt2 llama" runs each corpus with each block style (examples/gpt2.py; files *_<arch>_*
# for llama, unchanged names for gpt2).
#   STEPS=2000 CORPUS="default big" ARCH=gpt2 bash benchmarks/dev/long_run.sh      (logs, metrics -> $OUT)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-2000}
common="--model small --steps $STEPS --eval_every 250 --eval_iters ${EVAL_ITERS:-40} --log_every 50 --no-tensorboard --save_every 100000"
for corpus in ${CORPUS:-default big}; do
  data=""
  if [ "$corpus" = big ]; then
    torch_dir=$(python3 -c "import os, torch; print(os.path.dirname(torch.__file__))")
    stdlib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")
    find "$stdlib" "$torch_dir" -name '*.py' -print0 | sort -z | xargs -0 cat > /tmp/corpus_big.txt
    data="--data /tmp/corpus_big.txt"
    echo "big corpus: $(wc -c < /tmp/corpus_big.txt) bytes"
  fi
  for arch in ${ARCH:-gpt2}; do
    tag=$corpus; [ "$arch" = gpt2 ] || tag="${corpus}_$arch"
    for mode in bf16 fp8; do
      fp8=""; [ "$mode" = fp8 ] && fp8="--use_fp8 --fp8_backend fp8ops --fp8_policy always"
      python3 examples/train_fp8.py $common --arch "$arch" $data $fp8 --out_dir "/tmp/runs/${tag}_$mode" \
        > "$OUT/long_${tag}_$mode.log" 2>&1 &
    done
  done
done
wait
for corpus in ${CORPUS:-default big}; do
  for arch in ${ARCH:-gpt2}; do
    tag=$corpus; [ "$arch" = gpt2 ] || tag="${corpus}_$arch"
    for mode in bf16 fp8; do
      cp "/tmp/runs/${tag}_$mode/metrics.json" "$OUT/long_${tag}_$mode.json" 2>/dev/null
      tail -4 "$OUT/long_${tag}_$mode.log"
    done
  done
done
