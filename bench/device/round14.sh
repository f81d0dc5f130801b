#!/usr/bin/env bash
# On nvidia-h100-x1 / nvidia-h200 (nineteenth session; vLLM + DeepSpeed staged into /tmp/site). Issue #27's one-GPU
# figures with the current code, after round13.sh's seam checks. One command per argument, each under the 600 s limit:
#   bash bench/device/round14.sh vpause   # GPU 0: bench/pause_latency.py --engine vllm at 0/256/512 running, keep and
#                                         # abort (up to 2,048 tokens each): the pause against requests in flight
#   bash bench/device/round14.sh coloc    # GPU 0: bench/async_rl.py --colocated, sync/k1/k1p interleaved, with the bound
#   bash bench/device/round14.sh realc    # GPU 0: issue #12's realistic 1B step colocated (both resident, CUDA IPC),
#                                         # max_staleness 0 then 1, 8 steps each: seconds per step
# Files in $OUT: gpus.txt, one log per job, vpause.md, async.md (+ the run's timeline), r_c*.tgz.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
case "${1:-}" in
  vpause)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${PAUSE_TIMEOUT:-540}" python3 bench/pause_latency.py --engine vllm \
      --running ${RUNNING:-0 256 512} --max-tokens 2048 --rounds "${ROUNDS:-4}" --abort-rounds "${ABORT_ROUNDS:-3}" \
      --out "$OUT/vpause.md" > "$OUT/vpause.log" 2>&1
    echo "== vpause exit $?"; grep -E "^\|" "$OUT/vpause.md" 2>/dev/null || tail -20 "$OUT/vpause.log" ;;
  coloc)
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${ASYNC_TIMEOUT:-560}" python3 bench/async_rl.py --colocated \
      --modes "${MODES:-sync,k1,k1p}" --steps "${STEPS:-3}" --median 200 --kv-cache-gb 30 --out "$OUT/async.md" \
      --workdir /tmp/async_rl --copy-to "$OUT" > "$OUT/async.log" 2>&1; echo "== coloc exit $?"
    grep -E "^seg|Error|Traceback" "$OUT/async.log" | cut -c1-240 | tail -20; cat "$OUT/async.md" 2>/dev/null ;;
  realc)
    W=("${B1[@]}" data.prompts_per_step=64 data.max_operand=9 algorithm.kl_coef=0 trainer.lr=1e-6
       trainer.micro_batch_size=16 trainer.gradient_checkpointing=true trainer.packing=true trainer.offload=false
       trainer.max_tokens_per_micro_batch=16384 engines.0.sampling.max_new_tokens=1024 engines.0.enforce_eager=false
       engines.0.streaming=true engines.0.enable_sleep_mode=false engines.0.sleep_level=0 engines.0.gpu_memory_utilization=0.45
       engines.0.kv_cache_memory_gb=20 experiment.overwrite=true experiment.steps=8 metrics.plots=false)
    for run in "r_c0 rollout.max_staleness=0" "r_c1 rollout.max_staleness=1"; do
      set -- $run
      CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${REAL_TIMEOUT:-270}" python3 launch.py --config configs/vllm_coloc_1gpu.yaml \
        experiment.output_dir=/tmp/runs experiment.name="$1" "${W[@]}" "${@:2}" > "$OUT/$1.log" 2>&1
      echo "== $1 exit $?"; keep "$1" "/tmp/runs/$1"; grep -E "Traceback|Error" "$OUT/$1.log" | tail -3
    done
    python3 - <<'PY'
import json, statistics
for name in ("r_c0", "r_c1"):
    try:
        ms = [m for m in map(json.loads, open(f"/tmp/runs/{name}/metrics.jsonl")) if "perf/step_s" in m]
    except OSError:
        print(name, "no metrics"); continue
    later = ms[2:]   # steps 3-8: compile, warm-up and the async pipeline fill excluded
    med = lambda k: statistics.median(m.get(k, float("nan")) for m in later) if later else float("nan")
    print(f"{name}: steps {len(ms)}, step_s {[round(m['perf/step_s'], 2) for m in ms]}, median steps 3-8 "
          f"{med('perf/step_s'):.2f} s (generate wait {med('perf/generate_s'):.2f}, train {med('perf/train_s'):.2f}, "
          f"sync {med('perf/sync_s'):.3f}, trainer idle {med('perf/trainer_idle_frac'):.2f}), "
          f"checksums ok {sum(m.get('sync/checksum_ok', 0) for m in ms)}/{len(ms)}")
PY
    ;;
  *) echo "usage: $0 vpause|coloc|realc"; exit 2 ;;
esac
