"""Weight sync: bucket layouts, the transport plan, IPC handles, the broadcast group, sender and receiver.

The coordinator actor (actors/coordinator.py) strings these together; everything here is importable
and testable without Ray.
"""
from rlhf_orch.weight_sync.buckets import BucketLayout, TensorSlot, checksums, digest, pack, plan_buckets, unpack
from rlhf_orch.weight_sync.plan import EngineRoute, SyncPlan, make_plan
from rlhf_orch.weight_sync.receiver import WeightReceiver
from rlhf_orch.weight_sync.sender import SendResult, WeightSender

__all__ = ["BucketLayout", "EngineRoute", "SendResult", "SyncPlan", "TensorSlot", "WeightReceiver", "WeightSender",
           "checksums", "digest", "make_plan", "pack", "plan_buckets", "unpack"]
