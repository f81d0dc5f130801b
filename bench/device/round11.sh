#!/usr/bin/env bash
# On nvidia-h100-x1 (eleventh session; issue #27 item 1). vLLM + DeepSpeed staged into /tmp/site.
#   bash bench/device/round11.sh pause   # GPU 0: 512 running requests, abort pauses with every thread's stacks
#                                        # sampled (where the "end" text mode's ~0.4 s return goes), 2 keep rounds
#   bash bench/device/round11.sh gc      # GPU 0: 512 running, the runner without then with gc.freeze (flat logprobs
#                                        # against dict logprobs inside each run), then the streaming vLLM GPU tests
# Files in $OUT: gpus.txt, pause*.log, pause*.md (the table, GC totals, for `pause` one JSON line of stacks per abort
# pause), stream_tests.log.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
case "${1:-}" in
  pause)
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${PAUSE_TIMEOUT:-500}" python3 bench/pause_latency.py --engine vllm \
      --running ${RUNNING:-512} --max-tokens 2048 --rounds 2 --abort-rounds "${ABORT_ROUNDS:-4}" --sample-stacks \
      --out "$OUT/pause.md" > "$OUT/pause.log" 2>&1
    echo "== pause exit $?"; grep -E "^\|" "$OUT/pause.md" 2>/dev/null || tail -20 "$OUT/pause.log"
    grep -c '^{' "$OUT/pause.md" ;;
  gc)
    for f in --no-gc-freeze ""; do n=pause${f:+_nofreeze}
      CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${PAUSE_TIMEOUT:-200}" python3 bench/pause_latency.py --engine vllm \
        --running 512 --max-tokens 2048 --rounds 3 --abort-rounds 2 $f --out "$OUT/$n.md" > "$OUT/$n.log" 2>&1
      echo "== $n exit $?"; grep -vE "^\{|^\`" "$OUT/$n.md" 2>/dev/null || tail -20 "$OUT/$n.log"
    done
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${TESTS_TIMEOUT:-220}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/gpu/test_vllm_streaming.py > "$OUT/stream_tests.log" 2>&1; echo "== streaming tests exit $?"
    tail -3 "$OUT/stream_tests.log" ;;
  *) echo "usage: $0 pause|gc"; exit 2 ;;
esac
