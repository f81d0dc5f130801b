#!/usr/bin/env bash
# On nvidia-h100-x2 / nvidia-h200-x2 (issues #33, #27, #32; eighth session). One command per argument, each under the
# 600 s limit; vLLM + DeepSpeed staged into /tmp/site (SGLang into /tmp/site-sglang for `sgtest`):
#   bash bench/device/round9.sh mixed   # GPUs 0,1: configs/vllm_mixed_2gpu.yaml, 3B layers x 16 (1.9 B, 3.7 GB); the
#                                       # colocated engine (and its engine core, --tree) SIGKILLed inside a sync's
#                                       # receive, so the dedicated engine is left inside an NCCL broadcast (#33)
#                                       # (16 of 3B's 28 layers: the whole 3B ran out of memory at the colocated
#                                       # wake-up on an 80 GB H100, trainer and engine on GPU 0)
#   bash bench/device/round9.sh check   # GPUs 0,1: the NCCL sync GPU tests and a 1B disaggregated vLLM sync benchmark
#   bash bench/device/round9.sh pause   # GPU 0: bench/pause_latency.py, 0-512 running requests (#27 item 1, with the
#                                       # texts decoded by decode_batch since 6d0dfe3)
#   bash bench/device/round9.sh async   # GPUs 0,1: bench/async_rl.py disaggregated, sync / k1 / k1p (#27, #32 item 5)
#   bash bench/device/round9.sh final   # GPU 0: FINAL_ONLY requests on the streaming vLLM engine (ninth session)
#   bash bench/device/round9.sh sgtest  # GPU 0: the SGLang colocated stream test whose assertion 21eaf5c fixed
# Files in $OUT: gpus.txt, one log per job, tables, a tar of the fault run's records.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
case "${1:-}" in
  mixed)
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 15 "${FAULT_TIMEOUT:-540}" python3 bench/engine_fault.py \
      --config configs/vllm_mixed_2gpu.yaml --engine c --kill-step 3 --mid-sync receive --tree --output-dir /tmp/runs \
      experiment.name=mixed experiment.steps="${STEPS:-12}" "${B3[@]}" model.tiny.num_hidden_layers=16 weight_sync.bucket_size_mb=64 \
      engines.0.kv_cache_memory_gb=8 engines.1.kv_cache_memory_gb=20 engines.1.gpu_memory_utilization=0.5 \
      engines.0.sampling.max_new_tokens=256 engines.1.sampling.max_new_tokens=256 data.prompts_per_step=32 \
      data.max_operand=9 trainer.lr=1e-6 trainer.packing=true trainer.max_tokens_per_micro_batch=16384 \
      trainer.micro_batch_size=16 trainer.gradient_checkpointing=true algorithm.kl_coef=0 > "$OUT/mixed.log" 2>&1
    echo "== mixed exit $?"; keep mixed /tmp/runs/mixed
    grep -E "^exit|^mid-sync|^fault|^seconds|^median|^\||steps served|replaced|aborted|abort|let go|Traceback|Error" \
      "$OUT/mixed.log" | cut -c1-300 | tail -60 ;;
  check)   # GPUs 0,1: the NCCL sync path after f7e3d14 (polled waits, next bucket posted first): its GPU tests and the
           # streaming vLLM engine's (its batch sizes, the pause), then
           # one vLLM engine's disaggregated 1B sync against the raw-broadcast floor (10 interleaved rounds)
    timeout -k 15 "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_weight_sync_gpu.py \
      tests/gpu/test_copysum_gpu.py tests/gpu/test_vllm_streaming.py > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests exit $?"; tail -3 "$OUT/gpu_tests.log"
    timeout -k 15 "${BENCH_TIMEOUT:-300}" python3 bench/weight_sync.py --engine vllm --models llama-3.2-1b \
      --placements disaggregated --receivers 1 --repeats 10 --json "$OUT/sync_1b.json" > "$OUT/sync_1b.log" 2>&1
    echo "== sync bench exit $?"; grep -E "^\||Error" "$OUT/sync_1b.log" | tail -8 ;;
  pause)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${PAUSE_TIMEOUT:-560}" python3 bench/pause_latency.py --engine vllm \
      --running ${RUNNING:-0 64 256 512} --max-tokens 2048 --rounds 6 --abort-rounds 2 --out "$OUT/pause.md" > "$OUT/pause.log" 2>&1
    echo "== pause exit $?"; grep -E "^\|" "$OUT/pause.md" 2>/dev/null || tail -20 "$OUT/pause.log" ;;
  async)
    timeout -k 20 "${ASYNC_TIMEOUT:-570}" python3 bench/async_rl.py --modes "${MODES:-sync,k1,k1p}" \
      --steps "${STEPS:-2}" --median 200 --out "$OUT/async.md" --workdir /tmp/async_rl --copy-to "$OUT" \
      > "$OUT/async.log" 2>&1; echo "== async exit $?"
    grep -E "^seg|Error|Traceback" "$OUT/async.log" | cut -c1-240 | tail -30; cat "$OUT/async.md" 2>/dev/null ;;
  final)   # GPU 0: the streaming engine's FINAL_ONLY requests (no partial rollouts) against streamed ones
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${TESTS_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_vllm_streaming.py -k "final_only or as_wide" > "$OUT/final_tests.log" 2>&1
    echo "== final tests exit $?"; tail -3 "$OUT/final_tests.log" ;;
  sgtest)
    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests RLHF_ORCH_LOG_LEVEL=WARNING CUDA_VISIBLE_DEVICES=0 \
      timeout -k 15 "${TEST_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" \
      tests/gpu/test_sglang_engine.py -k "one_call_per_sync" > "$OUT/sgtest.log" 2>&1; echo "== sgtest exit $?"
    tail -5 "$OUT/sgtest.log" ;;
  *) echo "usage: $0 mixed|check|pause|async|final|sgtest"; exit 2 ;;
esac
