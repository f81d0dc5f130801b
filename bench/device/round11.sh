#!/usr/bin/env bash
# On nvidia-h100-x1 (eleventh session; issue #27 item 1). vLLM + DeepSpeed staged into /tmp/site.
#   bash bench/device/round11.sh pause   # GPU 0: 512 running requests, abort pauses with every thread's stacks
#                                        # sampled (where the "end" text mode's ~0.4 s return goes), 2 keep rounds
# Files in $OUT: gpus.txt, pause.log, pause.md (the table, then one JSON line of stacks per abort pause).
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
  *) echo "usage: $0 pause"; exit 2 ;;
esac
