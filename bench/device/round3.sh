#!/usr/bin/env bash
# On one GPU after staging vLLM + DeepSpeed (../shared/device/README.md), the runs of 2026-11-27 (issues #27, #33):
#   bash bench/device/round3.sh pause   # bench/pause_latency.py: vLLM pause with 0..512 running requests, new vs old
#   bash bench/device/round3.sh fault   # bench/engine_fault.py --mid-sync: the 1B-shaped colocated vLLM engine killed
#                                       # inside a weight sync; seconds from the death to serving again
#   bash bench/device/round3.sh tests   # the GPU tests these changes touch
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext RLHF_ORCH_LOG_LEVEL=WARNING TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
B1=(model.tiny.hidden_size=2048 model.tiny.intermediate_size=8192 model.tiny.num_hidden_layers=16
    model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.max_position_embeddings=1100
    trainer.bf16=true trainer.warm_start_steps=0 weight_sync.bucket_size_mb=512)
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
