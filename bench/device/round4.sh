#!/usr/bin/env bash
# On nvidia-h100-x4 / nvidia-h200-x4 after staging vLLM + DeepSpeed (../shared/device/README.md): issue #32's runs of
# 2026-11-27 (third session). Two lanes of two GPUs each run side by side in `pair`; `x4` takes all four GPUs.
#   bash bench/device/round4.sh pair   # GPUs 0,1: bench/async_rl.py disaggregated (item 5: sync, k1, k1p, k1s)
#                                      # GPUs 2,3: bench/engine_fault.py, two colocated engines, one killed (item 4),
#                                      #           then the one-GPU mid-sync kill on GPU 2 (issue #33's GPU figure)
#   bash bench/device/round4.sh x4     # item 6: GRPO at the 8B shape, 2 ZeRO-3 ranks (GPUs 0,1) and one TP=2 vLLM
#                                      # engine (GPUs 2,3), packed; phase times, MFU, rank imbalance (item 3)
# Files in $OUT (at most 8 come back): gpus.txt, one log per job, the async table, and a tar of each run's metrics.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
B1+=(metrics.plots=false metrics.ray_metrics=false trainer.export_hf=false trainer.checkpoint_every_minutes=0)
case "${1:-}" in
  pair)
    ( CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 "${ASYNC_TIMEOUT:-545}" python3 bench/async_rl.py --steps "${STEPS:-3}" \
        --median 200 --out "$OUT/async.md" --workdir /tmp/async_rl > "$OUT/async.log" 2>&1
      echo "== async exit $?" ) &
    ( CUDA_VISIBLE_DEVICES=2,3 timeout -k 15 "${FAULT_TIMEOUT:-300}" python3 bench/engine_fault.py \
        --config configs/vllm_coloc_1gpu.yaml --kill-step 3 --output-dir /tmp/runs experiment.name=fault2 \
        experiment.steps=8 "${B1[@]}" trainer.num_ranks=2 engines.0.count=2 engines.0.sampling.max_new_tokens=128 \
        engines.0.kv_cache_memory_gb=20 engines.0.gpu_memory_utilization=0.5 > "$OUT/fault2.log" 2>&1
      echo "== fault2 exit $?"; keep fault2 /tmp/runs/fault2
      CUDA_VISIBLE_DEVICES=2 timeout -k 15 "${MIDSYNC_TIMEOUT:-220}" python3 bench/engine_fault.py \
        --config configs/vllm_coloc_1gpu.yaml --kill-step 2 --mid-sync --output-dir /tmp/runs experiment.name=midsync \
        experiment.steps=5 "${B1[@]}" engines.0.sampling.max_new_tokens=128 engines.0.kv_cache_memory_gb=20 \
        engines.0.gpu_memory_utilization=0.5 > "$OUT/midsync.log" 2>&1
      echo "== midsync exit $?"; keep midsync /tmp/runs/midsync ) &
    wait
    for f in fault2 midsync; do echo "---- $f"; grep -E "^exit|^mid-sync|^fault|^seconds|^median|^\||replaced|aborted|status" \
      "$OUT/$f.log" | tail -25; done
    echo "---- async"; cat "$OUT/async.md" 2>/dev/null || tail -40 "$OUT/async.log" ;;
  x4)
    timeout -k 20 "${X4_TIMEOUT:-560}" python3 launch.py --config configs/vllm_disagg_2gpu.yaml \
      experiment.output_dir=/tmp/runs experiment.name=grpo8b experiment.steps="${STEPS:-6}" "${B8[@]}" \
      trainer.num_ranks=2 trainer.zero_stage=3 trainer.packing=true trainer.max_tokens_per_micro_batch=8192 \
      trainer.micro_batch_size=16 trainer.gradient_checkpointing=true trainer.lr=1e-6 algorithm.kl_coef=0 \
      data.prompts_per_step=32 data.max_operand=9 engines.0.tensor_parallel_size=2 engines.0.enforce_eager="${EAGER:-false}" \
      engines.0.gpu_memory_utilization=0.85 engines.0.kv_cache_memory_gb=30 engines.0.sampling.max_new_tokens=512 \
      > "$OUT/grpo8b.log" 2>&1
    echo "== grpo8b exit $?"; keep grpo8b /tmp/runs/grpo8b
    grep -E "Error|error|Traceback|OOM|out of memory" "$OUT/grpo8b.log" | grep -v Warning | tail -8
    tail -30 "$OUT/grpo8b.log" ;;
  *) echo "usage: $0 pair|x4"; exit 2 ;;
esac
