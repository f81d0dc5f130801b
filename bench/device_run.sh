#!/usr/bin/env bash
# On the lent GPU machine, after staging (../shared/device/README.md): GPU tests, then benchmarks.
#   bash bench/device_run.sh tests   # pytest -m gpu, logs to $OUT
#   bash bench/device_run.sh bench   # bench/weight_sync.py over the three model shapes, table to $OUT
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext RLHF_ORCH_LOG_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "${1:-tests}" in
  tests)
    python3 -c "import torch, vllm, deepspeed, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__)" 2>&1 | tail -1
    timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" tests/gpu ${2:-} 2>&1 \
      | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$|Warning|warn\(" | tail -40 ;;
  bench)
    timeout "${BENCH_TIMEOUT:-560}" python3 bench/weight_sync.py --out "$OUT/RESULTS_weight_sync.md" ${2:-} 2>&1 | tee "$OUT/bench.log" | tail -20 ;;
esac
