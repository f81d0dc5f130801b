#!/usr/bin/env bash
# On the lent GPU machine, after staging vLLM (../shared/device/README.md): the rollout and weight-sync benchmarks.
#   bash bench/run_gpu_benches.sh rollout [ARGS]  # bench/rollout.py on GPU 0 (any kind; ~4-6 min for the defaults)
#   bash bench/run_gpu_benches.sh sync [ARGS]     # bench/weight_sync.py (default: raw receiver, 3 shapes, 2 GPUs;
#                                                 #   e.g. `sync --engine vllm --models llama-3.2-1b`; SGLang needs
#                                                 #   PYTHONPATH=/tmp/site-sglang:... and `--engine sglang`)
#   bash bench/run_gpu_benches.sh fanout [ARGS]   # bench/weight_sync.py into 1, 3, TP=2 and TP=1+TP=2 vLLM engines
#                                                 #   (needs 4 GPUs: nvidia-h200-x4; engines start per layout, ~6-8 min)
#   bash bench/run_gpu_benches.sh async [ARGS]    # bench/async_rl.py: sync vs max_staleness 1 vs +partial (2 GPUs; ~8 min)
#   bash bench/run_gpu_benches.sh all             # both, fan-out only when 4 GPUs are visible (may pass 10 min)
# ARGS go to that benchmark (e.g. `fanout --models llama-3.2-1b`, `rollout --prompts 64 --repeats 1`).
# Files in $OUT (kept few: at most 8 come back): gpus.txt, NAME.log, RESULTS_gpu.md (the tables), and for the
# weight-sync runs NAME.json (every round's seconds and the summaries).
set -uo pipefail
. bench/device/env.sh
what=${1:-all}; shift || true
ngpu=$(nvidia-smi -L | wc -l)
python3 -c "import torch, vllm, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)" 2>&1 | tail -1
status=0
# The fan-out cases of issue #7 (later options win, so ARGS may override any of these).
FANOUT=(--engine vllm --models llama-3.1-8b --placements disaggregated --receivers 1 3 tp2 tp1+tp2 --shard-floor)

bench() {   # name, timeout, script, args...: full log to $OUT/name.log, table appended to RESULTS_gpu.md
  local name=$1 limit=$2 script=$3; shift 3
  echo "== $name: python3 $script $* (limit ${limit}s)"
  local t0=$SECONDS
  timeout -k 20 "$limit" python3 "$script" --out "$OUT/RESULTS_gpu.md" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
  if [ $rc -ne 0 ]; then
    status=1
    grep -E "Error|error|Traceback|failed|warning:" "$OUT/$name.log" | grep -v "DeprecationWarning" | tail -15
    tail -25 "$OUT/$name.log"
  fi
}

case "$what" in
  rollout) bench rollout "${ROLLOUT_TIMEOUT:-560}" bench/rollout.py "$@" ;;
  async) bench async_rl "${ASYNC_TIMEOUT:-570}" bench/async_rl.py "$@" ;;
  sync) bench sync "${SYNC_TIMEOUT:-560}" bench/weight_sync.py --json "$OUT/sync.json" "$@" ;;
  fanout)
    if [ "$ngpu" -lt 4 ]; then echo "fanout needs 4 GPUs, this machine has $ngpu"; exit 2; fi
    bench fanout "${FANOUT_TIMEOUT:-560}" bench/weight_sync.py --json "$OUT/fanout.json" "${FANOUT[@]}" "$@" ;;
  all)
    bench rollout "${ROLLOUT_TIMEOUT:-330}" bench/rollout.py
    if [ "$ngpu" -ge 4 ]; then bench fanout "${FANOUT_TIMEOUT:-240}" bench/weight_sync.py --json "$OUT/fanout.json" "${FANOUT[@]}"
    else echo "== fanout skipped: $ngpu GPUs (needs 4)"; fi ;;
  *) echo "usage: $0 rollout|sync|fanout|async|all [ARGS]"; exit 2 ;;
esac
echo
echo "================ tables ($OUT/RESULTS_gpu.md) ================"
cat "$OUT/RESULTS_gpu.md" 2>/dev/null || echo "(no table written)"
exit $status
