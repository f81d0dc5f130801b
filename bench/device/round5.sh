#!/usr/bin/env bash
# On nvidia-h100-x2 / nvidia-h200-x2 after staging vLLM + DeepSpeed (../shared/device/README.md): issue #32's and
# #27's runs of 2026-11-27 (fourth session). One command per argument, each under the 600 s limit:
#   bash bench/device/round5.sh async   # item 5: bench/async_rl.py disaggregated (trainer GPU 0, vLLM GPU 1), modes
#                                       # sync, k1 (auto: waits for running requests), k1a (aborts them), k1p
#   bash bench/device/round5.sh pause   # GPU 0: bench/pause_latency.py (vLLM detokenizing per token vs once at the
#                                       # end); GPU 1 at the same time: the streaming-vLLM GPU tests; then both GPUs:
#                                       # item 3, 2 ZeRO-3 ranks packed with per-rank train seconds (rank imbalance)
#   bash bench/device/round5.sh realistic  # #27: issue #12's 1B step, packed, disaggregated (trainer GPU 0, streaming
#                                       # vLLM GPU 1): max_staleness 0, 1, 1 + partial rollouts; 8 steps each
# Files in $OUT (at most 8 come back): gpus.txt, one log per job, the tables, the async run's timeline and metrics.
set -uo pipefail
. bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
B1+=(metrics.plots=false metrics.ray_metrics=false trainer.export_hf=false trainer.checkpoint_every_minutes=0)
case "${1:-}" in
  async)
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 "${ASYNC_TIMEOUT:-570}" python3 bench/async_rl.py --modes sync,k1,k1a,k1p \
      --steps "${STEPS:-2}" --median 200 --out "$OUT/async.md" --workdir /tmp/async_rl --copy-to "$OUT" \
      > "$OUT/async.log" 2>&1
    echo "== async exit $?"
    grep -E "^seg|^cluster|Error|Traceback" "$OUT/async.log" | tail -40
    cat "$OUT/async.md" 2>/dev/null ;;
  pause)
    ( CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${PAUSE_TIMEOUT:-260}" python3 bench/pause_latency.py --engine vllm \
        --running 0 64 256 512 --max-tokens 2048 --rounds 6 --abort-rounds 2 --out "$OUT/pause.md" \
        > "$OUT/pause.log" 2>&1; echo "== pause exit $?" ) &
    ( CUDA_VISIBLE_DEVICES=1 timeout -k 15 200 python3 -m pytest -q -m gpu tests/gpu/test_vllm_streaming.py \
        > "$OUT/gpu_tests.log" 2>&1; echo "== gpu tests exit $?" ) &
    wait
    tail -3 "$OUT/gpu_tests.log"; cat "$OUT/pause.md" 2>/dev/null || tail -20 "$OUT/pause.log"
    W=("${B1[@]}" data.prompts_per_step=64 data.max_operand=9 algorithm.kl_coef=0 trainer.lr=1e-6
       trainer.micro_batch_size=16 trainer.gradient_checkpointing=true engines.0.sampling.max_new_tokens=1024
       engines.0.enforce_eager=false experiment.overwrite=true)
    CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 "${ZERO3_TIMEOUT:-250}" python3 launch.py --config configs/vllm_coloc_1gpu.yaml \
      experiment.output_dir=/tmp/runs "${W[@]}" trainer.max_tokens_per_micro_batch=16384 trainer.packing=true \
      experiment.name=zero3_2r experiment.steps=6 trainer.num_ranks=2 trainer.zero_stage=3 trainer.offload=auto \
      engines.0.count=2 engines.0.gpu_memory_utilization=0.35 engines.0.kv_cache_memory_gb=16 > "$OUT/zero3_2r.log" 2>&1
    echo "== zero3_2r exit $?"
    tar czf "$OUT/zero3_2r.tgz" -C /tmp/runs/zero3_2r metrics.jsonl summary.json 2>/dev/null
    python3 - <<'PY'
import json
for line in open("/tmp/runs/zero3_2r/metrics.jsonl"):
    m = json.loads(line)
    if "train/rank_time_imbalance" in m:
        print({k: round(m[k], 4) for k in ("step", "perf/step_s", "perf/train_s", "train/rank_time_imbalance",
                                           "train/rank_flops_imbalance", "train/rank_imbalance") if k in m})
PY
    ;;
  realistic)
    W=("${B1[@]}" data.prompts_per_step=64 data.max_operand=9 algorithm.kl_coef=0 trainer.lr=1e-6
       trainer.micro_batch_size=16 trainer.gradient_checkpointing=true trainer.packing=true
       trainer.max_tokens_per_micro_batch=16384 engines.0.sampling.max_new_tokens=1024 engines.0.enforce_eager=false
       engines.0.streaming=true engines.0.gpu_memory_utilization=0.5 engines.0.kv_cache_memory_gb=20
       experiment.overwrite=true experiment.steps=8)
    for run in "r_k0 rollout.max_staleness=0" "r_k1 rollout.max_staleness=1" \
               "r_k1p rollout.max_staleness=1 rollout.partial_rollouts=true"; do
      set -- $run
      CUDA_VISIBLE_DEVICES=0,1 timeout -k 20 "${REAL_TIMEOUT:-170}" python3 launch.py --config configs/vllm_disagg_2gpu.yaml \
        experiment.output_dir=/tmp/runs experiment.name="$1" "${W[@]}" "${@:2}" > "$OUT/$1.log" 2>&1
      echo "== $1 exit $?"
    done
    python3 - <<'PY'
import json, statistics
for name in ("r_k0", "r_k1", "r_k1p"):
    try:
        ms = [json.loads(l) for l in open(f"/tmp/runs/{name}/metrics.jsonl")]
    except OSError:
        print(name, "no metrics"); continue
    ms = [m for m in ms if "perf/step_s" in m]
    later = ms[2:]   # steps 3-8: compile, warm-up and the async pipeline fill excluded
    med = lambda k: statistics.median(m.get(k, float("nan")) for m in later) if later else float("nan")
    print(f"{name}: steps {len(ms)}, step_s per step {[round(m['perf/step_s'], 2) for m in ms]}, median steps 3-8 "
          f"{med('perf/step_s'):.2f} s (generate wait {med('perf/generate_s'):.2f}, train {med('perf/train_s'):.2f}, "
          f"sync {med('perf/sync_s'):.3f}), wall steps 3-8 {sum(m['perf/step_s'] for m in later):.1f} s")
    try:
        s = json.load(open(f"/tmp/runs/{name}/summary.json"))
        print("   summary:", s.get("status"), {k: v for k, v in s.items() if "verified" in k or "ledger" in k})
    except OSError:
        print("   no summary.json")
PY
    ;;
  *) echo "usage: $0 async|pause|realistic"; exit 2 ;;
esac
