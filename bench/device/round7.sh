#!/usr/bin/env bash
# On nvidia-h100-x4 / nvidia-h200-x4 (issue #32, sixth session). One command per argument, each under the 600 s limit:
#   bash bench/device/round7.sh fault   # after staging vLLM + DeepSpeed. GPUs 0-2: trainer GPU 0, two dedicated
#                                       # vLLM engines (GPUs 1, 2), one SIGKILLed *inside* a broadcast sync after
#                                       # step 3 (#33's NCCL abort path with a survivor; #32 item 4's replacement
#                                       # joining); GPU 3 at the same time: the one-GPU vLLM and sync GPU tests
#   bash bench/device/round7.sh sglang  # after staging SGLang into /tmp/site-sglang. GPUs 0,1: bench/weight_sync.py
#                                       # into SGLang, disaggregated, 1B and 8B, ours vs SGLang's own call (item 2);
#                                       # GPUs 2,3: the SGLang GPU tests (engine, streaming pause), then GPU 2: the
#                                       # colocated rounds at 1B and 8B
#   bash bench/device/round7.sh sgtests # SGLang staged, 2 GPUs: the copy-and-checksum GPU tests (one runs a plan and a
#                                       # send while the other GPU is current) and the SGLang GPU tests, in one pytest
#   bash bench/device/round7.sh sgstream # SGLang staged, 2 GPUs: SGLang's engine GPU tests (our receiver in its
#                                       # scheduler over NCCL), then the disaggregated rounds at 1B and 8B again
# Files in $OUT: gpus.txt, one log per job, tables, a tar of the fault run's records.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
B1+=(metrics.plots=false metrics.ray_metrics=false trainer.export_hf=false trainer.checkpoint_every_minutes=0)
case "${1:-}" in
  fault)
    ( CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${FAULT_TIMEOUT:-540}" python3 bench/engine_fault.py \
        --config configs/vllm_disagg_2gpu.yaml --kill-step 3 --mid-sync --output-dir /tmp/runs \
        experiment.name=midsync experiment.steps="${STEPS:-70}" "${B1[@]}" engines.0.count=2 \
        engines.0.enforce_eager=false engines.0.sampling.max_new_tokens=256 data.prompts_per_step=32 \
        data.max_operand=9 trainer.lr=1e-6 trainer.packing=true trainer.max_tokens_per_micro_batch=16384 \
        trainer.micro_batch_size=16 trainer.gradient_checkpointing=true algorithm.kl_coef=0 \
        engines.0.kv_cache_memory_gb=20 engines.0.gpu_memory_utilization=0.5 > "$OUT/midsync.log" 2>&1
      echo "== midsync exit $?"; keep midsync /tmp/runs/midsync ) &
    ( CUDA_VISIBLE_DEVICES=3 timeout -k 15 "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -m gpu \
        tests/gpu/test_copysum_gpu.py tests/gpu/test_weight_sync_gpu.py tests/gpu/test_vllm_engine.py \
        tests/gpu/test_vllm_streaming.py > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests exit $?" ) &
    wait
    tail -5 "$OUT/gpu_tests.log"
    grep -E "^exit|^mid-sync|^fault|^seconds|^median|^\||steps served|replaced|aborted|let go|Traceback|Error" \
      "$OUT/midsync.log" | cut -c1-260 | tail -45 ;;
  sglang)
    export PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests RLHF_ORCH_LOG_LEVEL=WARNING
    python3 -c "import torch, sglang; print('torch', torch.__version__, 'sglang', sglang.__version__)" 2>&1 | tail -1
    ( CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 "${DIS_TIMEOUT:-540}" python3 bench/weight_sync.py --engine sglang \
        --placements disaggregated --models llama-3.2-1b llama-3.1-8b --repeats 10 --out "$OUT/sglang_disagg.md" \
        --json "$OUT/sglang_disagg.json" > "$OUT/sglang_disagg.log" 2>&1; echo "== sglang disagg exit $?" ) &
    ( CUDA_VISIBLE_DEVICES=2,3 timeout -k 15 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        -o addopts="-ra" tests/gpu/test_sglang_engine.py tests/gpu/test_sglang_streaming.py \
        > "$OUT/sglang_tests.log" 2>&1; echo "== sglang tests exit $?"
      CUDA_VISIBLE_DEVICES=2 timeout -k 15 "${COLOC_TIMEOUT:-240}" python3 bench/weight_sync.py --engine sglang \
        --placements colocated --models llama-3.2-1b llama-3.1-8b --repeats 10 --out "$OUT/sglang_coloc.md" \
        --json "$OUT/sglang_coloc.json" > "$OUT/sglang_coloc.log" 2>&1; echo "== sglang coloc exit $?" ) &
    wait
    grep -vE "^\s*$|Warning|warn\(" "$OUT/sglang_tests.log" | tail -12
    cat "$OUT/sglang_disagg.md" "$OUT/sglang_coloc.md" 2>/dev/null | grep -E "^\||verified|floor" | tail -30
    grep -E "Traceback|Error" "$OUT/sglang_disagg.log" "$OUT/sglang_coloc.log" | tail -8 ;;
  sgtests)
    export PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests RLHF_ORCH_LOG_LEVEL=WARNING
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 "${TEST_TIMEOUT:-450}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      -o addopts="-ra" tests/gpu/test_copysum_gpu.py tests/gpu/test_sglang_engine.py tests/gpu/test_sglang_streaming.py \
      > "$OUT/sgtests.log" 2>&1; echo "== sgtests exit $?"
    grep -vE "^\s*$|Warning|warn\(" "$OUT/sgtests.log" | tail -15 ;;
  sgstream)
    export PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests RLHF_ORCH_LOG_LEVEL=WARNING
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 "${TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      -o addopts="-ra" tests/gpu/test_sglang_engine.py > "$OUT/sgengine.log" 2>&1; echo "== sglang engine tests exit $?"
    grep -vE "^\s*$|Warning|warn\(" "$OUT/sgengine.log" | grep -E "passed|failed|Error|^E " | tail -12
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 10 "${DIS_TIMEOUT:-200}" python3 bench/weight_sync.py --engine sglang \
      --placements disaggregated --models llama-3.2-1b llama-3.1-8b --repeats 10 --out "$OUT/sglang_disagg.md" \
      --json "$OUT/sglang_disagg.json" > "$OUT/sglang_disagg.log" 2>&1; echo "== sglang disagg exit $?"
    grep -E "^\||Traceback|Error" "$OUT/sglang_disagg.log" | tail -14 ;;
  *) echo "usage: $0 fault|sglang|sgtests|sgstream"; exit 2 ;;
esac
