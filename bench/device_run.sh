#!/usr/bin/env bash
# On the lent GPU machine, after staging (../shared/device/README.md): GPU tests, then benchmarks.
#   bash bench/device_run.sh tests   # pytest -m gpu, logs to $OUT
#   bash bench/device_run.sh bench   # bench/weight_sync.py over the three model shapes, table to $OUT
#   bash bench/device_run.sh configs vllm_coloc_1gpu:0 zero3_mixed_4gpu:1,2,3 vllm_disagg_2gpu:2,3:experiment.steps=50
#        # launch.py on configs/NAME.yaml with CUDA_VISIBLE_DEVICES=GPUS, all at once (each its own local Ray);
#        # a log per config, bench/summarize_run.py of every run to $OUT/summaries.md, metrics to $OUT/runs.tgz
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1 RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo \
  TORCH_EXTENSIONS_DIR=/tmp/torch_ext RLHF_ORCH_LOG_LEVEL=WARNING
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "${1:-tests}" in
  tests)
    python3 -c "import torch, vllm, deepspeed, ray; print('torch', torch.__version__, 'vllm', vllm.__version__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__)" 2>&1 | tail -1
    # One pytest process per file: vLLM forks its engine core, and a process where an earlier module's engine
    # initialised CUDA cannot fork a working one ("CUDA error: initialization error", seen 2026-11-23).
    for f in ${2:-tests/gpu/test_*.py}; do
      timeout "${TEST_TIMEOUT:-540}" python3 -m pytest -q -m gpu -p no:cacheprovider -o addopts="-ra" "$f" 2>&1 \
        | tee -a "$OUT/gpu_tests.log" | grep -vE "^\s*$|Warning|warn\(" | tail -8
    done ;;
  configs)
    shift
    i=0
    for item in "$@"; do   # NAME:GPUS[:override,override...]
      IFS=: read -r c gpus ovr <<< "$item"; i=$((i + 1)); log="$OUT/$c.$i.log"
      ( CUDA_VISIBLE_DEVICES=$gpus RLHF_ORCH_LOG_LEVEL=INFO timeout -k 20 "${CONFIG_TIMEOUT:-540}" python3 launch.py \
          --config "configs/$c.yaml" experiment.output_dir=/tmp/runs experiment.overwrite=true ${ovr//,/ } > "$log" 2>&1
        echo "== $c ${ovr} (GPUs $gpus): exit $?" >> "$log" ) &
    done
    wait
    for log in "$OUT"/*.log; do tail -n 1 "$log"; grep -E "^error|Traceback" -A3 "$log" | head -20; done
    for d in /tmp/runs/*/; do [ -f "$d/metrics.jsonl" ] && python3 bench/summarize_run.py "$d"; done | tee -a "$OUT/summaries.md"
    tar czf "$OUT/runs.tgz" --exclude=checkpoints --exclude=models -C /tmp runs ;;
  bench)
    timeout "${BENCH_TIMEOUT:-560}" python3 bench/weight_sync.py --out "$OUT/RESULTS_weight_sync.md" ${2:-} 2>&1 | tee "$OUT/bench.log" | tail -20 ;;
esac
