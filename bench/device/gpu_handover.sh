#!/usr/bin/env bash
# The GPU hand-over of colocated syncs (weight_sync/mailbox.py) on one lent GPU, through bench/device_run.sh:
#   bash bench/device/gpu_handover.sh tests                      # its GPU tests + the raw colocated transport test
#   bash bench/device/gpu_handover.sh bench raw "llama-3.2-1b llama-3.1-8b"   # A/B against the host hand-over
#   bash bench/device/gpu_handover.sh bench vllm "llama-3.2-1b llama-3.1-8b"  # (vLLM staged in /tmp/site)
#   bash bench/device/gpu_handover.sh bench raw llama-3.1-8b "--bucket-mb 1024"   # 4th: more weight_sync.py flags
set -uo pipefail
case "${1:-tests}" in
  tests)
    exec bash bench/device_run.sh tests "tests/gpu/test_gpu_handover.py tests/gpu/test_copysum_gpu.py \
      tests/gpu/test_weight_sync_gpu.py::test_raw_transport_bucketed_and_verified" ;;
  bench)
    exec bash bench/device_run.sh bench "--engine ${2:-raw} --placements colocated --models ${3:-llama-3.2-1b llama-3.1-8b} \
      --repeats ${REPEATS:-10} --compare-handover --json ${OUT:-/tmp/out}/handover.json ${4:-}" ;;
esac
