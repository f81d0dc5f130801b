#!/usr/bin/env bash
# On nvidia-h100-x1. `seam` and `run` passed on an H100 in the nineteenth session (bench/RESULTS.md); `sgseam` is still
# to run. Issue #28 item 3 (eighteenth session) moved every weight sync onto
# one transport seam (rlhf_orch/weight_sync/transport.py, ipc_stream.py, broadcast.py) and one coordinator protocol,
# and removed the per-bucket IPC path; these check it on the GPU. vLLM + DeepSpeed staged into /tmp/site, SGLang into
# /tmp/site-sglang for `sgseam`. One command per argument, each under the 600 s limit:
#   bash bench/device/round13.sh seam     # GPU 0: the one-GPU weight-sync and vLLM tests (one pytest per file), then
#                                         # bench/weight_sync.py colocated 1B, raw and vLLM, 10 rounds against the floor
#                                         # (compare with bench/RESULTS.md's colocated rows of the same shapes)
#   bash bench/device/round13.sh sgseam   # GPU 0: the SGLang GPU tests (stream, keep pause with a stream sync)
#   bash bench/device/round13.sh run      # GPU 0: configs/vllm_coloc_1gpu.yaml for 8 steps: the coordinator's one
#                                         # protocol in a whole run (sync/checksum_ok, sync/gpu_handover_engines)
# Files in $OUT: gpus.txt, one log per job, seam.md (the benchmark's table), run.tgz.
set -uo pipefail
RLHF_ORCH_LOG_LEVEL=INFO; . bench/device/env.sh
git log -1 --format='code: %h %s' 2>/dev/null; git status --short 2>/dev/null | head -5
tests() {   # name, files...: one pytest process per file (vLLM forks its engine core; see bench/device_run.sh)
  local name=$1; shift
  for f in "$@"; do
    CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      -o addopts="-ra" "$f" >> "$OUT/$name.log" 2>&1
    echo "== $f exit $?"; grep -E "FAIL|Error|passed|failed|skipped" "$OUT/$name.log" | tail -3
  done
}
case "${1:-}" in
  seam)
    tests seam tests/gpu/test_copysum_gpu.py tests/gpu/test_gpu_handover.py tests/gpu/test_weight_sync_gpu.py \
      tests/gpu/test_vllm_engine.py
    for engine in raw vllm; do
      CUDA_VISIBLE_DEVICES=0 timeout -k 15 "${BENCH_TIMEOUT:-150}" python3 bench/weight_sync.py --engine $engine \
        --models llama-3.2-1b --placements colocated --repeats 10 --out "$OUT/seam.md" > "$OUT/seam_$engine.log" 2>&1
      echo "== bench $engine exit $?"; grep -E "^\||Error" "$OUT/seam_$engine.log" | tail -6
    done ;;
  sgseam)
    PYTHONPATH=/tmp/site-sglang:$PWD:$PWD/tests tests sgseam tests/gpu/test_sglang_engine.py \
      tests/gpu/test_sglang_streaming.py ;;
  run)
    CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${RUN_TIMEOUT:-480}" python3 launch.py --config configs/vllm_coloc_1gpu.yaml \
      experiment.output_dir=/tmp/runs experiment.steps="${STEPS:-8}" experiment.overwrite=true > "$OUT/run.log" 2>&1
    echo "== run exit $?"; keep run /tmp/runs/vllm_coloc
    grep -E "Traceback|Error" "$OUT/run.log" | tail -5
    python3 - /tmp/runs/vllm_coloc <<'PY'
import json, sys
ms = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")] if sys.argv[1:] else []
for m in ms:
    print(m.get("step"), {k: round(m[k], 4) for k in ("sync/checksum_ok", "sync/total_s", "sync/gpu_handover_engines",
                                                       "sync/held_engines", "rollout/reward_mean") if k in m})
PY
    ;;
  *) echo "usage: $0 seam|sgseam|run"; exit 2 ;;
esac
