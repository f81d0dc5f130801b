# Sourced by the scripts that run on the lent GPU machine (bench/device/*.sh, bench/run_gpu_benches.sh,
# bench/device_run.sh), after staging (../shared/device/README.md): one environment for all of them.
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM (the machines' rule) and in vLLM's symmetric-memory
# all-reduce; vLLM takes pickled collective_rpc arguments; Ray and gloo stay on loopback; one DeepSpeed op folder.
# RLHF_ORCH_LOG_LEVEL may be set before sourcing (default WARNING). $OUT is made; gpus.txt lists the GPUs.
# B1: the Llama-3.2-1B shape of the built-in model with the settings every 1B run here uses; B8: Llama-3.1-8B's
# layers with the built-in tokenizer's small vocabulary, for a whole run. keep NAME DIR: a run's records into $OUT.
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \
  NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0 VLLM_ALLOW_INSECURE_SERIALIZATION=1 \
  RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 GLOO_SOCKET_IFNAME=lo TORCH_EXTENSIONS_DIR=/tmp/torch_ext \
  RLHF_ORCH_LOG_LEVEL=${RLHF_ORCH_LOG_LEVEL:-WARNING} TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
B1=(model.tiny.hidden_size=2048 model.tiny.intermediate_size=8192 model.tiny.num_hidden_layers=16
    model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.max_position_embeddings=1100
    trainer.bf16=true trainer.warm_start_steps=0 weight_sync.bucket_size_mb=512)
B8=(model.tiny.hidden_size=4096 model.tiny.intermediate_size=14336 model.tiny.num_hidden_layers=32
    model.tiny.num_attention_heads=32 model.tiny.num_key_value_heads=8 model.tiny.max_position_embeddings=1100
    trainer.bf16=true trainer.warm_start_steps=0 weight_sync.bucket_size_mb=512 metrics.plots=false
    metrics.ray_metrics=false trainer.export_hf=false trainer.checkpoint_every_minutes=0)
# B3: Llama-3.2-3B's layer shapes (3.2 B parameters with the built-in small vocabulary; 6.4 GB bf16)
B3=(model.tiny.hidden_size=3072 model.tiny.intermediate_size=8192 model.tiny.num_hidden_layers=28
    model.tiny.num_attention_heads=24 model.tiny.num_key_value_heads=8 model.tiny.max_position_embeddings=1100
    trainer.bf16=true trainer.warm_start_steps=0 weight_sync.bucket_size_mb=512 metrics.plots=false
    metrics.ray_metrics=false trainer.export_hf=false trainer.checkpoint_every_minutes=0)
keep() {   # name, run dir: its metrics, summary and timeline in one tar
  tar czf "$OUT/$1.tgz" -C "$2" $(cd "$2" && ls metrics.jsonl summary.json timeline.jsonl 2>/dev/null) 2>/dev/null
}
