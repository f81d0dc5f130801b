#!/usr/bin/env bash
# On nvidia-h200 (1x H200; issue #29, its GPU part). vLLM + DeepSpeed staged into /tmp/site.
#   bash bench/device/round12.sh turns     # GPU 0: bench/multiturn.py, one vLLM engine in the process (Llama-3.2-1B
#                                          # shape, random bf16): 64 prompts x 8, 4 turns x 128 tokens + 3 observations
#                                          # x 32 against one 608-token response; T (seconds, default 400) bounds it
#   bash bench/device/round12.sh gputest   # GPU 0: tests/gpu/test_multiturn_vllm.py (agent and MultiTurn trajectories
#                                          # on vLLM, the engine's logprobs against a forward of the trajectory) and
#                                          # tests/gpu/test_vllm_streaming.py (the streaming engine's pauses)
#   bash bench/device/round12.sh sgtest    # GPU 0: tests/gpu/test_sglang_streaming.py (SGLang staged, as sgpause)
#   bash bench/device/round12.sh sgpause   # GPU 0: bench/pause_latency.py --engine sglang at 0-512 running (#27 item 1;
#                                          # needs SGLang staged into /tmp/site-sglang); ROUNDS keep pauses per set and
#                                          # retraction variant (default 4), ABORT_ROUNDS fresh sets (default 2)
#   bash bench/device/round12.sh toolrun   # GPU 0: configs/vllm_coloc_tool.yaml (tiny model, calculator tool, vLLM
#                                          # colocated) for STEPS steps (default 30); reward and turns, first and last
# Files in $OUT: gpus.txt, multiturn.md (the table, appended), multiturn.log, toolrun.log, toolrun.tgz (metrics,
# summary and timeline of the run).
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
case "${1:-}" in
  turns)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${T:-400}" python3 bench/multiturn.py --engine vllm \
      --out "$OUT/multiturn.md" > "$OUT/multiturn.log" 2>&1
    echo "== turns exit $?"; grep -E "^\||^multi / single|^P=" "$OUT/multiturn.md" 2>/dev/null \
      || grep -E "warm-up|^single|^multi|engine .* up|Error|Traceback" "$OUT/multiturn.log" | tail -20
    grep -E "^(warm-up )?(single|multi):" "$OUT/multiturn.log" ;;
  gputest)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_multiturn_vllm.py tests/gpu/test_vllm_streaming.py > "$OUT/gputest.log" 2>&1
    echo "== gputest exit $?"; grep -E "PASS|FAIL|Error|passed|failed" "$OUT/gputest.log" | tail -12 ;;
  sgtest)
    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${TEST_TIMEOUT:-300}" \
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_sglang_streaming.py > "$OUT/sgtest.log" 2>&1
    echo "== sgtest exit $?"; grep -E "FAIL|Error|passed|failed" "$OUT/sgtest.log" | tail -12 ;;
  sgpause)
    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${PAUSE_TIMEOUT:-540}" \
      python3 bench/pause_latency.py --engine sglang --running ${RUNNING:-0 64 256 512} --max-tokens 2048 --rounds "${ROUNDS:-4}" \
      --abort-rounds "${ABORT_ROUNDS:-2}" --gpu-mem 0.7 --out "$OUT/sgpause.md" > "$OUT/sgpause.log" 2>&1
    echo "== sgpause exit $?"; grep -E "^\|" "$OUT/sgpause.md" 2>/dev/null || { grep "^row" "$OUT/sgpause.log" | tail -30
      grep -vE "^row" "$OUT/sgpause.log" | tail -20; } ;;
  toolrun)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${TOOL_TIMEOUT:-480}" python3 launch.py --config configs/vllm_coloc_tool.yaml \
      experiment.output_dir=/tmp/runs experiment.steps="${STEPS:-30}" experiment.overwrite=true \
      > "$OUT/toolrun.log" 2>&1
    echo "== toolrun exit $?"; keep toolrun /tmp/runs/vllm_coloc_tool
    python3 - /tmp/runs/vllm_coloc_tool <<'PY'
import json, sys
try:
    ms = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
except OSError:
    print("no metrics"); sys.exit()
ms = [m for m in ms if "rollout/reward_mean" in m]
keys = ("step", "rollout/reward_mean", "rollout/turns_mean", "rollout/tool_calls_mean", "rollout/tool_errors_mean",
        "rollout/observation_tokens_mean", "rollout/truncated_mean", "perf/step_s", "sync/verified")
for name, m in (("first", ms[0]), ("last", ms[-1])) if ms else ():
    print(name, {k: round(m[k], 4) if isinstance(m[k], float) else m[k] for k in keys if k in m})
for name, part in (("first 5", ms[:5]), ("last 5", ms[-5:])) if ms else ():
    print(name, "mean reward", round(sum(m["rollout/reward_mean"] for m in part) / len(part), 3),
          "turns", round(sum(m.get("rollout/turns_mean", 0) for m in part) / len(part), 3))
PY
    grep -E "Traceback|Error|error:" "$OUT/toolrun.log" | head -10 ;;
  *) echo "usage: $0 turns|gputest|sgtest|sgpause|toolrun"; exit 2 ;;
esac
