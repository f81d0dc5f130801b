#!/usr/bin/env bash
# On nvidia-h100-x4 / nvidia-h200-x4 (issues #32, #33, #27; seventh session). One command per argument, each under the
# 600 s limit; vLLM + DeepSpeed staged into /tmp/site, SGLang into /tmp/site-sglang (../shared/device/README.md):
#   bash bench/device/round8.sh a   # GPUs 0-2: trainer GPU 0, two dedicated vLLM engines at the Llama-3.2-3B shape
#                                   # (a ~20 ms transfer), one SIGKILLed inside a sync's *receive* (#33: a survivor
#                                   # blocked in an NCCL broadcast, let go by the abort); GPU 3: bench/pause_latency.py
#                                   # with 0-512 running requests (#27 item 1, now with the way back split out)
#   bash bench/device/round8.sh b   # GPUs 0,1: the SGLang and copy-and-checksum GPU tests (the nccl_stream case was
#                                   # never run whole); GPUs 2,3: bench/async_rl.py disaggregated, sync / k1 / k2 / k1p
#   bash bench/device/round8.sh c   # GPUs 0-2: one TP=2 vLLM engine, 1B, at 128, 256 (the default) and 512 MiB buckets
#                                   # (#32 item 1); GPU 3: the one-GPU vLLM GPU tests
# Files in $OUT: gpus.txt, one log per job, tables, a tar of the fault run's records.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
midsync() {   # name, steps, extra flags: GPUs 0-2, dedicated engine v-0 SIGKILLed inside sync v4's receive
  CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${FAULT_TIMEOUT:-480}" python3 bench/engine_fault.py \
    --config configs/vllm_disagg_2gpu.yaml --kill-step 3 --mid-sync receive "${@:3}" --output-dir /tmp/runs \
    experiment.name="$1" experiment.steps="$2" "${B3[@]}" engines.0.count=2 \
    engines.0.enforce_eager=false engines.0.sampling.max_new_tokens=256 data.prompts_per_step=32 \
    data.max_operand=9 trainer.lr=1e-6 trainer.packing=true trainer.max_tokens_per_micro_batch=16384 \
    trainer.micro_batch_size=16 trainer.gradient_checkpointing=true algorithm.kl_coef=0 \
    engines.0.kv_cache_memory_gb=20 engines.0.gpu_memory_utilization=0.5 > "$OUT/$1.log" 2>&1
  echo "== $1 exit $?"; keep "$1" "/tmp/runs/$1"
}
report() {   # name: what bench/engine_fault.py printed at its end
  grep -E "^exit|^mid-sync|^fault|^seconds|^median|^\||steps served|replaced|aborted|let go|Traceback|Error" \
    "$OUT/$1.log" | cut -c1-300 | tail -45
}
case "${1:-}" in
  a)
    midsync midrecv "${STEPS:-30}" &
    ( CUDA_VISIBLE_DEVICES=3 timeout -k 15 "${PAUSE_TIMEOUT:-400}" python3 bench/pause_latency.py --engine vllm \
        --running 0 64 256 512 --max-tokens 2048 --rounds 6 --abort-rounds 2 --out "$OUT/pause.md" \
        > "$OUT/pause.log" 2>&1; echo "== pause exit $?" ) &
    wait
    cat "$OUT/pause.md" 2>/dev/null | grep -E "^\|" || tail -20 "$OUT/pause.log"
    report midrecv ;;
  b)
    ( export PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests RLHF_ORCH_LOG_LEVEL=WARNING
      CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 "${TEST_TIMEOUT:-450}" python3 -m pytest -q -m gpu -p no:cacheprovider \
        -o addopts="-ra" --durations=0 tests/gpu/test_copysum_gpu.py tests/gpu/test_sglang_engine.py \
        tests/gpu/test_sglang_streaming.py > "$OUT/sgtests.log" 2>&1; echo "== sgtests exit $?" ) &
    ( CUDA_VISIBLE_DEVICES=2,3 timeout -k 20 "${ASYNC_TIMEOUT:-560}" python3 bench/async_rl.py --modes sync,k1,k2,k1p \
        --steps "${STEPS:-2}" --median 200 --out "$OUT/async.md" --workdir /tmp/async_rl --copy-to "$OUT" \
        > "$OUT/async.log" 2>&1; echo "== async exit $?" ) &
    wait
    grep -vE "^\s*$|Warning|warn\(" "$OUT/sgtests.log" | grep -E "passed|failed|PASS|FAIL|Error|^E |s call" | tail -25
    grep -E "^seg|Error|Traceback" "$OUT/async.log" | cut -c1-240 | tail -30
    cat "$OUT/async.md" 2>/dev/null ;;
  c)
    ( for mb in 256 128 512; do
        CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${TP_TIMEOUT:-150}" python3 bench/weight_sync.py --engine vllm \
          --models llama-3.2-1b --placements disaggregated --receivers tp2 --shard-floor --repeats 10 \
          --bucket-mb "$mb" --json "$OUT/tp2_$mb.json" > "$OUT/tp2_$mb.log" 2>&1; echo "== tp2 $mb MiB exit $?"
      done ) &
    ( CUDA_VISIBLE_DEVICES=3 timeout -k 15 "${TESTS_TIMEOUT:-420}" python3 -m pytest -q -m gpu \
        tests/gpu/test_copysum_gpu.py tests/gpu/test_weight_sync_gpu.py tests/gpu/test_vllm_engine.py \
        tests/gpu/test_vllm_streaming.py > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests exit $?" ) &
    wait
    tail -4 "$OUT/gpu_tests.log"
    for mb in 256 128 512; do echo "-- $mb MiB"; grep -E "^\||Error" "$OUT/tp2_$mb.log" | tail -6; done ;;
  fault)   # the fault job of "a" alone, the engine's child processes (vLLM's engine core) killed with it (--tree)
    midsync midtree "${STEPS:-20}" --tree
    report midtree ;;
  *) echo "usage: $0 a|b|c|fault"; exit 2 ;;
esac
