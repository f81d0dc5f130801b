"""The trainer: the only package that imports DeepSpeed (lazily, inside deepspeed_trainer.py).

`batch.py` is pure tensor code usable anywhere; `DeepSpeedTrainer` is one data-parallel rank.
"""
from rlhf_orch.trainer.batch import build_sft_batch, build_train_batch, shard, shard_bounds

__all__ = ["build_sft_batch", "build_train_batch", "shard", "shard_bounds"]
