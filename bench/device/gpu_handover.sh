#!/usr/bin/env bash
# The GPU hand-over of colocated syncs (weight_sync/mailbox.py), on one lent GPU:
#   bash bench/device/gpu_handover.sh tests                      # its GPU tests + the raw colocated transport test
#   bash bench/device/gpu_handover.sh bench raw "llama-3.2-1b llama-3.1-8b"   # A/B against the host hand-over
#   bash bench/device/gpu_handover.sh bench vllm "llama-3.2-1b llama-3.1-8b"  # (vLLM staged in /tmp/site)
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo \
  RLHF_ORCH_LOG_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tail -1
case "${1:-tests}" in
  tests)
    timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" \
      tests/gpu/test_gpu_handover.py tests/gpu/test_copysum_gpu.py "tests/gpu/test_weight_sync_gpu.py::test_raw_transport_bucketed_and_verified" \
      2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$|Warning|warn\(" | tail -15 ;;
  bench)
    timeout "${BENCH_TIMEOUT:-540}" python3 bench/weight_sync.py --engine "${2:-raw}" --placements colocated \
      --models ${3:-llama-3.2-1b llama-3.1-8b} --repeats "${REPEATS:-10}" --compare-handover ${4:-} \
      --out "$OUT/RESULTS_handover.md" --json "$OUT/handover.json" 2>&1 | tee "$OUT/bench.log" | tail -25 ;;
esac
