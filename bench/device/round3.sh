#!/usr/bin/env bash
# On one GPU after staging vLLM + DeepSpeed (../shared/device/README.md), the runs of 2026-11-27 (issues #27, #33):
#   bash bench/device/round3.sh pause   # bench/pause_latency.py: vLLM pause with 0..512 running requests, new vs old
#   bash bench/device/round3.sh fault   # bench/engine_fault.py --mid-sync: the 1B-shaped colocated vLLM engine killed
#                                       # inside a weight sync; seconds from the death to serving again
#   bash bench/device/round3.sh tests   # the GPU tests these changes touch
set -uo pipefail
. bench/device/env.sh
case "${1:-}" in
  pause)
    timeout -k 20 "${PAUSE_TIMEOUT:-540}" python3 bench/pause_latency.py --engine vllm --running 0 64 256 512 \
      --max-tokens 2048 --rounds "${ROUNDS:-6}" --abort-rounds "${ABORT_ROUNDS:-2}" --out "$OUT/pause.md" \
      > "$OUT/pause.log" 2>&1; echo "== pause exit $?"; grep -vE "^\s*$" "$OUT/pause.md" 2>/dev/null || tail -30 "$OUT/pause.log" ;;
  fault)
    timeout -k 20 "${FAULT_TIMEOUT:-500}" python3 bench/engine_fault.py --config configs/vllm_coloc_1gpu.yaml \
      --kill-step 2 --mid-sync --copy-to "$OUT" experiment.steps=5 "${B1[@]}" engines.0.sampling.max_new_tokens=128 \
      engines.0.kv_cache_memory_gb=20 engines.0.gpu_memory_utilization=0.5 > "$OUT/fault.log" 2>&1
    echo "== fault exit $?"; grep -E "^exit|^mid-sync|^fault|^seconds|^median|^\|" "$OUT/fault.log" || tail -30 "$OUT/fault.log" ;;
  tests)
    for f in ${FILES:-tests/gpu/test_vllm_streaming.py tests/gpu/test_vllm_engine.py tests/gpu/test_weight_sync_gpu.py}; do
      timeout -k 20 "${TEST_TIMEOUT:-280}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" "$f" 2>&1 \
        | tee -a "$OUT/gpu_tests.log" | grep -vE "^\s*$|Warning|warn\(" | tail -6
    done ;;
  *) echo "usage: $0 pause|fault|tests"; exit 2 ;;
esac
