#!/usr/bin/env bash
# On nvidia-h100-x4 / x2 (tenth session; issue #32 items 1 and 2). `tp`, `tp1` and `prio` compared, through
# RLHF_ORCH_SYNC_HANDOVER=host|device, the broadcast sync of 304d1d2 (receives two buckets ahead of the loads, checksums
# kept on the device on both sides) with the one before it; it did not pay (bench/RESULTS.md) and was reverted, so on
# later code both values run the same broadcast path. One command per argument, each
# under the 600 s limit; vLLM + DeepSpeed staged into /tmp/site, SGLang into /tmp/site-sglang for `sg`:
#   bash bench/device/round10.sh tp   # GPUs 0-2 (not run yet): one TP=2 vLLM engine, 1B with the NCCL stream at
#                                     # normal then high priority, twice, 10 rounds each against the raw-broadcast
#                                     # floor; 8B; the TP=2 GPU test. GPU 3 meanwhile: the one-GPU sync and vLLM tests
#   bash bench/device/round10.sh tp1  # nvidia-h100-x2 (x4 was refused): one TP=1 engine instead, same comparison
#   bash bench/device/round10.sh prio # nvidia-h100-x2: the TP=1 comparison with NCCL's stream at normal and high priority
#   bash bench/device/round10.sh recovery  # nvidia-h100-x1: bench/recovery.py with vLLM on one GPU (issue #34)
#   bash bench/device/round10.sh sg   # GPUs 0,1: the SGLang GPU tests (item 2, after 21eaf5c); GPUs 2,3 meanwhile:
#                                     # the two-GPU NCCL sync tests and the streaming vLLM tests
# Files in $OUT: gpus.txt, one log and one JSON per job, tables.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
tp_bench() {   # name, model, handover, receivers (tp2: GPUs 0-2; 1: GPUs 0,1)
  CUDA_VISIBLE_DEVICES=$([ "$4" = tp2 ] && echo 0,1,2 || echo 0,1) RLHF_ORCH_SYNC_HANDOVER=$3 \
    timeout -k 15 "${BENCH_TIMEOUT:-150}" python3 bench/weight_sync.py \
    --engine vllm --models "$2" --placements disaggregated --receivers "$4" --shard-floor --repeats 10 \
    --bucket-mb "${BUCKET_MB:-256}" --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1
  echo "== $1 exit $?"; grep -E "^\||Error" "$OUT/$1.log" | tail -6
}
case "${1:-}" in
  tp)
    (CUDA_VISIBLE_DEVICES=3 timeout -k 15 "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_copysum_gpu.py tests/gpu/test_weight_sync_gpu.py tests/gpu/test_vllm_engine.py \
      > "$OUT/gpu3_tests.log" 2>&1; echo "== GPU 3 tests exit $?" > "$OUT/gpu3_rc.txt") &
    for run in a b; do for pr in normal high; do   # since 28fa5ec both hand-over values run one broadcast path
      RLHF_ORCH_SYNC_NCCL_PRIORITY=$pr tp_bench tp2_1b_${pr}_$run llama-3.2-1b device tp2
    done; done
    tp_bench tp2_8b llama-3.1-8b device tp2
    CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${TP_TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_vllm_tp.py > "$OUT/tp_test.log" 2>&1; echo "== tp test exit $?"; tail -3 "$OUT/tp_test.log"
    wait; cat "$OUT/gpu3_rc.txt"; tail -3 "$OUT/gpu3_tests.log" ;;
  tp1)   # nvidia-h100-x2: one TP=1 engine (GPU 1, sender GPU 0), 1B host then device then host then device, 8B device
    tp_bench tp1_1b_host_a llama-3.2-1b host 1
    tp_bench tp1_1b_device_a llama-3.2-1b device 1
    tp_bench tp1_1b_host_b llama-3.2-1b host 1
    tp_bench tp1_1b_device_b llama-3.2-1b device 1
    tp_bench tp1_8b_device llama-3.1-8b device 1 ;;
  prio)  # nvidia-h100-x2: the same TP=1 1B sync, {host, device hand-over} x {NCCL stream normal, high priority}
    for pr in normal high; do for h in host device; do
      RLHF_ORCH_SYNC_NCCL_PRIORITY=$pr tp_bench tp1_1b_${h}_$pr llama-3.2-1b $h 1
    done; done ;;
  recovery)   # nvidia-h100-x1: issue #34's benchmark with one DeepSpeed rank and one colocated vLLM engine (GPU 0)
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${RECOVERY_TIMEOUT:-540}" python3 bench/recovery.py \
      --config configs/vllm_coloc_1gpu.yaml --workdir /tmp/recovery \
      --victims=-reward-0:4,-weight-sync:8,-engine-v:12,-rollouts:16,-trainer-0:20 \
      reference.placement=colocated fault_tolerance.step_snapshots=true > "$OUT/recovery.log" 2>&1
    echo "== recovery exit $?"; keep recovery /tmp/recovery/recovery
    sed -n '/^## bench\/recovery.py/,$p' "$OUT/recovery.log"; grep -E "Traceback|Error" "$OUT/recovery.log" | tail -5 ;;
  sg)   # the NCCL tests on GPUs 2,3 only where there are four GPUs (on two they found none: 13 skipped)
    [ "$(nvidia-smi -L | wc -l)" -ge 4 ] && (CUDA_VISIBLE_DEVICES=2,3 timeout -k 15 "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_weight_sync_gpu.py tests/gpu/test_vllm_streaming.py tests/gpu/test_gpu_handover.py \
      > "$OUT/nccl_tests.log" 2>&1; echo "== GPUs 2,3 tests exit $?" > "$OUT/nccl_rc.txt") &
    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests RLHF_ORCH_LOG_LEVEL=WARNING CUDA_VISIBLE_DEVICES=0,1 \
      timeout -k 15 "${SG_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" \
      tests/gpu/test_copysum_gpu.py tests/gpu/test_sglang_engine.py tests/gpu/test_sglang_streaming.py \
      > "$OUT/sglang_tests.log" 2>&1; echo "== SGLang tests exit $?"; tail -8 "$OUT/sglang_tests.log"
    wait; cat "$OUT/nccl_rc.txt" 2>/dev/null && tail -3 "$OUT/nccl_tests.log" ;;
  *) echo "usage: $0 tp|tp1|prio|recovery|sg"; exit 2 ;;
esac
