#!/usr/bin/env bash
# On one lent GPU with SGLang 0.5.17 staged into /tmp/site-sglang (../shared/device/README.md): the SGLang GPU tests,
# then the colocated sync benchmark into SGLang (ours, one call per sync, against SGLang's own single call).
#   bash bench/device/sglang_coloc.sh tests                      # tests/gpu/test_sglang_engine.py
#   bash bench/device/sglang_coloc.sh bench "llama-3.2-1b" [extra bench/weight_sync.py flags]
# Logs and tables go to $OUT.
set -uo pipefail
export PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 RLHF_ORCH_LOG_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__)" 2>&1 | tail -1
case "${1:-tests}" in
  tests)
    timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" \
      tests/gpu/test_sglang_engine.py 2>&1 | tee "$OUT/sglang_tests.log" | grep -vE "^\s*$|Warning|warn\(" | tail -15 ;;
  bench)
    models=${2:-llama-3.2-1b}; shift 2 || shift $#
    timeout "${BENCH_TIMEOUT:-560}" python3 bench/weight_sync.py --engine sglang --placements colocated \
      --models $models --repeats 10 --out "$OUT/RESULTS_sglang.md" --json "$OUT/sglang.json" "$@" 2>&1 \
      | tee "$OUT/sglang_bench.log" | grep -vE "Warning|warn\(" | tail -30 ;;
esac
