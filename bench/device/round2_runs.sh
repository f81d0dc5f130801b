#!/usr/bin/env bash
# The single-GPU runs behind bench/RESULTS.md "Weight sync, round two: load replay" (after staging vLLM + DeepSpeed):
#   bash bench/device/round2_runs.sh moe       # Qwen3-30B-A3B-shaped into vLLM, colocated, replay vs the loader
#   bash bench/device/round2_runs.sh buckets   # 8B-shaped colocated at 1 and 2 GiB buckets (per-bucket overhead)
#   bash bench/device/round2_runs.sh grpo      # the tiny GRPO run on vLLM: sync phases with replay on and off
#   bash bench/device/round2_runs.sh fault     # issue #17 on one GPU: the only engine killed, replaced, re-synced
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
B1=(model.tiny.hidden_size=2048 model.tiny.intermediate_size=8192 model.tiny.num_hidden_layers=16
    model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.max_position_embeddings=1100
    trainer.bf16=true trainer.warm_start_steps=0 weight_sync.bucket_size_mb=512)
case "${1:-}" in
  moe)
    SYNC_TIMEOUT=330 bash bench/run_gpu_benches.sh sync --engine vllm --placements colocated --models qwen3-30b-a3b \
      --repeats 5 --compare-loads --gpu-mem 0.5 --kv-gb 2 2>&1 | grep -E "^\| vLLM|exit|Error" ;;
  buckets)
    for b in 1024 2048; do
      SYNC_TIMEOUT=150 bash bench/run_gpu_benches.sh sync --engine vllm --placements colocated --models llama-3.1-8b \
        --repeats 10 --bucket-mb $b 2>&1 | grep -E "^\| vLLM|exit [1-9]|Error"
    done ;;
  grpo)
    ALT="weight_sync.replay_loads=false" STEPS=25 bash bench/device/grpo_sync_cost.sh ;;
  fault)
    RLHF_ORCH_LOG_LEVEL=WARNING timeout -k 20 400 python3 bench/engine_fault.py --config configs/vllm_coloc_1gpu.yaml \
      --kill-step 4 --copy-to "$OUT" experiment.steps=10 "${B1[@]}" engines.0.sampling.max_new_tokens=128 \
      engines.0.kv_cache_memory_gb=20 engines.0.gpu_memory_utilization=0.5 2>&1 | tail -40 ;;
  *) echo "usage: $0 moe|buckets|grpo|fault"; exit 2 ;;
esac
