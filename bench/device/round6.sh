#!/usr/bin/env bash
# On nvidia-h100-x4 / nvidia-h200-x4 after staging vLLM + DeepSpeed (../shared/device/README.md): issue #32's runs of
# 2026-11-27 (fifth session). One command per argument, each under the 600 s limit:
#   bash bench/device/round6.sh x4     # item 6: GRPO at the 8B shape, 2 ZeRO-3 ranks (GPUs 0,1), one TP=2 vLLM engine
#                                      # (GPUs 2,3) with CUDA graphs (bcc4008's multicast guard); a smaller step than
#                                      # round4's so that steps finish; nvidia-smi every 10 s and, if no step has
#                                      # finished by DUMP_AT seconds, py-spy stacks of every Ray worker (where it stands)
#   bash bench/device/round6.sh fault  # item 4 on dedicated engines: trainer GPU 0, two dedicated vLLM engines
#                                      # (GPUs 1, 2), one SIGKILLed after step 3 (packed trainer: the padded one ran
#                                      # out of memory on its first try)
#   bash bench/device/round6.sh tp     # item 1: GPUs 0-2, bench/weight_sync.py into one TP=2 engine, replay on/off,
#                                      # then tests/gpu/test_vllm_tp.py; GPU 3: the one-GPU sync and vLLM GPU tests
# Files in $OUT (at most 8 come back): gpus.txt, one log per job, tables, a tar of each run's metrics.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
B1+=(metrics.plots=false metrics.ray_metrics=false trainer.export_hf=false trainer.checkpoint_every_minutes=0)
stacks() {  # py-spy stacks of every Ray worker and the driver, into $OUT/$1
  for pid in $(pgrep -f "ray::|launch.py|engine_fault.py"); do
    echo "=== pid $pid: $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-120)"
    timeout 20 py-spy dump --pid "$pid" 2>&1 | head -60
  done > "$OUT/$1" 2>&1
}
summary() {  # run dir: per-step phase seconds and MFU
  python3 - "$1" <<'PY'
import json, sys
run = sys.argv[1]
try:
    ms = [json.loads(l) for l in open(f"{run}/metrics.jsonl")]
except OSError:
    print(run, "no metrics"); sys.exit()
keys = ("step", "perf/step_s", "perf/generate_s", "perf/train_s", "perf/sync_s", "perf/mfu", "train/mfu",
        "rollout/tokens", "train/rank_time_imbalance", "sync/verified")
for m in ms:
    print({k: round(m[k], 4) if isinstance(m[k], float) else m[k] for k in keys if k in m})
print("other perf keys:", sorted(k for k in ms[-1] if k.startswith(("perf/", "train/mfu", "flops/")))[:30] if ms else [])
try:
    s = json.load(open(f"{run}/summary.json"))
    print("summary:", s.get("status"), {k: v for k, v in s.items() if "verified" in k or "ledger" in k})
except OSError:
    print("no summary.json")
PY
}
case "${1:-}" in
  x4)
    nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader -l 10 > "$OUT/smi.log" 2>&1 &
    SMI=$!
    ( sleep "${DUMP_AT:-420}"; [ -s /tmp/runs/grpo8b/metrics.jsonl ] || stacks stacks8b.txt ) &
    timeout -k 20 "${X4_TIMEOUT:-560}" python3 launch.py --config configs/vllm_disagg_2gpu.yaml \
      experiment.output_dir=/tmp/runs experiment.name=grpo8b experiment.steps="${STEPS:-4}" "${B8[@]}" \
      trainer.num_ranks=2 trainer.zero_stage=3 trainer.packing=true trainer.max_tokens_per_micro_batch=8192 \
      trainer.micro_batch_size=16 trainer.gradient_checkpointing=true trainer.lr=1e-6 algorithm.kl_coef=0 \
      data.prompts_per_step="${PROMPTS:-16}" data.max_operand=9 engines.0.tensor_parallel_size=2 \
      engines.0.enforce_eager="${EAGER:-false}" engines.0.gpu_memory_utilization=0.85 engines.0.kv_cache_memory_gb=30 \
      engines.0.sampling.max_new_tokens="${NEW:-256}" > "$OUT/grpo8b.log" 2>&1
    echo "== grpo8b exit $?"; kill $SMI; keep grpo8b /tmp/runs/grpo8b
    grep -E "Error|error|Traceback|OOM|out of memory" "$OUT/grpo8b.log" | grep -v Warning | tail -8
    grep -E "cluster up|weight sync plan|step [0-9]|allreduce|fusion|multicast" "$OUT/grpo8b.log" | cut -c1-220 | tail -20
    summary /tmp/runs/grpo8b
    awk -F, '{u[$1]=u[$1]" "$2} END {for (g in u) print "gpu" g ":" u[g]}' "$OUT/smi.log" | cut -c1-400 ;;
  fault)
    CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${FAULT_TIMEOUT:-400}" python3 bench/engine_fault.py \
      --config configs/vllm_disagg_2gpu.yaml --kill-step 3 --output-dir /tmp/runs experiment.name=faultded \
      experiment.steps="${STEPS:-10}" "${B1[@]}" engines.0.count=2 engines.0.enforce_eager=false \
      engines.0.sampling.max_new_tokens=256 data.prompts_per_step=32 data.max_operand=9 trainer.lr=1e-6 \
      trainer.packing=true trainer.max_tokens_per_micro_batch=16384 trainer.micro_batch_size=16 \
      trainer.gradient_checkpointing=true algorithm.kl_coef=0 engines.0.kv_cache_memory_gb=20 \
      engines.0.gpu_memory_utilization=0.5 > "$OUT/faultded.log" 2>&1
    echo "== faultded exit $?"; keep faultded /tmp/runs/faultded
    grep -E "^exit|^mid-sync|^fault|^seconds|^median|^\||replaced|aborted|Traceback|Error" "$OUT/faultded.log" | tail -30 ;;
  tp)
    ( CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${TP_TIMEOUT:-330}" python3 bench/weight_sync.py --engine vllm \
        --models llama-3.2-1b llama-3.1-8b --placements disaggregated --receivers tp2 --shard-floor --compare-loads \
        --repeats 10 --json "$OUT/tp2.json" > "$OUT/tp2.log" 2>&1; echo "== tp2 bench exit $?"
      CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 15 "${TPT_TIMEOUT:-200}" python3 -m pytest -q -m gpu \
        tests/gpu/test_vllm_tp.py > "$OUT/tp_test.log" 2>&1; echo "== tp test exit $?" ) &
    ( CUDA_VISIBLE_DEVICES=3 timeout -k 15 "${TESTS_TIMEOUT:-400}" python3 -m pytest -q -m gpu \
        tests/gpu/test_copysum_gpu.py tests/gpu/test_vllm_engine.py tests/gpu/test_weight_sync_gpu.py \
        > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests exit $?" ) &
    wait
    tail -4 "$OUT/tp_test.log" "$OUT/gpu_tests.log"; grep -E "^\||floor|replay|Error" "$OUT/tp2.log" | tail -30 ;;
  *) echo "usage: $0 x4|fault|tp"; exit 2 ;;
esac
