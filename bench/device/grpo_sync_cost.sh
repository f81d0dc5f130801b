#!/usr/bin/env bash
# On the GPU machine (staged): the tiny GRPO run on vLLM (configs/vllm_coloc_1gpu.yaml) at this tree and at an
# older tree (OLD, a folder with an earlier checkout) and/or at this tree with other settings (ALT, overrides), one
# after the other on the same GPU; prints the medians and min-max of the sync/* phases per run (steps 2..N: step 1
# pays for first-time set-up).
#   OLD=old_main STEPS=40 bash bench/device/grpo_sync_cost.sh
#   ALT="weight_sync.replay_loads=false" STEPS=25 bash bench/device/grpo_sync_cost.sh
#   ALT_ENV="RLHF_ORCH_SYNC_HANDOVER=host" STEPS=25 bash bench/device/grpo_sync_cost.sh   # alt: another environment
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; STEPS=${STEPS:-40}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 \
  GLOO_SOCKET_IFNAME=lo TORCH_EXTENSIONS_DIR=/tmp/torch_ext RLHF_ORCH_LOG_LEVEL=WARNING
run() {   # $1: tree, $2: run name, then overrides
  local tree=$1 name=$2; shift 2
  ( cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout -k 20 280 python3 launch.py --config configs/vllm_coloc_1gpu.yaml \
      experiment.output_dir=/tmp/grpo experiment.name="$name" experiment.overwrite=true experiment.steps=$STEPS metrics.plots=false \
      metrics.ray_metrics=false "$@" > "$OUT/$name.log" 2>&1; echo "== $name exit $?" | tee -a "$OUT/$name.log" )
}
run . new
[ -n "${ALT:-}${ALT_ENV:-}" ] && ( [ -n "${ALT_ENV:-}" ] && export ${ALT_ENV}; run . alt ${ALT:-} )
[ -n "${OLD:-}" ] && run "$OLD" old
python3 - <<'PY'
import json, statistics, glob, os
keys = ["sync/total_s", "sync/pause_s", "sync/transfer_s", "sync/pack_s", "sync/wait_s", "sync/load_s", "sync/verify_s",
        "sync/resume_s"]
print("| run | steps | " + " | ".join(k.removeprefix("sync/") + " ms" for k in keys) + " | verified | GPU hand-over |")
print("|---|---|" + "---|" * (len(keys) + 2))
for name in ("new", "alt", "old"):
    p = f"/tmp/grpo/{name}/metrics.jsonl"
    if not os.path.exists(p):
        continue
    rows = [json.loads(l) for l in open(p)][1:]
    cells = []
    for k in keys:
        v = [r[k] * 1e3 for r in rows if k in r]
        cells.append(f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})" if v else "-")
    ok = sum(r.get("sync/checksum_ok") == 1.0 for r in rows)
    gpu = sum(r.get("sync/gpu_handover_engines", 0) > 0 for r in rows)
    print(f"| {name} | {len(rows)} | " + " | ".join(cells) + f" | {ok}/{len(rows)} | {gpu}/{len(rows)} |")
PY
